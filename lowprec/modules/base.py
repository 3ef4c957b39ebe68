"""The base of every GEMM module: its roles, how a compiled call gets its quantizers,
initialization and extra state. The recipe state it keeps (``scaling``), its quantized
weights (``quantized_weights``) and its parameters (``params``) have files of their own."""

from __future__ import annotations

import functools
import warnings

import torch
from torch import nn

from ..autocast import active_region, torch_autocast_dtype
from ..checkpoint import current_frame
from ..compiled_call import CompiledCallMixin
from ..formats.base import QuantizedTensor, keep_quantized, user_attributes
from ..linear.function import LinearQuantizers
from ..roles import check_num_quantizers, gemm_roles
from ..state import RecipeState, stateful, stateless_quantizers
from . import extra_state
from .params import init_linear_params
from .quantized_weights import QuantizedWeightsMixin
from .scaling import ScalingStateMixin

#: Attributes the roles are built from (``get_quantizer_roles``)
_ROLE_ATTRS = frozenset({"name", "output_quantizer_role", "grad_input_quantizer_role"})

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


class LowprecModule(CompiledCallMixin, ScalingStateMixin, QuantizedWeightsMixin, nn.Module):
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
        self._register_live()

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
            return self._linear_quantizers(fq, bq), recipe.backward_mode, delayed
        # only the slots a GEMM without boundary roles reads: its input, weight and dY
        # (each quantizer built costs a compiled call tracing time)
        fwd_roles, bwd_roles = self._roles()
        fq = stateless_quantizers(recipe, "forward", fwd_roles[0::3] + fwd_roles[1::3])
        bq = stateless_quantizers(recipe, "backward", bwd_roles[0::2])
        n = len(bq)
        return ([LinearQuantizers(input=fq[i], weight=fq[n + i], output=None,
                                  grad_output=bq[i], grad_input=None) for i in range(n)],
                recipe.backward_mode, None)

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

    def gemm_quantizers(self, device) -> tuple[list[LinearQuantizers] | None, str, object]:
        """Per-GEMM quantizers under the active autocast (None outside), the backward mode,
        and a callback for the end of the backward pass."""
        active = self.active_states(device, backward_calls=len(self._gemm_names()))
        if active is None:
            return None, "default", None
        recipe, fwd, bwd, callback = active
        key = (fwd, bwd, self.output_quantizer_role, self.grad_input_quantizer_role)
        kept = self.__dict__.get("_gemm_quantizers_of")
        if kept is None:
            kept = self._gemm_quantizers_of = {}
        cached = kept.get(id(fwd))
        if cached is not None and all(a is b for a, b in zip(cached[0], key)):
            return cached[1], recipe.backward_mode, callback
        out = self._linear_quantizers(fwd.quantizers, bwd.quantizers)
        self._check_quantized_weights(recipe, out)
        # Reused while the states are: the quantizers are the states' own objects, and
        # which slots a module quantizes does not change between calls. One entry a
        # forward state: a checkpointed delayed-scaling call alternates between the state
        # and its replay twin.
        if len(kept) >= 4:
            kept.clear()
        kept[id(fwd)] = (key, out)
        return out, recipe.backward_mode, callback

    def _check_quantized_weights(self, recipe, gemms: list[LinearQuantizers]) -> None:
        """Refuse a weight quantized in another format than ``recipe``'s weight quantizer
        makes (``quantized_model_init`` under one recipe, autocast under another): its
        GEMMs would read a format the recipe never asked for. Under a recipe of the same
        format but other settings, warn: the weights stay quantized, and are re-quantized
        after each optimizer step, under the recipe they were made with."""
        quantized = False
        for name, q in zip(self._weight_names(), gemms):
            w = getattr(self, name, None)
            if not isinstance(w, QuantizedTensor) or q.weight is None:
                continue
            quantized = True
            made = q.weight._tensor_class()
            if type(w) is not made:
                raise RuntimeError(
                    f"Recipe mismatch for {type(self).__name__} {self.name!r}: its {name} is a "
                    f"{type(w).__name__}, but {type(recipe).__name__}'s weight quantizer "
                    f"({type(q.weight).__name__}) makes {made.__name__}; run it under the recipe "
                    f"its weights were quantized with, or quantize them under this one "
                    f"(lowprec.quantized_model_init(recipe=...))")
        init = getattr(self, "_init_recipe", None)
        if quantized and init is not None and init is not recipe and init != recipe:
            warnings.warn(
                f"Quantizer is being updated, this may affect model behavior: "
                f"{type(self).__name__} {self.name!r} runs under {recipe!r}, its weights stay "
                f"quantized (and are re-quantized after each optimizer step) under {init!r}, "
                f"the recipe of their quantized_model_init", UserWarning, stacklevel=4)

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

    def __setstate__(self, state):
        super().__setstate__(state)
        self._register_live()

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

    def _check_input_dtype(self, x: torch.Tensor, features: int | None = None) -> None:
        """A floating-point input with ``features`` in its last dimension (where given: the
        GEMM modules, whose error then names both sizes, in and outside autocast)."""
        if not x.is_floating_point():
            raise TypeError(f"{type(self).__name__} expects a floating-point input, got {x.dtype}")
        if features is not None and (x.dim() == 0 or x.shape[-1] != features):
            got = x.shape[-1] if x.dim() else "no"
            raise ValueError(f"{type(self).__name__} input has {got} features (shape "
                             f"{tuple(x.shape)}), the module expects {features}")
