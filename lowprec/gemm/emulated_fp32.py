"""The exact fp32 GEMM emulation: both operands dequantized in fp32, an fp32 matmul.

Every pair of operands is accepted: :func:`lowprec.gemm.gemm` falls back to it after the
GPU backends, and a backend that finds its pair refused at run time computes it here.
"""

from __future__ import annotations

import torch

from ..formats import IdentityTensor, QuantizedTensor


def plain_matrix(t: torch.Tensor, usage: str) -> torch.Tensor:
    """``mat(t, usage)`` of an unquantized operand (or an IdentityTensor's data)."""
    if isinstance(t, IdentityTensor):
        return getattr(t, f"{usage}_data")
    m2 = t.reshape(-1, t.shape[-1])
    return m2 if usage == "rowwise" else m2.t()


def operand_matrix_fp32(t: torch.Tensor, usage: str) -> torch.Tensor:
    """fp32 values of ``mat(t, usage)``, dequantized exactly for quantized operands."""
    if isinstance(t, QuantizedTensor) and not isinstance(t, IdentityTensor):
        if not t.has_usage(usage):
            raise RuntimeError(f"GEMM needs the {usage} representation of {t!r}")
        return t._stored_values(usage)
    return plain_matrix(t, usage).to(torch.float32)


def fp32_product(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b.T`` of fp32 matrices, each read row-major: the BLAS call, and so its order
    of accumulation, is then the same whichever layout the operands arrive in (an eager
    call and a compiled graph lay out a transposed operand differently, and CPU BLAS
    kernels for the two layouts can sum in different orders)."""
    return a.contiguous() @ b.contiguous().t()


def emulated_fp32_run(a, a_usage, b, b_usage, out_dtype, bias):
    """``mat(a) @ mat(b).T (+ bias)`` in fp32, rounded once to ``out_dtype``."""
    out = fp32_product(operand_matrix_fp32(a, a_usage), operand_matrix_fp32(b, b_usage))
    if bias is not None:
        out = out + bias.to(torch.float32)
    return out.to(out_dtype)
