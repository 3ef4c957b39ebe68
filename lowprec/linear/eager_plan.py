"""Eager calls that run the traced plan: where every form of a call's plan launches eager's
kernels (``GraphOperand.eager``), an eager call runs :class:`traced.TracedLinear` over
the same plan a compiled call traces (one engine); elsewhere the eager Function
(``lowprec.linear.function``) runs it. Decided once per kind of call and kept with the
quantizers."""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from ..kernels import ThreadFlagOn
from ..memory import register_thread_setting
from . import grad_split
from .padding import Padding
from .plan import keep
from .traced import TracedLinear, TracedPlan, decide
from .traced_delayed import StateQuantizers

_EAGER = threading.local()


register_thread_setting(lambda: getattr(_EAGER, "off", False),
                        lambda value: setattr(_EAGER, "off", value))


class eager_plans_off(ThreadFlagOn):
    """Context manager: within the block, eager calls on this thread run the eager
    Function (``lowprec.linear.function``) even where a plan's forms run eagerly (A/B
    comparisons of the two, and tests)."""

    _local, _flag = _EAGER, "off"


def eager_plans_are_off() -> bool:
    """Whether :class:`eager_plans_off` holds on this thread."""
    return getattr(_EAGER, "off", False)


@dataclass(frozen=True)
class EagerPlan:
    """What an eager call of one kind runs: the plan of its operands padded to whole
    blocks, and that ``padding`` (the plan's, made once for the call's hot path)."""

    plan: TracedPlan
    padding: Padding


def eager_plan(q, backward_mode: str, x: torch.Tensor, weight: torch.Tensor,
               bias: torch.Tensor | None) -> EagerPlan | None:
    """What an eager call of these operands runs through :class:`TracedLinear`, or None
    where the eager Function runs it (no plan, a forward form that is not
    ``GraphOperand.eager``, or a gradient form that runs only in a graph).
    Decided once per kind of call and kept with the quantizers (``q.plans``)."""
    if getattr(_EAGER, "off", False) or torch.compiler.is_compiling():
        return None
    grad = torch.is_grad_enabled()
    key = ("eager", backward_mode, x.shape, x.dtype, x.device, type(x), weight.shape,
           weight.dtype, type(weight), None if bias is None else bias.dtype, grad,
           grad and x.requires_grad, grad and weight.requires_grad, grad_split.mode())
    plans = q.plans
    plan = plans.get(key)
    if plan is None:
        plan = keep(plans, key, _eager_decision(q, backward_mode, x, weight, bias))
    return plan if isinstance(plan, EagerPlan) else None


def _eager_decision(q, backward_mode: str, x, weight, bias):
    got = decide(q, backward_mode, x, weight, bias)
    if (isinstance(got, str) or not (got.x.eager and got.w.eager)
            or (got.dy is not None and not got.dy.launches_eagerly)):
        return _NoPlan()
    return EagerPlan(got, got.padding)


class _NoPlan:
    """An eager call's kept answer that the eager Function runs it (one object a call
    kind: a copy of the quantizers decides its own)."""


def run_plan(eager: EagerPlan, x: torch.Tensor, weight: torch.Tensor,
             bias: torch.Tensor | None, q=None, done=None) -> torch.Tensor:
    """``x @ weight.T + bias`` of an eager call through :func:`eager_plan`'s answer
    (operands already in one dtype, torch.autocast off). Delayed scaling's quantizes read
    and record into the state of its quantizers ``q``; ``done``: the module's
    end-of-backward callback."""
    plan, pad = eager.plan, eager.padding
    state = StateQuantizers(q, done) if plan.delayed else None
    if not pad:
        return TracedLinear.apply(x, weight, bias, plan, torch.is_grad_enabled(),
                                  isinstance(weight, torch.nn.Parameter), state, None)
    x_shape = x.shape
    x, weight, bias = pad.operands(x, weight, bias)
    y = TracedLinear.apply(x, weight, bias, plan, torch.is_grad_enabled(),
                           isinstance(weight, torch.nn.Parameter), state, None)
    return pad.cut(y, x_shape)
