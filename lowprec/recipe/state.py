"""Recipe state: one quantizer per role slot, and delayed-scaling history.

``RecipeState.create(recipe, mode, roles)`` builds the quantizers a module
uses for one direction (``mode`` is ``"forward"`` or ``"backward"``).
Built-in recipes pick per-role settings here; ``CustomRecipe`` asks its
``qfactory``. Delayed scaling keeps its scales and amax history in the state
and hands the quantizers views into them.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from ..formats import (
    FP8_MAX,
    Float8BlockQuantizer,
    Float8CurrentScalingQuantizer,
    Float8Quantizer,
    MXFP8Quantizer,
    NVFP4Quantizer,
    Quantizer,
)
from ..formats.float8 import FirstScale, delayed_scale, inv_margin
from ..kernels import use_kernels
from .handles import new_handle, resolve
from .recipes import (
    CustomRecipe,
    DelayedScaling,
    Float8BlockScaling,
    Float8CurrentScaling,
    MXFP8BlockScaling,
    NVFP4BlockScaling,
    Recipe,
)
from .roles import BACKWARD_TENSOR_TYPES, QuantizerRole, slot_tensor_type

MODES = ("forward", "backward")


def _is_grad(role: QuantizerRole | None, mode: str, index: int) -> bool:
    return slot_tensor_type(role, mode, index) in BACKWARD_TENSOR_TYPES


def builtin_quantizer(recipe: Recipe, role: QuantizerRole | None, mode: str = "forward",
                      index: int = 0) -> Quantizer:
    """The quantizer a built-in recipe (delayed scaling aside: its quantizers share the
    state's scales) gives slot ``index`` of a ``mode`` recipe state whose role is ``role``.

    Every rule reads the slot's tensor type (:func:`~lowprec.recipe.roles.slot_tensor_type`:
    the role's own, or for a ``None`` or unknown one the slot's place in the layout):
    gradients (``grad_output``, ``grad_input``) take the recipe's backward settings,
    ``weight`` its weight settings, and everything else (``input``, ``output``) its input
    settings, as Transformer Engine's recipe states pick them. MXFP8's 2D weight blocks go
    to a forward slot whose role names a weight, never to a fallback."""
    ttype = slot_tensor_type(role, mode, index)
    grad = ttype in BACKWARD_TENSOR_TYPES
    if isinstance(recipe, Float8CurrentScaling):
        fmt = recipe.fp8_format
        return Float8CurrentScalingQuantizer(fmt.bwd_dtype if grad else fmt.fwd_dtype,
                                             force_pow_2_scales=recipe.use_power_2_scales)
    if isinstance(recipe, Float8BlockScaling):
        fmt = recipe.fp8_format
        dim = (recipe.w_block_scaling_dim if ttype == "weight" else
               recipe.grad_block_scaling_dim if grad else recipe.x_block_scaling_dim)
        return Float8BlockQuantizer(fmt.bwd_dtype if grad else fmt.fwd_dtype, block_scaling_dim=dim,
                                    force_pow_2_scales=True)
    if isinstance(recipe, MXFP8BlockScaling):
        fmt = recipe.fp8_format
        two_d = (recipe.enable_2d_quantization and mode == "forward" and role is not None
                 and role.tensor_type == "weight")
        return MXFP8Quantizer(fmt.bwd_dtype if grad else fmt.fwd_dtype,
                              with_2d_quantization=two_d)
    if isinstance(recipe, NVFP4BlockScaling):
        if grad:
            return NVFP4Quantizer(with_rht=not recipe.disable_rht,
                                  stochastic_rounding=not recipe.disable_stochastic_rounding)
        if ttype == "weight":
            return NVFP4Quantizer(with_2d_quantization=not recipe.disable_2d_quantization)
        return NVFP4Quantizer(with_rht=not recipe.disable_rht)
    raise TypeError(f"builtin_quantizer: no per-role rule for {type(recipe).__name__}; "
                    f"accepted: Float8CurrentScaling, Float8BlockScaling, MXFP8BlockScaling, "
                    f"NVFP4BlockScaling")


def check_factory_result(q, role: QuantizerRole | None) -> Quantizer:
    """``q`` if a CustomRecipe factory may return it for ``role``; else ValueError (None) or
    TypeError (not a lowprec Quantizer), naming the role."""
    if q is None:
        raise ValueError(f"CustomRecipe qfactory returned None for role {role!r}; return "
                         f"IdentityQuantizer() to keep this tensor in high precision")
    if not isinstance(q, Quantizer):
        raise TypeError(f"CustomRecipe qfactory returned {type(q).__name__} {q!r:.60} for role "
                        f"{role!r}; it must return a lowprec Quantizer")
    return q


def _factory_quantizer(recipe: CustomRecipe, role: QuantizerRole | None) -> Quantizer:
    return check_factory_result(recipe.qfactory(role), role)


def amax_from_callable(algo: Callable, history: torch.Tensor) -> torch.Tensor:
    """``algo(history)`` for a callable ``DelayedScaling.amax_compute_algo``, checked and
    returned as an fp32 tensor of shape (n,) on ``history``'s device.

    ``history`` is the (history_len, n) fp32 amax history, newest row first; ``algo`` gets a
    copy of it and must return a floating-point torch.Tensor holding n amaxes, one per slot
    (shape (n,); any shape holding n elements, such as a keepdim reduction's (1, n), is
    read as (n,)). Anything else raises TypeError (not a floating-point tensor) or
    ValueError (another number of elements) naming the option, the expected shape and
    dtype, and what came back.
    """
    n = history.shape[1]
    expected = (f"a floating-point torch.Tensor of shape ({n},), one amax per slot, from the "
                f"({history.shape[0]}, {n}) history")
    out = algo(history.clone())
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"DelayedScaling amax_compute_algo {algo!r} returned "
                        f"{type(out).__name__} {out!r:.60}; it must return {expected}")
    if not out.is_floating_point():
        raise TypeError(f"DelayedScaling amax_compute_algo {algo!r} returned a {out.dtype} "
                        f"tensor; it must return {expected}")
    if out.numel() != n:
        raise ValueError(f"DelayedScaling amax_compute_algo {algo!r} returned shape "
                         f"{tuple(out.shape)}; it must return {expected}")
    return out.detach().to(device=history.device, dtype=torch.float32).reshape(n)


def push_amaxes(history: torch.Tensor, amax_current: torch.Tensor, scale: torch.Tensor,
                fp8_max: torch.Tensor, current: torch.Tensor, algo, margin: float) -> None:
    """One delayed-scaling update in place: roll ``history``, push ``current`` (the recorded
    amaxes, perhaps all-reduced), recompute ``scale`` per ``algo``, zero ``amax_current``.
    One kernel launch (an op a traced backward holds as it is) where the kernel computes
    ``algo``, else :func:`pushed_amaxes`: torch ops, with the kernel's bits."""
    if use_kernels(scale) and _kernel_update_fits(history, algo):
        if current is not amax_current:
            amax_current.copy_(current)
        from ..formats.float8 import fp8_delayed_update
        fp8_delayed_update(history, amax_current, scale, fp8_max, inv_margin(margin),
                           algo == "most_recent")
        return
    new_history, new_scale = pushed_amaxes(history, scale, fp8_max, current, algo, margin)
    history.copy_(new_history)
    scale.copy_(new_scale)
    amax_current.zero_()


