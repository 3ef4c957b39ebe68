"""The GEMM table: which route ``mat(a) @ mat(b).T`` takes, for every pair of operand kinds
on every device, eager and traced alike.

An operand is described by its :class:`~lowprec.formats.Kind`: a traced form gives it
(``GraphOperand.kind``), an eager quantized tensor gives the same one
(``QuantizedTensor.gemm_kind``), a plain tensor is ``Kind("plain", dtype=...)``.
:func:`route` names one of :data:`ROUTE_NAMES`; eager's dispatcher (``dispatch.gemm``)
and the traced plans (``linear.traced.plan_for``) both ask it, and each runs the route's
computation in its form (``dispatch.EAGER_RUNS``, ``traced.ROUTES``). So the two forms
take one route by construction, and the fp32 emulation takes whatever no tensor-core
route does: the table is total.

What the kinds cannot say an eager call checks at run time and then asks the table again
without the route (``exclude``): a cuBLAS route needs its data contiguous and 16-byte
aligned, and cuBLAS may refuse a block-scaled pair (:class:`RouteRefused`). A traced
graph's operands are its own aligned tensors, and a refused pair is known from eager
steps, so traced calls never exclude.

A grouped call (the experts of an MoE layer) asks :func:`grouped_route` for its GEMMs,
from the grouped scheme its quantizers pick, its shapes and what the device offers
(:class:`GroupedDevice`): a plain description, so the choices a GPU makes are tested
on any machine.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..formats import Kind

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2

#: every route, in the order the table prefers them
ROUTE_NAMES = ("plain", "cublas_fp8", "cublas_fp8_block", "exact_bf16", "emulated")
#: the routes on tensor cores (CUDA only)
NATIVE_ROUTES = ROUTE_NAMES[1:4]
_OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class RouteRefused(RuntimeError):
    """An eager route found at run time that it cannot run this pair (cuBLAS refused a
    block-scaled combination): the dispatcher asks the table again without it."""


def block_scales_fit(dim_a: int, dim_b: int, k: int) -> bool:
    """Whether cuBLAS takes the block scales of operands with block dims ``dim_a`` and
    ``dim_b`` over a contraction of ``k`` (a multiple of 128): 128x128 scale rows must be
    16-byte aligned, so a 128x128 operand needs K/128 % 4 == 0."""
    return not ((dim_a == 2 or dim_b == 2) and (k // 128) % 4)


def bf16_domain(kind: Kind | None) -> str | None:
    """Where an operand of ``kind`` enters a bf16 tensor-core GEMM exactly: ``"original"``;
    ``"rht"`` for values in NVFP4's Hadamard domain along the contraction dimension (exact
    only against another such operand, where the transform cancels); None where its values
    are not exact in bf16."""
    if kind is None:
        return None
    if kind.name == "fp8":  # the codes; the per-tensor scale is the divisor
        return "original"
    if kind.name == "exact":
        return None if not kind.bf16 else "rht" if kind.rht else "original"
    if kind.name == "plain":
        return "original" if kind.dtype == torch.bfloat16 else None
    if kind.name == "blocks":  # data / scale is exact in bf16 for power-of-two scales
        return "original" if kind.pow2 else None
    return None


def route(a: Kind, b: Kind, m: int, n: int, k: int, out_dtype: torch.dtype,
          bias: torch.dtype | None, cuda: bool, exclude: frozenset = frozenset()) -> str:
    """The route of ``mat(a) (m, k) @ mat(b) (n, k).T (+ bias)`` with operands of kinds
    ``a`` and ``b``, a ``bias`` of that dtype (None: without one) and an ``out_dtype``
    product, on CUDA or not: one of :data:`ROUTE_NAMES` and never one in ``exclude``
    (which must not hold ``"emulated"``)."""
    if ("plain" not in exclude and a.name == "plain" and b.name == "plain"
            and a.dtype == b.dtype == out_dtype and bias in (None, out_dtype)):
        return "plain"  # a bias through cuBLAS's epilogue
    if not cuda or out_dtype not in _OUT_DTYPES or m == 0 or n == 0 or k == 0:
        return "emulated"
    if a.name == b.name == "fp8" and "cublas_fp8" not in exclude:
        if not (a.fp8_dtype == E5M2 and b.fp8_dtype == E5M2) and k % 16 == 0 and n % 16 == 0:
            return "cublas_fp8"
    if a.name == b.name == "blocks" and "cublas_fp8_block" not in exclude:
        if (not (a.dim == 2 and b.dim == 2) and not (a.fp8_dtype == E5M2 and b.fp8_dtype == E5M2)
                and k % 128 == 0 and m % 16 == 0 and n % 16 == 0
                and block_scales_fit(a.dim, b.dim, k)):
            return "cublas_fp8_block"
    da, db = bf16_domain(a), bf16_domain(b)
    if da is not None and da == db and "exact_bf16" not in exclude:
        return "exact_bf16"
    return "emulated"


# ---- grouped GEMMs -----------------------------------------------------------------------
#: the routes of a grouped call's GEMMs (every group's rows against its expert's weight):
#: one launch for all groups, offsets on the device (``torch._grouped_mm``,
#: ``torch._scaled_grouped_mm``, lowprec's ``fp8_grouped`` and ``block_grouped`` kernels),
#: or ``per_group``: one :func:`route` GEMM a group, the group sizes read on the host
GROUPED_ROUTES = ("grouped_mm", "scaled_grouped_mm", "fp8_grouped", "block_grouped",
                  "per_group")
#: mean rows an expert from which FP8 current scaling takes ``torch._scaled_grouped_mm``
#: (E4M3 operands) over lowprec's kernel (``linear/grouped_current.py`` gives the timings)
CUTLASS_ROWS = 2048


@dataclass(frozen=True)
class GroupedDevice:
    """What the grouped routes need of a device: a Hopper-class GPU (sm_90 or newer),
    Triton on it, and torch's grouped GEMMs (``gemm.device.grouped_device`` reads them
    off a tensor; a test gives them by hand)."""

    hopper: bool = False
    triton: bool = False
    grouped_mm: bool = False
    scaled_grouped_mm: bool = False


def fp8_grouped_takes(device: GroupedDevice, dtypes) -> bool:
    """Whether lowprec's grouped GEMM kernel runs operands of ``dtypes`` on ``device``:
    bf16 ones, or E4M3 and E5M2 ones but not both E5M2 (which cuBLAS does not take)."""
    if not (device.hopper and device.triton):
        return False
    if all(d == torch.bfloat16 for d in dtypes):
        return True
    return all(d in (E4M3, E5M2) for d in dtypes) and not all(d == E5M2 for d in dtypes)


def grouped_mm_takes(device: GroupedDevice, rows_dtype: torch.dtype, n: int, k: int) -> bool:
    """Whether ``torch._grouped_mm`` runs bf16 rows of ``k`` features against experts of
    ``n`` outputs on ``device`` (16-byte strides)."""
    return (device.grouped_mm and device.hopper and rows_dtype == torch.bfloat16
            and k % 8 == 0 and n % 8 == 0)


def grouped_route(scheme: str, rows_dtype: torch.dtype, dtypes: tuple, rows: int, n: int,
                  k: int, groups: int, device: GroupedDevice) -> str:
    """The route of a grouped call's GEMMs (one of :data:`GROUPED_ROUTES`) for the grouped
    ``scheme`` its quantizers pick (``linear.grouped_engine``: ``"plain"``,
    ``"current"``, ``"exact"``, ``"block"``, ``"nvfp4"``), ``rows`` rows of
    ``rows_dtype`` with ``k`` features, ``groups`` experts of ``n`` outputs, GEMM operands
    of ``dtypes`` (the fp8 dtypes of a current-scaling or block-scaled pair), on
    ``device``."""
    if scheme in ("plain", "exact"):
        return "grouped_mm" if grouped_mm_takes(device, rows_dtype, n, k) else "per_group"
    if scheme == "current":
        if rows_dtype != torch.bfloat16 or k % 16 or n % 16:
            return "per_group"
        cutlass = (device.scaled_grouped_mm and device.hopper
                   and all(d == E4M3 for d in dtypes))
        if cutlass and rows >= CUTLASS_ROWS * groups:
            return "scaled_grouped_mm"
        if fp8_grouped_takes(device, dtypes):
            return "fp8_grouped"
        return "scaled_grouped_mm" if cutlass else "per_group"
    if scheme == "block":
        return ("block_grouped" if rows_dtype == torch.bfloat16 and device.hopper
                and device.triton and all(d == E4M3 for d in dtypes) else "per_group")
    if scheme == "nvfp4":  # exact bf16 values, each expert's alpha: lowprec's kernel
        return ("fp8_grouped" if grouped_mm_takes(device, rows_dtype, n, k)
                and fp8_grouped_takes(device, (torch.bfloat16,)) else "per_group")
    raise ValueError(f"grouped_route: unknown scheme {scheme!r}; the schemes are plain, "
                     f"current, exact, block and nvfp4")


__all__ = ["ROUTE_NAMES", "NATIVE_ROUTES", "RouteRefused", "bf16_domain", "block_scales_fit",
           "route", "GROUPED_ROUTES", "GroupedDevice", "grouped_route"]
