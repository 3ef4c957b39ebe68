"""The fusion switch: whether a producer may hand a quantizer its output through a fused
kernel (``can_fuse``), and the ``unfused`` context that turns fusion off."""

from __future__ import annotations

from ..formats import rows_fit
from ..kernels import FlagOff
from ..recipe import BackwardMode, torch_autocast_dtype

enabled = True


class unfused(FlagOff):
    """Context manager: modules run the producer and the quantizer as separate passes."""

    _module, _flag = __name__, "enabled"


def can_fuse(quantizer, x, backward_mode: str) -> bool:
    """Whether a producer may hand ``quantizer`` its output through a fused kernel.

    Not in ``high_precision`` backward mode: that mode saves the GEMM's high-precision
    input, which a fused producer never writes.
    """
    return (enabled and quantizer is not None and backward_mode != BackwardMode.HIGH_PRECISION
            and quantizer.supports_fused(x)
            # torch.autocast: the producer's output is rounded to the autocast dtype first
            and torch_autocast_dtype(x) is None
            # a token count that does not fill the blocks along M is padded by the GEMM
            and rows_fit(quantizer, x, rowwise=True, columnwise=True))
