"""Delayed-scaling state updates in batches: one amax all-reduce and one launch for many.

Under :class:`~lowprec.recipe.DelayedScaling` every lowprec module keeps two states, one
per direction, so a model of L modules has 2L of them. Updated one at a time, a training
step pays 2L update launches (tens of microseconds of host time each) and, with amax
reduction, 2L all-reduces. Here they go together, as in Transformer Engine:

* an autocast region's forward states update together when it exits
  (:func:`update_states`);
* a module's backward state, once its backward has run, is queued
  (:func:`defer_backward_update`), and the autograd engine updates the queue together
  when it finishes the backward pass (a final callback). Backward amaxes still enter the
  history "after the backward pass", before ``backward()`` returns.

Each state ends exactly as its own :meth:`~lowprec.state.DelayedScalingState.update` leaves
it: the all-reduce is elementwise MAX over the concatenated amaxes, and the batched kernel
runs the single-state kernel's code on each state's columns. One difference: a module whose
forward ran several times in one backward pass has its backward state updated once, at the
end of the pass (as its forward state is once per region), not once per call.

The batched launch takes an int64 table of the states' tensor addresses, so it runs only in
eager mode outside CUDA graph capture (the table is made on the first update of a set of
states and kept while they live); under tracing or capture each state updates alone, as
before.
"""

from __future__ import annotations

import threading
import weakref

import torch

from .kernels import FlagOff, _tracing

#: Whether states update in batches (off: each alone, for A/B comparisons and tests)
BATCHED = True

#: tuple of state ids -> (weak references to the states, their device address table)
_TABLES: dict = {}
_MAX_TABLES = 64

#: id(state) -> (state, amax reduction group) of backward states waiting for the end of
#: the backward pass, in the order their modules' backwards finished
_DEFERRED: dict = {}
_LOCK = threading.Lock()


class per_state_updates(FlagOff):
    """Context manager: every delayed-scaling state updates alone, at once (the behaviour
    before batching; for A/B comparisons and tests)."""

    _module, _flag = __name__, "BATCHED"


def update_states(states, group=None) -> None:
    """:meth:`~lowprec.state.DelayedScalingState.update` of every pending state in
    ``states``, with one all-reduce of their amaxes over ``group`` per device (states
    whose recipe has ``reduce_amax``) and one update launch per compatible set (same
    device, history length, algorithm and margin); the rest update alone."""
    pending = [s for s in states if s.pending]
    if not BATCHED or len(pending) < 2:
        for s in pending:
            s.update(group)
        return
    if group is not None:
        _all_reduce_amaxes([s for s in pending if s.recipe.reduce_amax], group)
    batched: dict = {}
    for s in pending:
        key = _batch_key(s)
        if key is None:
            s.update()
        else:
            batched.setdefault(key, []).append(s)
    for (device, h, algo, inv_margin), members in batched.items():
        if len(members) == 1:
            members[0].update()
            continue
        from .formats.float8.launch import fp8_delayed_update_many
        fp8_delayed_update_many(_table(members, device), h,
                                max(s.scale.numel() for s in members), inv_margin,
                                algo == "most_recent")
        for s in members:
            s.pending = False


def _batch_key(state):
    """What a state shares with the others it can update in one launch with, or None when
    it updates alone (a callable algorithm, the torch path, tracing, graph capture)."""
    algo = state.recipe.amax_compute_algo
    if not isinstance(algo, str) or not state._update_with_kernel(algo) or _tracing(()) \
            or torch.cuda.is_current_stream_capturing():
        return None
    return state.scale.device, state.amax_history.shape[0], algo, state._inv_margin()


def _all_reduce_amaxes(states, group) -> None:
    """MAX-reduce the recorded amaxes of ``states`` over ``group``: one all-reduce per
    device of all of them concatenated (the states then update without a group)."""
    by_device: dict = {}
    for s in states:
        by_device.setdefault(s.amax_current.device, []).append(s)
    for members in by_device.values():
        currents = [s.amax_current for s in members]
        flat = torch.cat(currents)
        torch.distributed.all_reduce(flat, op=torch.distributed.ReduceOp.MAX, group=group)
        torch._foreach_copy_(currents, list(flat.split([c.numel() for c in currents])))


def _table(states, device) -> torch.Tensor:
    """The int64 (S, 5) table ``delayed_update_many_kernel`` reads: per state the addresses
    of its history, current amax, scale and fp8 maxima, and its column count. A state's
    tensors are made once and only ever written in place, so a table stays right while its
    states live (checked through weak references)."""
    key = tuple(map(id, states))
    hit = _TABLES.get(key)
    if hit is not None and all(ref() is s for ref, s in zip(hit[0], states)):
        return hit[1]
    rows = [[s.amax_history.data_ptr(), s.amax_current.data_ptr(), s.scale.data_ptr(),
             s.fp8_max.data_ptr(), s.scale.numel()] for s in states]
    table = torch.tensor(rows, dtype=torch.int64).to(device, non_blocking=True)
    if len(_TABLES) >= _MAX_TABLES:
        _TABLES.pop(next(iter(_TABLES)))
    _TABLES[key] = ([weakref.ref(s) for s in states], table)
    return table


def defer_backward_update(state, group=None) -> None:
    """Update ``state`` (a module's backward state, its backward done) when the autograd
    engine finishes the current backward pass, together with the others queued in it; at
    once where nothing can be queued (not inside a backward pass, tracing, batching off)."""
    state.pending = True
    if BATCHED and not _tracing(()):
        with _LOCK:
            _DEFERRED[id(state)] = (state, group)
        try:
            # One callback per call: the first to run updates everything queued; a pass
            # that failed before its callbacks ran leaves its states to the next one.
            torch.autograd.Variable._execution_engine.queue_callback(flush_backward_updates)
            return
        except RuntimeError:  # not inside a backward pass
            with _LOCK:
                _DEFERRED.pop(id(state), None)
    state.update(group)


def flush_backward_updates() -> None:
    """Update every queued backward state now (grouped by amax reduction group)."""
    with _LOCK:
        items = list(_DEFERRED.values())
        _DEFERRED.clear()
    by_group: dict = {}
    for state, group in items:
        by_group.setdefault(id(group), (group, []))[1].append(state)
    for group, states in by_group.values():
        update_states(states, group)
