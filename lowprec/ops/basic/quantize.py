"""Quantize: quantize the activation (forward) and/or its gradient (backward) at this point."""

from __future__ import annotations

import torch

from ...modules import LowprecModule
from ...recipe import BackwardMode, QuantizerRole, check_num_quantizers
from ..base import BasicOperation, RunContext, as_plain, plain


class _QuantizeFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, fwd_q, usages, bwd_q, hand_quantized, done):
        ctx.bwd_q, ctx.hand_quantized, ctx.done = bwd_q, hand_quantized, done
        if fwd_q is None:
            return x.view_as(x)
        fwd_q.set_usage(rowwise=usages[0], columnwise=usages[1])
        return fwd_q.quantize(x)

    @staticmethod
    def backward(ctx, g):
        g = plain(g)
        if ctx.bwd_q is not None:
            ctx.bwd_q.set_usage(rowwise=True, columnwise=ctx.hand_quantized)
            gq = ctx.bwd_q.quantize(g)
            g = gq if ctx.hand_quantized else gq.dequantize()
        if ctx.done is not None:
            ctx.done()
        return g, None, None, None, None, None


class Quantize(LowprecModule, BasicOperation):
    """``Quantize(forward=True, backward=False, *, name=None)``.

    Under :func:`lowprec.autocast`, ``forward=True`` quantizes the input with
    the quantizer of role ``QuantizerRole("quantize", "input", name)`` and
    outputs the quantized tensor: a following linear consumes it as its
    input (so this role, not the linear's, picks the format), other ops read
    its values. ``backward=True`` quantizes the gradient with role
    ``QuantizerRole("quantize", "grad_output", name)`` (default backward
    mode only): a preceding ``BasicLinear`` (or ``Linear``) consumes it as
    its grad_output, other ops get its values. Outside autocast it is the
    identity, in high precision. Delayed scaling keeps its state here.

    The usages of the forward quantization are those the next linear needs
    (rowwise, plus columnwise for its wgrad), rowwise only before another
    op, both when it is the last op or used on its own.
    """

    module_type = "quantize"
    op_kind = "quantize"

    def __init__(self, forward: bool = True, backward: bool = False, *,
                 name: str | None = None) -> None:
        super().__init__(name)
        self.quantize_forward, self.quantize_backward = bool(forward), bool(backward)

    def get_quantizer_roles(self, *, fwd: bool, num_quantizers: int | None = None) -> list:
        role = QuantizerRole(self.module_type, "input" if fwd else "grad_output", self.name)
        return check_num_quantizers(self, fwd, num_quantizers, [role])

    def _weight_names(self) -> list[str]:
        return []

    def _quantizers(self, device):
        """(forward quantizer, backward quantizer, backward mode, backward callback) under
        autocast, else None."""
        active = self.active_states(device)
        if active is None:
            return None
        recipe, fwd, bwd, callback = active
        return fwd.quantizers[0], bwd.quantizers[0], recipe.backward_mode, callback

    def op_forward(self, x: torch.Tensor, extra_inputs: list, ctx: RunContext) -> torch.Tensor:
        qs = self._quantizers(x.device)
        if qs is None or not (self.quantize_forward or self.quantize_backward):
            return x
        fwd_q, bwd_q, mode, done = qs
        if not self.quantize_forward:
            fwd_q = None
        if not self.quantize_backward or mode != BackwardMode.DEFAULT:
            bwd_q = None
        if fwd_q is None and bwd_q is None:
            return x
        if ctx.next_usages is not None:
            usages = ctx.next_usages
        elif ctx.next_kind is not None:
            usages = (True, False)  # a high-precision op reads the rowwise values
        else:
            usages = (True, True)
        x = as_plain(x)
        return _QuantizeFn.apply(x, fwd_q, usages, bwd_q, ctx.prev_takes_quantized_grad,
                                 done if bwd_q is not None else None)

    def extra_repr(self) -> str:
        return (f"forward={self.quantize_forward}, backward={self.quantize_backward}, "
                f"name={self.name!r}")