def pushed_amaxes(history: torch.Tensor, scale: torch.Tensor, fp8_max: torch.Tensor,
                  current: torch.Tensor, algo, margin: float
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(history, scale) after one delayed-scaling update, out of place, in torch ops a
    compiler traces: ``history`` rolled down a row with ``current`` on top, and the scale
    ``fp8_max / amax / 2**margin`` (at most the fp32 max) where the ``algo`` amax is finite
    and > 0, else the old one. The update kernel's bits: the quotient is correctly rounded
    (in fp64, then fp32, as ``casting.scale_from_amax`` does: inductor's fp32 division is
    approximate), and on CUDA the margin multiplies by its fp32 reciprocal, as torch's CUDA
    division by a scalar does."""
    rolled = torch.cat([current.reshape(1, -1).to(history.dtype), history[:-1]])
    if algo == "max":
        amax = rolled.amax(dim=0)
        # amax() ignores NaN on some backends; a NaN in the history must keep the scale. The
        # NaN from full_like: a scalar NaN compiles to other bits than eager's.
        amax = torch.where(torch.isnan(rolled).any(dim=0), torch.full_like(amax, float("nan")),
                           amax)
    elif algo == "most_recent":
        amax = rolled[0]
    else:
        amax = amax_from_callable(algo, rolled)
    new = delayed_scale(fp8_max, amax, margin)
    ok = torch.isfinite(amax) & (amax > 0)
    return rolled, torch.where(ok, new, scale)


def _kernel_update_fits(history: torch.Tensor, algo) -> bool:
    """Whether the update kernel computes ``algo`` on ``history``."""
    from ..formats.float8 import UPDATE_MAX_HISTORY
    # A state's history is made contiguous and stays so (the update op checks when it
    # runs). A traced backward does not ask: dynamo cannot answer ``is_contiguous`` of a
    # tensor while it speculates an autograd.Function's backward, and its retry leaves
    # torch.autocast's state changed (torch 2.11).
    return (algo in ("max", "most_recent") and history.shape[0] <= UPDATE_MAX_HISTORY
            and (torch.compiler.is_compiling() or history.is_contiguous()))


def note_seeded(states) -> None:
    """After an update of ``states``: clear the ``unseeded`` note of each slot an eager
    quantize used (``FirstScale.used``) that holds a scale now. One read of those scales
    per device, a sync, made only while such a slot may be without one: in practice after
    the first step. Not while a compiler traces or a CUDA graph captures (the notes then
    stay set: eager quantizes keep checking, which costs time, never bits)."""
    slots = [(s, i) for s in states if s.firsts is not None and not s.scale.is_meta
             for i, first in enumerate(s.firsts) if first.unseeded and first.used]
    if not slots or torch.compiler.is_compiling() or (
            torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()):
        return
    by_device: dict = {}
    for s, i in slots:
        by_device.setdefault(s.scale.device, []).append((s, i))
    for group in by_device.values():
        zero = torch.stack([s.scale[i] == 0 for s, i in group]).tolist()
        for (s, i), still in zip(group, zero):
            s.firsts[i].unseeded, s.firsts[i].used = still, False


def state_of_key(key: torch.Tensor) -> "DelayedScalingState":
    """The live state whose ``key`` is ``key``."""
    return resolve(key, "delayed-scaling state")


class DelayedScalingState:
    """Scales and amax history for one direction of one module (delayed scaling).

    ``scale`` is (n,), ``amax_history`` (history_len, n) with the newest row
    first; quantizers record into ``amax_current`` (n,) the max over every
    call since the last :meth:`update`, which pushes it into the history.
    Quantizers of calls that must not move the state (grad disabled: eval,
    ``no_grad``, ``inference_mode``) record into ``amax_scratch`` instead,
    which nothing reads.

    With the recipe's ``first_scale="current"`` a slot starts at scale 0, "no scale yet":
    its quantizes take the scale of the tensor's own amax until an update finds an amax
    for it (``formats.float8.FirstScale``); with ``"one"`` it starts at 1, as Transformer
    Engine's does.
    """

    def __init__(self, recipe: DelayedScaling, n: int, fp8_dtypes: Sequence[torch.dtype],
                 device: torch.device) -> None:
        self.recipe = recipe
        #: the formats' maxima, kept on the host too (a state on the meta device has none)
        self.fp8_maxima = tuple(float(FP8_MAX[d]) for d in fp8_dtypes)
        self.fp8_max = torch.tensor(self.fp8_maxima, dtype=torch.float32, device=device)
        #: each slot's ``FirstScale`` (``first_scale="current"``), else None
        self.firsts = ([FirstScale(recipe.margin) for _ in range(n)]
                       if recipe.first_scale == "current" else None)
        self.scale = torch.full((n,), self._start_scale, dtype=torch.float32, device=device)
        self.amax_history = torch.zeros(recipe.amax_history_len, n, dtype=torch.float32,
                                        device=device)
        self.amax_current = torch.zeros(n, dtype=torch.float32, device=device)
        self.amax_scratch = torch.zeros(n, dtype=torch.float32, device=device)
        self.pending = False
        self._register()

    def _register(self) -> None:
        #: the handle a compiled graph names the state by (``state_of_key``), and its value:
        #: handles are numbered in creation order, which batched updates run in (alike on
        #: every rank)
        self.key = new_handle(self)
        self.serial = int(self.key)

    @property
    def _start_scale(self) -> float:
        return 0.0 if self.firsts is not None else 1.0

    def __getstate__(self):
        # A copy (deepcopy, pickling, perhaps loaded onto another device) works out its own
        # batch key (lowprec.recipe.state_batch).
        state = dict(self.__dict__)
        for name in ("_batch_key", "serial", "key"):  # a copy is another state
            state.pop(name, None)
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._register()

    def move_to(self, device: torch.device) -> None:
        """Put the state's tensors on ``device`` (values kept; a state on the meta device,
        which has none, starts afresh: its first scales, an empty history)."""
        fresh = self.scale.is_meta
        if fresh:
            self._may_be_unseeded()
        self.fp8_max = (torch.tensor(self.fp8_maxima, dtype=torch.float32, device=device)
                        if fresh else self.fp8_max.to(device))
        for name, start in (("scale", self._start_scale), ("amax_history", 0.0),
                            ("amax_current", 0.0), ("amax_scratch", 0.0)):
            t = getattr(self, name)
            setattr(self, name, torch.full_like(t, start, device=device) if fresh
                    else t.to(device))
        self.__dict__.pop("_batch_key", None)

    def quantizers(self, fp8_dtypes: Sequence[torch.dtype], *, record: bool = True,
                   scale: torch.Tensor | None = None) -> list[Float8Quantizer]:
        """One quantizer per slot with this state's scale (or ``scale``, a copy of it that
        later updates do not move); ``record=False``: its amaxes go to the scratch slots
        and never reach the history."""
        amax = self.amax_current if record else self.amax_scratch
        scale = self.scale if scale is None else scale
        made = [_state_owned(Float8Quantizer(scale[i:i + 1], amax[i:i + 1], dt))
                for i, dt in enumerate(fp8_dtypes)]
        for i, q in enumerate(made):
            q.first = None if self.firsts is None else self.firsts[i]
        return made

    def adopt(self, other: "DelayedScalingState") -> None:
        """Take ``other``'s scales, history and recorded amaxes when they fit this state
        (same slots, formats and history length; else nothing): a module's delayed-scaling
        state for another DelayedScaling recipe or other roles goes on from where it was."""
        if (other.amax_history.shape != self.amax_history.shape
                or not torch.equal(other.fp8_max.cpu(), self.fp8_max.cpu())):
            return
        with torch.no_grad():
            self.scale.copy_(other.scale)
            self.amax_history.copy_(other.amax_history)
            self.amax_current.copy_(other.amax_current)
        self.pending = other.pending
        self._may_be_unseeded()

    def update(self, group=None) -> None:
        """Push the recorded amaxes into the history and recompute the scales."""
        if not self.pending:
            return
        self.pending = False
        current = self.amax_current
        if group is not None and self.recipe.reduce_amax:
            current = current.clone()
            torch.distributed.all_reduce(current, op=torch.distributed.ReduceOp.MAX, group=group)
        push_amaxes(self.amax_history, self.amax_current, self.scale, self.fp8_max, current,
                    self.recipe.amax_compute_algo, self.recipe.margin)
        note_seeded([self])

    def _may_be_unseeded(self) -> None:
        """Scales came from elsewhere (a checkpoint, another state, a fresh start): eager
        quantizes check for slots without a scale again until the next update."""
        for first in self.firsts or ():
            first.unseeded = True

    def _update_with_kernel(self, algo) -> bool:
        return use_kernels(self.scale) and self._kernel_update_fits(algo)

    def _kernel_update_fits(self, algo) -> bool:
        return _kernel_update_fits(self.amax_history, algo)

    def _inv_margin(self) -> float:
        return inv_margin(self.recipe.margin)

    def state_dict(self) -> dict:
        """Scales, history and the amaxes recorded since the last update (a quantized
        weight's re-quantize after an optimizer step records one that the next update
        reads): a resumed run goes on bit for bit."""
        return {"scale": self.scale.clone(), "amax_history": self.amax_history.clone(),
                "amax_current": self.amax_current.clone()}

    def load_state_dict(self, state: dict) -> None:
        if state["amax_history"].shape != self.amax_history.shape:
            raise ValueError(f"delayed-scaling state has history shape "
                             f"{tuple(state['amax_history'].shape)}, the recipe wants "
                             f"{tuple(self.amax_history.shape)}")
        with torch.no_grad():
            self.scale.copy_(state["scale"])
            self.amax_history.copy_(state["amax_history"])
            # checkpoints written before the recorded amaxes were saved have none
            current = state.get("amax_current")
            if current is not None:
                self.amax_current.copy_(current)
            else:
                self.amax_current.zero_()
        self._may_be_unseeded()


def stateful(recipe: Recipe) -> bool:
    """Whether ``recipe``'s quantizers share state a module keeps (delayed scaling)."""
    return isinstance(recipe, DelayedScaling)


