"""Per-tensor FP8 quantizers: delayed scaling and current scaling."""

from __future__ import annotations

import torch

from ...kernels import use_kernels
from ..base import Quantizer, check_amax_epsilon, check_bool_option
from ..casting import check_fp8_dtype
from . import graph, launch
from .reference import current_scale, quantize_per_tensor, seeded_scale, tensor_amax
from .tensor import Float8Tensor


class _PerTensorFloat8(Quantizer):
    # Slices share the whole tensor's amax: one more pass over it.
    slices_need_stats_pass = True

    def __init__(self, fp8_dtype: torch.dtype) -> None:
        super().__init__()
        self.fp8_dtype = check_fp8_dtype(fp8_dtype)

    def _tensor_class(self):
        return Float8Tensor

    def __getstate__(self):
        # The kernels' kept amax words (launch.kept_amax_words) are this object's, on this
        # process's devices and streams: a copy (copy(), deepcopy, pickling) may quantize
        # while this one does, or elsewhere, and makes its own; so are the launches bound
        # to its state (graph.Delayed.state_quantize).
        state = dict(self.__dict__)
        state.pop("_amax_words", None)
        state.pop("_state_prepared", None)
        return state

    def _fields(self, x2d: torch.Tensor, scale: torch.Tensor) -> dict:
        row, col = quantize_per_tensor(x2d, scale, self.fp8_dtype, rowwise=self.rowwise_usage,
                                       columnwise=self.columnwise_usage)
        return {"rowwise_data": row, "columnwise_data": col, "shared_scale": scale,
                "fp8_dtype": self.fp8_dtype}

    def _empty_fields(self, m, k, device):
        empty = lambda *s: torch.empty(s, dtype=self.fp8_dtype, device=device)  # noqa: E731
        return {"rowwise_data": empty(m, k) if self.rowwise_usage else None,
                "columnwise_data": empty(k, m) if self.columnwise_usage else None,
                "shared_scale": torch.ones(1, dtype=torch.float32, device=device),
                "fp8_dtype": self.fp8_dtype}

    def can_quantize_usage_like(self) -> bool:
        return True

    def quantize_usage_like(self, x2d, like, usage):
        # Both usages of one quantize share one scale: cast with like's (NaN when the tensor
        # held NaN/Inf, so this half comes out NaN too). Delayed scaling records nothing
        # here: like's quantize recorded the same amax.
        scale = like.shared_scale
        if use_kernels(x2d):
            return self._slice_tensor(
                x2d, usage, lambda v: launch.quantize_with_scale(self, v, scale, like._decode))
        return self._slice_tensor(x2d, usage, lambda v: self._fields(v, scale))


    def _prepared_usage_like(self, shape, dtype, device, rowwise, columnwise):
        # the cast with like's scale, as quantize_usage_like's kernel path (both scalings)
        if type(self) not in (Float8Quantizer, Float8CurrentScalingQuantizer):
            return None
        return launch.PreparedUsageLike(self, shape, dtype, device, rowwise, columnwise)


