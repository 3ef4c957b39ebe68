"""``LowprecModule``, the base of every GEMM module: its composition, its construction,
and the plumbing of an ``nn.Module`` (attributes, pickling, device moves, re-initialization,
input checks). Its roles (``roles``), the quantizers a call reads (``quantizers``), the
recipe state it keeps (``scaling``), its quantized weights (``quantized_weights``), its extra
state (``extra_state``) and its parameters (``params``) have files of their own."""

from __future__ import annotations

import functools

import torch
from torch import nn

from ..compile import CompiledCallMixin
from ..formats import QuantizedTensor, keep_quantized, user_attributes
from ..recipe import RecipeState
from .extra_state import ExtraStateMixin, ScalingStateDict
from .params import init_linear_params
from .quantized_weights import QuantizedWeightsMixin
from .quantizers import CallQuantizersMixin
from .roles import _ROLE_ATTRS, RolesMixin
from .scaling import ScalingStateMixin

# ScalingStateDict is pickled under this module's path (see extra_state.py)
__all__ = ["LowprecModule", "ScalingStateDict"]


class LowprecModule(CompiledCallMixin, RolesMixin, CallQuantizersMixin, ExtraStateMixin,
                    ScalingStateMixin, QuantizedWeightsMixin, nn.Module):
    """Base of the GEMM modules: one or more GEMMs with [input, weight, output] forward
    slots and [grad_output, grad_input] backward slots each."""

    module_type = "linear"

    # Held by the class itself, not only inherited from the mixins: an op that is also a
    # LowprecModule (``ops.basic.BasicLinear``) has BasicOperation's get_quantizer_roles
    # ahead of them in its MRO, and ``lowprec.debug`` swaps gemm_quantizers on this class.
    get_quantizer_roles = RolesMixin.get_quantizer_roles
    gemm_quantizers = CallQuantizersMixin.gemm_quantizers

    def __init__(self, name: str | None, output_quantizer_role=None,
                 grad_input_quantizer_role=None) -> None:
        super().__init__()
        if name is not None and not isinstance(name, str):
            raise TypeError(f"{type(self).__name__}: name must be a str or None, got {name!r}")
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

    def _check_input_dtype(self, x: torch.Tensor, features: int | None = None) -> None:
        """A floating-point input with ``features`` in its last dimension (where given: the
        GEMM modules, whose error then names both sizes, in and outside autocast)."""
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{type(self).__name__} expects a tensor input, got "
                            f"{type(x).__name__}")
        if not x.is_floating_point():
            raise TypeError(f"{type(self).__name__} expects a floating-point input, got {x.dtype}")
        if features is not None and (x.dim() == 0 or x.shape[-1] != features):
            got = x.shape[-1] if x.dim() else "no"
            raise ValueError(f"{type(self).__name__} input has {got} features (shape "
                             f"{tuple(x.shape)}), the module expects {features}")
