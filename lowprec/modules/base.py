"""What every GEMM module shares: roles, recipe state, quantized weights, extra state."""

from __future__ import annotations

import functools
import math

import torch
import torch.distributed as dist
from torch import nn

from ..autocast import active_region, init_recipe, register_delayed_state, torch_autocast_dtype
from ..checkpoint import check_not_recomputing, current_frame, record, replayed
from ..compiled_call import HANDLE_ATTR, CompiledCallMixin
from ..formats.base import REQUANTIZE_ATTR, QuantizedTensor, keep_quantized, user_attributes
from ..linear.function import LinearQuantizers
from ..recipe import BackwardMode, operand_usages
from ..roles import check_num_quantizers, gemm_roles
from ..state import RecipeState, stateful, stateless_quantizers
from . import extra_state

PARALLEL_MODES = (None, "column", "row")


def tp_group_size(parallel_mode, tp_group, sequence_parallel, *, modes=("column", "row"),
                  module: str = "this module") -> int:
    """Validate tensor-parallel arguments; returns the group's size (1 without a group)."""
    if parallel_mode not in PARALLEL_MODES:
        raise ValueError(f"parallel_mode={parallel_mode!r}; use one of {PARALLEL_MODES}")
    if not isinstance(sequence_parallel, bool):
        raise TypeError(f"sequence_parallel must be a bool, got {sequence_parallel!r}")
    if tp_group is None:
        return 1
    if not dist.is_initialized():
        raise RuntimeError(f"tp_group={tp_group!r} given but torch.distributed is not "
                           f"initialized")
    size = dist.get_world_size(tp_group)
    if size > 1 and parallel_mode not in modes:
        raise ValueError(f"{module} over a tp_group of {size} ranks takes parallel_mode in "
                         f"{modes}, got {parallel_mode!r}")
    return size


def check_parallel_args(parallel_mode, tp_group, sequence_parallel) -> None:
    """Validate tensor-parallel arguments of a module that runs on a single rank only."""
    if tp_group_size(parallel_mode, tp_group, sequence_parallel) > 1:
        raise NotImplementedError("tensor parallelism over more than one rank is implemented "
                                  "for Linear, LayerNormLinear and LayerNormMLP; pass "
                                  "tp_group=None or a single-rank group")


def producer_usages(weight: torch.Tensor, backward_mode: str) -> tuple[bool, bool]:
    """(rowwise, columnwise) usages a producer quantizes a GEMM's input with: what
    ``quantized_linear`` would make itself (columnwise only for wgrad in default mode)."""
    return operand_usages(backward_mode, needs_dgrad=False,
                          needs_wgrad=weight.requires_grad and torch.is_grad_enabled()).input


def release_fprop_copy(x: torch.Tensor, backward_mode: str) -> None:
    """After fprop, drop the rowwise data of an input a producer quantized for this GEMM
    alone: in default mode backward saved only the columnwise data."""
    if (backward_mode == BackwardMode.DEFAULT and isinstance(x, QuantizedTensor)
            and x.has_usage("rowwise") and x.has_usage("columnwise")):
        x.update_usage(rowwise_usage=False)


def init_linear_params(weight: torch.Tensor, bias: torch.Tensor | None,
                       fan_in: int | None = None) -> None:
    """torch.nn.Linear's initialization (Kaiming-uniform weight, uniform bias).
    ``fan_in``: the whole layer's, for a row-parallel shard (its columns are a slice of it):
    the bounds are those of the unsplit layer."""
    if fan_in is None or fan_in == weight.shape[1]:
        nn.init.kaiming_uniform_(weight, a=math.sqrt(5))
        fan_in = weight.shape[1]
    else:  # kaiming_uniform_ with a=sqrt(5) draws from U(-1/sqrt(fan_in), 1/sqrt(fan_in))
        nn.init.uniform_(weight, -1 / math.sqrt(fan_in), 1 / math.sqrt(fan_in))
    if bias is not None:
        bound = 1 / math.sqrt(fan_in) if fan_in > 0 else 0
        nn.init.uniform_(bias, -bound, bound)


