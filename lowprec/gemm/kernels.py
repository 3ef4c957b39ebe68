"""Launchers for the GEMM backends' elementwise helpers, with pure-torch fallbacks.

* :func:`mxfp8_dequantize_bf16` -- MXFP8 data and E8M0 scales to exact bf16 (the MXFP8
  format's own kernel, :mod:`lowprec.formats.mxfp8.dequantize`, re-exported here);
* :func:`scale_bias_epilogue` -- ``(acc / div_a / div_b + bias)`` in fp32, rounded
  once to the output dtype;
* :func:`gemm_alpha` -- ``1 / (div_a * div_b)`` (fp64, rounded to fp32) on the device, the
  output scale of :func:`scaled_mm_lt` (a cuBLASLt GEMM that applies it in its epilogue).

The Triton versions are registered as torch custom ops (``lowprec_gemm::*``)
so ``torch.compile`` can trace them; they run on CUDA when Triton imports
and :func:`lowprec.kernels.use_kernels` allows it, else the torch ops run.
Both give the same values (each is exact or a single rounding).
"""

from __future__ import annotations

from typing import Optional

import torch

from ..formats.mxfp8 import (  # noqa: F401 - the GEMM backends' helpers in one place
    MX_DEQUANT_CONFIG,
    mxfp8_dequantize_bf16,
    mxfp8_dequantize_bf16_torch,
)
from ..kernels import graph_op, kernel_op, use_kernels
from ..kernels.launch import launch


# ---- torch reference versions -------------------------------------------------------------
def scale_bias_epilogue_torch(acc, div_a, div_b, bias, out_dtype):
    if div_a is not None:
        acc = acc / div_a.to(torch.float32)
    if div_b is not None:
        acc = acc / div_b.to(torch.float32)
    if bias is not None:
        acc = acc + bias.to(torch.float32)
    return acc.to(out_dtype)


def gemm_alpha_torch(div_a, div_b):
    """:func:`gemm_alpha` in torch ops, element by element over divisors of one shape (one
    GEMM's each: (1,), or (G,) for a grouped GEMM's groups); a missing one counts as 1."""
    ds = [d.to(torch.float64).reshape(-1) for d in (div_a, div_b) if d is not None]
    p = ds[0] * ds[1] if len(ds) == 2 else ds[0]
    return p.reciprocal().to(torch.float32).clamp(max=torch.finfo(torch.float32).max)


