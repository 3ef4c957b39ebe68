"""``torch.utils.checkpoint`` recomputes lowprec forwards exactly as they ran.

A checkpoint re-runs its function during backward: outside the ``lowprec.autocast`` region
the forward ran in when the region encloses the checkpoint, after the region's exit has
moved the delayed-scaling scales on, and (``use_reentrant=True``) after a forward that ran
without gradients. So every checkpointed call is a *frame*: while its forward runs, each
lowprec module call records what it quantized with (recipe, quantizers, amax reduction
group, and under delayed scaling a copy of the scales it used); the recompute replays the
records in call order, so each module quantizes with the same quantizers and scales and
records no amax a second time, and torch's own RNG restore repeats NVFP4's
stochastic-rounding draws. A reentrant checkpoint's forward runs without gradients but
trains: its delayed-scaling amaxes are recorded there, into the update they enter without
checkpointing, and the recompute's graph, which runs the backward, pushes each call's
backward amaxes once. Gradients and the delayed-scaling state are bit-identical to running
without checkpointing.

The calls come from code users do not own (Hugging Face ``gradient_checkpointing_enable``,
``checkpoint_wrapper``, torchtitan, selective checkpointing), so importing lowprec wraps
the two places every ``torch.utils.checkpoint.checkpoint`` goes through
(``_install``): ``CheckpointFunction.forward`` (``use_reentrant=True``) and
``_checkpoint_without_reentrant_generator`` (``use_reentrant=False``). A frame lives as
long as torch keeps the checkpoint's recompute (the autograd graph), and none is made where
nothing can be recomputed (gradients off), so forwards outside a checkpoint cost nothing.

A lowprec module that a backward pass runs outside any frame, outside autocast after having
run under it or under delayed scaling (a recompute by something other than
``torch.utils.checkpoint``), raises rather than computing in high precision or with other
scales (:func:`check_not_recomputing`).
"""

from __future__ import annotations

import contextlib
import sys
import threading

import torch
import torch.utils.checkpoint as torch_checkpoint


class _Local(threading.local):
    def __init__(self) -> None:
        self.frames: list = []


_LOCAL = _Local()


class _Record:
    """What one lowprec module call inside a checkpointed function quantized with:
    ``active`` is (recipe, forward state, backward state, group, the forward's
    delayed-scaling scales or None), or None outside autocast (:func:`replay_states`).
    ``callback``: the call's end-of-backward callback where a recompute's graph runs the
    backward (reentrant), made at the first recompute: one per call, as without
    checkpointing, however many backward passes recompute it (``retain_graph``)."""

    __slots__ = ("module", "active", "callback")

    def __init__(self, module, active) -> None:
        self.module, self.active, self.callback = module, active, None


#: (get, set) of each thread-local setting that steers a lowprec forward
#: (:func:`register_thread_setting`)
_SETTINGS: list = []


def register_thread_setting(get, set_) -> None:
    """Declare a thread-local setting that steers a lowprec forward (``get()`` reads it,
    ``set_(value)`` sets it): each checkpointed call keeps its value from the forward and
    sets it around the recomputes, which run in a backward pass, perhaps on the autograd
    engine's thread and outside the ``with`` block that set it, and must take the
    forward's path (torch checks that they save the same tensors)."""
    _SETTINGS.append((get, set_))


class _Frame:
    """One checkpointed call: its records, filled by the forward, replayed by recomputes."""

    def __init__(self, reentrant: bool) -> None:
        #: the forward's thread settings (``register_thread_setting``)
        self.settings = tuple(get() for get, _ in _SETTINGS)
        # reentrant: the forward runs without gradients but trains, and the recompute's
        # graph is the one backward runs
        self.reentrant = reentrant
        self.records: list[_Record] = []
        self.replaying = False
        self.next = 0
        #: a recompute's last shared input quantize (``lowprec.linear.shared_input``): the
        #: recompute shares one quantize between Linears as the forward's region did, so
        #: it runs the forward's ops (torch's selective checkpointing matches them by count)
        self.shared_input = None

    def record(self, module, active) -> None:
        """``active``: (recipe, forward state for replays, backward state, group), or None
        outside autocast."""
        self.records.append(_Record(module, active))

    def replay(self, module) -> _Record:
        """The record of the next call, which must be ``module``'s."""
        if self.next >= len(self.records) or self.records[self.next].module is not module:
            expected = ("nothing more" if self.next >= len(self.records)
                        else type(self.records[self.next].module).__name__)
            raise RuntimeError(
                f"activation checkpointing: the recompute called {type(module).__name__} "
                f"{getattr(module, 'name', '')!r} where the forward called {expected}; the "
                f"checkpointed function must call the same lowprec modules in the same order "
                f"each time")
        rec = self.records[self.next]
        self.next += 1
        return rec


