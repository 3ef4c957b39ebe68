"""Recipes: which quantizer each tensor role gets.

Every recipe is a frozen dataclass validated on construction: its ``bool``
fields take only ``True``/``False`` (numpy bools too) and its ``int`` fields
only integers, never a bool, else ValueError. All recipes
carry ``backward_mode`` (keyword-only): ``"default"`` quantizes the backward
GEMM operands per the recipe, ``"high_precision"`` (alias ``"unquant"``)
runs dgrad/wgrad in high precision on the saved original tensors and
``"dequantized"`` (alias ``"dequant"``) runs them in high precision on the
dequantized forward operands. When the field is not given, the environment
variable ``LOWPREC_BACKWARD_MODE`` supplies it.
"""

from __future__ import annotations

import dataclasses
import enum
import inspect
import itertools
import numbers
import os
import weakref
from dataclasses import dataclass, field
from typing import Callable, NamedTuple, Union

import torch

__all__ = ["Format", "Recipe", "DelayedScaling", "Float8CurrentScaling", "Float8BlockScaling",
           "MXFP8BlockScaling", "NVFP4BlockScaling", "CustomRecipe", "BACKWARD_MODES",
           "RECIPE_ALIASES", "BackwardMode", "OperandUsages", "operand_usages"]


class BackwardMode(str, enum.Enum):
    """How dgrad and wgrad run (the ``backward_mode`` of every recipe).

    A ``str`` enum: each member equals its string (``BackwardMode.DEFAULT == "default"``),
    and recipes hold the plain string, so code and configs that use strings keep working.
    """

    DEFAULT = "default"                # quantize the backward GEMM operands per the recipe
    HIGH_PRECISION = "high_precision"  # save the original x and W; hp dgrad/wgrad
    DEQUANTIZED = "dequantized"        # save fprop's rowwise x and W; dequantize for backward

    def __str__(self) -> str:
        return self.value


BACKWARD_MODES = tuple(m.value for m in BackwardMode)
_BACKWARD_ALIASES = {"unquant": "high_precision", "dequant": "dequantized"}
BACKWARD_MODE_ENV = "LOWPREC_BACKWARD_MODE"


class OperandUsages(NamedTuple):
    """The (rowwise, columnwise) usages a linear's forward quantizes its input and its
    weight with."""

    input: tuple[bool, bool]
    weight: tuple[bool, bool]


def operand_usages(mode: str, needs_dgrad: bool, needs_wgrad: bool) -> OperandUsages:
    """Which usages of the input and the weight a linear's forward must produce.

    fprop consumes both rowwise. Only the ``default`` backward mode consumes quantized
    columnwise operands: the weight's for dgrad (``needs_dgrad``), the input's for wgrad
    (``needs_wgrad``); the other modes save high-precision or rowwise data instead.
    ``mode`` is a normalized backward mode (a ``BackwardMode`` or its string).
    """
    quantized_bwd = mode == BackwardMode.DEFAULT
    return OperandUsages(input=(True, quantized_bwd and bool(needs_wgrad)),
                         weight=(True, quantized_bwd and bool(needs_dgrad)))


class Format(enum.Enum):
    """Element formats. HYBRID is E4M3 for forward tensors and E5M2 for gradients."""

    E4M3 = "E4M3"
    E5M2 = "E5M2"
    HYBRID = "HYBRID"
    E2M1 = "E2M1"

    @property
    def fwd_dtype(self) -> torch.dtype:
        return torch.float8_e5m2 if self is Format.E5M2 else torch.float8_e4m3fn

    @property
    def bwd_dtype(self) -> torch.dtype:
        return torch.float8_e4m3fn if self is Format.E4M3 else torch.float8_e5m2


