"""The fusion switch: whether a producer may hand a quantizer its output through a fused
kernel (``can_fuse``), and the ``unfused`` context that turns fusion off on its thread."""

from __future__ import annotations

import threading

from ..formats import rows_fit
from ..memory import register_thread_setting
from ..recipe import BackwardMode, torch_autocast_dtype

_FUSION = threading.local()


def enabled() -> bool:
    """Whether fusion is on for this thread: on, except inside :class:`unfused`."""
    return getattr(_FUSION, "on", True)


# a checkpointed call's recompute fuses as its forward did, on whichever thread it runs
register_thread_setting(enabled, lambda value: setattr(_FUSION, "on", value))


class unfused:
    """Context manager: within the block, modules on this thread run the producer and the
    quantizer as separate passes (the recomputes of checkpointed calls made there too)."""

    def __enter__(self):
        self._saved = enabled()
        _FUSION.on = False
        return self

    def __exit__(self, *exc):
        _FUSION.on = self._saved
        return False


def can_fuse(quantizer, x, backward_mode: str) -> bool:
    """Whether a producer may hand ``quantizer`` its output through a fused kernel.

    Not in ``high_precision`` backward mode: that mode saves the GEMM's high-precision
    input, which a fused producer never writes.
    """
    return (enabled() and quantizer is not None
            and backward_mode != BackwardMode.HIGH_PRECISION
            and quantizer.supports_fused(x)
            # torch.autocast: the producer's output is rounded to the autocast dtype first
            and torch_autocast_dtype(x) is None
            # a token count that does not fill the blocks along M is padded by the GEMM
            and rows_fit(quantizer, x, rowwise=True, columnwise=True))