def replay_states(active: tuple) -> tuple:
    """(recipe, forward state, backward state, group) a recompute quantizes with, from a
    record's ``active``: under delayed scaling the forward state's replay twin
    (``RecipeState.replay_twin``), holding the scales the forward used (the region's exit
    updates the state's before backward) and recording its amaxes where nothing reads
    them; other recipes' states hold nothing that moves and are used as they are."""
    recipe, fwd, bwd, group, scales = active
    if scales is not None:
        fwd = fwd.replay_twin(scales)
    return recipe, fwd, bwd, group


def current_frame() -> _Frame | None:
    """The innermost checkpointed call running on this thread, or None."""
    return _LOCAL.frames[-1] if _LOCAL.frames else None


def replaying_frame() -> _Frame | None:
    """The innermost checkpointed call being recomputed on this thread, or None."""
    for frame in reversed(_LOCAL.frames):
        if frame.replaying:
            return frame
    return None


def replayed(module) -> tuple[_Record, bool] | None:
    """What ``module`` quantizes with in a recompute: None when no checkpointed call is being
    recomputed, else (the replayed record, whether its graph is the one backward runs).
    A checkpointed call nested in the recompute (its own original forward) records what the
    outer one replays."""
    frames = _LOCAL.frames
    for i in range(len(frames) - 1, -1, -1):
        if frames[i].replaying:
            rec = frames[i].replay(module)
            for inner in frames[i + 1:]:
                inner.record(module, rec.active)
            return rec, frames[i].reentrant
    return None


def record(module, active) -> None:
    """Record a forward call into every checkpointed call running (none is replaying).
    ``active``: (recipe, forward state, backward state, group), or None outside autocast;
    under delayed scaling the record keeps a copy of the scales the forward used."""
    if active is not None:
        recipe, fwd, bwd, group = active
        scales = None
        if fwd.delayed is not None:  # (made here: a recompute runs no op of its own)
            scale = fwd.delayed.scale.detach().clone()
            scales = tuple(scale[i:i + 1] for i in range(len(fwd.quantizers)))
            fwd.replay_twin()
        active = (recipe, fwd, bwd, group, scales)
    for frame in _LOCAL.frames:
        frame.record(module, active)


@contextlib.contextmanager
def _in_frame(frame: _Frame, replaying: bool):
    frame.replaying = replaying
    frame.next = 0
    frame.shared_input = None
    _LOCAL.frames.append(frame)
    saved = tuple(get() for get, _ in _SETTINGS) if replaying else ()
    for (_, set_), value in zip(_SETTINGS, frame.settings if replaying else ()):
        set_(value)
    try:
        yield
    finally:
        for (_, set_), value in zip(_SETTINGS, saved):
            set_(value)
        _LOCAL.frames.pop()


def in_backward() -> bool:
    """Whether the autograd engine is running a backward pass on this thread."""
    return torch._C._current_graph_task_id() != -1


def check_not_recomputing(module, delayed: bool) -> None:
    """Raise when ``module`` runs inside a backward pass, outside any checkpoint frame, in a
    way only a recompute explains: outside autocast after having run under one
    (``delayed=False``), or under delayed scaling (``delayed=True``)."""
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
        f"{type(module).__name__} {module.name!r} is being run during backward by something "
        f"other than torch.utils.checkpoint (whose recomputes lowprec replays exactly"
        f"{'' if _INSTALLED else '; its wrapping is not installed on this torch version'}): "
        f"{why}. Recompute it with torch.utils.checkpoint (or lowprec.checkpoint), or run "
        f"it under the same lowprec.autocast.")


