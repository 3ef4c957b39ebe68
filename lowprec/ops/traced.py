"""A ``Sequential`` (or one op) as ``torch.compile`` traces it: the pieces of its run
(``base.plan``), each in the graph form of what eager runs.

* a linear is ``lowprec.Linear``'s traced form (``lowprec.linear.traced``), its bias in the
  GEMM where the piece puts it there;
* a norm is ``fused.graph_norm_of``, through the fused kernel's computation where eager
  hands the next linear its input from ``fused.norm_then_quantize``;
* an activation, and the bias + activation step, are ``graph``'s ops around eager's fp32
  math (the bias gradient summed from the fp32 values, as the fused backward sums it);
* a quantized hand-over (a norm, bias or activation quantizing its output for the next
  linear, or a fused backward quantizing dY for the previous one) is the next linear's own
  quantize of the same values with the same quantizer, so the traced linear quantizes;
* a ``Quantize`` op that quantizes hands its quantized tensor to a linear next to it,
  which consumes it as is: its forward quantizer becomes the next linear's input
  quantizer, its backward one the previous linear's dY quantizer, and the op itself is
  the identity in the graph.

A ``GroupedLinear`` op is ``lowprec.GroupedLinear``'s traced form where it has one, else
one opaque ``lowprec::call`` of its own between the traced pieces (it takes and hands on
plain tensors, as in eager). What it does not mirror it declines, and the whole call
stays one opaque op: a ``Quantize`` op whose quantized tensor another kind of op reads
(or the caller), or under delayed scaling (its own state) or another backward mode than
the default, a fusion registered outside lowprec, a quantized input, a quantized weight of
a ``GroupedLinear`` op (``compile.opaque_refusal``) and anything ``lowprec.Linear``'s
traced form declines. Outside ``lowprec.autocast`` the linears are torch's linear (cast
by torch.autocast where it is on), the high-precision path eager runs, and a ``Quantize``
op is the identity.

Under delayed scaling every linear's plan is decided before any op is traced: a traced
linear records its amaxes, which a later refusal (then the opaque call) would record twice.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from ..compile import opaque_call, opaque_refusal
from ..fused import graph_activation, graph_norm_of, producer_kernel
from ..linear import traced
from ..recipe import (
    BackwardMode,
    active_region,
    stateful,
    stateless_quantizers,
    torch_autocast_dtype,
)
from .graph import bias_activation_dtype, bias_operand, graph_bias, graph_bias_activation

_SUPPORTED_KINDS = ("linear", "bias", "activation", "norm", "quantize", "grouped_linear")


def _declined(parts: list, x: torch.Tensor, extra_inputs: tuple) -> str | None:
    if type(x) is not torch.Tensor or not x.is_floating_point():
        return f"an input of type {type(x).__name__}"
    for part in parts:
        kind = part.op_kind
        if kind not in _SUPPORTED_KINDS:
            return f"a {type(part).__name__} op"
    if len(extra_inputs) != sum(p.num_extra_inputs for p in parts):
        return "a wrong number of extra inputs"  # the eager call raises
    return None


def _piece_kind(piece) -> str | None:
    """``"op"``, ``"linear"`` (linear [+ bias] [+ activation]), ``"bias_act"``,
    ``"opaque"`` (a ``GroupedLinear`` op), or None for a piece of a fusion registered
    outside lowprec (``Piece.graph_kind``)."""
    if piece.graph_kind == "op":
        if piece.leading_linear is not None:
            return "linear"
        if piece.parts[0].op_kind == "grouped_linear":
            return "opaque"
    return piece.graph_kind


class _Linear:
    """One linear piece's traced quantizers (None: torch's linear, outside autocast),
    backward mode, delayed states and plan."""

    def __init__(self, linear, got, plan_) -> None:
        self.linear = linear
        (self.quantizers,), self.mode, self.delayed = got
        self.plan = plan_

    def emit(self) -> bool:
        """Whether eager hands this linear its input quantized (``input_emit_spec``)."""
        return (self.quantizers is not None and self.mode != BackwardMode.HIGH_PRECISION
                and self.quantizers.input is not None)


_PLAIN = ([None], BackwardMode.DEFAULT, None)
_NOT_HANDED = "a Quantize op whose quantized output is not a linear's input"


def _params(piece) -> list[torch.Tensor]:
    params = []
    for part in piece.parts:
        if isinstance(part, torch.nn.Module):
            params += list(part.parameters(recurse=False))
        else:  # the bias half of an ops.Linear
            params.append(part.bias)
    return params


def _decide(pieces: list, x: torch.Tensor):
    """{piece index: ``_Linear``} of every linear piece, or the reason the run declines."""
    linears = {}
    shape = tuple(x.shape)
    needs_grad = torch.is_grad_enabled() and x.requires_grad
    amp = torch_autocast_dtype(x)
    handed = None  # a Quantize op's forward quantizer, for the next linear's input
    for k, piece in enumerate(pieces):
        kind = _piece_kind(piece)
        if kind is None:
            return f"a fusion of its own ({piece.name})"
        refused = opaque_refusal(piece.parts[0]) if kind == "opaque" else None
        if refused is not None:
            return refused
        if handed is not None and piece.leading_linear is None:
            return _NOT_HANDED
        lin = piece.leading_linear
        if lin is not None:
            # outside torch.autocast run_linear casts the input to the weight's dtype
            like = x.new_empty(shape, dtype=x.dtype if amp is not None else lin.weight.dtype)
            got = _linear_of(piece, like, needs_grad, handed)
            if isinstance(got, str):
                return got
            linears[k], handed = got, None
        elif piece.parts[0].op_kind == "quantize":
            got = _quantize_hand_over(pieces, linears, k)
            if isinstance(got, str):
                return got
            handed = got
        for part in piece.parts:
            shape = part.output_shape(shape)
        needs_grad = needs_grad or (torch.is_grad_enabled()
                                    and any(p.requires_grad for p in _params(piece)))
    if handed is not None:  # the run's last op
        return _NOT_HANDED
    return linears


def _quantize_hand_over(pieces: list, linears: dict, k: int):
    """For the ``Quantize`` op of piece ``k``: its forward quantizer (or None), which the
    next linear takes as its input quantizer; its backward quantizer becomes the previous
    linear's dY quantizer (in ``linears``). The reason the run declines where eager hands
    its quantized tensor to anything but a linear's GEMM, or the op keeps state."""
    op = pieces[k].parts[0]
    region = active_region()
    if region is None or not (op.quantize_forward or op.quantize_backward):
        return None  # the identity
    recipe = region.recipe
    if stateful(recipe):
        return "a Quantize op under delayed scaling (its own state)"
    if recipe.backward_mode != BackwardMode.DEFAULT:
        # eager's linear reads a quantized input in place of the high-precision one it keeps
        return f"a Quantize op under backward_mode={recipe.backward_mode!r}"
    if op.quantize_backward:
        prev = linears.get(k - 1)
        # the dY of a linear whose bias or activation comes after its GEMM is not the GEMM's
        if (prev is None or not pieces[k - 1].takes_quantized_grad
                or _gemm_bias(pieces[k - 1]) is not None):
            return "a Quantize op whose quantized gradient is not a linear's dY"
        bwd = stateless_quantizers(recipe, "backward", op.get_quantizer_roles(fwd=False))[0]
        linears[k - 1] = _Linear(prev.linear, ((_with(prev.quantizers, grad_output=bwd),),
                                               prev.mode, prev.delayed), prev.plan)
    if not op.quantize_forward:
        return None
    return stateless_quantizers(recipe, "forward", op.get_quantizer_roles(fwd=True))[0]