# ---- Triton launchers as custom ops -------------------------------------------------------
@kernel_op("lowprec_gemm::scale_bias_epilogue", mutates_args=())
def _epilogue_op(acc: torch.Tensor, div_a: Optional[torch.Tensor], div_b: Optional[torch.Tensor],
                 bias: Optional[torch.Tensor], out_dtype: torch.dtype) -> torch.Tensor:
    from ._triton_kernels import scale_bias_epilogue_kernel

    acc = acc.contiguous()
    m, n = acc.shape
    out = torch.empty((m, n), dtype=out_dtype, device=acc.device)
    bm, bn = 32, 256
    grid = ((m + bm - 1) // bm, (n + bn - 1) // bn)
    dummy = acc
    launch(scale_bias_epilogue_kernel, grid,
        acc, out, div_a if div_a is not None else dummy, div_b if div_b is not None else dummy,
        bias if bias is not None else dummy, m, n,
        HAS_DIV_A=div_a is not None, HAS_DIV_B=div_b is not None, HAS_BIAS=bias is not None,
        BM=bm, BN=bn, num_warps=8)
    return out


@_epilogue_op.register_fake
def _(acc, div_a, div_b, bias, out_dtype):
    return acc.new_empty(acc.shape, dtype=out_dtype)


def _alpha_launch(div_a, div_b, device):
    """(2,) fp32 ``[alpha, 0.0]`` on ``device`` (the current device): see gemm_alpha."""
    from ._triton_kernels import gemm_alpha_kernel

    out = torch.empty(2, dtype=torch.float32, device=device)
    launch(gemm_alpha_kernel, (1,), div_a if div_a is not None else out,
           div_b if div_b is not None else out, out,
           HAS_DIV_A=div_a is not None, HAS_DIV_B=div_b is not None,
           num_warps=1)
    return out


class _LastAlpha:
    """The last ``[alpha, 0]`` made for :func:`_scaled_mm_lt`, reused while the same
    divisors come back unchanged on the same stream: a sliced GEMM loop
    (``lowprec.linear.exact_split``) scales every slice by the same two divisors, and a launch
    costs more host time than the GEMM's other steps. The divisors are held, so their
    memory cannot be reused by another tensor while the entry stands; an in-place change
    bumps their version. Never used or filled during CUDA graph capture (a captured graph
    must own what it reads)."""

    entry = None  # (key, divisors held, alpha)

    @classmethod
    def get(cls, div_a, div_b, device):
        if torch.cuda.is_current_stream_capturing():
            return _alpha_launch(div_a, div_b, device)
        try:
            key = tuple((d.data_ptr(), d._version) if d is not None else None
                        for d in (div_a, div_b))
        except RuntimeError:  # inference tensors have no version counter
            return _alpha_launch(div_a, div_b, device)
        key += (torch._C._cuda_getCurrentRawStream(device.index),)
        if cls.entry is not None and cls.entry[0] == key:
            return cls.entry[2]
        alpha = _alpha_launch(div_a, div_b, device)
        cls.entry = (key, (div_a, div_b), alpha)
        return alpha


def _scaled_mm_lt(am, bm, div_a, div_b, out_dtype, out=None, workspace=None):
    from ..kernels.grid import device_guard
    from . import cublaslt

    with device_guard(am.device):
        result = None
        # a graph's call (a workspace given) leaves the strides to be checked here (an eager
        # caller has checked them: cublaslt.shape_ok)
        if workspace is None or cublaslt.strides_ok(am, bm):
            # alpha and beta are written on the stream the GEMM reads them on; a graph's
            # call keeps nothing for the next one
            alpha = (_LastAlpha.get(div_a, div_b, am.device) if workspace is None
                     else _alpha_launch(div_a, div_b, am.device))
            result = cublaslt.mm_scaled(am, bm, alpha, out_dtype, out, workspace)
        if result is None:  # strides or pointers cuBLASLt does not take: fp32 GEMM, then scale
            acc = torch.mm(am, bm.t(), out_dtype=torch.float32)
            result = _epilogue_op(acc, div_a, div_b, None, out_dtype)
            if out is not None:
                result = out.copy_(result)
    return result


@kernel_op("lowprec_gemm::scaled_mm_lt", mutates_args=())
def _scaled_mm_lt_op(am: torch.Tensor, bm: torch.Tensor, div_a: Optional[torch.Tensor],
                     div_b: Optional[torch.Tensor], out_dtype: torch.dtype) -> torch.Tensor:
    return _scaled_mm_lt(am, bm, div_a, div_b, out_dtype)


@_scaled_mm_lt_op.register_fake
def _(am, bm, div_a, div_b, out_dtype):
    return am.new_empty((am.shape[0], bm.shape[0]), dtype=out_dtype)


@kernel_op("lowprec_gemm::scaled_mm_lt_out", mutates_args=("out",))
def _scaled_mm_lt_out_op(am: torch.Tensor, bm: torch.Tensor, div_a: Optional[torch.Tensor],
                         div_b: Optional[torch.Tensor], out: torch.Tensor) -> None:
    _scaled_mm_lt(am, bm, div_a, div_b, out.dtype, out)


@_scaled_mm_lt_out_op.register_fake
def _(am, bm, div_a, div_b, out):
    return None


def graph_alpha_beta(div_a: torch.Tensor | None, div_b: torch.Tensor | None,
                     like: torch.Tensor) -> torch.Tensor:
    """``[alpha, 0.0]`` of :func:`scaled_mm_lt` (alpha as :func:`gemm_alpha` and the
    ``gemm_alpha_kernel`` compute it: the fp64 reciprocal of the exact fp64 product, rounded
    to fp32 and clamped) in torch ops, for a compiled graph: the compiler fuses them into
    the kernel that makes the divisors, where a launch of the alpha kernel would cost a
    Python call of its own. ``like``: a tensor on the GEMM's device (both divisors may be
    missing, alpha then 1)."""
    if div_a is None and div_b is None:
        alpha = like.new_ones(1, dtype=torch.float32)
    else:
        alpha = gemm_alpha_torch(div_a, div_b)
    return torch.cat([alpha, alpha.new_zeros(1)])


@graph_op("scaled_mm_lt_in_graph")
def scaled_mm_lt_in_graph(am: torch.Tensor, bm: torch.Tensor, div_a: Optional[torch.Tensor],
                          div_b: Optional[torch.Tensor], alpha_beta: torch.Tensor,
                          workspace: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """:func:`scaled_mm_lt` as an op of a compiled graph: ``alpha_beta`` is the graph's own
    :func:`graph_alpha_beta` of the fp32 (1,) divisors and the cuBLASLt workspace a tensor
    of the graph (``cublaslt.WORKSPACE_BYTES``), so nothing outlives the call (CUDA graph
    trees require the graph's memory pool to own every allocation a step keeps). The same
    cuBLASLt call as eager's, so the same bits; operands whose strides cuBLASLt does not
    take (``cublaslt.strides_ok``) get eager's fp32 GEMM and epilogue instead."""
    from ..kernels.grid import device_guard
    from . import cublaslt

    with device_guard(am.device):
        if cublaslt.strides_ok(am, bm):
            result = cublaslt.mm_scaled(am, bm, alpha_beta, out_dtype, None, workspace)
            if result is not None:
                return result
        acc = torch.mm(am, bm.t(), out_dtype=torch.float32)
        return _epilogue_op(acc, div_a, div_b, None, out_dtype)


@torch.library.register_fake("lowprec::scaled_mm_lt_in_graph")
def _(am, bm, div_a, div_b, alpha_beta, workspace, out_dtype):
    return am.new_empty((am.shape[0], bm.shape[0]), dtype=out_dtype)


# ---- dispatch -----------------------------------------------------------------------------
def divisor(d: torch.Tensor | None) -> torch.Tensor | None:
    """A per-tensor divisor as the (1,) fp32 tensor the kernels read (None stays None)."""
    return None if d is None else d.to(torch.float32).reshape(1)


def scale_bias_epilogue(acc: torch.Tensor, div_a: torch.Tensor | None, div_b: torch.Tensor | None,
                        bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """``acc / div_a / div_b + bias`` in fp32, rounded once to ``out_dtype``."""
    div_a, div_b = divisor(div_a), divisor(div_b)
    if use_kernels(acc) and acc.numel():
        if bias is not None:
            bias = bias.contiguous()
        return _epilogue_op(acc, div_a, div_b, bias, out_dtype)
    return scale_bias_epilogue_torch(acc, div_a, div_b, bias, out_dtype)


def gemm_alpha(div_a: torch.Tensor | None, div_b: torch.Tensor | None) -> torch.Tensor:
    """(1,) fp32 alpha of :func:`scaled_mm_lt`: the fp64 reciprocal of the exact fp64
    product ``div_a * div_b`` rounded to fp32 (within one fp32 ulp of ``1 / (div_a *
    div_b)``), clamped to the fp32 maximum; a missing divisor counts as 1 (one of the two
    must be given)."""
    div_a, div_b = divisor(div_a), divisor(div_b)
    some = div_a if div_a is not None else div_b
    if use_kernels(some):
        from ..kernels.grid import device_guard
        with device_guard(some.device):
            return _alpha_launch(div_a, div_b, some.device)[:1]
    return gemm_alpha_torch(div_a, div_b)


def scaled_mm_lt(am: torch.Tensor, bm: torch.Tensor, div_a: torch.Tensor | None,
                 div_b: torch.Tensor | None, out_dtype: torch.dtype,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """``(am @ bm.T) * alpha`` (alpha of :func:`gemm_alpha`) in cuBLASLt's fp32 epilogue,
    rounded once to ``out_dtype`` (CUDA bf16 operands that pass
    :func:`lowprec.gemm.cublaslt.shape_ok`); written to ``out`` (a contiguous tensor of
    the product's shape and ``out_dtype``) where given."""
    if out is None:
        return _scaled_mm_lt_op(am, bm, divisor(div_a), divisor(div_b), out_dtype)
    if out.dtype != out_dtype:
        raise ValueError(f"scaled_mm_lt: out is {out.dtype}, the product {out_dtype}")
    _scaled_mm_lt_out_op(am, bm, divisor(div_a), divisor(div_b), out)
    return out
