"""The GEMM dispatcher: one product for every layout, a backend per operand pair.

Every linear GEMM is written as ``mat(a) @ mat(b).T`` where ``mat`` takes an
operand in one *usage*:

* ``mat(t, "rowwise")`` is the (M, K) matrix of a tensor of shape (..., K);
* ``mat(t, "columnwise")`` is its transpose (K, M), the stored layout of a
  quantized tensor's columnwise data.

So fprop ``Y = X W^T`` is ``gemm(X, "rowwise", W, "rowwise")``, dgrad
``dX = dY W`` is ``gemm(dY, "rowwise", W, "columnwise")`` and wgrad
``dW = dY^T X`` is ``gemm(dY, "columnwise", X, "columnwise")``: both operands
are always contiguous in the contraction dimension, as cuBLAS FP8 wants.

Backends are tried in order; the first whose ``accepts`` is true runs. The
fallback emulates any pair exactly: it dequantizes both operands in fp32
(NVFP4 global scales and block scales applied, RHT undone) and multiplies in
fp32, so the result equals the product of the dequantized operands to fp32
rounding.
"""

from __future__ import annotations

import contextlib
from typing import Callable, NamedTuple

import torch

from ..formats import HybridQuantizedTensor, IdentityTensor, QuantizedTensor, check_usage
from .cuda import cuda_backends
from .emulated_fp32 import emulated_fp32_run, plain_matrix


def _is_plain(t) -> bool:
    return not isinstance(t, QuantizedTensor) or isinstance(t, IdentityTensor)


class Backend(NamedTuple):
    name: str
    accepts: Callable
    run: Callable
    #: ``run`` takes ``out=`` and writes the product there (no copy).
    takes_out: bool = False
    #: ``(type, direct)``: for a pair of that tensor type with no bias and no ``out=``,
    #: ``direct(a, a_usage, b, b_usage, out_dtype)`` is ``accepts`` and ``run`` in one
    #: short call (the product, or None where ``accepts`` is false); the GEMMs of every
    #: per-tensor FP8 linear call go this way.
    direct: tuple | None = None


def _plain_accepts(a, a_usage, b, b_usage, out_dtype, bias):
    if not (_is_plain(a) and _is_plain(b)):
        return False
    am, bm = plain_matrix(a, a_usage), plain_matrix(b, b_usage)
    return (am.dtype == bm.dtype and am.dtype == out_dtype
            and (bias is None or bias.dtype == out_dtype))


def _plain_run(a, a_usage, b, b_usage, out_dtype, bias):
    am, bm = plain_matrix(a, a_usage), plain_matrix(b, b_usage)
    if bias is None:
        return am @ bm.t()
    return torch.addmm(bias, am, bm.t())


#: Tried in order; GPU backends are inserted ahead of the emulation when available.
BACKENDS: list[Backend] = [
    Backend("plain", _plain_accepts, _plain_run),
    # the exact fp32 emulation takes every pair: the last one tried
    Backend("emulated_fp32", lambda *args: True, emulated_fp32_run),
]

# The GPU backends (lowprec/gemm/) accept CUDA operands only; CPU pairs reach the emulation.
BACKENDS[-1:-1] = cuda_backends(Backend)


def _direct_table(backends) -> dict:
    """Operand type -> the direct call of the first backend that may take such a pair, where
    it has one. A backend ahead of it that could take the pair too (``plain`` takes none of
    the quantized types) would make the direct call skip it: none here does."""
    table = {}
    for backend in backends:
        if backend.direct is not None:
            table.setdefault(backend.direct[0], backend.direct[1])
    return table


_DIRECT: tuple = ((), {})  # (the backends it was built from, _direct_table of them)


def _direct_calls() -> dict:
    """``_direct_table(BACKENDS)``, built again whenever the registry's contents changed (by
    ``use_backends`` or an edit of ``BACKENDS`` itself). Every GEMM call asks: comparing
    the registry as a tuple costs a sixth of comparing its elements' ids (tuples compare
    elements by identity first; backends equal in every field give the same table)."""
    global _DIRECT
    key = tuple(BACKENDS)
    if _DIRECT[0] != key:
        _DIRECT = (key, _direct_table(BACKENDS))
    return _DIRECT[1]


