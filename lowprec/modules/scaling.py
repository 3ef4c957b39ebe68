"""The recipe state a GEMM module keeps (``LowprecModule``'s share of it): one
``RecipeState`` per direction under the active recipe, delayed scaling's kept across
forwards under other recipes, and the per-GEMM quantizers read from them."""

from __future__ import annotations

import secrets
import warnings
import weakref

import torch

from ..compile import HANDLE_ATTR
from ..memory import (
    check_not_recomputing,
    current_frame,
    record,
    replay_states,
    replayed,
)
from ..recipe import (
    RecipeState,
    active_region,
    join_backward_pass,
    reads_role_names,
    register_delayed_state,
    running_backward_pass,
    stateful,
)


def _holds(state: RecipeState | None, recipe) -> bool:
    """Whether ``state`` is a state for ``recipe``. Identity first: the same recipe object
    every step is the common case, and a dataclass comparison of nested recipes costs host
    time each call."""
    return state is not None and (state.recipe is recipe or state.recipe == recipe)


class _BackwardDone:
    """Counts a forward call's GEMM backwards; once all have run, joins the module's
    backward state to the update of backward pass ``task`` (None: the pass running then;
    ``lowprec.recipe.backward_pass``). A second backward through a graph kept with
    ``retain_graph=True`` counts them again and joins its own pass, as every backward
    pass that runs the module's backward does (a compiled backward too)."""

    def __init__(self, n: int, state, group, task: int | None = None) -> None:
        self.n = self.left = n
        self.state, self.group, self.task = state, group, task

    def __call__(self) -> None:
        self.left -= 1
        if self.left == 0:
            self.left = self.n
            join_backward_pass(self.state, self.group, self.task)

    def skip(self) -> None:
        """One of the GEMMs will have no backward (nothing it read needs a gradient): the
        others' backwards fire without it; with none left to run, nothing fires."""
        self.n -= 1
        self.left -= 1



#: live lowprec modules by ``id``: what :func:`prepare_group`, which the compiler runs with
#: constant arguments only, finds a model's modules in (registered at construction and
#: unpickling)
_LIVE: "weakref.WeakValueDictionary[int, torch.nn.Module]" = weakref.WeakValueDictionary()

#: the attribute naming a module's group, a random int: the modules of one model share one
#: (``convert_model``, ``init_scaling_state``, ``attach_recipe``); a module built directly
#: has none until then. Random, so that unpickled models of other processes keep theirs
#: without meeting another's.
GROUP_ATTR = "_lowprec_group"


def _fresh_group() -> int:
    return secrets.randbits(62)


#: how dynamo names the body of a ``torch.utils.checkpoint`` it traces
_CHECKPOINT_BODY = "torch.utils.checkpoint.checkpoint"


def _in_traced_checkpoint() -> bool:
    """Whether dynamo is tracing the body of a ``torch.utils.checkpoint`` (its recompute
    would run a delayed-scaling call's amax recording again, in backward)."""
    from torch._dynamo.symbolic_convert import InstructionTranslator

    try:
        tx = InstructionTranslator.current_tx()
    except AttributeError:  # this thread never traced: no translator
        return False
    tracer = tx.output.current_tracer if tx is not None else None
    while tracer is not None:
        if getattr(tracer, "description", None) == _CHECKPOINT_BODY:
            return True
        tracer = getattr(tracer, "parent", None)
    return False


@torch._dynamo.assume_constant_result
def _outside_traced_checkpoint() -> bool:
    """Whether a delayed-scaling call may trace: not in the body of a checkpoint the
    compiler traces. Run by the compiler as it traces (its result a constant)."""
    return not _in_traced_checkpoint()


@torch._dynamo.assume_constant_result
def prepare_group(group: int | None) -> bool:
    """Make, for the active recipe, the recipe state of every module of ``group`` (one
    model's modules; ``None``: every live module never grouped, which a model built of
    lowprec modules directly is) that lacks it: delayed scaling's scales and histories, a
    ``CustomRecipe`` factory's quantizers per role. Run by the compiler as the group's
    first call is traced (its result a constant, the call not in the graph), so that the
    trace reads state every layer already holds: a model compiled decoder layer by decoder
    layer compiles the layer's code once, where state made for the traced module alone
    would fail the next layer's guards and compile every layer again. Nothing where the
    autocast region is entered inside the compiled function (dynamo enters it as the graph
    runs, not while it traces). Returns True."""
    region = active_region()
    if region is not None:
        for module in list(_LIVE.values()):
            if module.__dict__.get(GROUP_ATTR) == group:
                module.prepare_state(region.recipe)
    return True