def reads_role_names(recipe: Recipe) -> bool:
    """Whether a recipe's quantizer for a role may depend on the role's name or GEMM (a
    ``CustomRecipe`` factory); the built-in rules read a role's tensor type and direction
    only, so every GEMM of a module gets the same quantizers."""
    return isinstance(recipe, CustomRecipe)


def stateless_quantizers(recipe: Recipe, mode: str, roles) -> list[Quantizer]:
    """One quantizer per role of a recipe without state (every recipe but delayed
    scaling): the built-in rule or the ``CustomRecipe`` factory. A compiled call traces
    this to find its quantizers' traced forms (``lowprec.linear.traced``), reading of
    each role only what the rule reads."""
    if isinstance(recipe, CustomRecipe):
        return [_factory_quantizer(recipe, r) for r in roles]
    return [builtin_quantizer(recipe, r, mode, i) for i, r in enumerate(roles)]


def delayed_stand_ins(head: tuple) -> list[Quantizer]:
    """Delayed-scaling quantizers over scratch scales and amaxes of their own, for ``head``:
    the FP8 dtypes of the input, weight and dY, then each one's seeding margin
    (``Float8Quantizer.graph_first_margin``) or None. What a compiled call decides its plan
    from (a delayed form reads the dtype and the margin; the module's scales and amaxes
    come with the call)."""
    *fp8_dtypes, margins = head
    made = [_state_owned(Float8Quantizer(torch.ones(1), torch.zeros(1), d)) for d in fp8_dtypes]
    for q, margin in zip(made, margins):
        q.first = None if margin is None else FirstScale(margin)  # unseeded: seeds
    return made


