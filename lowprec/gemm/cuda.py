"""GPU GEMM backends, tried by :func:`lowprec.gemm.gemm` ahead of the fp32 emulation.

Each backend accepts only CUDA operands, so on CPU (and for any pair none of
them takes) the exact fp32 emulation runs.

=================  ==============================================================
backend            operand pairs
=================  ==============================================================
cublas_fp8         Float8Tensor x Float8Tensor (E4M3/E5M2, not both E5M2),
                   ``torch._scaled_mm`` with per-tensor decode scales
cublas_fp8_block   Float8BlockwiseTensor pairs 1x128 x 128x128, 128x128 x 1x128,
                   1x128 x 1x128, ``torch._scaled_mm`` block scaling (sm90)
exact_bf16         any pair whose dequantized values are exact in bf16 (MXFP8,
                   NVFP4, FP8, power-of-two block FP8, bf16): bf16 tensor-core
                   GEMM, fp32 accumulation, global scales and bias in fp32; the
                   production path of MXFP8 and NVFP4 on Hopper
=================  ==============================================================
"""

from __future__ import annotations

from ..formats.float8 import Float8Tensor
from .cublas_fp8 import (
    blockwise_accepts,
    blockwise_run,
    tensorwise_accepts,
    tensorwise_direct,
    tensorwise_run,
)
from .exact_bf16 import exact_bf16_accepts, exact_bf16_run


def cuda_backends(backend_cls):
    """The GPU backends as ``backend_cls(name, accepts, run, takes_out, direct)`` entries, in
    dispatch order."""
    return [
        backend_cls("cublas_fp8", tensorwise_accepts, tensorwise_run, True,
                    (Float8Tensor, tensorwise_direct)),
        backend_cls("cublas_fp8_block", blockwise_accepts, blockwise_run, True),
        backend_cls("exact_bf16", exact_bf16_accepts, exact_bf16_run, True),
    ]


__all__ = ["cuda_backends"]