def normalize_backward_mode(mode: str, *, source: str = "backward_mode") -> str:
    """Resolve aliases and validate a backward mode (a string or a :class:`BackwardMode`);
    returns the mode's plain string, else ValueError naming the value and the accepted ones."""
    if not isinstance(mode, str):
        raise TypeError(f"{source} must be a string, got {type(mode).__name__}")
    if isinstance(mode, BackwardMode):
        return mode.value
    resolved = _BACKWARD_ALIASES.get(mode, mode)
    if resolved not in BACKWARD_MODES:
        raise ValueError(f"{source}={mode!r} is not a backward mode; use one of "
                         f"{BACKWARD_MODES} (aliases {sorted(_BACKWARD_ALIASES)})")
    return resolved


def _check_fp8_format(recipe: str, fmt, allowed) -> None:
    if not isinstance(fmt, Format) or fmt not in allowed:
        raise ValueError(f"{recipe}: fp8_format={fmt!r} is not supported; use one of "
                         f"{[f.name for f in allowed]}")


def _check_field_types(recipe: "Recipe") -> None:
    """Check every ``bool`` and ``int`` field of ``recipe`` by its annotation (numpy bools
    and integers become Python ones); else ValueError naming the recipe, the field and the
    value. Going by the annotations checks every field a recipe declares, now and later:
    a flag read from a config as the string ``"false"`` is truthy, and ``True`` passes for
    the int 1."""
    # the same checks as the quantizers' options; imported here so that recipes stay
    # importable without the formats loaded first
    from ..formats import check_bool_option, check_int_option

    checks = {"bool": check_bool_option, "int": check_int_option}
    for f in dataclasses.fields(recipe):
        check = checks.get(f.type if isinstance(f.type, str) else getattr(f.type, "__name__", None))
        if check is not None:
            value = check(type(recipe).__name__, f.name, getattr(recipe, f.name))
            object.__setattr__(recipe, f.name, value)


_RECIPES: "weakref.WeakValueDictionary[int, Recipe]" = weakref.WeakValueDictionary()
_next_key = itertools.count()


#: one int per distinct value of a built-in recipe (``Recipe._lowprec_value``), and the
#: first recipe of each value (one object a value is kept: equal recipes made each step
#: add nothing; a CustomRecipe, whose factory may hold anything, is never kept)
_VALUES: "dict[Recipe, int]" = {}
_BY_VALUE: "dict[int, Recipe]" = {}


def _register(recipe: "Recipe") -> None:
    key = next(_next_key)
    object.__setattr__(recipe, "_lowprec_key", key)
    _RECIPES[key] = recipe
    value = -1 - key  # a CustomRecipe, or a field that does not hash: the object itself
    if not isinstance(recipe, CustomRecipe):
        try:
            value = _VALUES.get(recipe)
            if value is None:
                value = _VALUES[recipe] = len(_VALUES)
                _BY_VALUE[value] = recipe
        except TypeError:  # (the lookup raised before assigning: the object's own value)
            pass
    object.__setattr__(recipe, "_lowprec_value", value)


def recipe_of_value(value: int) -> "Recipe":
    """A live recipe whose ``_lowprec_value`` is ``value`` (any: they are equal)."""
    recipe = _BY_VALUE.get(value)
    if recipe is None:
        raise RuntimeError(f"no live recipe has the value key {value}")
    return recipe


def recipe_from_key(key: int) -> "Recipe":
    """The recipe object whose ``_lowprec_key`` is ``key`` (compiled calls name recipes by
    it; see ``lowprec.compile.call``)."""
    recipe = _RECIPES.get(key)
    if recipe is None:
        raise RuntimeError(f"a compiled lowprec call names recipe key {key}, which no live "
                           f"recipe has; keep the recipe object alive while the compiled "
                           f"function runs")
    return recipe