class Float8Quantizer(_PerTensorFloat8):
    """Per-tensor FP8 with *delayed* scaling.

    ``scale`` and ``amax`` are 1-element fp32 tensors owned by the recipe
    state: quantize casts ``x * scale`` and records ``amax(|x|)`` into
    ``amax`` in place, as the max with what ``amax`` holds (NaN sticks), so a
    slot quantized several times before the state's update (a shared layer,
    gradient accumulation in one region) keeps the largest; the state turns
    recorded amaxes into the next scale and zeroes them.
    """

    format_name = "fp8_delayed"

    def __init__(self, scale: torch.Tensor, amax: torch.Tensor,
                 fp8_dtype: torch.dtype = torch.float8_e4m3fn) -> None:
        super().__init__(fp8_dtype)
        for name, t in (("scale", scale), ("amax", amax)):
            if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or t.numel() != 1:
                raise TypeError(
                    f"Float8Quantizer: {name} must be a 1-element fp32 tensor, got "
                    f"{t if not isinstance(t, torch.Tensor) else (t.dtype, tuple(t.shape))}")
        self.scale = scale
        self.amax = amax
        #: the scale and amax are a delayed-scaling state's slots (``RecipeState``), which a
        #: compiled call takes as inputs; False for tensors a ``CustomRecipe`` factory holds
        self.state_owned = False
        #: the state's ``FirstScale`` (a scale of 0 means: the tensor's own amax's scale),
        #: or None: the scale is used as it is
        self.first = None

    def cast_scale(self, amax: torch.Tensor | None = None) -> torch.Tensor:
        """The 1-element scale to cast with, before NaN poisoning: ``self.scale``, or with
        ``first`` set, the seeded one of ``amax`` (the tensor's, taken before the cast)."""
        if self.first is None:
            return self.scale
        return seeded_scale(self.scale.reshape(1), amax.reshape(1).to(self.scale.device),
                            self.fp8_dtype, self.first.margin)

    def graph_first_margin(self, kernel: bool) -> float | None:
        """The ``FirstScale`` margin this slot's traced form seeds a missing scale with, as
        its eager quantizes do (``kernel``: the form launches the kernels): the reference
        always (it takes the amax before the cast anyway), the kernels only while the slot
        may be without a scale (``FirstScale.unseeded``; a compiled graph then reads the
        note as a guard). None: the form casts with the state's scale as it is."""
        first = self.first
        if first is None or (kernel and not first.unseeded):
            return None
        return first.margin

    def needs_amax_first(self) -> bool:
        """Whether an eager quantize must take the tensor's amax before its cast: the slot
        may have no scale yet (``FirstScale.unseeded``; asking marks it used)."""
        first = self.first
        if first is None or not first.unseeded:
            return False
        first.used = True
        return True

    def _quantize_2d(self, x2d):
        if use_kernels(x2d):
            return launch.quantize_delayed(self, x2d)
        return self._fields(x2d, self._record_amax(tensor_amax(x2d), x2d.device))

    def _record_amax(self, amax: torch.Tensor, device: torch.device) -> torch.Tensor:
        """Record ``amax`` (1 element) into ``self.amax`` (the max with what it holds); return
        the scale to cast with on ``device``: a copy of ``self.scale``, NaN when the amax is
        not finite (a NaN/Inf input must not come back as finite values)."""
        # torch.maximum propagates NaN: a NaN input keeps the state's scale at its update
        torch.maximum(self.amax, amax.reshape(self.amax.shape).to(self.amax.device),
                      out=self.amax)
        if not torch.compiler.is_compiling():
            self.needs_amax_first()  # the reference has the amax first anyway: notes the use
        scale = self.cast_scale(amax).detach().reshape(1).to(device=device, dtype=torch.float32,
                                                              copy=True)
        return torch.where(torch.isfinite(amax.to(device)), scale,
                           torch.full_like(scale, float("nan")))

    def _quantize_2d_fused(self, x2d, prologue):
        if self.needs_amax_first():  # the amax of the prologue's output comes first
            return self._quantize_2d(prologue.apply(x2d))
        return launch.quantize_delayed(self, x2d, prologue)

    def _prepared(self, shape, dtype, device, rowwise, columnwise):
        if type(self) is not Float8Quantizer:
            return None
        return launch.PreparedDelayed(self, shape, dtype, device, rowwise, columnwise)

    def slice_quantizer(self, x2d):
        # The whole tensor's amax is recorded once and poisons the scale of every slice when
        # it is not finite, as quantize() does for the whole tensor.
        if use_kernels(x2d):
            scale = self._record_amax(launch.fp8_amax(x2d).view(torch.float32), x2d.device)
            return self._slicer(lambda v: launch.quantize_with_scale(self, v, scale))
        scale = self._record_amax(tensor_amax(x2d), x2d.device)
        return self._slicer(lambda v: self._fields(v, scale))

    def graph_operand(self, t, *, grad=False):
        if not self._quantizes_as(Float8Quantizer):
            return super().graph_operand(t, grad=grad)
        if not self.state_owned:  # a CustomRecipe factory's own tensors
            return graph.HeldScale(self.fp8_dtype, quantizer=self,
                                   materialized=isinstance(t, torch.nn.Parameter))
        kernel = use_kernels(t)
        return graph.Delayed(self.fp8_dtype, kernel=kernel,
                             materialized=isinstance(t, torch.nn.Parameter),
                             first_margin=self.graph_first_margin(kernel))

    def _repr_params(self):
        return {"fp8_dtype": self.fp8_dtype, "scale": float(self.scale)}