def _with(q, **slots):
    """``q`` (``LinearQuantizers``) with other quantizers in ``slots``, deciding its own
    plans."""
    return dataclasses.replace(q, plans={}, **slots)


def _linear_of(piece, like: torch.Tensor, needs_grad: bool, handed=None) -> _Linear | str:
    """The ``_Linear`` of a linear piece whose input is like ``like``, or the reason the run
    declines; under delayed scaling with its plan (the stand-in's). ``handed``: the input
    quantizer of a ``Quantize`` op before it, which eager quantizes the input with."""
    lin = piece.leading_linear
    if active_region() is None:  # high precision, as torch's linear
        if not lin.traced_plain_call(like, lin.weight):
            return "outside lowprec.autocast and checkpointed"
        return _Linear(lin, _PLAIN, None)
    got = lin.traced_quantizers(like, lin.weight)
    if isinstance(got, str):
        return got
    if handed is not None:
        (q,), mode, delayed = got
        q = _with(q, input=handed)
        # eager's Quantize op quantizes the rows as they are; the traced linear would pad
        if traced.padding_for(q, mode, like, lin.weight):
            return "a Quantize op before a linear whose operands are not whole blocks"
        got = ((q,), mode, delayed)
    plan_ = None
    delayed = got[2]
    if delayed is not None:
        plan_ = traced.planned(got[0][0], got[1], like, lin.weight, _gemm_bias(piece),
                               input_grad=needs_grad)
        if isinstance(plan_, str):
            return plan_
    return _Linear(lin, got, plan_)