class ScalingStateMixin:
    """The recipe-state methods of ``LowprecModule`` (which holds ``_recipe_states``,
    ``_delayed_states`` and ``_pending_extra_state``)."""

    @staticmethod
    def new_group(modules) -> None:
        """Make ``modules`` (the lowprec modules of one model) a group of their own: a
        compiled call prepares its whole group's recipe state when it is traced
        (:func:`prepare_group`)."""
        group = _fresh_group()
        for m in modules:
            m.__dict__[GROUP_ATTR] = group

    def _register_live(self) -> None:
        """Make this module findable by :func:`prepare_group` (construction, unpickling)."""
        _LIVE[id(self)] = self

    def prepare_state(self, recipe) -> None:
        """Make the recipe state a compiled call under ``recipe`` reads, where the module
        lacks it: delayed scaling's (as :meth:`init_scaling_state`), or the quantizers a
        ``CustomRecipe`` factory gives each role, whose choice may read the roles' names
        (a trace that asked the factory would guard on them). On the parameters' device;
        nothing on the meta device or for other recipes."""
        if not (stateful(recipe) or reads_role_names(recipe)):
            return
        device = self._params_device()
        if device is None or device.type == "meta":
            return
        for mode in ("forward", "backward"):
            self._state(mode, recipe, device)  # a state it holds already is kept

    def held_quantizers(self, recipe):
        """(forward, backward) quantizer lists of the states the module holds for ``recipe``
        (:meth:`prepare_state`), or None where it holds none."""
        held = self.__dict__["_recipe_states"]
        fwd, bwd = held["forward"], held["backward"]
        if not (_holds(fwd, recipe) and _holds(bwd, recipe)):
            return None
        return fwd.quantizers, bwd.quantizers

    def traced_delayed_states(self, recipe):
        """(forward, backward ``DelayedScalingState``, module handle or None, whether the
        call records) a traced call under ``recipe`` reads: a training call records its
        amaxes, and the forward state joins the region's update as an eager forward's does
        (through the handle where the region was entered outside the compiled call); an
        evaluation (gradients off) casts with the states' scales and records nothing, as
        eager's records where nothing reads. The states are made as the module's group is
        traced (:func:`prepare_group`). None where the call stays opaque: a checkpoint is
        in play, or the states do not exist (the region entered inside the compiled
        function, a module without parameters or on the meta device): the opaque call
        makes them, and the compiler traces the next call. In the body of a checkpoint the
        compiler traces, the call stays opaque, whose recompute in backward refuses
        delayed scaling by name."""
        if current_frame() is not None or not _outside_traced_checkpoint():
            return None
        states = self.__dict__["_recipe_states"]
        fwd, bwd = states["forward"], states["backward"]
        if (not _holds(fwd, recipe) or not _holds(bwd, recipe) or fwd.delayed is None
                or bwd.delayed is None):
            return None
        if not torch.is_grad_enabled():
            # an evaluation casts with the states' scales and records nothing (eager's
            # records into scratch amaxes nothing reads)
            return fwd.delayed, bwd.delayed, None, False
        if active_region().traced:
            # the region lives in the graph: its exit's update is traced with it
            fwd.delayed.pending = True
            register_delayed_state(fwd.delayed)
            return fwd.delayed, bwd.delayed, None, True
        # a region around the compiled call: joined at run time (``lowprec::join_region``)
        return fwd.delayed, bwd.delayed, self.__dict__[HANDLE_ATTR], True

    def _state(self, mode: str, recipe, device) -> RecipeState:
        state = self._recipe_states[mode]
        if not _holds(state, recipe):
            state = self._new_state(mode, recipe, device)
        return state

    def _warn_on_recipe_type_change(self, recipe) -> None:
        """Warn where a forward runs under a recipe of another type than the module's
        quantizers were last built for (their state is rebuilt), as Transformer Engine
        does."""
        held = self._recipe_states["forward"]
        if held is None or held.recipe is recipe or type(held.recipe) is type(recipe):
            return
        warnings.warn(
            f"Recipe type changed from {type(held.recipe).__name__} to {type(recipe).__name__} "
            f"for {type(self).__name__} {self.name!r}: its quantizers are rebuilt for the new "
            f"recipe (delayed scaling's state is kept and taken up again when that recipe "
            f"returns)", UserWarning, stacklevel=4)

    def _new_state(self, mode: str, recipe, device) -> RecipeState:
        """The state for ``recipe`` under the current roles. A module's delayed-scaling state
        outlives forwards under other recipes (an eval under MXFP8, say): it is kept aside
        and taken up again, or carried into the state of another DelayedScaling recipe or
        other roles where it fits."""
        roles = self._roles()[0 if mode == "forward" else 1]
        kept = self._kept_delayed().get(mode)
        if (stateful(recipe) and kept is not None and kept.roles == roles
                and (kept.recipe is recipe or kept.recipe == recipe)):
            state = kept
        else:
            state = RecipeState.create(recipe, mode, roles, device)
            if state.delayed is not None:
                if kept is not None:
                    state.delayed.adopt(kept.delayed)
                self._delayed_states[mode] = state
                self._take_pending(mode, state)
        self._recipe_states[mode] = state
        return state

    def _kept_delayed(self) -> dict:
        """The module's delayed-scaling state per mode (None until it has one)."""
        kept = self.__dict__.get("_delayed_states")
        if kept is None:  # a module pickled before the states were kept apart
            kept = self.__dict__["_delayed_states"] = {
                m: (s if s is not None and s.delayed is not None else None)
                for m, s in self._recipe_states.items()}
        return kept

    def active_states(self, device, backward_calls: int = 1):
        """(recipe, forward state, backward state, end-of-backward callback) under the active
        autocast, or None outside it. The callback fires after ``backward_calls`` calls.

        A forward with grad disabled (eval, ``no_grad``, ``inference_mode``) gets the
        forward state's ``eval_twin``: the same quantizers, except that delayed scaling's
        record their amaxes where no update reads them, so such calls never move the
        state and interleaved eval steps leave training bit-identical.

        Inside a ``torch.utils.checkpoint`` recompute it is what the original call
        quantized with, autocast or not (``lowprec.checkpoint``)."""
        frame = current_frame()
        if frame is not None:
            replay = replayed(self)
            if replay is not None:
                return self._replayed_states(*replay, backward_calls)
        region = active_region()
        if region is None:
            if frame is not None:
                record(self, None)
            else:
                check_not_recomputing(self, delayed=False)
            return None
        recipe = region.recipe
        self._warn_on_recipe_type_change(recipe)
        fwd, bwd = self._state("forward", recipe, device), self._state("backward", recipe, device)
        if frame is not None:
            record(self, (recipe, fwd, bwd, region.group))
        if fwd.delayed is None:
            return recipe, fwd, bwd, None
        # a reentrant checkpoint runs its forward without gradients, and it trains
        if not (torch.is_grad_enabled() or (frame is not None and frame.reentrant)):
            return recipe, fwd.eval_twin, bwd, None
        if frame is None:
            check_not_recomputing(self, delayed=True)
        fwd.delayed.pending = True
        register_delayed_state(fwd.delayed)
        callback = (self._backward_callback(bwd, region.group, backward_calls)
                    if torch.is_grad_enabled() else None)
        return recipe, fwd, bwd, callback

    def _replayed_states(self, rec, reentrant: bool, backward_calls: int):
        """``active_states`` in a checkpoint recompute, from the original call's record
        (``lowprec.memory.checkpointing._Record``)."""
        if rec.active is None:  # it ran outside autocast
            return None
        recipe, fwd, bwd, group = replay_states(rec.active)
        # Only a reentrant recompute's graph runs backward (a non-reentrant one refills the
        # original graph's saved tensors, and the original call's callback fires).
        if not reentrant or bwd.delayed is None:
            return recipe, fwd, bwd, None
        if rec.callback is None:
            rec.callback = self._backward_callback(bwd, group, backward_calls)
        # the recompute's backward is a pass of its own, within the pass running now (each
        # backward through a retained graph recomputes, in its own pass)
        rec.callback.task = running_backward_pass()
        return recipe, fwd, bwd, rec.callback

    @staticmethod
    def _backward_callback(bwd: RecipeState, group, backward_calls: int) -> "_BackwardDone":
        """Joins the backward state to the running backward pass's update once
        ``backward_calls`` GEMM backwards of one forward call have run."""
        return _BackwardDone(backward_calls, bwd.delayed, group)

    def _move_scaling_state(self) -> None:
        # delayed-scaling state follows the parameters (.to, .cuda, to_empty)
        device = self._params_device()
        if device is not None:
            for mode, state in self._kept_delayed().items():
                if state is not None:
                    state.move_to(device)
                    self._take_pending(mode, state)

    def _take_pending(self, mode: str, state: RecipeState) -> None:
        """Load a state dict's delayed-scaling state that arrived before ``state`` could
        hold it (before the first forward, or while on the meta device)."""
        extra = (self._pending_extra_state or {}).get(mode)
        if extra is not None and not state.delayed.scale.is_meta:
            state.delayed.load_state_dict(extra)
            del self._pending_extra_state[mode]

    def init_scaling_state(self, recipe) -> None:
        """Create the delayed-scaling state ``recipe`` gives this module now instead of at
        its first forward (on the parameters' device), so that its ``_extra_state`` already
        has the size a trained module's has: ``torch.distributed.checkpoint`` loads a saved
        one into it in place. Nothing for recipes without state."""
        if not stateful(recipe):
            return
        for mode in ("forward", "backward"):
            self._state(mode, recipe, self._params_device())
