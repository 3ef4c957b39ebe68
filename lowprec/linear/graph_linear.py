"""A decided traced linear as two graph ops, one a direction.

Dynamo interprets every bytecode of what it traces, and the forward and backward of
:class:`~lowprec.linear.traced.TracedLinear` (the quantizes of each operand, the GEMM
table, the saved forms) are most of a quantized model's tracing time. A call decided
outside the trace (``lowprec.linear.decided``) runs that same Python as two ops instead:
``lowprec::linear_forward`` (the output and the tensors the backward keeps) and
``lowprec::linear_backward`` (the gradients), inside :class:`GraphLinear`. Dynamo records
one node for each and propagates shapes by running the Python natively on fake tensors;
AOT autograd hands inductor each op decomposed into that Python's ops
(``kernels.traced_op``), so inductor receives the graph a traced ``TracedLinear`` gives,
and its bits.

The Python runs as in a graph (``torch.compiler.is_compiling()`` true, as torch 2.13 holds
it through a whole compile), so each form takes its graph branch also where the op runs
whole (a backend without inductor's decompositions).

The ops' outputs may not alias their inputs, so the forward returns only the tensors it
made; what it keeps of its inputs (the input, its 2-D view, the weight) the decision's
:class:`Layout` names, found once by running the forward on fake operands.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch

from ..kernels import traced_op
from . import traced_steps as steps
from .traced import TracedLinear, TracedPlan


class _Decisions:
    """Every decision made (``lowprec.linear.decided``), one attribute each (never
    dropped: compiled graphs' guards read them)."""


DECISIONS = _Decisions()


def decision(name: str):
    """The ``decided.Decision`` called ``name``."""
    return getattr(DECISIONS, name)


@contextlib.contextmanager
def in_graph():
    """Within the block ``torch.compiler.is_compiling()`` is true (torch 2.11 and 2.12
    hold it only while dynamo traces; 2.13 through the whole compile)."""
    saved = torch.compiler._is_compiling_flag
    torch.compiler._is_compiling_flag = True
    try:
        yield
    finally:
        torch.compiler._is_compiling_flag = saved


@dataclass(frozen=True)
class Layout:
    """Where each tensor the forward keeps comes from: ``"x"`` (the input), ``"x2d"`` (its
    2-D view), ``"w"`` (the weight), ``"none"`` (None) or the index of a tensor the forward
    op made."""

    saved: tuple
    n_saved: tuple[int, int]
    x_shape: tuple
    x_dtype: torch.dtype
    w_dtype: torch.dtype
    has_bias: bool
    need_dx: bool
    need_dw: bool
    #: (shape, stride, dtype) of the forward op's outputs and of dX, dW, dB: the ops' fake
    #: implementations make these without running the Python again
    forward_meta: tuple = ()
    grad_meta: tuple = ()


class _Ctx:
    """Stands in for an ``autograd.Function``'s ctx around TracedLinear's steps."""

    state = None

    def __init__(self, needs_input_grad: tuple, saved: tuple = ()) -> None:
        self.needs_input_grad = needs_input_grad
        self.saved_tensors = saved

    def save_for_backward(self, *tensors) -> None:
        self.saved_tensors = tensors


def run_forward(plan: TracedPlan, x, weight, bias, need_dx: bool, need_dw: bool):
    """(y, the tensors TracedLinear's forward keeps, its count of input and weight keeps)."""
    ctx = _Ctx((need_dx, need_dw))
    with in_graph():
        y = TracedLinear.forward(ctx, x, weight, bias, plan, True)
    return y, ctx.saved_tensors, ctx.n_saved


def layout_of(plan: TracedPlan, x, weight, bias, need_dx: bool, need_dw: bool
              ) -> Layout | None:
    """The :class:`Layout` of a forward of these (fake) operands, or None where what it keeps
    aliases in a way the ops cannot hand over (a view of the weight, two views of one
    tensor made inside)."""
    y, saved, n_saved = run_forward(plan, x, weight, bias, need_dx, need_dw)
    x2d = steps.as_2d(x)
    where, made = [], []
    for t in saved:
        if t is None:
            where.append("none")
        elif t is x:
            where.append("x")
        elif t is weight:
            where.append("w")
        elif t._base is not None and t._base is (x._base if x._base is not None else x):
            if t.shape != x2d.shape or t.stride() != x2d.stride() or x2d is x:
                return None
            where.append("x2d")
        else:
            base = t._base if t._base is not None else t
            if base is weight or any(base is (m._base if m._base is not None else m)
                                     for m in made) or base is y:
                return None
            where.append(len(made))
            made.append(t)
    lay = Layout(tuple(where), n_saved, tuple(x.shape), x.dtype, weight.dtype,
                 bias is not None, need_dx, need_dw, _meta([y, *made]))
    if not (need_dx or need_dw):
        return lay
    keep = [x if w == "x" else weight if w == "w" else steps.as_2d(x) if w == "x2d"
            else None if w == "none" else made[w] for w in where]
    grads = _grads(lay, plan, y.new_empty(y.shape), keep, need_dx, need_dw, bias is not None)
    return dataclasses.replace(lay, grad_meta=_meta(grads))


def _meta(tensors) -> tuple:
    return tuple(None if t is None else (tuple(t.shape), tuple(t.stride()), t.dtype)
                 for t in tensors)


def _made(like: torch.Tensor, meta) -> list[torch.Tensor]:
    return [like.new_empty_strided(shape, stride, dtype=dtype) for shape, stride, dtype in meta]


@traced_op("linear_forward")
def linear_forward(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                   name: str) -> list[torch.Tensor]:
    """[y, the tensors the forward made and keeps] of decision ``name``."""
    d = decision(name)
    y, saved, _ = run_forward(d.plan, x, weight, bias, d.layout.need_dx, d.layout.need_dw)
    return [y, *(t for t, w in zip(saved, d.layout.saved) if isinstance(w, int))]


@torch.library.register_fake("lowprec::linear_forward")
def _linear_forward_fake(x, weight, bias, name):
    return _made(x, decision(name).layout.forward_meta)


@traced_op("linear_backward")
def linear_backward(dy: torch.Tensor, saved: list[Optional[torch.Tensor]], name: str, need_dx: bool,
                    need_dw: bool, need_db: bool) -> list[torch.Tensor]:
    """[dX, dW, dB], those asked for, of decision ``name`` from the kept tensors."""
    d = decision(name)
    grads = _grads(d.layout, d.plan, dy, saved, need_dx, need_dw, need_db)
    return [g for g in grads if g is not None]


def _grads(lay: Layout, plan: TracedPlan, dy, saved, need_dx: bool, need_dw: bool,
           need_db: bool) -> tuple:
    """(dX, dW, dB), None where not asked, as TracedLinear's backward computes them."""
    ctx = _Ctx((need_dx, need_dw, need_db), tuple(saved))
    ctx.plan, ctx.n_saved, ctx.has_bias = plan, lay.n_saved, lay.has_bias
    ctx.x_shape, ctx.x_dtype, ctx.w_dtype = lay.x_shape, lay.x_dtype, lay.w_dtype
    # autocast off as TracedLinear's backward runs (its traced form enters
    # ``torch.autocast(enabled=False)``; here the keys are excluded for the block, which
    # leaves the global autocast state as it was)
    with in_graph(), torch._C._DisableAutocast():
        return steps.backward_grads(ctx, dy, TracedLinear._grads)[:3]


@torch.library.register_fake("lowprec::linear_backward")
def _linear_backward_fake(dy, saved, name, need_dx, need_dw, need_db):
    meta = decision(name).layout.grad_meta
    return _made(dy, [m for m, need in zip(meta, (need_dx, need_dw, need_db))
                      if need and m is not None])


class GraphLinear(torch.autograd.Function):
    """``x @ weight.T + bias`` of a decided call (``decided``'s ``name``) as
    ``lowprec::linear_forward`` and ``lowprec::linear_backward``."""

    @staticmethod
    def forward(ctx, x, weight, bias, name: str, layout: Layout):
        made = linear_forward(x, weight, bias, name)
        pick = {"x": x, "w": weight, "none": None}
        if "x2d" in layout.saved:
            pick["x2d"] = steps.as_2d(x)
        ctx.save_for_backward(*(made[1 + w] if isinstance(w, int) else pick[w]
                                for w in layout.saved))
        ctx.name = name
        return made[0]

    @staticmethod
    def backward(ctx, dy):
        need_dx, need_dw, need_db = ctx.needs_input_grad[:3]
        got = iter(linear_backward(dy, list(ctx.saved_tensors), ctx.name, need_dx, need_dw,
                                   need_db))
        return (next(got) if need_dx else None, next(got) if need_dw else None,
                next(got) if need_db else None, None, None)