@dataclass(frozen=True)
class MMParams:
    """How a recipe's FP8 GEMMs of one direction accumulate (Transformer Engine's
    ``MMParams``). ``use_split_accumulator=True``: cuBLAS promotes partial sums to fp32
    (the exact fp32-accumulated product, bit for bit the reference). False: its fast
    accumulation, which keeps partial sums at lower precision inside the tensor cores and
    is faster; ``docs/formats.md`` states its error against the fp32-accumulated product.
    It steers GEMMs of two per-tensor FP8 operands: cuBLAS's block-scaled GEMMs and the
    emulated formats (MXFP8, NVFP4 on Hopper) always accumulate in fp32."""

    use_split_accumulator: bool = True

    def __post_init__(self) -> None:
        _check_field_types(self)


#: TE's defaults for per-tensor FP8: fast accumulation in fprop, split in dgrad and wgrad
_FAST, _SPLIT = MMParams(use_split_accumulator=False), MMParams(use_split_accumulator=True)

GEMM_PARAMS = ("fp8_gemm_fprop", "fp8_gemm_dgrad", "fp8_gemm_wgrad")


def gemm_fast_accum(recipe: "Recipe | None") -> tuple[bool, bool, bool]:
    """(fprop, dgrad, wgrad): whether ``recipe``'s per-tensor FP8 GEMMs of each direction
    accumulate fast (its ``fp8_gemm_*`` fields; a recipe without them: split everywhere)."""
    return tuple(not getattr(recipe, name, _SPLIT).use_split_accumulator
                 for name in GEMM_PARAMS)


def _check_gemm_params(recipe: "Recipe") -> None:
    for name in GEMM_PARAMS:
        value = getattr(recipe, name)
        if not isinstance(value, MMParams):
            raise TypeError(f"{type(recipe).__name__}: {name} must be a "
                            f"lowprec.recipe.MMParams, got {value!r} ({type(value).__name__})")


@dataclass(frozen=True)
class Recipe:
    """Base of all recipes; holds the backward mode.

    Each recipe object also carries ``_lowprec_key``, an int naming that object for
    ``torch.compile``, and ``_lowprec_value``, an int that equal recipes share (neither
    is a field: they take no part in comparison, hashing or repr; a copy or an unpickled
    recipe gets its own key).
    """

    backward_mode: str | None = field(default=None, kw_only=True)

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state.pop("_lowprec_key", None)
        state.pop("_lowprec_value", None)
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        _register(self)

    @classmethod
    def from_name(cls, name: str, **kwargs) -> "Recipe | None":
        """The recipe called ``name`` (one of :meth:`names`, or an alias of
        ``RECIPE_ALIASES``), built with ``kwargs`` (e.g. ``backward_mode=``).

        ``"bf16"`` names no quantization at all and returns ``None`` (run without
        ``lowprec.autocast``, or with ``recipe=None``). An unknown name raises ValueError
        naming it and the accepted names.
        """
        return _named_entry(name, "from_name")[0](**kwargs)

    @staticmethod
    def names() -> tuple[str, ...]:
        """The names :meth:`from_name` accepts (aliases aside), in display order."""
        return tuple(_NAMED_RECIPES)

    @staticmethod
    def describe(name: str) -> str:
        """One line saying what the recipe called ``name`` is (names as :meth:`from_name`)."""
        return _named_entry(name, "describe")[1]

    def __post_init__(self) -> None:
        if self.backward_mode is None:
            env = os.environ.get(BACKWARD_MODE_ENV)
            mode = (normalize_backward_mode(env, source=f"environment {BACKWARD_MODE_ENV}")
                    if env else "default")
        else:
            mode = normalize_backward_mode(self.backward_mode)
        object.__setattr__(self, "backward_mode", mode)
        _check_field_types(self)
        _register(self)  # its value is final: subclasses only check theirs


# 2**127 is the largest power of two fp32 holds; the scale divides by 2**margin in fp32
_MAX_MARGIN = 127


