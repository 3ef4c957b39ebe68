"""The production GEMM of MXFP8 and NVFP4 on Hopper (and any CUDA GPU without MX/FP4
tensor cores): any operand pair whose values are exact in bf16, multiplied on the bf16
tensor cores.

Each operand becomes a bf16 matrix that holds its dequantized values
*exactly*, times at most one fp32 per-tensor divisor applied after the GEMM:

=================  ==========================================  ===============
operand            bf16 matrix (exact)                         divisor
=================  ==========================================  ===============
MXFP8              ``data * 2**e`` (<= 4 significant bits)      none
NVFP4              ``q * d`` (E2M1 x E4M3: <= 6 bits)           global ``S``
per-tensor FP8     ``data``                                     ``scale``
block FP8          ``data / scale`` (power-of-two scales only)  none
ExactTensor        the held values                             its divisor
bf16 (plain or     the values                                  none
IdentityTensor)
=================  ==========================================  ===============

Each quantized tensor class gives its matrix and divisor itself
(``QuantizedTensor.bf16_operand``); the GEMM table (``table.bf16_domain`` of the operands'
kinds) decides which pairs come here.

The GEMM multiplies the bf16 matrices on the tensor cores with fp32
accumulation; the divisors and the bias are then applied in fp32 and the
result is rounded once to ``out_dtype``. So the result equals the fp32
emulation (dequantize both operands in fp32, multiply in fp32) up to fp32
rounding of the products' sums. Where nothing is left to apply in fp32 (no
divisor, a bf16 output, a bf16 bias) the GEMM writes bf16 directly, with
the bias in cuBLAS's epilogue. Otherwise, without a bias and for
row-contiguous operands, cuBLASLt applies the divisors as one factor
``RN32(RN64(1 / (div_a * div_b)))`` read from device memory in its fp32 epilogue
(:mod:`.cublaslt`); elsewhere the GEMM writes fp32 and a kernel divides by
each divisor in turn (``(acc / div_a) / div_b + bias``).

NVFP4 RHT: when both operands carry the Hadamard transform along the
contraction dimension (the wgrad pair of NVFP4BlockScaling), their stored
values are multiplied directly, since the orthogonal transform cancels.
When only one does, its original-domain values are no longer exact in bf16,
so the table sends the pair to the fp32 emulation (which undoes the transform
in fp32) instead; likewise fp16/fp32 operands and block FP8 with scales that
are not powers of two.

Limitation: values below bf16's subnormal grid (2**-133), which only occur
in MXFP8 blocks with a scale near 2**-127, would be rounded; their
contribution to any product is below 1e-38.
"""

from __future__ import annotations

import torch

from ..formats import ExactTensor, QuantizedTensor
from ..formats.mxfp8 import MXFP8Tensor
from ..formats.nvfp4 import NVFP4Tensor
from ..kernels import use_kernels
from . import cublaslt, kernels
from .emulated_fp32 import plain_matrix


def bf16_operand(t, usage: str):
    """(exact bf16 matrix of ``mat(t, usage)`` up to a divisor, fp32 divisor or None)."""
    if isinstance(t, QuantizedTensor):
        return t.bf16_operand(usage)
    return plain_matrix(t, usage), None


def as_exact(t, usage: str):
    """``t`` as an ExactTensor holding only ``usage``'s exact bf16 values (one dequantize
    pass, made once for GEMMs that would each dequantize ``t`` again), or ``t`` itself
    where this backend would not take it (CPU, a format without exact bf16 values here)."""
    if not (isinstance(t, (MXFP8Tensor, NVFP4Tensor)) and t.has_usage(usage)
            and use_kernels(t)):
        return t
    values, divisor = bf16_operand(t, usage)
    nvfp4 = isinstance(t, NVFP4Tensor)
    return ExactTensor(t.shape, t.dtype, **ExactTensor.one_usage_fields(
        usage, values, divisor, source_format="nvfp4" if nvfp4 else "mxfp8",
        rht=nvfp4 and t.with_rht))


def _mm_fp32_out(am: torch.Tensor, bm: torch.Tensor) -> torch.Tensor:
    """bf16 x bf16 -> fp32 on the tensor cores (fp32 accumulation, fp32 result)."""
    if not am.is_cuda:  # the CPU has no mm(..., out_dtype) (``device.cuda_routes``)
        return am.to(torch.float32) @ bm.to(torch.float32).t()
    try:
        return torch.mm(am, bm.t(), out_dtype=torch.float32)
    except (TypeError, RuntimeError):
        # Older torch without mm(..., out_dtype): exact but slower fp32 GEMM.
        return am.to(torch.float32) @ bm.to(torch.float32).t()


def exact_bf16_run(a, a_usage, b, b_usage, out_dtype, bias, out=None):
    """The product (see the module docstring); ``out``: a contiguous tensor of its shape
    and dtype to write it to (directly where cuBLAS or cuBLASLt writes it, else copied)."""
    am, div_a = bf16_operand(a, a_usage)
    bm, div_b = bf16_operand(b, b_usage)
    return exact_product(am, div_a, bm, div_b, out_dtype, bias, out)


def exact_product(am, div_a, bm, div_b, out_dtype, bias=None, out=None, *, in_graph=False):
    """``(am / div_a) @ (bm / div_b).T + bias`` of exact bf16 matrices ``am`` (M, K) and
    ``bm`` (N, K) with fp32 divisors (None: 1), rounded once to ``out_dtype``, as
    :func:`exact_bf16_run` computes it. ``in_graph``: a traced linear's GEMM, the same
    library calls with nothing kept between calls (``kernels.scaled_mm_lt_in_graph``)."""
    if div_a is None and div_b is None and out_dtype == torch.bfloat16 and (
            bias is None or bias.dtype == torch.bfloat16):
        # Nothing left to do in fp32: cuBLAS accumulates in fp32 and rounds once to bf16.
        if bias is None:
            return torch.mm(am, bm.t(), out=out)
        return torch.addmm(bias, am, bm.t(), out=out)
    # in a graph the op asks the strides itself: dynamo speculates a backward that reads a
    # tensor's strides a second time (and torch, 2.11 to 2.13, then leaves the first
    # attempt's torch.autocast state behind)
    if bias is None and use_kernels(am) and cublaslt.shape_ok(am, bm, out_dtype,
                                                              strides=not in_graph):
        # the divisors in cuBLASLt's epilogue: no fp32 result in memory
        if in_graph:
            div_a, div_b = kernels.divisor(div_a), kernels.divisor(div_b)
            workspace = am.new_empty(cublaslt.WORKSPACE_BYTES, dtype=torch.uint8)
            return kernels.scaled_mm_lt_in_graph(am, bm, div_a, div_b,
                                                 kernels.graph_alpha_beta(div_a, div_b, am),
                                                 workspace, out_dtype)
        return kernels.scaled_mm_lt(am, bm, div_a, div_b, out_dtype, out=out)
    acc = _mm_fp32_out(am, bm)
    result = kernels.scale_bias_epilogue(acc, div_a, div_b, bias, out_dtype)
    return result if out is None else out.copy_(result)