def _gemm_bias(piece) -> torch.Tensor | None:
    """The bias a linear piece adds in its GEMM."""
    bias_part = getattr(piece, "bias_part", None)
    return None if bias_part is None else bias_part.bias


def traced_run(parts: list, pieces: list, x: torch.Tensor, extra_inputs: tuple, fuse: bool):
    """``base.run_parts(parts, x, extra_inputs, fuse=fuse)`` in traced form (``pieces``:
    ``base.plan(parts, fuse)``), or the reason (a string) the call stays one opaque op."""
    reason = _declined(parts, x, extra_inputs)
    if reason is not None:
        return reason
    linears = _decide(pieces, x)
    if isinstance(linears, str):
        return linears
    extra = iter(extra_inputs)
    for k, piece in enumerate(pieces):
        nxt = linears.get(k + 1)
        emit = nxt if (fuse and piece.can_emit and nxt is not None and nxt.emit()) else None
        if _piece_kind(piece) == "opaque":
            extras = [next(extra) for _ in range(piece.num_extra_inputs)]
            op = piece.parts[0]
            y = op.traced_forward(x, *extras)
            x = opaque_call(op, x, *extras) if isinstance(y, str) else y
        else:
            x = _run_piece(piece, linears.get(k), x, emit)
        if isinstance(x, str):
            return x
    return x


def _linear(lin: _Linear, x: torch.Tensor, bias: torch.Tensor | None):
    w = lin.linear.weight
    lin.linear._check_input_dtype(x, w.shape[-1])
    if x.dtype != w.dtype and torch_autocast_dtype(x) is None:
        x = x.to(w.dtype)
    if lin.quantizers is None:
        return F.linear(x, w, bias)
    return traced.traced_linear(lin.quantizers, lin.mode, x, w, bias, lin.delayed,
                                plan=lin.plan)


def _run_piece(piece, lin: _Linear | None, x: torch.Tensor, emit: _Linear | None):
    if lin is not None:  # linear [+ bias] [+ activation]
        bias = _gemm_bias(piece)
        act = getattr(piece, "act", None)
        if act is None:
            return _linear(lin, x, bias)
        y = _linear(lin, x, None if bias is None else bias.detach())
        if isinstance(y, str):
            return y
        act.check_input(y)
        if bias is None:
            return graph_activation(act.activation, y, kernel=False)
        return graph_bias_activation(y, bias, act.activation, add_bias=False, dtype=y.dtype)
    if _piece_kind(piece) == "bias_act":
        bias_part, act = piece.parts
        act.check_input(x)
        return graph_bias_activation(x, bias_part.bias, act.activation, add_bias=True,
                                     dtype=bias_activation_dtype(x, bias_part.bias))
    (part,) = piece.parts
    kind = part.op_kind
    if kind == "quantize":  # its quantizes are its neighbouring linears' own (_decide)
        return x
    if kind == "activation":
        part.check_input(x)
        return graph_activation(part.activation, x, kernel=False)
    if kind == "bias":
        return graph_bias(x, bias_operand(x, part.bias))
    # a norm: the fused kernel's computation where eager quantizes its output with it
    kernel = emit is not None and producer_kernel(x, emit.quantizers.input,
                                                  BackwardMode.DEFAULT)
    return graph_norm_of(x, part.normalization, part.weight, getattr(part, "bias", None),
                         part.eps, part.zero_centered_gamma, kernel=kernel,
                         dtype=torch_autocast_dtype(x))