@dataclass(frozen=True)
class DelayedScaling(Recipe):
    """Per-tensor FP8 with scales from an amax history (delayed scaling).

    ``scale = fp8_max / amax / 2**margin`` where amax is ``max(history)``
    ("max"), the newest entry ("most_recent") or ``amax_compute_algo(history)``
    for a callable taking the (history_len, n) fp32 history (newest row
    first) and returning a floating-point tensor of n amaxes, shape (n,).
    ``margin`` is an int or a float in [0, 127] (``2**margin`` stays finite in
    fp32), ``amax_history_len`` an int >= 1 and ``reduce_amax`` a bool. Only
    ``backward_mode="default"`` is supported.

    ``first_scale``: how a tensor is scaled before its slot's history holds an amax.
    ``"current"`` (default): with the scale of its own amax, as current scaling does, so
    the first step's gradients are not flushed to zero. ``"one"``: with scale 1 until
    the first update, as Transformer Engine does (bit parity with it).

    ``fp8_gemm_fprop`` / ``fp8_gemm_dgrad`` / ``fp8_gemm_wgrad``: :class:`MMParams` of each
    GEMM direction, Transformer Engine's defaults (fast accumulation in fprop only).
    """

    margin: float = 0
    fp8_format: Format = Format.HYBRID
    amax_history_len: int = 1024
    amax_compute_algo: Union[str, Callable] = "max"
    reduce_amax: bool = True
    first_scale: str = "current"
    fp8_gemm_fprop: MMParams = _FAST
    fp8_gemm_dgrad: MMParams = _SPLIT
    fp8_gemm_wgrad: MMParams = _SPLIT

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.backward_mode != BackwardMode.DEFAULT:
            source = ("" if os.environ.get(BACKWARD_MODE_ENV) is None else
                      f" (from the environment variable {BACKWARD_MODE_ENV})")
            raise ValueError(f"DelayedScaling supports only backward_mode='default', got "
                             f"{self.backward_mode!r}{source}: its quantizers share recipe-owned "
                             f"scaling state that the backward GEMMs update")
        _check_fp8_format("DelayedScaling", self.fp8_format,
                          (Format.E4M3, Format.E5M2, Format.HYBRID))
        margin = self.margin
        if (isinstance(margin, bool) or not isinstance(margin, numbers.Real)
                or not 0 <= margin <= _MAX_MARGIN):
            raise ValueError(f"DelayedScaling: margin must be an int or a float in "
                             f"[0, {_MAX_MARGIN}] (2**margin must stay finite in fp32), got "
                             f"{margin!r} ({type(margin).__name__})")
        if type(margin) not in (int, float):  # numpy scalars
            object.__setattr__(self, "margin", int(margin) if isinstance(margin, numbers.Integral)
                               else float(margin))
        if self.amax_history_len < 1:
            raise ValueError(f"DelayedScaling: amax_history_len must be an int >= 1, got "
                             f"{self.amax_history_len!r}")
        _check_gemm_params(self)
        if self.first_scale not in ("current", "one"):
            raise ValueError(f"DelayedScaling: first_scale={self.first_scale!r}; use 'current' "
                             f"(the tensor's own amax until the history holds one) or 'one' "
                             f"(scale 1, as Transformer Engine)")
        if not (callable(self.amax_compute_algo)
                or self.amax_compute_algo in ("max", "most_recent")):
            raise ValueError(f"DelayedScaling: amax_compute_algo={self.amax_compute_algo!r}; use "
                             f"'max', 'most_recent' or a callable")


@dataclass(frozen=True)
class Float8CurrentScaling(Recipe):
    """Per-tensor FP8 with the scale computed from each tensor's own amax.

    ``fp8_gemm_fprop`` / ``fp8_gemm_dgrad`` / ``fp8_gemm_wgrad``: :class:`MMParams` of each
    GEMM direction, Transformer Engine's defaults (fast accumulation in fprop only).
    """

    fp8_format: Format = Format.HYBRID
    use_power_2_scales: bool = False
    fp8_gemm_fprop: MMParams = _FAST
    fp8_gemm_dgrad: MMParams = _SPLIT
    fp8_gemm_wgrad: MMParams = _SPLIT

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_gemm_params(self)
        _check_fp8_format("Float8CurrentScaling", self.fp8_format,
                          (Format.E4M3, Format.E5M2, Format.HYBRID))