# ---- the wrapping of torch.utils.checkpoint ---------------------------------------------------
class _ReentrantCalls:
    """A reentrant checkpoint's function: its first call is the forward (under no_grad),
    every later one a recompute (in a backward pass)."""

    def __init__(self, frame: _Frame, function) -> None:
        self.frame, self.function, self.calls = frame, function, 0

    def __call__(self, *args):
        replaying = self.calls > 0
        self.calls += 1
        with _in_frame(self.frame, replaying):
            return self.function(*args)


class _Recompute:
    """A non-reentrant checkpoint's function as torch calls it: only to recompute."""

    def __init__(self, frame: _Frame, function) -> None:
        self.frame, self.function = frame, function

    def __call__(self, *args, **kwargs):
        with _in_frame(self.frame, replaying=True):
            return self.function(*args, **kwargs)


def _torch_original(fn):
    # a reloaded lowprec finds its earlier wrapper installed: wrap torch's function again
    return getattr(fn, "_lowprec_wraps", fn)


_TORCH_REENTRANT_FORWARD = _torch_original(torch_checkpoint.CheckpointFunction.forward)
_TORCH_NONREENTRANT = _torch_original(
    getattr(torch_checkpoint, "_checkpoint_without_reentrant_generator", None))


def _reentrant_forward(ctx, run_function, preserve_rng_state, *args):
    # Edges out of the node exist only where backward will run it (gradients on and an
    # input that needs one); only then is the function recomputed.
    if ctx.next_functions:
        run_function = _ReentrantCalls(_Frame(reentrant=True), run_function)
    return _TORCH_REENTRANT_FORWARD(ctx, run_function, preserve_rng_state, *args)


def _nonreentrant_generator(fn, *args, **kwargs):
    # torch runs the forward itself between the generator's two steps, and ``fn`` only to
    # recompute; with gradients off it keeps nothing to recompute.
    if not torch.is_grad_enabled():
        return (yield from _TORCH_NONREENTRANT(fn, *args, **kwargs))
    frame = _Frame(reentrant=False)
    steps = _TORCH_NONREENTRANT(_Recompute(frame, fn), *args, **kwargs)
    with _in_frame(frame, replaying=False):
        return (yield from steps)


_reentrant_forward._lowprec_wraps = _TORCH_REENTRANT_FORWARD
_nonreentrant_generator._lowprec_wraps = _TORCH_NONREENTRANT

#: Modules that import the non-reentrant generator by name (``from ... import``): one
#: imported before lowprec holds torch's own, and gets the wrapper too.
_GENERATOR_USERS = ("torch.distributed._composable.checkpoint_activation",)
_INSTALLED = False


def _install() -> None:
    """Wrap ``torch.utils.checkpoint`` (on import, once) so that its recomputes replay what
    each lowprec module quantized with in the forward. A torch without these functions keeps
    its own: lowprec modules then refuse to be recomputed by it."""
    global _INSTALLED
    if _INSTALLED or _TORCH_NONREENTRANT is None:
        return
    torch_checkpoint.CheckpointFunction.forward = staticmethod(_reentrant_forward)
    torch_checkpoint._checkpoint_without_reentrant_generator = _nonreentrant_generator
    for name in _GENERATOR_USERS:
        user = sys.modules.get(name)
        if getattr(user, "_checkpoint_without_reentrant_generator", None) is _TORCH_NONREENTRANT:
            user._checkpoint_without_reentrant_generator = _nonreentrant_generator
    _INSTALLED = True


_install()


def checkpoint(function, *args, use_reentrant: bool = False, **kwargs):
    """``torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=..., **kwargs)``,
    with non-reentrant checkpointing by default. Every ``torch.utils.checkpoint`` call
    recomputes lowprec modules exactly as they ran (see this module's docstring):
    gradients and delayed-scaling state are bit-identical to no checkpointing.
    ``preserve_rng_state`` must stay on for NVFP4's stochastic rounding to repeat."""
    if not isinstance(use_reentrant, bool):
        raise TypeError(f"use_reentrant must be a bool, got {use_reentrant!r}")
    return torch_checkpoint.checkpoint(function, *args, use_reentrant=use_reentrant, **kwargs)
