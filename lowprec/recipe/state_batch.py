"""Delayed-scaling states updated in a batch: one amax all-reduce and one launch.

Under :class:`~lowprec.recipe.DelayedScaling` every lowprec module keeps two states, one
per direction. Each updated on its own would take one launch (tens of microseconds of
host time) and, with amax reduction, one all-reduce. The forward states of an
autocast region all update when the region exits, so :func:`update_states` does them
together, as Transformer Engine does: one all-reduce of their amaxes per device and one
launch per set of states with the same device, history length, algorithm and margin.

Each state ends exactly as its own :meth:`~lowprec.recipe.state.DelayedScalingState.update` leaves
it: the all-reduce is elementwise MAX over the concatenated amaxes, and the batched kernel
runs the single-state kernel's code on each state's columns.

The backward states of a backward pass update together at its end in the same way
(``lowprec.recipe.backward_pass``).

The batched launch takes an int64 table of the states' tensor addresses, so it runs only in
eager mode outside CUDA graph capture (the table is made on the first update of a set of
states and kept while they live); under tracing or capture each state updates alone.
"""

from __future__ import annotations

import threading
import weakref

import torch

from .. import kernels as lowprec_kernels
from ..kernels import FlagOff, _tracing
from .state import note_seeded

#: Whether states update in batches (off: each alone, for A/B comparisons and tests)
BATCHED = True

#: tuple of state ids -> (weak references to the states, their device address table, the
#: stream it was made on); an entry goes when one of its states does
_TABLES: dict = {}
_MAX_TABLES = 1024

_LOCK = threading.Lock()


class per_state_updates(FlagOff):
    """Context manager: every delayed-scaling state updates alone (the behaviour before
    batching; for A/B comparisons and tests)."""

    _module, _flag = __name__, "BATCHED"


def update_states(states, group=None) -> None:
    """:meth:`~lowprec.recipe.state.DelayedScalingState.update` of every pending state in
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
        from ..formats.float8 import fp8_delayed_update_many
        fp8_delayed_update_many(_table(members, device), h,
                                max(s.scale.numel() for s in members), inv_margin,
                                algo == "most_recent")
        for s in members:
            s.pending = False
        note_seeded(members)


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
        # the entry goes with the first of its states (the references and their callbacks
        # go with the entry)
        refs = [weakref.ref(s, lambda _, key=key: _TABLES.pop(key, None)) for s in states]
        with _LOCK:
            if len(_TABLES) >= _MAX_TABLES:  # a safety net: sets of states come and go
                _TABLES.pop(next(iter(_TABLES)))
            _TABLES[key] = (refs, table, made_on)
    stream = _raw_stream(device)
    if stream != made_on:  # the allocator must not hand it out while this launch reads it
        table.record_stream(torch.cuda.ExternalStream(stream, device=device))
    return table


def _raw_stream(device: torch.device) -> int:
    """The current CUDA stream of ``device`` as its handle (cheaper than a Stream object)."""
    return torch._C._cuda_getCurrentRawStream(
        device.index if device.index is not None else torch.cuda.current_device())