@dataclass(frozen=True)
class Float8BlockScaling(Recipe):
    """FP8 block scaling: inputs and gradients 1x128, weights 128x128, power-of-two scales."""

    fp8_format: Format = Format.E4M3
    x_block_scaling_dim: int = 1
    w_block_scaling_dim: int = 2
    grad_block_scaling_dim: int = 1

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_fp8_format("Float8BlockScaling", self.fp8_format,
                          (Format.E4M3, Format.E5M2, Format.HYBRID))
        for name in ("x_block_scaling_dim", "w_block_scaling_dim", "grad_block_scaling_dim"):
            if getattr(self, name) not in (1, 2):
                raise ValueError(f"Float8BlockScaling: {name}={getattr(self, name)!r}; use 1 or 2")


@dataclass(frozen=True)
class MXFP8BlockScaling(Recipe):
    """MXFP8: E4M3 data with E8M0 scales per 32 elements, for every role."""

    enable_2d_quantization: bool = False
    fp8_format: Format = Format.E4M3

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_fp8_format("MXFP8BlockScaling", self.fp8_format,
                          (Format.E4M3, Format.E5M2, Format.HYBRID))


@dataclass(frozen=True)
class NVFP4BlockScaling(Recipe):
    """NVFP4: E2M1 data, E4M3 scales per 16 elements and an fp32 per-tensor scale.

    Inputs get the random Hadamard transform on their columnwise (wgrad)
    side, weights 16x16 2-D blocks, gradients RHT and stochastic rounding;
    each can be switched off. Boundary slots follow the same rule by tensor type
    (an ``output`` quantizer as an input, a ``grad_input`` one as a gradient), and a
    ``None`` or unknown role takes the type of its slot's place in the layout
    (``lowprec.recipe.roles.slot_tensor_type``).
    """

    disable_rht: bool = False
    disable_stochastic_rounding: bool = False
    disable_2d_quantization: bool = False
    fp4_format: Format = Format.E2M1

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.fp4_format is not Format.E2M1:
            raise ValueError(f"NVFP4BlockScaling: fp4_format={self.fp4_format!r}; only E2M1")


@dataclass(frozen=True)
class CustomRecipe(Recipe):
    """A recipe whose quantizers come from ``qfactory(role) -> Quantizer``.

    The factory is called once per quantizer slot with a
    :class:`lowprec.QuantizerRole` (or ``None`` for an unset boundary role)
    and must return a quantizer; return ``IdentityQuantizer()`` to keep a
    tensor in high precision. A module-level function pickles; a closure or
    lambda does not.

    ``fp8_gemm_fprop`` / ``fp8_gemm_dgrad`` / ``fp8_gemm_wgrad``: :class:`MMParams` of the
    GEMMs whose operands are both per-tensor FP8; split accumulation (exact) by default.
    """

    qfactory: Callable | None = None
    fp8_gemm_fprop: MMParams = _SPLIT
    fp8_gemm_dgrad: MMParams = _SPLIT
    fp8_gemm_wgrad: MMParams = _SPLIT

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_gemm_params(self)
        from ..formats import Quantizer  # recipes stay importable without formats loaded first

        if isinstance(self.qfactory, Quantizer):
            raise TypeError(f"CustomRecipe got a quantizer ({type(self.qfactory).__name__}) "
                            f"where a factory is expected; pass a function role -> Quantizer, "
                            f"e.g. one that returns q.copy()")
        if not callable(self.qfactory):
            raise TypeError(f"CustomRecipe needs a callable qfactory(role) -> Quantizer, got "
                            f"{self.qfactory!r}")
        try:
            signature = inspect.signature(self.qfactory)
        except (TypeError, ValueError):  # a callable without a signature: called as it is
            return
        try:
            signature.bind(None)
        except TypeError:
            raise TypeError(f"CustomRecipe's qfactory is called with one argument (the "
                            f"QuantizerRole, or None), but {self.qfactory!r} takes "
                            f"{signature}") from None