class Float8CurrentScalingQuantizer(_PerTensorFloat8):
    """Per-tensor FP8 with *current* scaling: the scale comes from this tensor's amax.

    ``scale = fp8_max / max(amax, amax_epsilon)`` in fp32; amax 0 gives 1; an
    infinite scale becomes the fp32 max; ``force_pow_2_scales`` rounds the
    scale down to a power of two. ``amax_epsilon`` must be a real number in
    ``[0, fp32 max]`` and ``force_pow_2_scales`` a bool, else ValueError.
    """

    format_name = "fp8_current"
    stateless = True
    #: A fused norm computes the amax of its output for this quantizer (no amax pass).
    wants_producer_amax = True

    def __init__(self, fp8_dtype: torch.dtype = torch.float8_e4m3fn, *,
                 force_pow_2_scales: bool = False, amax_epsilon: float = 0.0) -> None:
        super().__init__(fp8_dtype)
        owner = type(self).__name__
        self.force_pow_2_scales = check_bool_option(owner, "force_pow_2_scales",
                                                    force_pow_2_scales)
        self.amax_epsilon = check_amax_epsilon(owner, amax_epsilon)

    def _quantize_2d(self, x2d):
        if use_kernels(x2d):
            return launch.quantize_current(self, x2d)
        return self._fields(x2d, self._reference_scale(x2d))

    def _prepared(self, shape, dtype, device, rowwise, columnwise):
        # subclasses may quantize otherwise: only this class's kernels are bound
        if type(self) is not Float8CurrentScalingQuantizer:
            return None
        return launch.PreparedCurrent(self, shape, dtype, device, rowwise, columnwise)

    def _prepared_part(self, shape, dtype, device, rowwise, columnwise):
        if type(self) is not Float8CurrentScalingQuantizer:
            return None
        return launch.PreparedPart(self, shape, dtype, device, rowwise, columnwise)

    def _reference_scale(self, x2d):
        return current_scale(tensor_amax(x2d), self.fp8_dtype, pow2=self.force_pow_2_scales,
                             eps=self.amax_epsilon)

    def _quantize_2d_fused(self, x2d, prologue):
        return launch.quantize_current(self, x2d, prologue)

    def can_quantize_part(self) -> bool:
        return True

    def part_statistic(self, part):
        # The amax as int32 bits: non-negative floats order as their bits do, NaN above +Inf,
        # so the maximum over the parts is the whole tensor's amax (NaN anywhere reaches all).
        if not part.numel():
            return torch.zeros(1, dtype=torch.int32, device=part.device)
        if use_kernels(part):
            return launch.fp8_amax(part.contiguous())
        return tensor_amax(part).view(torch.int32)

    def _part_fields(self, part, statistic):
        if statistic is None:
            raise ValueError("Float8CurrentScalingQuantizer.quantize_part needs the statistic "
                             "(the maximum of part_statistic over every part)")
        if use_kernels(part):
            return launch.quantize_current(self, part, amax_bits=statistic)
        scale = current_scale(statistic.view(torch.float32), self.fp8_dtype,
                              pow2=self.force_pow_2_scales, eps=self.amax_epsilon)
        return self._fields(part, scale)

    def slice_quantizer(self, x2d):
        # The scale of the whole tensor: the kernels take its amax bits (the same in-kernel
        # scale computation as an unsliced quantize), the reference the scale itself.
        if use_kernels(x2d):
            bits = launch.fp8_amax(x2d)
            return self._slicer(lambda v: launch.quantize_current(self, v, amax_bits=bits))
        scale = self._reference_scale(x2d)
        return self._slicer(lambda v: self._fields(v, scale))

    def graph_operand(self, t, *, grad=False):
        if not self._quantizes_as(Float8CurrentScalingQuantizer):
            return super().graph_operand(t, grad=grad)
        if isinstance(t, Float8Tensor):  # a weight that arrives quantized: read as it is
            if t.rowwise_data is None or t.fp8_dtype != self.fp8_dtype:
                return "a per-tensor FP8 weight without rowwise data in this fp8 dtype"
            return graph.GivenTensorwise(self.fp8_dtype)
        # isinstance: a compiled linear decides on fake stand-ins, and a parameter of a
        # FakeTensor keeps FakeTensor's type (nn.Parameter marks it instead)
        return graph.Tensorwise(self.fp8_dtype, self.force_pow_2_scales, self.amax_epsilon,
                                kernel=use_kernels(t),
                                materialized=isinstance(t, torch.nn.Parameter))

    def _repr_params(self):
        return {"fp8_dtype": self.fp8_dtype, "force_pow_2_scales": self.force_pow_2_scales,
                "amax_epsilon": self.amax_epsilon}
