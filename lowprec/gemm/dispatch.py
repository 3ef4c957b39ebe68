"""The eager GEMM dispatcher: one product for every layout, the table's route for each
operand pair.

Every linear GEMM is written as ``mat(a) @ mat(b).T`` where ``mat`` takes an
operand in one *usage*:

* ``mat(t, "rowwise")`` is the (M, K) matrix of a tensor of shape (..., K);
* ``mat(t, "columnwise")`` is its transpose (K, M), the stored layout of a
  quantized tensor's columnwise data.

So fprop ``Y = X W^T`` is ``gemm(X, "rowwise", W, "rowwise")``, dgrad
``dX = dY W`` is ``gemm(dY, "rowwise", W, "columnwise")`` and wgrad
``dW = dY^T X`` is ``gemm(dY, "columnwise", X, "columnwise")``: both operands
are always contiguous in the contraction dimension, as cuBLAS FP8 wants.

:func:`gemm` asks the GEMM table (``table.route``) for the route of the operands' kinds,
the same question a traced plan asks, and runs the route's eager computation
(:data:`EAGER_RUNS`). The fp32 emulation takes every pair no tensor-core route takes: it
dequantizes both operands in fp32 (NVFP4 global scales and block scales applied, RHT
undone) and multiplies in fp32, so the result equals the product of the dequantized
operands to fp32 rounding.
"""

from __future__ import annotations

import contextlib
import functools
import threading

import torch

from ..formats import HybridQuantizedTensor, Kind, QuantizedTensor, check_usage, plain_kind
from .cuda import CUDA_FITS, CUDA_RUNS
from .device import routes_cuda
from .emulated_fp32 import emulated_fp32_run, plain_matrix
from .table import NATIVE_ROUTES, ROUTE_NAMES, RouteRefused, route

#: the table's answers for eager calls, kept (traced plans ask ``route`` itself: dynamo
#: would trace through a cache)
_route = functools.lru_cache(maxsize=4096)(route)


def _plain_run(a, a_usage, b, b_usage, out_dtype, bias):
    am, bm = plain_matrix(a, a_usage), plain_matrix(b, b_usage)
    if bias is None:
        return am @ bm.t()
    return torch.addmm(bias, am, bm.t())


#: route -> its eager computation ``run(a, a_usage, b, b_usage, out_dtype, bias[, out])``
EAGER_RUNS = {"plain": _plain_run, **CUDA_RUNS, "emulated": emulated_fp32_run}
#: the routes whose computation writes into ``out=`` itself (no copy)
_TAKES_OUT = frozenset(CUDA_RUNS)

_LOCAL = threading.local()


def _excluded() -> frozenset:
    return getattr(_LOCAL, "exclude", frozenset())


@contextlib.contextmanager
def use_backends(names):
    """Within the block, on this thread, only the routes named in ``names`` run (the
    emulation must be among them; each pair takes the best route left): e.g.
    ``("plain", "emulated")`` to compare the GPU routes with the emulation."""
    names = tuple(names)
    unknown = [n for n in names if n not in ROUTE_NAMES]
    if unknown or "emulated" not in names:
        raise ValueError(f"use_backends takes route names among {ROUTE_NAMES}, 'emulated' "
                         f"included; got {names!r}")
    saved = _excluded()
    _LOCAL.exclude = frozenset(n for n in ROUTE_NAMES if n not in names)
    try:
        yield
    finally:
        _LOCAL.exclude = saved


def native_routes() -> list[str]:
    """The tensor-core routes calls on this thread may take (all but those
    :func:`use_backends` leaves out)."""
    return [n for n in NATIVE_ROUTES if n not in _excluded()]


def _kind(t, usage: str, read: bool = False) -> Kind | None:
    if isinstance(t, QuantizedTensor):
        return t.gemm_kind(usage, read)
    return plain_kind(t.dtype)


def _unsure(kind: Kind) -> bool:
    """A block FP8 operand whose scales are not known to be powers of two (reading them
    may show that they are)."""
    return kind.name == "blocks" and not kind.pow2


