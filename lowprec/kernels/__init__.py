"""Shared plumbing for the Triton kernels that live beside each format.

Kernels run only on CUDA tensors and only when Triton imports; everything
else takes the pure-PyTorch reference path, which the kernels match bit for
bit.
"""

from __future__ import annotations

import functools

import torch

_enabled = True


@functools.lru_cache(maxsize=None)
def triton_available() -> bool:
    """True when Triton imports and a CUDA device is present."""
    if not torch.cuda.is_available():
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def use_kernels(t: torch.Tensor) -> bool:
    """Whether ``t`` should be quantized by a Triton kernel rather than the reference."""
    return _enabled and t.is_cuda and triton_available()


class reference_only:
    """Context manager that forces the pure-PyTorch path (for tests and benchmarks)."""

    def __enter__(self):
        global _enabled
        self._saved, _enabled = _enabled, False
        return self

    def __exit__(self, *exc):
        global _enabled
        _enabled = self._saved
        return False