def add_linear_params(module: nn.Module, weight_name: str, bias_name: str | None,
                      out_features: int, in_features: int, *, bias: bool, dtype, device,
                      bias_features: int | None = None, fan_in: int | None = None) -> None:
    """Register an ``nn.Linear``-initialized weight (and bias) on ``module``.

    With ``bias=False`` the bias name (if given) is registered as ``None``.
    ``bias_features``/``fan_in``: a row-parallel shard's whole bias and whole fan-in.
    """
    w = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype, device=device))
    b = (nn.Parameter(torch.empty(bias_features or out_features, dtype=dtype, device=device))
         if bias else None)
    init_linear_params(w, b, fan_in)
    if fan_in is not None:
        module.__dict__.setdefault("_fan_in", {})[weight_name] = fan_in
    module.register_parameter(weight_name, w)
    if bias_name is not None:
        module.register_parameter(bias_name, b)


#: Attributes the roles are built from (``get_quantizer_roles``)
_ROLE_ATTRS = frozenset({"name", "output_quantizer_role", "grad_input_quantizer_role"})


class _WeightSlot:
    """Re-quantizes high-precision values into quantized weight ``index`` of ``module``
    (the parameter's ``REQUANTIZE_ATTR``). Holds the module itself, so a deepcopy or a
    pickle of the module carries a link to the copy."""

    def __init__(self, module: "LowprecModule", index: int) -> None:
        self.module, self.index = module, index

    def __call__(self, src: torch.Tensor, dst: QuantizedTensor) -> None:
        self.module.weight_quantizer(self.index, dst.device).update_quantized(src, dst)


class ScalingStateDict:
    """A module's delayed-scaling state, ``{mode: {name: tensor}}``, read like a dict
    (``LowprecModule.scaling_state()``), compared by value. State dicts hold it packed in
    a tensor (``lowprec.modules.extra_state``); ``set_extra_state`` still takes one, as
    older checkpoints stored it."""

    def __init__(self, states: dict | None = None) -> None:
        self.states = dict(states or {})

    def __getitem__(self, mode):
        return self.states[mode]

    def __contains__(self, mode) -> bool:
        return mode in self.states

    def __iter__(self):
        return iter(self.states)

    def __len__(self) -> int:
        return len(self.states)

    def keys(self):
        return self.states.keys()

    def items(self):
        return self.states.items()

    def values(self):
        return self.states.values()

    def __eq__(self, other) -> bool:
        other = other.states if isinstance(other, ScalingStateDict) else other
        return isinstance(other, dict) and other.keys() == self.states.keys() and all(
            other[m].keys() == sd.keys() and all(torch.equal(other[m][k], v) for k, v in sd.items())
            for m, sd in self.states.items())

    def __repr__(self) -> str:
        return f"ScalingStateDict({sorted(self.states)})"


torch.serialization.add_safe_globals([ScalingStateDict])


