"""Fast accumulation of per-tensor FP8 GEMMs, as the running linear's recipe asks
(``MMParams``, ``recipe.gemm_fast_accum``).

The eager linear Functions set it around each GEMM direction with :func:`accumulating`, a
thread-local setting that the per-tensor cuBLAS backend reads; a traced GEMM takes it as
an argument of its op instead. Where it is off (the default) every FP8 GEMM accumulates in
fp32, the exact product the reference computes.
"""

from __future__ import annotations

import contextlib
import threading

from ..kernels import ThreadFlagOn

_local = threading.local()


class _fast_accumulation(ThreadFlagOn):
    _local, _flag = _local, "fast"


def fast_accumulation() -> bool:
    """Whether this thread's per-tensor FP8 GEMMs accumulate fast now."""
    return getattr(_local, "fast", False)


def accumulating(fast: bool):
    """Context manager: this thread's per-tensor FP8 GEMMs accumulate fast inside it when
    ``fast`` (else it changes nothing)."""
    return _fast_accumulation() if fast else contextlib.nullcontext()
