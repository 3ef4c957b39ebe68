"""Each route of the GEMM table (``table.route``) as ops a compiled graph holds.

A traced linear (``lowprec.linear.traced``) describes each operand by its traced form's
:class:`~lowprec.formats.Kind` (per-tensor FP8, FP8 blocks, exact bf16 values, plain
values) and asks the table for each of its GEMMs when it plans the call, as eager's
dispatcher asks it of its tensors' kinds; eager calls that run through the plan take the
same routes. The fp32 emulation's operand values are made by ops that run eager's own
dequantize (IEEE division, the inverse Hadamard transform), so a route's bits do not
depend on whether inductor compiled it.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..formats import Blocks, Exact, Fp8, Plain, as_output, decode_scale
from ..kernels import graph_op, traced_op
from .cublas_fp8 import fusable_bias, scaled_mm
from .emulated_fp32 import fp32_product
from .exact_bf16 import exact_product


def plus_bias(out: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``out + bias`` in fp32 after the GEMM, as eager's emulation adds it: a custom op,
    so the compiler does not fold the add into the GEMM (an ``addmm`` accumulates the bias
    with the products and rounds differently)."""
    return out if bias is None else bias_add(out, bias)


def emulated_product(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None,
                     out_dtype: torch.dtype) -> torch.Tensor:
    """``a @ b.T (+ bias)`` of fp32 operand values rounded once to ``out_dtype``: the fp32
    GEMM emulation eager runs off CUDA (``gemm.emulated_fp32``), every traced plan's."""
    return as_output(plus_bias(fp32_product(a, b), bias), out_dtype)


