"""Launcher for the MXFP8 Triton kernel, registered as a torch custom op.

One pass over the input whatever the usages: each tile is read once and its rowwise and
columnwise data and E8M0 scales are written from registers, and, where asked, the exact
bf16 values of a direction (``data * 2**e``, what the bf16 GEMM emulation multiplies), so
an operand consumed at once needs no dequantize pass. Importing this module needs neither
Triton nor CUDA.
"""

from __future__ import annotations

import torch

from ...kernels import gluon_takes, kernel_op
from ...kernels.fp8_args import FP8_PARAMS, fp8_dtype_of, kernel_fp8_args
from ...kernels.grid import (
    device_guard,
    launches,
    logical_shape,
    order_axes,
    prologue_args,
    prologue_launch_args,
    tile_config,
    tile_grid,
    triton_cdiv,
)
from ...kernels.launch import BoundCalls, launch_calls, launch_in_graph
from ...kernels.tuning import tuning
from ..base import QuantizedTensor, check_exact_only
from .reference import BLOCK


def _gluon_applies(x: torch.Tensor, two_d: bool, rowwise: bool, columnwise: bool,
                   pro: int) -> bool:
    if not (tuning.mxfp8_gluon and rowwise and columnwise and not two_d and pro == 0):
        return False
    m, k = x.shape
    return m % BLOCK == 0 and k % BLOCK == 0 and gluon_takes(x)


def _gluon_call(x, outs, fp8_dtype, exact_row: bool, exact_col: bool, codes: bool,
                row_codes: bool) -> tuple:
    """The Gluon kernel's (kernel, grid, args, kwargs) for a non-empty x."""
    from .gluon_kernels import mx1_both_kernel
    rq, rs, cq, cs, re, ce = outs
    m, k = x.shape
    rb, warps, k_fast, evict = tuning.mxfp8_gluon_config
    grid, k_fast = order_axes((triton_cdiv(m, 32 * warps), triton_cdiv(k, 128)), k_fast)
    mbits, bias, max_bits, fmax = FP8_PARAMS[fp8_dtype]
    return (mx1_both_kernel, grid,
            (x, rq, rs, cq, cs, re if exact_row else None, ce if exact_col else None, m, k,
             x.stride(0)),
            dict(FP8_MAX=fmax, MBITS=mbits, BIAS=bias, MAX_BITS=max_bits, RB=rb,
                 WARPS=warps, EXACT_ROW=exact_row, EXACT_COL=exact_col,
                 ROW_CODES=codes and row_codes, COL_CODES=codes, K_FAST=k_fast,
                 EVICT=bool(evict), num_warps=warps))


#: quantizes without a prologue, their launches bound per kind of call
_QUANTIZES = BoundCalls()


def _usage(rowwise: bool, columnwise: bool) -> str:
    return "both" if rowwise and columnwise else ("row" if rowwise else "col")