def _pick(a, a_usage, b, b_usage, m, n, k, out_dtype, bias, exclude: frozenset) -> str:
    """The route of this eager pair (hybrids already resolved to their halves; a usage
    ending in a partial block is of the emulation's kind)."""
    ka, kb = _kind(a, a_usage), _kind(b, b_usage)
    if ka is None or kb is None:
        return "emulated"  # a usage not held: the emulation raises the proper error
    cuda = routes_cuda(a, b)
    bias_dtype = None if bias is None else bias.dtype
    read = False
    while True:
        name = _route(ka, kb, m, n, k, out_dtype, bias_dtype, cuda, exclude)
        fits = CUDA_FITS.get(name)
        if fits is not None and not fits(a, a_usage, b, b_usage, out_dtype, bias):
            exclude = exclude | {name}
        elif name == "emulated" and not read and (_unsure(ka) or _unsure(kb)):
            # before the emulation, learn whether block scales are powers of two after all
            # (a host sync), which the bf16 route would then take
            read = True
            ka, kb = _kind(a, a_usage, True), _kind(b, b_usage, True)
        else:
            return name


def _resolved(a, a_usage: str, b, b_usage: str):
    """(a, b, m, n, k): a hybrid operand as the sub-tensor of the direction this GEMM
    consumes, and the product's sizes (checked)."""
    check_usage(a_usage)
    check_usage(b_usage)
    if isinstance(a, HybridQuantizedTensor):
        a = a.sub_tensor(a_usage)
    if isinstance(b, HybridQuantizedTensor):
        b = b.sub_tensor(b_usage)
    ka = a.shape[-1] if a_usage == "rowwise" else a.numel() // max(a.shape[-1], 1)
    kb = b.shape[-1] if b_usage == "rowwise" else b.numel() // max(b.shape[-1], 1)
    if ka != kb:
        raise ValueError(f"GEMM contraction sizes differ: {a_usage} {tuple(a.shape)} vs "
                         f"{b_usage} {tuple(b.shape)}")
    return a, b, a.numel() // max(ka, 1), b.numel() // max(kb, 1), ka


def select_route(a, a_usage: str, b, b_usage: str, out_dtype: torch.dtype,
                 bias: torch.Tensor | None = None) -> str:
    """The route :func:`gemm` takes for these operands now (one of
    ``table.ROUTE_NAMES``)."""
    a, b, m, n, k = _resolved(a, a_usage, b, b_usage)
    return _pick(a, a_usage, b, b_usage, m, n, k, out_dtype, bias, _excluded())


def gemm(a: torch.Tensor, a_usage: str, b: torch.Tensor, b_usage: str, *,
         out_dtype: torch.dtype, bias: torch.Tensor | None = None,
         out: torch.Tensor | None = None) -> torch.Tensor:
    """``mat(a, a_usage) @ mat(b, b_usage).T (+ bias)`` as a 2-D tensor of ``out_dtype``.

    ``out``: a contiguous tensor of the product's shape and ``out_dtype`` (e.g. a row
    range of a larger result) that receives the product and is returned.
    """
    a, b, m, n, k = _resolved(a, a_usage, b, b_usage)
    if out is not None and (tuple(out.shape) != (m, n) or out.dtype != out_dtype
                            or not out.is_contiguous()):
        raise ValueError(f"gemm out= must be a contiguous ({m}, {n}) {out_dtype} tensor, "
                         f"got {tuple(out.shape)} {out.dtype} (contiguous="
                         f"{out.is_contiguous()})")
    exclude = _excluded()
    while True:
        name = _pick(a, a_usage, b, b_usage, m, n, k, out_dtype, bias, exclude)
        run = EAGER_RUNS[name]
        try:
            if name in _TAKES_OUT:
                return run(a, a_usage, b, b_usage, out_dtype, bias, out=out)
            res = run(a, a_usage, b, b_usage, out_dtype, bias)
        except RouteRefused:
            exclude = exclude | {name}  # this pair goes to the table's next route
            continue
        return res if out is None else out.copy_(res)
