"""GEMMs: one dispatcher for every operand pair, and the backends it picks from.

* ``dispatch``: :func:`gemm`, the product ``mat(a) @ mat(b).T`` of two operands in their
  usages, with the backend table and its selection;
* ``cuda``: the GPU backends in the order they are tried (``cublas_fp8``, ``exact_bf16``,
  ``cublaslt``, their kernels);
* ``emulated_fp32``: the exact fp32 emulation every pair falls back to (the CPU path);
* ``traced``: the same table over the operand kinds of traced forms (:func:`route`), and
  each route's computation as ops of a compiled graph (:func:`traced_gemm`);
* ``grouped_mm``, ``fp8_grouped``, ``block_grouped``: the grouped (MoE) GEMMs;
* ``accumulation``: fast accumulation of per-tensor FP8 GEMMs where a recipe asks for it.
"""

from .dispatch import BACKENDS, Backend, gemm, select_backend, use_backends

__all__ = ["gemm", "select_backend", "use_backends", "Backend", "BACKENDS"]

# The rest of lowprec enters the package here (internal names, not in __all__).
from .accumulation import accumulating, fast_accumulation
from .cublas_fp8 import block_scales_fit, fusable_bias, scaled_mm
from .device import cuda_routes, routes_cuda
from .emulated_fp32 import fp32_product
from .exact_bf16 import as_exact, exact_product
from .kernels import gemm_alpha_torch
from .traced import (
    ROUTES,
    bf16_operand,
    bias_mm,
    block_decode,
    emulated_product,
    fp8_gemm,
    route,
    traced_gemm,
)
