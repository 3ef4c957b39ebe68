"""LayerNorm and RMSNorm ops (the lowprec norm modules, able to emit a quantized output)."""

from __future__ import annotations

import torch

from ...modules import norms
from ..base import BasicOperation, RunContext, as_plain, emit_output


class _NormOp(BasicOperation):
    op_kind = "norm"
    can_emit = True

    def op_forward(self, x: torch.Tensor, extra_inputs: list, ctx: RunContext) -> torch.Tensor:
        h = norms.apply_norm(as_plain(x), self.normalization, self.weight, self.bias, self.eps,
                             self.zero_centered_gamma)
        return emit_output(h, ctx)


class LayerNorm(norms.LayerNorm, _NormOp):
    """LayerNorm over the last dimension (``weight``, ``bias``); in a Sequential it hands a
    following linear its input already quantized."""


class RMSNorm(norms.RMSNorm, _NormOp):
    """RMSNorm over the last dimension (``weight``); in a Sequential it hands a following
    linear its input already quantized."""
