"""Per-tensor FP8 as a compiled linear traces it (``formats.graph``).

The quantize is the reference's own torch ops (the amax, the scale rule, the saturating
cast), which inductor fuses into the kernel that produces the operand; any order of a max
reduction gives the same amax, so the values are eager's bit for bit. The columnwise data
is the rowwise cast transposed, with the same scale: the forward keeps the tensor and its
scale, and the backward casts the transpose again (one pass, the forward's values)
rather than holding an fp8 copy.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..casting import cast_fp8
from ..graph import Fp8, GraphOperand, Kind, rounded, rounded_amax, scale_in_use
from .reference import current_scale


@dataclass(frozen=True)
class Tensorwise(GraphOperand):
    """Current scaling (``Float8CurrentScalingQuantizer``'s settings)."""

    fp8_dtype: torch.dtype
    pow2: bool = False
    eps: float = 0.0

    def kind(self, usage):
        return Kind("fp8", self.fp8_dtype)

    def scale(self, t: torch.Tensor) -> torch.Tensor:
        return current_scale(rounded_amax(t), self.fp8_dtype, pow2=self.pow2, eps=self.eps)

    def cast(self, t: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return cast_fp8(rounded(t) * scale, self.fp8_dtype)

    def rowwise(self, t):
        scale = self.scale(t)
        return Fp8(self.cast(t, scale), scale)

    def columnwise(self, t):
        return self.saved_columnwise((t, self.scale(t)))

    def save_columnwise(self, t):
        return (t, self.scale(t))

    def saved_columnwise(self, saved):
        t, scale = saved
        return Fp8(self.cast(t.t(), scale).contiguous(), scale)

    def forward(self, t, keep):
        scale = self.scale(t)
        return Fp8(self.cast(t, scale), scale), ((t, scale) if keep else ())

    def grad(self, t, row, col):
        if not (row or col):
            return None, None
        scale = self.scale(t)
        data = self.cast(t, scale)
        return (Fp8(data, scale) if row else None,
                Fp8(data.t().contiguous(), scale) if col else None)


@dataclass(frozen=True)
class Delayed(Tensorwise):
    """Delayed scaling (``Float8Quantizer``): cast with a scale the recipe state holds,
    the tensor's amax recorded into the state. The scale and amax are tensors of the
    module's state, which the traced linear takes as its inputs; NaN or Inf in the tensor
    casts with a NaN scale, so it comes back NaN, as ``Float8Quantizer`` does."""

    reads_state = True

    def delayed(self, t: torch.Tensor, scale: torch.Tensor):
        """(fp8 data, the scale cast with, the amax to record) of ``t`` under the state's
        1-element ``scale``."""
        seen = rounded_amax(t)
        scale = scale_in_use(scale, seen)
        return self.cast(t, scale), scale, seen


@dataclass(frozen=True)
class GivenTensorwise(GraphOperand):
    """A per-tensor FP8 weight that arrives quantized (a ``Float8Tensor``: FSDP2's
    quantized all-gather, ``quantized_model_init``): its own codes and scale, as eager's
    GEMMs read them; dgrad reads the transpose of its codes."""

    fp8_dtype: torch.dtype
    given = True

    def kind(self, usage):
        return Kind("fp8", self.fp8_dtype)

    def rowwise(self, w):
        return Fp8(w.rowwise_data, w.shared_scale)

    def columnwise(self, w):
        return Fp8(w.rowwise_data.t().contiguous(), w.shared_scale)
