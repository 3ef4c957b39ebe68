"""The eager computations of the CUDA routes (``table.ROUTE_NAMES``), and what each needs
of eager operands beyond their kinds.

=================  ==============================================================
route              operand pairs (``table.route`` decides)
=================  ==============================================================
cublas_fp8         per-tensor FP8 x per-tensor FP8 (E4M3/E5M2, not both E5M2),
                   ``torch._scaled_mm`` with per-tensor decode scales
cublas_fp8_block   block FP8 pairs 1x128 x 128x128, 128x128 x 1x128,
                   1x128 x 1x128, ``torch._scaled_mm`` block scaling (sm90)
exact_bf16         any pair whose dequantized values are exact in bf16 (MXFP8,
                   NVFP4, FP8, power-of-two block FP8, bf16): bf16 tensor-core
                   GEMM, fp32 accumulation, global scales and bias in fp32; the
                   production path of MXFP8 and NVFP4 on Hopper
=================  ==============================================================
"""

from __future__ import annotations

from .cublas_fp8 import blockwise_fits, blockwise_run, tensorwise_fits, tensorwise_run
from .exact_bf16 import exact_bf16_run

#: route -> ``run(a, a_usage, b, b_usage, out_dtype, bias, out=None)``; each writes into
#: ``out`` itself
CUDA_RUNS = {"cublas_fp8": tensorwise_run, "cublas_fp8_block": blockwise_run,
             "exact_bf16": exact_bf16_run}

#: route -> ``fits(a, a_usage, b, b_usage, out_dtype, bias)``: whether it runs these eager
#: operands (what their kinds do not say); a route not listed runs every pair it is given
CUDA_FITS = {"cublas_fp8": tensorwise_fits, "cublas_fp8_block": blockwise_fits}

__all__ = ["CUDA_RUNS", "CUDA_FITS"]