@graph_op("bias_add")
def bias_add(out: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """``out + bias`` in fp32 (``out`` fp32 (M, N), ``bias`` (N,))."""
    return out + bias.to(torch.float32)


@torch.library.register_fake("lowprec::bias_add")
def _bias_add_fake(out, bias):
    return torch.empty_like(out)


def bias_mm(bias: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``bias + a @ b.T`` as eager's plain and exact-bf16 GEMMs run it, ``torch.addmm``
    (cuBLAS adds the bias in its epilogue, before the one rounding); in a graph one op
    the compiler keeps whole (:func:`addmm_op`), where inductor would add the bias to
    the rounded product."""
    if torch.compiler.is_compiling():
        return addmm_op(bias, a, b)
    return torch.addmm(bias, a, b.t())


@graph_op("addmm")
def addmm_op(bias: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``torch.addmm(bias, a, b.T)``."""
    return torch.addmm(bias, a, b.t())


@torch.library.register_fake("lowprec::addmm")
def _addmm_fake(bias, a, b):
    return a.new_empty((a.shape[0], b.shape[0]))


def _with_bias(res, bias, fused: bool, out_dtype):
    if bias is not None and not fused:
        return as_output(res.to(torch.float32) + bias.to(torch.float32), out_dtype)
    return res


def _cublas_fp8(a: Fp8, b: Fp8, out_dtype, bias, ops=None, fast=False):
    return fp8_gemm(a.data, a.scale, a.decode, b.data, b.scale, b.decode, bias, out_dtype,
                    fast)


@traced_op("fp8_gemm")
def fp8_gemm(a: torch.Tensor, a_scale: torch.Tensor, a_decode: Optional[torch.Tensor],
             b: torch.Tensor, b_scale: torch.Tensor, b_decode: Optional[torch.Tensor],
             bias: Optional[torch.Tensor], out_dtype: torch.dtype,
             fast_accum: bool = False) -> torch.Tensor:
    """``a @ b.T (+ bias)`` of per-tensor FP8 operands (codes, scale, ``1 / scale`` or None)
    through cuBLAS, as eager's ``cublas_fp8`` backend runs it (``fast_accum``: cuBLAS's
    fast accumulation)."""
    fused = fusable_bias(bias, out_dtype)
    decode_a = a_decode if a_decode is not None else decode_scale(a_scale).reshape(())
    decode_b = b_decode if b_decode is not None else decode_scale(b_scale).reshape(())
    res = scaled_mm(a, b, decode_a, decode_b, bias if fused else None, out_dtype, None,
                    fast_accum)
    return _with_bias(res, bias, fused, out_dtype)


@torch.library.register_fake("lowprec::fp8_gemm")
def _fp8_gemm_fake(a, a_scale, a_decode, b, b_scale, b_decode, bias, out_dtype,
                   fast_accum=False):
    return a.new_empty((a.shape[0], b.shape[0]), dtype=out_dtype)


def block_decode(rep: Blocks) -> torch.Tensor:
    """``1 / scale`` in cuBLAS's layout: 1x128 (R, K/128) as a contiguous (K/128, R);
    128x128 contiguous as it is (the quantize kernel's copy where an eager call has one)."""
    if rep.decode is not None:
        return rep.decode
    return decode_scale(rep.scale.t() if rep.dim == 1 else rep.scale).contiguous()


def _cublas_fp8_block(a: Blocks, b: Blocks, out_dtype, bias, ops=None):
    # mat(a)'s 1x128 scales read as the transpose of their (K/128, M) layout, mat(b)'s
    # 128x128 ones transposed
    da, db = block_decode(a), block_decode(b)
    scale_a = da.t() if a.dim == 1 else da
    scale_b = db if b.dim == 1 else db.t()
    fused = fusable_bias(bias, out_dtype)
    res = scaled_mm(a.data, b.data, scale_a, scale_b, bias if fused else None, out_dtype,
                    None)
    return _with_bias(res, bias, fused, out_dtype)


def bf16_operand(rep, form):
    """(exact bf16 matrix, fp32 divisor or None) of ``rep``, an operand of ``form``, as
    ``QuantizedTensor.bf16_operand``."""
    if isinstance(rep, Fp8):
        return rep.data.to(torch.bfloat16), rep.scale
    if isinstance(rep, Exact):  # stored contiguous by eager's quantize
        return rep.values.to(torch.bfloat16).contiguous(), rep.divisor
    if isinstance(rep, Blocks):  # power-of-two scales (``table.bf16_domain``)
        return form.bf16_values(rep), None
    return rep.values, None  # an IdentityTensor's data, perhaps a transposed view


def _exact_bf16(a, b, out_dtype, bias, ops):
    am, div_a = bf16_operand(a, ops[0][0].half(ops[0][1]))
    bm, div_b = bf16_operand(b, ops[1][0].half(ops[1][1]))
    if bias is not None and div_a is None and div_b is None and out_dtype == torch.bfloat16:
        return bias_mm(bias, am, bm)  # exact_product's bias epilogue
    return exact_product(am, div_a, bm, div_b, out_dtype, bias, in_graph=True)


def _emulated(a, b, out_dtype, bias, ops):
    """The fp32 emulation: both operands' fp32 values (``operand_matrix_fp32``)."""
    (a_op, a_usage), (b_op, b_usage) = ops
    return emulated_product(a_op.dequantized(a, torch.float32, a_usage),
                                  b_op.dequantized(b, torch.float32, b_usage), bias, out_dtype)


def _plain(a: Plain, b: Plain, out_dtype, bias, ops=None):
    if bias is None:
        return a.values @ b.values.t()
    return bias_mm(bias, a.values, b.values)


#: The traced computation of each route (``table.ROUTE_NAMES``).
ROUTES = {"plain": _plain, "cublas_fp8": _cublas_fp8, "cublas_fp8_block": _cublas_fp8_block,
          "exact_bf16": _exact_bf16, "emulated": _emulated}


def traced_gemm(name: str, a, b, out_dtype, bias, ops, fast: bool = False) -> torch.Tensor:
    """``mat(a) @ mat(b).T (+ bias)`` of two graph forms through route ``name``; ``ops``:
    ((operand, usage) of a, of b), which the emulation asks for the fp32 values; ``fast``:
    fast accumulation where the route is two per-tensor FP8 operands (``cublas_fp8``)."""
    if name == "cublas_fp8":
        return _cublas_fp8(a, b, out_dtype, bias, ops, fast)
    return ROUTES[name](a, b, out_dtype, bias, ops)