@contextlib.contextmanager
def use_backends(names):
    """Within the block, only the backends named in ``names`` run (in their usual order;
    the emulation must be among them): e.g. ``("plain", "emulated_fp32")`` to compare the
    GPU backends with the emulation."""
    saved = list(BACKENDS)
    kept = [b for b in saved if b.name in names]
    if not kept or kept[-1].name != "emulated_fp32":
        raise ValueError(f"use_backends needs 'emulated_fp32' among its names, got {names!r}")
    BACKENDS[:] = kept
    try:
        yield
    finally:
        BACKENDS[:] = saved


def _partial(t, usage: str) -> bool:
    """Whether ``t`` is a quantized operand whose ``usage`` ends in a partial block, which
    only the fp32 emulation multiplies (through ``QuantizedTensor._stored_values``)."""
    return isinstance(t, QuantizedTensor) and t.has_usage(usage) and t.partial(usage)


def select_backend(a, a_usage, b, b_usage, out_dtype, bias=None) -> Backend:
    for backend in BACKENDS:
        if backend.accepts(a, a_usage, b, b_usage, out_dtype, bias):
            return backend
    raise RuntimeError("no GEMM backend accepts these operands")  # the emulation accepts all


def gemm(a: torch.Tensor, a_usage: str, b: torch.Tensor, b_usage: str, *,
         out_dtype: torch.dtype, bias: torch.Tensor | None = None,
         out: torch.Tensor | None = None) -> torch.Tensor:
    """``mat(a, a_usage) @ mat(b, b_usage).T (+ bias)`` as a 2-D tensor of ``out_dtype``.

    ``out``: a contiguous tensor of the product's shape and ``out_dtype`` (e.g. a row
    range of a larger result) that receives the product and is returned.
    """
    check_usage(a_usage)
    check_usage(b_usage)
    partial = _partial(a, a_usage) or _partial(b, b_usage)
    if out is None and bias is None and type(a) is type(b) and not partial:
        direct = _direct_calls().get(type(a))
        if direct is not None:
            res = direct(a, a_usage, b, b_usage, out_dtype)
            if res is not None:
                return res
    # A hybrid operand is just the sub-tensor of the direction this GEMM consumes.
    if isinstance(a, HybridQuantizedTensor):
        a = a.sub_tensor(a_usage)
    if isinstance(b, HybridQuantizedTensor):
        b = b.sub_tensor(b_usage)
    ka = a.shape[-1] if a_usage == "rowwise" else a.numel() // max(a.shape[-1], 1)
    kb = b.shape[-1] if b_usage == "rowwise" else b.numel() // max(b.shape[-1], 1)
    if ka != kb:
        raise ValueError(f"GEMM contraction sizes differ: {a_usage} {tuple(a.shape)} vs "
                         f"{b_usage} {tuple(b.shape)}")
    # operands ending in partial blocks: the exact product of their dequantized values
    backend = (BACKENDS[-1] if partial
               else select_backend(a, a_usage, b, b_usage, out_dtype, bias))
    if out is None:
        return backend.run(a, a_usage, b, b_usage, out_dtype, bias)
    rows = a.numel() // max(ka, 1)
    cols = b.numel() // max(kb, 1)
    if tuple(out.shape) != (rows, cols) or out.dtype != out_dtype or not out.is_contiguous():
        raise ValueError(f"gemm out= must be a contiguous ({rows}, {cols}) {out_dtype} tensor, "
                         f"got {tuple(out.shape)} {out.dtype} (contiguous="
                         f"{out.is_contiguous()})")
    if backend.takes_out:
        return backend.run(a, a_usage, b, b_usage, out_dtype, bias, out=out)
    return out.copy_(backend.run(a, a_usage, b, b_usage, out_dtype, bias))
