"""FP8 GEMMs through cuBLAS (``torch._scaled_mm``) on Hopper.

Both routes (``table.route``'s ``cublas_fp8`` and ``cublas_fp8_block``) take the operands
exactly as lowprec stores them: ``mat(a)`` is
(M, K) row-major and ``mat(b)`` is (N, K) row-major, so ``mat(b).T`` is the
(K, N) column-major second operand cuBLAS FP8 wants, with no copy.

* :data:`TENSORWISE` -- two :class:`Float8Tensor` operands (E4M3 x E4M3,
  E4M3 x E5M2, E5M2 x E4M3). cuBLAS gets the *decode* scales ``1 / scale``
  (one element each); the product is accumulated in fp32, or with cuBLAS's fast
  accumulation where the running linear's recipe asks for it (``accumulation``), and
  written once in ``out_dtype``. A bias is
  fused into the epilogue when cuBLAS allows it (bf16/fp16 output with a
  bias of that dtype), else added in fp32 afterwards.
* :data:`BLOCKWISE` -- two :class:`Float8BlockwiseTensor` operands with
  1x128 x 128x128, 128x128 x 1x128 or 1x128 x 1x128 blocks (cuBLAS has no
  128x128 x 128x128 kernel). Decode scales are ``1 / scale`` per block, exact
  for the default power-of-two scales. cuBLAS wants the 1x128 scales
  outer-dim-major ((M, K/128) with strides (1, M)) and the 128x128 scales of
  the second operand as the transpose of their (N/128, K/128) matrix; the
  128x128 scale rows must be 16-byte aligned, so those need K/128 % 4 == 0.
  A combination cuBLAS refuses on this machine (an fp8 dtype pair, an output
  dtype) is remembered, and the table's next route runs it (:class:`RouteRefused`).

The table sends these routes only what cuBLAS FP8 takes (shapes multiples of 16, not
E5M2 x E5M2, CUDA); :func:`tensorwise_fits` and :func:`blockwise_fits` add what an eager
tensor's kind cannot say (its data contiguous and 16-byte aligned, a refused block pair).
"""

from __future__ import annotations

import torch

from .accumulation import fast_accumulation
from .device import block_scaled_mm_cpu
from .table import RouteRefused


def scaled_mm_available() -> bool:
    return hasattr(torch, "_scaled_mm")


def _aligned(t: torch.Tensor | None) -> bool:
    return t is not None and t.is_contiguous() and t.data_ptr() % 16 == 0


def tensorwise_fits(a, a_usage: str, b, b_usage: str, out_dtype, bias) -> bool:
    """Whether cuBLAS FP8 runs these eager operands the table sent it: their data
    contiguous and 16-byte aligned, ``torch._scaled_mm`` present."""
    ad = a.rowwise_data if a_usage == "rowwise" else a.columnwise_data
    bd = b.rowwise_data if b_usage == "rowwise" else b.columnwise_data
    return _aligned(ad) and _aligned(bd) and scaled_mm_available()


def blockwise_fits(a, a_usage: str, b, b_usage: str, out_dtype, bias) -> bool:
    """:func:`tensorwise_fits`, and a block-scale combination cuBLAS has not refused here."""
    return (tensorwise_fits(a, a_usage, b, b_usage, out_dtype, bias)
            and _BLOCK_REFUSED.get(_block_key(a, b, out_dtype, bias), True))


def fusable_bias(bias, out_dtype) -> bool:
    """Whether cuBLAS's FP8 epilogue adds ``bias``: bf16 or fp16 matching the output (not
    with an fp32 output), contiguous."""
    return (bias is not None and out_dtype in (torch.bfloat16, torch.float16)
            and bias.dtype == out_dtype and bias.is_contiguous())


def _finish(res, bias, fused, out):
    """Add an unfused bias to the GEMM result ``res`` (which is ``out`` when one was given:
    the sum then goes back into it)."""
    if bias is not None and not fused:
        summed = (res.to(torch.float32) + bias.to(torch.float32)).to(res.dtype)
        return summed if out is None else out.copy_(summed)
    return res