def _custom(factory_name: str, *args):
    """A builder of ``CustomRecipe`` over a factory of :mod:`lowprec.recipe.factories`, imported at
    build time: the factories import the formats, which import this module."""
    def build(**kwargs) -> CustomRecipe:
        from . import factories

        factory = getattr(factories, factory_name)
        return CustomRecipe(qfactory=factory(*args) if args else factory, **kwargs)
    return build


# The one table of named recipes: name -> (builder taking the recipe's keyword arguments,
# description). ``lowprec compare``, the benchmarks and the tests all build from it.
_NAMED_RECIPES: dict[str, tuple[Callable[..., "Recipe | None"], str]] = {
    "bf16": (lambda **kw: None, "bf16 weights and GEMMs, no quantization (the baseline)"),
    "fp8_delayed": (lambda **kw: DelayedScaling(**kw),
                    "DelayedScaling(): per-tensor FP8, scales from an amax history"),
    "fp8_current": (lambda **kw: Float8CurrentScaling(**kw),
                    "Float8CurrentScaling(): per-tensor FP8, E4M3 forward / E5M2 gradients"),
    "fp8_block": (lambda **kw: Float8BlockScaling(**kw),
                  "Float8BlockScaling(): FP8, 1x128 activations/gradients, 128x128 weights"),
    "mxfp8": (lambda **kw: MXFP8BlockScaling(**kw),
              "MXFP8BlockScaling(): E4M3 with E8M0 scales per 32 elements"),
    "nvfp4": (lambda **kw: NVFP4BlockScaling(**kw),
              "NVFP4BlockScaling(): E2M1 with E4M3 scales per 16, RHT, SR on gradients"),
    "mxfp8_fwd_nvfp4_bwd": (
        _custom("mxfp8_fwd_nvfp4_bwd_factory"),
        "CustomRecipe(mxfp8_fwd_nvfp4_bwd_factory): MXFP8 forward GEMM, NVFP4 backward GEMMs"),
    "fp8_row_mxfp8_col": (
        _custom("fp8_row_mxfp8_col_factory"),
        "CustomRecipe(fp8_row_mxfp8_col_factory): per-tensor FP8 rowwise, MXFP8 columnwise"),
    "nvfp4_fp8_head": (
        _custom("NVFP4ExceptLayers", ("lm_head",)),
        "CustomRecipe(NVFP4ExceptLayers(('lm_head',))): NVFP4 except an FP8 output head"),
}

#: Short names the tests and benchmarks use, accepted by :meth:`Recipe.from_name`.
RECIPE_ALIASES: dict[str, str] = {"delayed": "fp8_delayed", "current": "fp8_current",
                                  "block": "fp8_block"}


def _named_entry(name: str, method: str) -> tuple[Callable[..., "Recipe | None"], str]:
    """``_NAMED_RECIPES``'s entry for ``name`` or an alias of it; TypeError/ValueError naming
    the value and the accepted names otherwise."""
    if not isinstance(name, str):
        raise TypeError(f"Recipe.{method} takes a recipe name string, got "
                        f"{type(name).__name__}")
    entry = _NAMED_RECIPES.get(RECIPE_ALIASES.get(name, name))
    if entry is None:
        raise ValueError(f"unknown recipe name {name!r}; accepted names: "
                         f"{', '.join(_NAMED_RECIPES)} (aliases: "
                         f"{', '.join(f'{a}={c}' for a, c in RECIPE_ALIASES.items())})")
    return entry
