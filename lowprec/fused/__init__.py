"""Fused producer + quantize: a norm or an activation whose output goes straight into the
next GEMM's quantized input without being written in high precision (GPU with Triton;
per-tensor FP8, block FP8 and MXFP8 quantizers; everything else runs the producer and the
quantizer apart). See docs/fused.md for the passes each case makes.

``enabled`` / :class:`unfused` switch the fusion off (benchmarks and tests compare both).
"""

from __future__ import annotations

from ..formats.base import rows_fit
from ..kernels import FlagOff
from ..recipe.autocast import torch_autocast_dtype
from ..recipe.recipes import BackwardMode
from .activation_quantize import activation_then_quantize
from .norm_quantize import norm_then_quantize
from .prologue import Prologue, activation_prologue, apply_prologue, norm_prologue

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


__all__ = ["Prologue", "activation_prologue", "activation_then_quantize", "apply_prologue",
           "can_fuse", "enabled", "norm_prologue", "norm_then_quantize", "unfused"]