# ---- per-tensor ---------------------------------------------------------------------------
def scaled_mm(ad, bd, scale_a, scale_b, bias, out_dtype, out, fast_accum: bool = False):
    """``torch._scaled_mm(ad, bd.T)``, into ``out`` when given: exact fp32 accumulation, or
    for per-tensor scales with ``fast_accum`` cuBLAS's fast accumulation (block scales
    always accumulate in fp32)."""
    if not ad.is_cuda and scale_a.numel() > 1:  # block scales, CPU (``device.cuda_routes``)
        res = block_scaled_mm_cpu(ad, bd.t(), scale_a, scale_b, torch.float32)
        res = res if bias is None else res + bias.to(torch.float32)
        return res.to(out_dtype) if out is None else out.copy_(res)
    extra = {} if out is None else {"out": out}
    return torch._scaled_mm(ad, bd.t(), scale_a=scale_a, scale_b=scale_b, bias=bias,
                            out_dtype=out_dtype,
                            use_fast_accum=fast_accum and scale_a.numel() == 1, **extra)


def tensorwise_run(a, a_usage, b, b_usage, out_dtype, bias, out=None):
    ad, bd = getattr(a, f"{a_usage}_data"), getattr(b, f"{b_usage}_data")
    scale_a, scale_b = a.decode_scale(), b.decode_scale()
    fused = fusable_bias(bias, out_dtype)
    res = scaled_mm(ad, bd, scale_a, scale_b, bias if fused else None, out_dtype, out,
                    fast_accumulation())
    return _finish(res, bias, fused, out)


# ---- block-scaled -------------------------------------------------------------------------
#: (block dims, fp8 dtypes, out dtype, fused bias) -> False once cuBLAS refused the combination.
_BLOCK_REFUSED: dict = {}


def _block_key(a, b, out_dtype, bias):
    return (a.block_scaling_dim, b.block_scaling_dim, a.fp8_dtype, b.fp8_dtype, out_dtype,
            fusable_bias(bias, out_dtype))


def _block_scales(a, a_usage, b, b_usage):
    """Decode scales in the layouts ``torch._scaled_mm`` expects for (mat(a), mat(b).T)."""
    da, db = a.decode_scale(a_usage), b.decode_scale(b_usage)
    # 1x128: da (K/128, M) -> (M, K/128) with strides (1, M); db (K/128, N) as it is.
    # 128x128: da (M/128, K/128) as it is; db (N/128, K/128) -> a (K/128, N/128) view.
    scale_a = da.t() if a.block_scaling_dim == 1 else da
    scale_b = db if b.block_scaling_dim == 1 else db.t()
    return scale_a, scale_b


def blockwise_run(a, a_usage, b, b_usage, out_dtype, bias, out=None):
    ad, bd = getattr(a, f"{a_usage}_data"), getattr(b, f"{b_usage}_data")
    scale_a, scale_b = _block_scales(a, a_usage, b, b_usage)
    fused = fusable_bias(bias, out_dtype)
    key = _block_key(a, b, out_dtype, bias)
    try:
        res = scaled_mm(ad, bd, scale_a, scale_b, bias if fused else None, out_dtype, out)
    except (RuntimeError, ValueError, NotImplementedError):
        if torch.cuda.is_current_stream_capturing():
            # Under CUDA graph capture a cuBLAS failure may already have invalidated the
            # capture, and a refusal seen only there must not mark the pair refused for
            # the eager steps: raise (run an eager step before capturing, as capture
            # requires anyway, and a refused pair is known and emulated by then).
            raise
        # This torch/cuBLAS refuses the combination: remember it; the table's next route
        # runs the pair.
        _BLOCK_REFUSED[key] = False
        raise RouteRefused(f"cuBLAS refused block-scaled {key}") from None
    return _finish(res, bias, fused, out)