def _plain_values(w: QuantizedTensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A quantized weight's values as a plain tensor of ``dtype`` (default: its own): the
    rowwise representation (what the forward GEMM reads), the columnwise one where that is
    all the weight holds."""
    if w.is_meta:
        return torch.empty(w.shape, dtype=dtype or w.dtype, device="meta")
    usage = "rowwise" if w.has_usage("rowwise") else "columnwise"
    return w.dequantize(dtype, usage=usage).detach()


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors hold the same bits (NaNs included)."""
    if a.dtype != b.dtype or a.shape != b.shape or a.device != b.device:
        return False
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    as_int = ints[a.element_size()]
    return torch.equal(a.contiguous().view(as_int), b.contiguous().view(as_int))


def _holds(state: RecipeState | None, recipe) -> bool:
    """Whether ``state`` is a state for ``recipe``. Identity first: the same recipe object
    every step is the common case, and a dataclass comparison of nested recipes costs host
    time each call."""
    return state is not None and (state.recipe is recipe or state.recipe == recipe)


class _BackwardDone:
    """Counts a forward call's GEMM backwards and fires once all have run."""

    def __init__(self, n: int, fn) -> None:
        self.left, self.fn = n, fn

    def __call__(self) -> None:
        self.left -= 1
        if self.left == 0:
            self.fn()

    def skip(self) -> None:
        """One of the GEMMs will have no backward (nothing it read needs a gradient): the
        others' backwards fire without it; with none left to run, nothing fires."""
        self.left -= 1


class LowprecModule(CompiledCallMixin, nn.Module):
    """Base of the GEMM modules: one or more GEMMs with [input, weight, output] forward
    slots and [grad_output, grad_input] backward slots each."""

    module_type = "linear"

    def __init__(self, name: str | None, output_quantizer_role=None,
                 grad_input_quantizer_role=None) -> None:
        super().__init__()
        self.name = name or ""
        self.output_quantizer_role = output_quantizer_role
        self.grad_input_quantizer_role = grad_input_quantizer_role
        self._recipe_states: dict[str, RecipeState | None] = {"forward": None, "backward": None}
        # the delayed-scaling states, kept across forwards under other recipes
        self._delayed_states: dict[str, RecipeState | None] = {"forward": None, "backward": None}
        self._pending_extra_state: dict | None = None
        #: tensor parallelism (``modules.tensor_parallel.TensorParallel``), None on one rank
        self._tp = None

    def set_tensor_parallel_group(self, tp_group) -> None:
        """Give a tensor-parallel module its process group again (one unpickled in another
        process, where the group it was built with does not exist): a group of the same
        ranks."""
        tp = self.__dict__.get("_tp")
        if tp is None:
            raise ValueError(f"{type(self).__name__} was not built tensor-parallel")
        tp.set_group(tp_group)

    # ---- roles ------------------------------------------------------------------------
    def _gemm_names(self) -> list[str]:
        """Name of each GEMM (its roles' ``name``); one GEMM named after the module by default."""
        return [self.name]

    def _boundary(self, i: int, fwd: bool):
        """The boundary role of GEMM i's output (fwd) or grad-input (bwd) slot, or None."""
        n = len(self._gemm_names())
        if fwd:
            return self.output_quantizer_role if i == n - 1 else None
        return self.grad_input_quantizer_role if i == 0 else None

    def get_quantizer_roles(self, *, fwd: bool, num_quantizers: int | None = None) -> list:
        """Roles of every quantizer slot: forward [input, weight, output] per GEMM,
        backward [grad_output, grad_input] per GEMM."""
        roles = []
        for i, gname in enumerate(self._gemm_names()):
            boundary = self._boundary(i, fwd)
            roles += gemm_roles(self.module_type, gname, fwd=fwd,
                                output_role=boundary if fwd else None,
                                grad_input_role=None if fwd else boundary)
        return check_num_quantizers(self, fwd, num_quantizers, roles)

    # ---- recipe state -------------------------------------------------------------------
    def traced_plain_call(self, x: torch.Tensor, *weights: torch.Tensor) -> bool:
        """Whether a compiled call runs no recipe and traces as the torch ops of its high
        precision path: outside autocast and checkpointing, no tensor parallelism, plain
        input and weights of one dtype, no torch.autocast."""
        return (active_region() is None and current_frame() is None and self._tp is None
                and type(x) is torch.Tensor and torch_autocast_dtype(x) is None
                and all(type(w) in (torch.Tensor, nn.Parameter) and w.dtype == x.dtype
                        for w in weights))

    def traced_quantizers(self, x: torch.Tensor, *weights: torch.Tensor,
                          stateful_ok: bool = True):
        """(per-GEMM ``LinearQuantizers``, backward mode, delayed-scaling states or None)
        that a compiled call traces its GEMMs with (``lowprec.linear.traced``), or the
        reason (a string) it stays one opaque call.

        The quantizers come from the recipe's rule for this module's roles, as its state
        would hold them (``state.stateless_quantizers``), so that tracing them reads the
        quantizers' settings alone: same-shaped layers whose quantizers agree share one
        compiled code, whatever their names or states. Delayed scaling reads the state
        the module keeps (:meth:`traced_delayed_states`), which joins the autocast region's
        update; a module whose traced form does not take that state says so with
        ``stateful_ok=False``, before anything is joined."""
        region = active_region()
        if region is None:
            return "outside lowprec.autocast"
        if region.group is not None:
            return "an amax_reduction_group"
        if current_frame() is not None:
            # its recompute replays the eager call's record (lowprec.checkpoint)
            return "inside an eagerly run activation checkpoint"
        if self.output_quantizer_role is not None or self.grad_input_quantizer_role is not None:
            return "a quantized output or input gradient (boundary roles)"
        if self._tp is not None:
            return "tensor parallelism"
        if type(x) is not torch.Tensor or not x.is_floating_point():
            return f"an input of type {type(x).__name__}"
        for w in weights:
            if type(w) not in (torch.Tensor, nn.Parameter) and not isinstance(w, QuantizedTensor):
                return f"a weight of type {type(w).__name__}"
        recipe = region.recipe
        delayed = None
        if stateful(recipe):
            if not stateful_ok:
                return f"{type(self).__name__} under {type(recipe).__name__}"
            states = self.traced_delayed_states(recipe)
            if states is None:
                return "delayed scaling before its state exists, without gradients or checkpointed"
            held = self.__dict__["_recipe_states"]
            fq, bq = held["forward"].quantizers, held["backward"].quantizers
            delayed = (*states, recipe)
        else:
            fwd_roles, bwd_roles = self._roles()
            fq = stateless_quantizers(recipe, "forward", fwd_roles)
            bq = stateless_quantizers(recipe, "backward", bwd_roles)
        return self._linear_quantizers(fq, bq), recipe.backward_mode, delayed

    def _roles(self) -> tuple[list, list]:
        """The (forward, backward) roles, kept from construction and from each change of
        the attributes they are built from (reading them costs a compiled call no guard
        on those attributes)."""
        roles = self.__dict__.get("_role_lists")
        if roles is None:
            roles = self._cache_roles()
        return roles

    def _cache_roles(self) -> tuple[list, list]:
        roles = self.__dict__["_role_lists"] = (self.get_quantizer_roles(fwd=True),
                                                self.get_quantizer_roles(fwd=False))
        return roles

    def __init_subclass__(cls, **kwargs) -> None:
        # Each module's roles are built once its constructor has finished (the outermost
        # one: a subclass's constructor runs its parent's first).
        super().__init_subclass__(**kwargs)
        init = cls.__dict__.get("__init__")
        if init is None:
            return

        @functools.wraps(init)
        def __init__(self, *args, **kw):
            init(self, *args, **kw)
            if type(self).__init__ is __init__:
                self._cache_roles()

        cls.__init__ = __init__

    def traced_delayed_states(self, recipe):
        """(forward, backward ``DelayedScalingState``, module handle or None) a traced
        training call under ``recipe`` records into; the forward state joins the region's
        update as an eager forward's does (through the handle where the region was entered
        outside the compiled call). None where the call stays opaque: the states do not exist yet
        (the opaque call makes them, and the compiler traces the next call), gradients are
        off (an evaluation records where nothing reads), or a checkpoint is in play."""
        states = self.__dict__["_recipe_states"]
        fwd, bwd = states["forward"], states["backward"]
        if (not _holds(fwd, recipe) or not _holds(bwd, recipe) or fwd.delayed is None
                or bwd.delayed is None or not torch.is_grad_enabled()
                or current_frame() is not None):
            return None
        if active_region().traced:
            # the region lives in the graph: its exit's update is traced with it
            fwd.delayed.pending = True
            register_delayed_state(fwd.delayed)
            return fwd.delayed, bwd.delayed, None
        # a region around the compiled call: joined at run time (``lowprec::record_amaxes``)
        return fwd.delayed, bwd.delayed, self.__dict__[HANDLE_ATTR]

    def __setattr__(self, key, value) -> None:
        super().__setattr__(key, value)
        if key in _ROLE_ATTRS:
            # the roles are built from these: the states are rebuilt at the next forward
            # (checked here, once, rather than on every forward)
            states = self.__dict__.get("_recipe_states")
            if states is not None:
                for mode in states:
                    states[mode] = None
            if "_role_lists" in self.__dict__:
                self._cache_roles()

    def __getstate__(self):
        # The per-recipe caches are rebuilt at the next forward: they stay out of a pickle or
        # a copy, so a recipe that does not pickle (a CustomRecipe with a lambda) never makes
        # the module unpicklable. Delayed-scaling states are real state and travel.
        state = dict(super().__getstate__())
        state["_recipe_states"] = {m: (s if s is not None and s.delayed is not None else None)
                                   for m, s in state["_recipe_states"].items()}
        state.pop("_gemm_quantizers_of", None)
        return state

    def _state(self, mode: str, recipe, device) -> RecipeState:
        state = self._recipe_states[mode]
        if not _holds(state, recipe):
            state = self._new_state(mode, recipe, device)
        return state

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
        (``lowprec.checkpoint._Record``)."""
        if rec.active is None:  # it ran outside autocast
            return None
        recipe, fwd, bwd, group = rec.active
        # Only a reentrant recompute's graph runs backward (a non-reentrant one refills the
        # original graph's saved tensors, and the original call's callback fires).
        if not reentrant or bwd.delayed is None:
            return recipe, fwd, bwd, None
        if rec.callback is None:
            rec.callback = self._backward_callback(bwd, group, backward_calls)
        return recipe, fwd, bwd, rec.callback

    @staticmethod
    def _backward_callback(bwd: RecipeState, group, backward_calls: int) -> "_BackwardDone":
        """Pushes the backward amaxes into the history once ``backward_calls`` GEMM
        backwards of one forward call have run."""

        def bwd_update():
            bwd.delayed.pending = True
            bwd.delayed.update(group)

        return _BackwardDone(backward_calls, bwd_update)

    def gemm_quantizers(self, device) -> tuple[list[LinearQuantizers] | None, str, object]:
        """Per-GEMM quantizers under the active autocast (None outside), the backward mode,
        and a callback for the end of the backward pass."""
        active = self.active_states(device, backward_calls=len(self._gemm_names()))
        if active is None:
            return None, "default", None
        recipe, fwd, bwd, callback = active
        key = (fwd, bwd, self.output_quantizer_role, self.grad_input_quantizer_role)
        cached = self.__dict__.get("_gemm_quantizers_of")
        if cached is not None and all(a is b for a, b in zip(cached[0], key)):
            return cached[1], recipe.backward_mode, callback
        out = self._linear_quantizers(fwd.quantizers, bwd.quantizers)
        # Reused while the states are: the quantizers are the states' own objects, and
        # which slots a module quantizes does not change between calls.
        self._gemm_quantizers_of = (key, out)
        return out, recipe.backward_mode, callback

    def _linear_quantizers(self, fq: list, bq: list) -> list[LinearQuantizers]:
        """Per-GEMM quantizers from the forward slots ``fq`` and backward slots ``bq``."""
        # The GEMMs are counted from the slots, and the boundary slots asked for only where
        # a boundary role is set: both read the GEMMs' names, which a compiled call would
        # guard on (same-shaped layers would then not share code).
        boundary = (self.output_quantizer_role is not None
                    or self.grad_input_quantizer_role is not None)
        out = []
        for i in range(len(fq) // 3):
            f, b = fq[3 * i:3 * i + 3], bq[2 * i:2 * i + 2]
            out.append(LinearQuantizers(
                input=f[0], weight=f[1],
                output=f[2] if boundary and self._boundary(i, True) is not None else None,
                grad_output=b[0],
                grad_input=(b[1] if boundary and self._boundary(i, False) is not None
                            else None)))
        return out

    # ---- quantized weights ----------------------------------------------------------------
    def _weight_names(self) -> list[str]:
        return ["weight"]

    def _expert_weights(self) -> dict[str, range]:
        """The 3-D expert weights (parameter name -> the GEMM slots of its experts, one an
        expert), for FSDP2's quantized all-gathers; none here."""
        return {}

    def _link_quantized_weights(self) -> None:
        """Let each quantized weight re-quantize high-precision values copied into it
        (``param.copy_(hp)``, ``load_state_dict`` of a high-precision checkpoint) with this
        module's weight quantizer. Set again whenever the parameters are replaced."""
        if getattr(self, "_init_recipe", None) is None:
            return
        for i, pname in enumerate(self._weight_names()):
            w = getattr(self, pname, None)
            if isinstance(w, QuantizedTensor):
                setattr(w, REQUANTIZE_ATTR, _WeightSlot(self, i))

    def _apply(self, fn, recurse=True):
        # A module's .float()/.half() keeps its quantized weights quantized (only their
        # nominal dtype changes), where the tensor's own .float() dequantizes.
        def keep(t):
            with keep_quantized():
                return fn(t)

        # torch swaps a tensor subclass parameter's contents and __dict__ with the converted
        # tensor's: the user's attributes on it are put back, as a plain parameter keeps them.
        attrs = {name: user_attributes(p) for name, p in self._parameters.items()
                 if isinstance(p, QuantizedTensor)}
        out = super()._apply(keep, recurse)
        self._move_scaling_state()
        for name, kept in attrs.items():
            p = self._parameters.get(name)
            if p is not None:
                for k, v in kept.items():
                    if k not in p.__dict__:
                        setattr(p, k, v)
        self._link_quantized_weights()
        return out

    def _params_device(self) -> torch.device | None:
        """Where the module's own parameters are (None: it has none)."""
        p = next(self.parameters(recurse=False), None)
        return p.device if p is not None else None

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

    def _maybe_quantize_weights(self) -> None:
        """Under quantized_model_init, replace each weight by a quantized tensor (both usages)."""
        recipe = init_recipe()
        if recipe is None:
            return
        self._init_recipe = recipe
        for i, pname in enumerate(self._weight_names()):
            w = getattr(self, pname)
            q = self.weight_quantizer(i, w.device)
            setattr(self, pname, nn.Parameter(q.quantize(w.detach()),
                                              requires_grad=w.requires_grad))
        self._link_quantized_weights()

    def weight_quantizer(self, gemm_index: int, device=None, values: torch.Tensor | None = None):
        """The quantizer (both usages on) for GEMM ``gemm_index``'s weight under the
        quantized_model_init recipe; used to (re)quantize quantized weights.

        Under delayed scaling an empty amax history of the weight's slot is first seeded
        from ``values`` (default: the weight, when it is still high precision)."""
        recipe = getattr(self, "_init_recipe", None)
        if recipe is None:
            raise RuntimeError(f"{type(self).__name__} was not built under quantized_model_init")
        state = self._state("forward", recipe, device)
        q = state.quantizers[3 * gemm_index + 1]
        if state.delayed is not None:
            # Delayed scaling: seed this slot from the weight's own amax so the first
            # quantization is not done with the placeholder scale 1.
            w = values if values is not None else getattr(self, self._weight_names()[gemm_index])
            slot = 3 * gemm_index + 1
            if (not isinstance(w, QuantizedTensor) and w.device.type != "meta"
                    and state.delayed.amax_history[:, slot].abs().sum() == 0):
                q.quantize(w.detach())  # records the amax into this slot
                state.delayed.pending = True
                state.delayed.update()
        q.set_usage(rowwise=True, columnwise=True)
        return q

    # ---- initialization ---------------------------------------------------------------------
    def reset_parameters(self) -> None:
        """The constructor's initialization again, in place: each linear weight and bias as
        ``torch.nn.Linear`` draws them (a fused norm's weight and bias first: one, or zero
        with ``zero_centered_gamma``, and zero), in the constructor's order (the same draws
        after the same seed). Quantized weights are re-quantized from the fresh values with every
        usage they hold, and scaling state starts afresh. This completes meta-device init:
        ``device="meta"`` → ``to_empty(device=...)`` → ``reset_parameters()``."""
        kept = {m: s.recipe for m, s in self._kept_delayed().items() if s is not None}
        self._recipe_states = {"forward": None, "backward": None}
        self._delayed_states = {"forward": None, "backward": None}
        self.__dict__.pop("_gemm_quantizers_of", None)
        for mode, recipe in kept.items():  # fresh states of the same sizes (init_scaling_state)
            self._state(mode, recipe, self._params_device())
        with torch.no_grad():
            for i, wname in enumerate(self._weight_names()):
                w = getattr(self, wname)
                b = getattr(self, wname.replace("weight", "bias"), None)
                fan_in = self.__dict__.get("_fan_in", {}).get(wname)
                if not isinstance(w, QuantizedTensor):
                    init_linear_params(w, b, fan_in)
                    continue
                fresh = torch.empty(w.shape, dtype=w.dtype, device=w.device)
                init_linear_params(fresh, b, fan_in)
                self.weight_quantizer(i, w.device, values=fresh).update_quantized(fresh, w)

    # ---- extra state (delayed scaling) ----------------------------------------------------
    def scaling_state(self) -> ScalingStateDict:
        """The delayed-scaling state (scales, amax histories, amaxes recorded since the last
        update) per mode, as the module holds it; empty before its first delayed-scaling
        forward."""
        return ScalingStateDict({mode: state.delayed.state_dict()
                                 for mode, state in self._kept_delayed().items()
                                 if state is not None})

    def get_extra_state(self) -> torch.Tensor:
        # a tensor, so that tensor-only formats (safetensors, save_pretrained) take it; with
        # the exact bytes of the quantized weights (see _save_to_state_dict)
        return extra_state.encode(self.scaling_state().states, self._held_quantized_weights())

    def set_extra_state(self, state) -> None:
        if isinstance(state, torch.Tensor):
            state = extra_state.decode(state)
        elif isinstance(state, ScalingStateDict):
            state = state.states
        if not state:
            return
        pending = {}
        for mode, sd in state.items():
            current = self._kept_delayed().get(mode)
            # a state on the meta device cannot hold values: taken up once it has a device
            if current is not None and not current.delayed.scale.is_meta:
                current.delayed.load_state_dict(sd)
            else:
                pending[mode] = sd
        self._pending_extra_state = pending or None

    # ---- quantized weights in state dicts ---------------------------------------------------
    def _held_quantized_weights(self) -> dict:
        """``{param name: quantized weight}`` of this module's weights that are quantized."""
        return {pname: w for pname in self._weight_names()
                if isinstance(w := self._parameters.get(pname), QuantizedTensor)}

    def _save_to_state_dict(self, destination, prefix, keep_vars) -> None:
        """A quantized weight enters the state dict as plain high-precision values: its
        dequantized (rowwise) values in its dtype, what the module computes with, so that
        tensor-only formats (safetensors, ``save_pretrained``, Trainer checkpoints) save it,
        an unconverted model (``from_pretrained``) loads it, and ``load_state_dict``
        re-quantizes it. The quantized bytes travel in ``_extra_state``: loading the state
        dict into a module of the same format restores them exactly
        (``_exact_saved_weights``). ``keep_vars=True`` keeps the quantized parameters."""
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if keep_vars:
            return
        for pname, w in self._held_quantized_weights().items():
            if prefix + pname in destination:
                destination[prefix + pname] = _plain_values(w)

    def _exact_saved_weights(self, state_dict, prefix: str) -> dict:
        """``{key: quantized tensor}``: the quantized weights this state dict's
        ``_extra_state`` holds the bytes of, for each weight whose high-precision entry is
        still exactly those bytes' dequantized values (the state dict as saved, perhaps in
        another dtype) and whose layout (format, shape, usages) is this module's weight's.
        Another entry (an edited weight, a checkpoint of another recipe or of a plain model)
        is re-quantized instead."""
        extra = state_dict.get(prefix + "_extra_state")
        held = self._held_quantized_weights()
        if not held or not isinstance(extra, torch.Tensor) or extra.dtype != torch.uint8:
            return {}
        saved = extra_state.decode_weights(extra)
        out = {}
        for pname, w in held.items():
            hp, entry = state_dict.get(prefix + pname), saved.get(pname)
            # plain tensors only (a quantized one is copied as it is, a DTensor left to torch)
            if (entry is None or type(hp) not in (torch.Tensor, nn.Parameter) or hp.is_meta
                    or not hp.is_floating_point() or hp.shape != w.shape):
                continue
            # compared where the weight lives (where it was saved from, as a rule), so that
            # a device's own dequantize reproduces the saved values
            device = hp.device if w.is_meta else w.device
            exact = extra_state.weight_from_bytes(entry, w, device)
            if exact is None:
                continue
            if _same_bits(_plain_values(exact, hp.dtype), hp.detach().to(device)):
                # on the entry's device, where assign=True puts it
                out[prefix + pname] = (exact if hp.device == device else
                                       extra_state.weight_from_bytes(entry, w, hp.device))
        return out

    def _quantize_assigned_weights(self, state_dict, prefix: str, local_metadata,
                                   exact: dict) -> dict:
        """``load_state_dict(assign=True)``: a high-precision tensor for a quantized weight is
        assigned quantized by the weight quantizer, with the usages the weight holds (else
        the module would silently keep a high-precision weight), or as the exact quantized
        weight the state dict saved (``exact``). Without assign, the exact weights are
        copied in (``copy_`` of quantized tensors copies their bytes). Rewrites those
        entries of ``state_dict``; returns the originals to put back."""
        originals = {}
        for key, qt in exact.items():
            originals[key] = state_dict[key]
            state_dict[key] = qt
        if (not local_metadata.get("assign_to_params_buffers", False)
                or getattr(self, "_init_recipe", None) is None):
            return originals
        for i, pname in enumerate(self._weight_names()):
            w, key = self._parameters.get(pname), prefix + pname
            hp = state_dict.get(key)
            # a wrong shape is left to torch, which reports it as a size mismatch
            if (isinstance(w, QuantizedTensor) and isinstance(hp, torch.Tensor)
                    and not isinstance(hp, QuantizedTensor) and hp.shape == w.shape):
                q = self.weight_quantizer(i, hp.device)
                with q.usages(rowwise=w.has_usage("rowwise"),
                              columnwise=w.has_usage("columnwise")):
                    state_dict[key] = q.quantize(hp.detach().to(w.dtype))
                originals[key] = hp
        return originals

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        # A high-precision tensor for a quantized weight: the exact bytes _extra_state saved
        # with it where they are its values; else copy_ re-quantizes it in place
        # (_WeightSlot), and assign=True assigns it quantized.
        exact = self._exact_saved_weights(state_dict, prefix)
        originals = self._quantize_assigned_weights(state_dict, prefix, local_metadata, exact)
        try:
            super()._load_from_state_dict(state_dict, prefix, local_metadata, strict,
                                          missing_keys, unexpected_keys, error_msgs)
        finally:
            state_dict.update(originals)
        # A checkpoint from before conversion (torch.nn.Linear) has no scaling state; starting
        # it fresh is what loading such a checkpoint means, so it is not a missing key.
        key = prefix + "_extra_state"
        if key in missing_keys:
            missing_keys.remove(key)
        self._link_quantized_weights()  # load_state_dict(assign=True) swaps parameters in

    def _check_input_dtype(self, x: torch.Tensor) -> None:
        if not x.is_floating_point():
            raise TypeError(f"{type(self).__name__} expects a floating-point input, got {x.dtype}")
