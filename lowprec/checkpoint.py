"""Activation checkpointing that recomputes lowprec forwards exactly as they ran.

``torch.utils.checkpoint`` re-runs the checkpointed function during backward, outside
the ``lowprec.autocast`` region the forward ran in (and after the region's exit has moved
the delayed-scaling scales on). :func:`checkpoint` wraps it: while the original forward
runs, every lowprec module records what it quantized with (recipe, quantizers, amax
reduction group, and for delayed scaling a copy of the scales it used); the recompute
replays those records in call order, so each module quantizes with the same quantizers
and scales, records no amax a second time, and torch's own RNG restore repeats NVFP4's
stochastic-rounding draws. Gradients are bit-identical to running without checkpointing.

The plain ``torch.utils.checkpoint`` cannot be made right from inside a module: a
lowprec module that a backward pass re-runs outside autocast after it ran under one, or a
delayed-scaling forward inside a backward pass, raises (see ``check_not_recomputing``)
instead of silently computing in high precision or with other scales.
"""

from __future__ import annotations

import contextlib
import threading

import torch

from .state import RecipeState


class _Local(threading.local):
    def __init__(self) -> None:
        self.frames: list = []


_LOCAL = _Local()


class _Record:
    """What one lowprec module call inside a checkpointed function quantized with."""

    __slots__ = ("module", "active")

    def __init__(self, module, active) -> None:
        self.module, self.active = module, active


class _Frame:
    """One checkpointed call: its records, filled by the forward, replayed by recomputes."""

    def __init__(self, reentrant: bool, training: bool) -> None:
        self.reentrant = reentrant
        # a reentrant forward runs under no_grad: whether it trains is decided at the call
        self.training = training
        self.records: list[_Record] = []
        self.replaying = False
        self.next = 0

    def record(self, module, active) -> None:
        """``active``: (recipe, forward state, backward state, group) or None (no autocast)."""
        if active is not None:
            recipe, fwd, bwd, group = active
            active = (recipe, _frozen(fwd), bwd, group)
        self.records.append(_Record(module, active))

    def replay(self, module):
        """The record of the next call, which must be ``module``'s."""
        if self.next >= len(self.records) or self.records[self.next].module is not module:
            expected = ("nothing more" if self.next >= len(self.records)
                        else type(self.records[self.next].module).__name__)
            raise RuntimeError(
                f"lowprec.checkpoint: the recompute called {type(module).__name__} "
                f"{getattr(module, 'name', '')!r} where the forward called "
                f"{expected}; "
                f"the checkpointed function must call the same lowprec modules in the same "
                f"order each time")
        rec = self.records[self.next]
        self.next += 1
        return rec.active


def _frozen(fwd: RecipeState) -> RecipeState:
    """``fwd`` for a replay: delayed scaling's quantizers with a copy of the scales the
    forward used (the region's exit updates them before backward) that record their amaxes
    where nothing reads them; other recipes' quantizers hold no state and are reused."""
    if fwd.delayed is None:
        return fwd
    quantizers = fwd.delayed.quantizers([q.fp8_dtype for q in fwd.quantizers], record=False,
                                        scale=fwd.delayed.scale.detach().clone())
    return RecipeState(fwd.recipe, fwd.mode, fwd.roles, quantizers, None)


def current_frame() -> _Frame | None:
    """The innermost checkpointed call running on this thread, or None."""
    return _LOCAL.frames[-1] if _LOCAL.frames else None


def replayed(module):
    """What ``module`` quantizes with in a recompute: None when no checkpointed call is being
    recomputed, else (the replayed record, whether its graph is the one backward runs).
    A record of None means the call ran outside autocast. A checkpointed call nested in the
    recompute (its own original forward) records what the outer one replays."""
    frames = _LOCAL.frames
    for i in range(len(frames) - 1, -1, -1):
        if frames[i].replaying:
            active = frames[i].replay(module)
            for inner in frames[i + 1:]:
                inner.record(module, active)
            return active, frames[i].reentrant
    return None


def record(module, active) -> None:
    """Record a forward call into every checkpointed call running (none is replaying)."""
    for frame in _LOCAL.frames:
        frame.record(module, active)


@contextlib.contextmanager
def _in_frame(frame: _Frame, replaying: bool):
    frame.replaying = replaying
    frame.next = 0
    _LOCAL.frames.append(frame)
    try:
        yield
    finally:
        _LOCAL.frames.pop()


def in_backward() -> bool:
    """Whether the autograd engine is running a backward pass on this thread."""
    return torch._C._current_graph_task_id() != -1


def check_not_recomputing(module, delayed: bool) -> None:
    """Raise when ``module`` runs inside a backward pass in a way only a recompute by the
    plain ``torch.utils.checkpoint`` explains: outside autocast after having run under
    one (``delayed=False``), or under delayed scaling (``delayed=True``)."""
    if torch.compiler.is_compiling() or not in_backward():
        return
    if delayed:
        why = ("a DelayedScaling forward inside a backward pass would quantize with scales "
               "updated since the original forward and record its amaxes twice")
    elif module._recipe_states.get("forward") is not None:
        why = ("it ran under lowprec.autocast before and is now run outside it, so the "
               "recomputed backward would silently be high precision")
    else:
        return
    raise RuntimeError(
        f"{type(module).__name__} {module.name!r} is being recomputed during backward "
        f"(torch.utils.checkpoint?): {why}. Use lowprec.checkpoint(fn, *args, "
        f"use_reentrant=...), which recomputes lowprec modules exactly as they ran.")


def checkpoint(function, *args, use_reentrant: bool = False, **kwargs):
    """``torch.utils.checkpoint.checkpoint(function, *args, ...)`` for functions that run
    lowprec modules: the recompute quantizes exactly as the forward did (recipe, role
    quantizers, delayed-scaling scales, NVFP4 stochastic-rounding draws through torch's RNG
    restore), records no amax twice, and gradients are bit-identical to no checkpointing.

    ``lowprec.autocast`` may be outside or inside ``function``. Other keyword arguments go
    to torch's checkpoint (``preserve_rng_state`` must stay on for NVFP4's stochastic
    rounding to repeat; a ``context_fn`` of your own is entered inside lowprec's).
    """
    if not isinstance(use_reentrant, bool):
        raise TypeError(f"use_reentrant must be a bool, got {use_reentrant!r}")
    outer = current_frame()  # nested in a reentrant forward, grad is off but it trains
    frame = _Frame(use_reentrant, torch.is_grad_enabled() or (outer is not None and outer.training))
    if use_reentrant:
        if "context_fn" in kwargs:
            raise ValueError("context_fn is not supported with use_reentrant=True (as in "
                             "torch.utils.checkpoint)")
        calls = []

        def run(*a):
            # the first call is the forward (under no_grad), any later one a recompute
            with _in_frame(frame, replaying=bool(calls)):
                calls.append(None)
                return function(*a)

        return torch.utils.checkpoint.checkpoint(run, *args, use_reentrant=True, **kwargs)

    user_context_fn = kwargs.pop("context_fn", None)

    def context_fn():
        fwd_ctx, re_ctx = (user_context_fn() if user_context_fn is not None
                           else (contextlib.nullcontext(), contextlib.nullcontext()))
        return _stacked(_in_frame(frame, False), fwd_ctx), _stacked(_in_frame(frame, True), re_ctx)

    return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False,
                                             context_fn=context_fn, **kwargs)


@contextlib.contextmanager
def _stacked(outer, inner):
    with outer, inner:
        yield
