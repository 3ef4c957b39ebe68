"""Delayed-scaling state updates in batches: one amax all-reduce and one launch for many.

Under :class:`~lowprec.recipe.DelayedScaling` every lowprec module keeps two states, one
per direction, so a model of L modules has 2L of them. Updated one at a time, a training
step pays 2L update launches (tens of microseconds of host time each) and, with amax
reduction, 2L all-reduces. Here they go together, as in Transformer Engine:

* an autocast region's forward states update together when it exits
  (:func:`update_states`);
* a module's backward state, once its backward has run, is queued
  (:func:`defer_backward_update`), and the autograd engine updates the pass's queue
  together when it finishes the backward pass (a final callback), each state on the
  stream its own update would have used. Backward amaxes still enter the history "after
  the backward pass", before ``backward()`` returns.

Each state ends exactly as its own :meth:`~lowprec.state.DelayedScalingState.update` leaves
it: the all-reduce is elementwise MAX over the concatenated amaxes, and the batched kernel
runs the single-state kernel's code on each state's columns. A module called several times
before one backward (shared weights, recurrence) still updates its backward state after
each call's backward but the last (:func:`close_backward`): each call's amax overwrites the
one before, so waiting would lose all but one. A backward pass that fails leaves its queue
unflushed: those amaxes never enter the history.

The batched launch takes an int64 table of the states' tensor addresses, so it runs only in
eager mode outside CUDA graph capture (the table is made on the first update of a set of
states and kept while they live); under tracing or capture each state updates alone, as
before.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import weakref

import torch

from . import kernels as lowprec_kernels
from .kernels import FlagOff, _tracing

#: Whether states update in batches (off: each alone, for A/B comparisons and tests)
BATCHED = True

#: tuple of state ids -> (weak references to the states, their device address table, the
#: stream it was made on); an entry goes when one of its states does
_TABLES: dict = {}
_MAX_TABLES = 1024

#: autograd graph task id -> {id(state): (state, amax reduction group, device, CUDA stream
#: handle)} of the backward states waiting for the end of that backward pass, in the order
#: their modules' backwards finished
_QUEUES: dict = {}
_MAX_QUEUES = 16
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
    pending = list({id(s): s for s in states if s.pending}.values())
    if not BATCHED or len(pending) < 2:
        for s in pending:
            s.update(group)
        return
    if group is not None:
        _all_reduce_amaxes([s for s in pending if s.recipe.reduce_amax], group)
    batched: dict = {}
    can_batch = None  # decided once, at the first state that could batch
    for s in pending:
        key = _batch_key(s)
        if key is not None and can_batch is None:
            # a captured graph must not read a table made outside it; tracers cannot
            can_batch = lowprec_kernels._enabled and not _tracing(()) \
                and not torch.cuda.is_current_stream_capturing()
        if key is None or not can_batch:
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
    """What a state shares with the others it can update in one launch with (device,
    history length, algorithm, margin), or None when its update takes the torch path (a
    callable algorithm, no kernels for it). Fixed for a state's life: computed once."""
    key = state.__dict__.get("_batch_key", False)
    if key is False:
        algo = state.recipe.amax_compute_algo
        key = None
        if isinstance(algo, str) and state.scale.is_cuda \
                and lowprec_kernels.triton_available() and state._kernel_update_fits(algo):
            key = (state.scale.device, state.amax_history.shape[0], algo, state._inv_margin())
        state._batch_key = key
    return key


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
    states live; it is dropped when one of them goes."""
    key = tuple(map(id, states))
    with _LOCK:
        hit = _TABLES.get(key)
    if hit is not None and all(ref() is s for ref, s in zip(hit[0], states)):
        _, table, made_on = hit
    else:
        rows = [[s.amax_history.data_ptr(), s.amax_current.data_ptr(), s.scale.data_ptr(),
                 s.fp8_max.data_ptr(), s.scale.numel()] for s in states]
        table = torch.tensor(rows, dtype=torch.int64).to(device, non_blocking=True)
        made_on = _raw_stream(device)
        with _LOCK:
            if len(_TABLES) >= _MAX_TABLES:  # a safety net: sets of states come and go
                _TABLES.pop(next(iter(_TABLES)))
            _TABLES[key] = ([weakref.ref(s) for s in states], table, made_on)
        for s in states:
            weakref.finalize(s, _TABLES.pop, key, None)
    stream = _raw_stream(device)
    if stream != made_on:  # the allocator must not hand it out while this launch reads it
        table.record_stream(torch.cuda.ExternalStream(stream, device=device))
    return table


def _raw_stream(device: torch.device) -> int:
    """The current CUDA stream of ``device`` as its handle (cheaper than a Stream object)."""
    return torch._C._cuda_getCurrentRawStream(
        device.index if device.index is not None else torch.cuda.current_device())


# ---- backward states --------------------------------------------------------------------
def open_backward(state) -> None:
    """A forward call (with gradients) whose backward will record an amax into ``state``;
    :func:`close_backward` when that backward has run or its graph is dropped."""
    with _LOCK:
        state._open_backwards += 1


def close_backward(state, group, ran: bool) -> None:
    """One forward call's backward into ``state`` has run (``ran``), or never will. When it
    ran and another call's backward into ``state`` is still to come (a module called more
    than once), that one will overwrite the amax just recorded: update now, as before
    batching. Otherwise the update waits for the end of the backward pass
    (:func:`defer_backward_update`)."""
    with _LOCK:
        state._open_backwards -= 1
        more = state._open_backwards > 0
    if not ran:
        return
    if more:
        state.pending = True
        state.update(group)
    else:
        defer_backward_update(state, group)


def defer_backward_update(state, group=None) -> None:
    """Update ``state`` (a module's backward state, its backward done) when the autograd
    engine finishes the current backward pass, together with the others queued in it, on
    the CUDA stream current now (the backward's own, as an update at once would run); at
    once where nothing can be queued (outside a backward pass, tracing, batching off)."""
    state.pending = True
    task = torch._C._current_graph_task_id() if BATCHED and not _tracing(()) else -1
    if task == -1:
        state.update(group)
        return
    device = state.scale.device
    stream = _raw_stream(device) if device.type == "cuda" else None
    with _LOCK:
        # a pass that failed before its end may have left it queued (its queue then goes)
        for t in [t for t, q in _QUEUES.items()
                  if t != task and q.pop(id(state), None) is not None and not q]:
            del _QUEUES[t]
        queue = _QUEUES.get(task)
        first = queue is None
        if first:
            while len(_QUEUES) >= _MAX_QUEUES:  # passes that failed: never flushed
                _QUEUES.pop(next(iter(_QUEUES)))
            queue = _QUEUES[task] = {}
        queue[id(state)] = (state, group, device, stream)
    if first:
        torch.autograd.Variable._execution_engine.queue_callback(
            functools.partial(_flush, task))


def _flush(task: int) -> None:
    """The end of backward pass ``task``: update its queued states, together per amax
    reduction group and stream. Another pass's queue is left alone (it may still be
    running, or it failed and its amaxes never complete a step)."""
    with _LOCK:
        queue = _QUEUES.pop(task, None) or {}
    buckets: dict = {}
    for state, group, device, stream in queue.values():
        buckets.setdefault((id(group), device, stream), (group, device, stream, []))[3].append(state)
    for group, device, stream, states in buckets.values():
        # the engine runs this callback on the stream current at backward(); a state's own
        # update would have run on its module's backward stream
        other = stream is not None and stream != _raw_stream(device)
        with torch.cuda.stream(torch.cuda.ExternalStream(stream, device=device)) if other \
                else contextlib.nullcontext():
            update_states(states, group)
