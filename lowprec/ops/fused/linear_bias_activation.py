"""Linear + bias (+ activation): bias in the GEMM, activation and its backward fused.

Pattern ``BasicLinear, [Bias], [Activation]`` (at least one of the two):

* forward: the bias is added inside the GEMM (one rounding, no pass of its
  own, as ``lowprec.Linear``); the activation runs in the same step and,
  when a linear follows, emits that linear's quantized input;
* backward (with an activation): the fused dact + dbias of
  :mod:`.activation_bias_backward`, which also quantizes the GEMM's
  grad_output for its dgrad/wgrad in the same step.

Without an activation the piece is ``quantized_linear(x, W, b)`` itself.
Not used when the linear has an ``output_quantizer_role`` (its output then
leaves the GEMM quantized) or when the bias dtype differs from the weight's.
"""

from __future__ import annotations

import torch

from ..base import Piece, RunContext, register_fusion
from .activation_bias_backward import bias_activation


class LinearBiasActivation(Piece):
    graph_kind = "linear"

    def __init__(self, linear, bias_part, act) -> None:
        super().__init__(*[p for p in (linear, bias_part, act) if p is not None])
        self.linear, self.bias_part, self.act = linear, bias_part, act

    @property
    def can_emit(self) -> bool:
        # Only the activation's output can be handed on quantized (a GEMM's own output is
        # quantized only through its output_quantizer_role).
        return self.act is not None

    @property
    def takes_quantized_grad(self) -> bool:
        # Without an activation the backward is quantized_linear's, which consumes it as is.
        return self.act is None

    @property
    def name(self) -> str:
        return "Linear" + ("Bias" if self.bias_part is not None else "") + (
            "Activation" if self.act is not None else "")

    def run(self, x: torch.Tensor, extra_inputs: list, ctx: RunContext) -> torch.Tensor:
        lin, bias = self.linear, (self.bias_part.bias if self.bias_part is not None else None)
        if self.act is None:
            return lin.run_linear(x, bias, ctx.prep, intermediate=ctx.intermediate)
        # The bias goes into the GEMM detached; its gradient comes from the fused dact+dbias.
        y = lin.run_linear(x, None if bias is None else bias.detach(), ctx.prep,
                           intermediate=ctx.intermediate)
        self.act.check_input(y)
        return bias_activation(y, bias, self.act.activation, add_bias=False, emit=ctx.emit,
                               grad_emit=lin.grad_emit_spec(ctx.prep, x))


@register_fusion
def match_linear_bias_activation(parts: list, i: int):
    lin = parts[i]
    if lin.op_kind != "linear" or lin.output_quantizer_role is not None:
        return None
    j, bias_part, act = i + 1, None, None
    if j < len(parts) and parts[j].op_kind == "bias" and parts[j].bias.dtype == lin.weight.dtype:
        bias_part, j = parts[j], j + 1
    if j < len(parts) and parts[j].op_kind == "activation":
        act = parts[j]
    if bias_part is None and act is None:
        return None
    return LinearBiasActivation(lin, bias_part, act)
