"""GEMMs: one table of routes for every operand pair, run eagerly or in a graph.

* ``table``: :func:`route`, the route of ``mat(a) @ mat(b).T`` from the operands' kinds,
  which eager calls and traced plans both ask, and ``grouped_route``, the route of a
  grouped (MoE) call's GEMMs from its scheme, shapes and device description;
* ``dispatch``: :func:`gemm`, the eager product of two operands in their usages, the
  table's route run eagerly;
* ``cuda``: the eager computations of the GPU routes (``cublas_fp8``,
  ``cublas_fp8_block``, ``exact_bf16``) and their run-time checks;
* ``emulated_fp32``: the exact fp32 emulation the table gives every other pair (the CPU
  path);
* ``traced``: each route's computation as ops of a compiled graph (:func:`traced_gemm`);
* ``grouped_mm``, ``fp8_grouped``, ``block_grouped``: the grouped (MoE) GEMMs;
* ``accumulation``: fast accumulation of per-tensor FP8 GEMMs where a recipe asks for it.
"""

from .dispatch import gemm, native_routes, select_route, use_backends
from .table import NATIVE_ROUTES, ROUTE_NAMES, route

__all__ = ["gemm", "select_route", "use_backends", "native_routes", "route", "ROUTE_NAMES",
           "NATIVE_ROUTES"]

# The rest of lowprec enters the package here (internal names, not in __all__).
from .accumulation import accumulating, fast_accumulation
from .cublas_fp8 import fusable_bias, scaled_mm
from .device import cuda_routes, grouped_device, routes_cuda
from .emulated_fp32 import fp32_product
from .exact_bf16 import as_exact, exact_product
from .kernels import gemm_alpha_torch
from .table import (
    GROUPED_ROUTES,
    GroupedDevice,
    RouteRefused,
    bf16_domain,
    block_scales_fit,
    grouped_route,
)
from .traced import (
    ROUTES,
    bf16_operand,
    bias_mm,
    block_decode,
    emulated_product,
    fp8_gemm,
    traced_gemm,
)