def _state_owned(q: Float8Quantizer) -> Float8Quantizer:
    q.state_owned = True
    return q


class RecipeState:
    """Quantizers for one direction of one module under one recipe."""

    def __init__(self, recipe: Recipe, mode: str, roles: Sequence[QuantizerRole | None],
                 quantizers: list[Quantizer], delayed: DelayedScalingState | None) -> None:
        self.recipe = recipe
        self.mode = mode
        self.roles = list(roles)
        self.quantizers = quantizers
        self.delayed = delayed
        self._make_eval_twin()

    def _make_eval_twin(self) -> None:
        # What a forward that must not move the state uses (grad disabled): the same
        # quantizers, except that delayed scaling's record into the scratch amaxes.
        self.eval_twin = self if self.delayed is None else self._scratch_twin()

    def _scratch_twin(self) -> "RecipeState":
        """This state with delayed scaling's quantizers recording into the scratch amaxes
        (the same scales, which a replay twin points elsewhere)."""
        twin = object.__new__(RecipeState)
        twin.__dict__.update(self.__dict__)
        twin.quantizers = self.delayed.quantizers([q.fp8_dtype for q in self.quantizers],
                                                  record=False)
        twin.eval_twin = twin
        return twin

    def replay_twin(self, scales: tuple | None = None) -> "RecipeState":
        """The state a checkpoint's recompute of a delayed-scaling forward quantizes with
        (``lowprec.memory.checkpointing.replay_states``): this state's quantizers reading ``scales``
        (one 1-element tensor a slot: the scales that forward used) and recording their
        amaxes into the scratch slots. One twin a state, made by the first checkpointed
        forward (``scales`` None) and pointed at each recompute's scales (no op: torch's
        selective checkpointing matches a recompute's ops to the forward's), so
        recomputes reuse the quantizers and what is kept with them: their plans and bound
        launches."""
        twin = self.__dict__.get("_replay_twin")
        if twin is None:
            twin = self._replay_twin = self._scratch_twin()
        for q, scale in zip(twin.quantizers, scales or ()):
            q.scale = scale
        return twin

    def __getstate__(self):
        state = dict(self.__dict__)
        state.pop("eval_twin", None)
        state.pop("_replay_twin", None)  # made again where it is needed
        return state

    def __setstate__(self, state: dict) -> None:
        # Plain pickle stores each quantizer's scale/amax view as its own storage; re-point
        # them into the shared delayed-scaling state so they keep following its updates.
        self.__dict__.update(state)
        if self.delayed is not None:
            if "amax_scratch" not in self.delayed.__dict__:  # pickled before it existed
                self.delayed.amax_scratch = torch.zeros_like(self.delayed.amax_current)
            for i, q in enumerate(self.quantizers):
                q.scale = self.delayed.scale[i:i + 1]
                q.amax = self.delayed.amax_current[i:i + 1]
        self._make_eval_twin()

    def move_to(self, device: torch.device) -> None:
        """Move the delayed-scaling state to ``device`` (the module moved), re-pointing the
        quantizers at it."""
        if self.delayed is None or self.delayed.scale.device == torch.device(device):
            return
        self.delayed.move_to(device)
        self.__setstate__(self.__getstate__())

    @classmethod
    def create(cls, recipe: Recipe, mode: str, roles: Sequence[QuantizerRole | None],
               device: torch.device | None = None) -> "RecipeState":
        if mode not in MODES:
            raise ValueError(f"mode={mode!r}; use 'forward' or 'backward'")
        if not isinstance(recipe, Recipe):
            raise TypeError(f"recipe must be a lowprec recipe, got {type(recipe).__name__}")
        # A first forward under torch.inference_mode() (an eval before training) must not
        # make the state's tensors inference tensors: training updates them in place.
        with torch.inference_mode(False):
            return cls._create(recipe, mode, roles, device)

    @classmethod
    def _create(cls, recipe, mode, roles, device) -> "RecipeState":
        delayed = None
        if stateful(recipe):
            fmt = recipe.fp8_format
            dtypes = [fmt.bwd_dtype if _is_grad(r, mode, i) else fmt.fwd_dtype
                      for i, r in enumerate(roles)]
            delayed = DelayedScalingState(recipe, len(roles), dtypes,
                                          device or torch.device("cpu"))
            quantizers = delayed.quantizers(dtypes)
        else:
            quantizers = stateless_quantizers(recipe, mode, roles)
        # One object per slot: a factory that returns a shared quantizer must not see one
        # slot's usage settings leak into another.
        seen: set[int] = set()
        for i, q in enumerate(quantizers):
            if id(q) in seen:
                quantizers[i] = q.copy()
            seen.add(id(quantizers[i]))
        return cls(recipe, mode, roles, quantizers, delayed)
