"""Delayed-scaling backward states updated once per backward pass, all in one batch.

A module's backward state records dY's amax during the backward pass (the max over
every call, as the forward states do over a region). When the module's last GEMM has run
its backward, the state joins the pass (:func:`join`); when the autograd engine finishes
the pass, one callback updates every state that joined it through
:func:`~lowprec.recipe.state_batch.update_states`: one amax all-reduce per group and
device, and one update launch per compatible set of states, as Transformer Engine's
multi-tensor amax and scale update does at the end of its backward. A compiled backward
joins through one host-side op per module (``lowprec::join_backward``), so its graph
holds no update kernels at all.

What that means for a module whose forward ran several times before one backward pass (a
shared layer, a loop): the pass pushes one history row holding the max of its calls'
amaxes, and every call's backward quantizes dY with the scale the pass began with
(Transformer Engine's behaviour too).

The states are updated in the order they were created, so that every rank concatenates
the same amaxes for the all-reduce whatever order its backward ran the modules in.
Outside an autograd engine pass (a backward function called by hand) a state updates at
once, as it joins. A reentrant checkpoint's recompute and a compiled opaque call
(``lowprec::call``) run their backward as a nested pass; their modules join the outer pass
(:func:`running`, :func:`for_running`), as they would run without the nesting.
"""

from __future__ import annotations

import threading
import weakref
from contextlib import contextmanager

import torch

from .state_batch import update_states

_LOCK = threading.Lock()

#: autograd graph task id -> {id(group): (group, {id(state): state}, held weakly)}, for the
#: passes under way. A pass that raises never runs its end's callback: its entry stays
#: (its states stay pending, and the next pass that joins them updates them), so the
#: oldest entries go past ``_MAX_PASSES`` (more than any nesting of passes).
_PASSES: dict = {}
_MAX_PASSES = 64
#: ``outer``: the pass a nested one runs for (:func:`for_running`), per thread
_NESTED = threading.local()


def running() -> int:
    """The backward pass under way (its autograd graph task id; -1 outside one), its end's
    update queued: what a callback made now but fired in a nested pass (a reentrant
    checkpoint's recompute backward, which the autograd engine runs as a pass of its own)
    joins, so that its state updates with the others, at the end of the outer pass."""
    task = torch._C._current_graph_task_id()
    if task >= 0:
        _joined(task)
    return task


@contextmanager
def for_running():
    """Within: a backward pass run by hand inside the one running now, on its behalf (an
    opaque compiled call's backward, ``torch.autograd.grad`` over the graph its forward
    recorded). States that join it join the outer pass instead, so a module called more
    than once updates once, at the outer pass's end, and each call's backward quantizes
    with the scale that pass began with."""
    outer = running()
    before = getattr(_NESTED, "outer", -1)
    _NESTED.outer = outer if outer >= 0 else before
    try:
        yield
    finally:
        _NESTED.outer = before


def join(state, group=None, task: int | None = None) -> None:
    """Mark ``state`` (a backward ``DelayedScalingState``) for the update at the end of the
    backward pass ``task`` (:func:`running`; default: the pass running now, or the one it
    runs for, :func:`for_running`), its amaxes all-reduced over ``group`` (None: not
    reduced)."""
    state.pending = True
    if task is None:
        task = getattr(_NESTED, "outer", -1)
        if task < 0:
            task = torch._C._current_graph_task_id()
    joined = _joined(task) if task >= 0 else None
    if joined is None:
        state.update(group)
        return
    with _LOCK:
        joined.setdefault(id(group), (group, weakref.WeakValueDictionary()))[1][id(state)] = state


def _joined(task: int):
    """The states joined to pass ``task``, its end's update queued with the first; None
    where that pass is not the one running and has nothing queued (it has ended)."""
    with _LOCK:
        joined = _PASSES.get(task)
        if joined is not None:
            return joined
        if task != torch._C._current_graph_task_id():
            return None
        while len(_PASSES) >= _MAX_PASSES:
            del _PASSES[min(_PASSES)]
        joined = _PASSES[task] = {}
    torch.autograd.Variable._execution_engine.queue_callback(lambda: _finish(task))
    return joined


def _finish(task: int) -> None:
    with _LOCK:
        joined = _PASSES.pop(task, {})
    for group, states in joined.values():
        update_states(sorted(list(states.values()), key=lambda s: s.serial), group)


def pending_passes() -> int:
    """How many backward passes have states waiting for their end (for tests)."""
    with _LOCK:
        return len(_PASSES)
