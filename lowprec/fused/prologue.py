"""What a fused quantize computes before it quantizes: a norm or an activation.

A :class:`Prologue` names the computation and holds the tensors it needs. Quantizers
whose kernels take a prologue (per-tensor FP8, block FP8, MXFP8) quantize
``prologue(x)`` in one pass without writing it out (``Quantizer.quantize_fused``); every
other path computes ``prologue(x)`` with :func:`apply_prologue` and quantizes that, which
gives the same bits. Launchers here are custom ops (see ``lowprec.kernels.kernel_op``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..activations import REGISTRY as _ACTIVATIONS
from ..kernels import kernel_op
from ..kernels.launch import launch

NORM_CODES = {"LayerNorm": 1, "RMSNorm": 2}
ACT_CODES = {name: act.code for name, act in _ACTIVATIONS.items()}


@dataclass(frozen=True)
class Prologue:
    """``code`` is the kernels' ``PRO`` code; ``tensors`` its pointer arguments in order
    (norms: mean, rstd, gamma, beta; any tensor stands in for one the code does not read).
    ``amax_bits``: the int32 amax bits of the prologue's output when its producer already
    computed them (norm statistics), so current scaling skips its amax pass."""

    code: int
    tensors: tuple = ()
    amax_bits: torch.Tensor | None = None

    @property
    def gated(self) -> bool:
        return self.code >= 20  # the kernels' numbering (lowprec.activations)

    def out_features(self, in_features: int) -> int:
        if self.gated:
            if in_features % 2:
                raise ValueError(f"a gated activation needs an even number of features, got "
                                 f"{in_features}")
            return in_features // 2
        return in_features

    def kernel_tensors(self) -> list[torch.Tensor]:
        return list(self.tensors)

    def apply(self, x2d: torch.Tensor) -> torch.Tensor:
        """This prologue of ``x2d`` written out in its dtype (:func:`apply_prologue`)."""
        return apply_prologue(x2d, self)


def activation_prologue(name: str) -> Prologue | None:
    """The prologue of an activation, None when there is no kernel for it."""
    code = ACT_CODES.get(name)
    return Prologue(code) if code is not None else None


def norm_prologue(normalization: str, mean, rstd, gamma, beta, amax_bits=None) -> Prologue:
    """A LayerNorm/RMSNorm prologue from row statistics (RMSNorm: ``mean``/``beta`` unused)."""
    return Prologue(NORM_CODES[normalization],
                    (mean if mean is not None else rstd, rstd, gamma,
                     beta if beta is not None else gamma), amax_bits)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


# ---- row statistics -----------------------------------------------------------------------
@kernel_op("lowprec::norm_stats", mutates_args=())
def norm_stats(x: torch.Tensor, gamma: torch.Tensor, beta: torch.Tensor, eps: float, rms: bool,
               want_amax: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(mean, rstd, amax_bits) of a row-major (M, K) ``x``: fp32 (M,) statistics (mean is
    zeros for RMSNorm) and, with ``want_amax``, the int32 bit pattern of the normalized
    output's amax (else 0). ``beta`` is ignored for RMSNorm."""
    from ..kernels.grid import device_guard
    from ..kernels.prologue import norm_stats_kernel
    m, k = x.shape
    mean = torch.zeros(m, dtype=torch.float32, device=x.device) if rms else \
        torch.empty(m, dtype=torch.float32, device=x.device)
    rstd = torch.empty(m, dtype=torch.float32, device=x.device)
    amax = torch.zeros(1, dtype=torch.int32, device=x.device)
    bk = min(4096, max(16, 1 << (k - 1).bit_length()))
    br = max(1, 2048 // bk)
    with device_guard(x.device):
        launch(norm_stats_kernel, (_cdiv(m, br),), x, mean, rstd, gamma, beta, amax, m, k,
               x.stride(0), eps, RMS=rms, WANT_AMAX=want_amax, BR=br, BK=bk,
               num_warps=4)
    return mean, rstd, amax


@norm_stats.register_fake
def _(x, gamma, beta, eps, rms, want_amax):
    m = x.shape[0]
    return (x.new_empty((m,), dtype=torch.float32), x.new_empty((m,), dtype=torch.float32),
            x.new_empty((1,), dtype=torch.int32))


# ---- the unfused form ---------------------------------------------------------------------
@kernel_op("lowprec::apply_prologue", mutates_args=())
def _apply_op(x: torch.Tensor, code: int, p: list[torch.Tensor], k_out: int, want_amax: bool
              ) -> tuple[torch.Tensor, torch.Tensor]:
    from ..kernels.grid import device_guard, prologue_args
    from ..kernels.prologue import apply_kernel
    m = x.shape[0]
    out = torch.empty((m, k_out), dtype=x.dtype, device=x.device)
    amax = torch.zeros(1, dtype=torch.int32, device=x.device)
    bm, bn = 32, 128
    with device_guard(x.device):
        launch(apply_kernel, (_cdiv(m, bm), _cdiv(k_out, bn)), x, out, amax, m, k_out, x.stride(0),
               x.stride(1), *prologue_args(x, p),
               PRO=code, WANT_AMAX=want_amax,
               BM=bm, BN=bn, num_warps=4)
    return out, amax


@_apply_op.register_fake
def _(x, code, p, k_out, want_amax):
    return x.new_empty((x.shape[0], k_out)), x.new_empty((1,), dtype=torch.int32)


def apply_prologue(x2d: torch.Tensor, prologue: Prologue) -> torch.Tensor:
    """``prologue(x2d)`` written out in x's dtype (CUDA + Triton only)."""
    return apply_prologue_with_amax(x2d, prologue, want_amax=False)[0]


def apply_prologue_with_amax(x2d: torch.Tensor, prologue: Prologue, *, want_amax: bool = True
                             ) -> tuple[torch.Tensor, torch.Tensor]:
    """(``prologue(x2d)``, int32 bits of its amax): the producer pass of current scaling,
    whose amax must be known before the cast (the amax is 0 unless ``want_amax``)."""
    k_out = prologue.out_features(x2d.shape[1])
    return _apply_op(x2d, prologue.code, prologue.kernel_tensors(), k_out, want_amax)
