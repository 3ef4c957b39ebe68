"""LayerNorm and RMSNorm ops (the lowprec norm modules, able to emit a quantized output)."""

from __future__ import annotations

import torch

from ... import fused
from ...modules import norms
from ..base import BasicOperation, RunContext, as_plain, emit_output


class _NormOp(BasicOperation):
    op_kind = "norm"
    can_emit = True

    def op_forward(self, x: torch.Tensor, extra_inputs: list, ctx: RunContext) -> torch.Tensor:
        x = as_plain(x)
        args = (self.normalization, self.weight, self.bias, self.eps, self.zero_centered_gamma)
        # An emit spec exists only outside high_precision mode (see input_emit_spec).
        if ctx.emit is not None and fused.can_fuse(ctx.emit.quantizer, x, "default"):
            return fused.norm_then_quantize(x, *args, ctx.emit.quantizer, ctx.emit.rowwise,
                                            ctx.emit.columnwise)
        return emit_output(norms.apply_norm(x, *args), ctx)


class LayerNorm(norms.LayerNorm, _NormOp):
    """LayerNorm over the last dimension (``weight``, ``bias``); in a Sequential it hands a
    following linear its input already quantized."""


class RMSNorm(norms.RMSNorm, _NormOp):
    """RMSNorm over the last dimension (``weight``); in a Sequential it hands a following
    linear its input already quantized."""