def empty_outputs(x, two_d, rowwise, columnwise, pro=0, exact_row=False, exact_col=False,
                  codes=True, row_codes=True):
    m, k = logical_shape(x, pro)
    per = BLOCK if two_d else 1
    u8, bf16 = torch.uint8, torch.bfloat16
    row_codes, col_codes = rowwise and codes and row_codes, columnwise and codes
    return (x.new_empty((m, k) if row_codes else (0,), dtype=u8),
            x.new_empty((m // per, k // BLOCK) if row_codes else (0,), dtype=u8),
            x.new_empty((k, m) if col_codes else (0,), dtype=u8),
            x.new_empty((k // per, m // BLOCK) if col_codes else (0,), dtype=u8),
            x.new_empty((m, k) if rowwise and exact_row else (0,), dtype=bf16),
            x.new_empty((k, m) if columnwise and exact_col else (0,), dtype=bf16))


@kernel_op("lowprec::mxfp8_quantize", mutates_args=())
def mxfp8_quantize(x: torch.Tensor, e5m2: bool, two_d: bool, rowwise: bool, columnwise: bool,
                   pro: int, pro_args: list[torch.Tensor], exact_row: bool = False,
                   exact_col: bool = False, codes: bool = True, row_codes: bool = True
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                              torch.Tensor, torch.Tensor]:
    """(rowwise data, scale, columnwise data, scale, rowwise exact bf16, columnwise exact
    bf16); a direction not asked for gets empty tensors. ``codes=False`` (every direction
    in use asks for its exact values): no data or scales, empty tensors in their place.
    ``row_codes=False`` (with ``exact_row``): no rowwise data or scale, for an input whose
    fprop reads its exact values and whose backward keeps only its columnwise codes."""
    if not codes:
        check_exact_only("mxfp8_quantize", rowwise, columnwise, exact_row, exact_col)
    elif rowwise and not row_codes and not exact_row:
        raise ValueError("mxfp8_quantize: row_codes=False needs exact_row (the rowwise "
                         "direction would hold nothing)")
    fp8_dtype = fp8_dtype_of(e5m2)
    rq, rs, cq, cs, re, ce = empty_outputs(x, two_d, rowwise, columnwise, pro, exact_row,
                                            exact_col, codes, row_codes)
    if x.numel() == 0:
        return rq, rs, cq, cs, re, ce
    outs = (rq, rs, cq, cs, re, ce)
    gluon = _gluon_applies(x, two_d, rowwise, columnwise, pro)

    def calls():
        if gluon:
            return [_gluon_call(x, outs, fp8_dtype, exact_row, exact_col, codes, row_codes)]
        return _triton_calls(x, outs, fp8_dtype, two_d, rowwise, columnwise, pro, pro_args,
                             exact_row, exact_col, codes, row_codes)

    with device_guard(x.device):
        if pro:  # a fused prologue's tensors: launched the usual way
            launch_calls(calls())
        else:  # launches bound per kind of call
            kind = (x.shape, x.stride(), x.dtype, x.device.index, e5m2, two_d, rowwise,
                    columnwise, exact_row, exact_col, codes, row_codes, gluon,
                    tuning.mxfp8_gluon_config,
                    tuning.mxfp8_configs.get((two_d, _usage(rowwise, columnwise))),
                    tuning.hw_cvt, tuning.col_mode)
            _QUANTIZES.run(kind, (x, *outs), calls)
    return rq, rs, cq, cs, re, ce


def _triton_calls(x, outs, fp8_dtype, two_d, rowwise, columnwise, pro, pro_args, exact_row,
                  exact_col, codes, row_codes=True) -> list:
    """The Triton kernel's launches, (kernel, grid, args, kwargs) each."""
    from ...kernels.block_scaled import block_scaled_quant_kernel
    rq, rs, cq, cs, re, ce = outs
    m, k = logical_shape(x, pro)
    calls = []
    for r, c in launches(rowwise, columnwise, "mx2" if two_d else "mx1"):
        bm, bn, warps, iters, stages, k_fast = tile_config(
            tuning.mxfp8_configs[(two_d, _usage(r, c))])
        grid, k_fast = tile_grid(m, k, bm, bn, iters, k_fast)
        calls.append((block_scaled_quant_kernel, grid,
            (x, rq, rs, cq, cs, None, None, m, k, x.stride(0), x.stride(1),
             *prologue_args(x, pro_args), 0.0),
            dict(PRO=pro, FP8_MAX=FP8_PARAMS[fp8_dtype][3],
                 POW2=False, TWO_D=two_d, ROWWISE=r, COLWISE=c, BM=bm, BN=bn, E8M0=True,
                 BLK=BLOCK, ITERS=iters, STAGES=stages,
                 re_ptr=re if r and exact_row else None, ce_ptr=ce if c and exact_col else None,
                 EXACT_ROW=r and exact_row, EXACT_COL=c and exact_col,
                 ROW_CODES=codes and row_codes, COL_CODES=codes,
                 K_FAST=k_fast, num_warps=warps, **kernel_fp8_args(fp8_dtype))))
    return calls


@torch.library.triton_op("lowprec::mxfp8_exact_inline", mutates_args=())
def mxfp8_exact_inline(x: torch.Tensor, e5m2: bool, rowwise: bool, columnwise: bool,
                       two_d: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact bf16 values of ``x``'s 1x32 blocks (32x32 with ``two_d``; rowwise (M, K),
    columnwise (K, M); empty where not asked for), as ``mxfp8_quantize`` with
    ``codes=False`` makes them, for compiled graphs: a ``triton_op``, which inductor
    launches from its own code. The Triton kernel of eager's path, so the same bits."""
    outs = empty_outputs(x, two_d, rowwise, columnwise, 0, rowwise, columnwise, False)
    for kernel, grid, args, kwargs in _triton_calls(x, outs, fp8_dtype_of(e5m2), two_d,
                                                    rowwise, columnwise, 0, [], rowwise,
                                                    columnwise, False):
        launch_in_graph(kernel, grid, *args, **kwargs)
    return outs[4], outs[5]


@mxfp8_quantize.register_fake
def _(x, e5m2, two_d, rowwise, columnwise, pro, pro_args, exact_row=False, exact_col=False,
      codes=True, row_codes=True):
    return empty_outputs(x, two_d, rowwise, columnwise, pro, exact_row, exact_col, codes,
                         row_codes)


def quantize_mxfp8(quantizer, x2d: torch.Tensor, prologue=None) -> dict:
    """MXFP8Quantizer._quantize_2d through the kernel (same fields), with the exact bf16
    records of the directions in ``quantizer.exact_usages()``."""
    row, col = quantizer.rowwise_usage, quantizer.columnwise_usage
    dt = quantizer.fp8_dtype
    exact = quantizer.exact_usages()
    ex_row, ex_col = row and "rowwise" in exact, col and "columnwise" in exact
    rq, rs, cq, cs, re, ce = mxfp8_quantize(x2d, dt == torch.float8_e5m2,
                                            quantizer.with_2d_quantization, row, col,
                                            *prologue_launch_args(prologue), ex_row, ex_col)
    rq, cq = rq.view(dt), cq.view(dt)
    fields = {"rowwise_data": rq if row else None, "rowwise_scale": rs if row else None,
              "columnwise_data": cq if col else None,
              "columnwise_scale": cs if col else None,
              "fp8_dtype": dt, "with_2d_quantization": quantizer.with_2d_quantization}
    if ex_row:
        fields["_exact_rowwise"] = QuantizedTensor.derived_record(rq, re)
    if ex_col:
        fields["_exact_columnwise"] = QuantizedTensor.derived_record(cq, ce)
    return fields


def quantize_mxfp8_exact(quantizer, x2d: torch.Tensor) -> dict:
    """ExactTensor fields of ``x2d`` (no codes or scales written): the exact bf16 values of
    each direction ``quantizer`` has on, as ``quantize_mxfp8`` would record them."""
    row, col = quantizer.rowwise_usage, quantizer.columnwise_usage
    _, _, _, _, re, ce = mxfp8_quantize(x2d, quantizer.fp8_dtype == torch.float8_e5m2,
                                        quantizer.with_2d_quantization, row, col, 0, [], row,
                                        col, False)
    return {"rowwise_data": re if row else None, "rowwise_divisor": None,
            "columnwise_data": ce if col else None, "columnwise_divisor": None,
            "source_format": "mxfp8", "columnwise_rht": False}
