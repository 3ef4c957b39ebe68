"""Recipes: defaults, immutability, validation, backward modes (aliases, environment) and Format.

Expectations come from SPEC section 4 (and Transformer Engine's recipe defaults where
the spec is silent), written out literally here; nothing is read back from lowprec to
build an expected value.
"""

from __future__ import annotations

import dataclasses
import pickle

import pytest
import torch

import lowprec
from lowprec.recipe import factories
from lowprec.recipe.factories import mxfp8_factory
from lowprec.recipe.recipes import (
    CustomRecipe,
    DelayedScaling,
    Float8BlockScaling,
    Float8CurrentScaling,
    Format,
    MXFP8BlockScaling,
    NVFP4BlockScaling,
)

ENV = "LOWPREC_BACKWARD_MODE"
MODES = ("default", "high_precision", "dequantized")
ALIASES = {"unquant": "high_precision", "dequant": "dequantized"}


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    """Every test starts without the environment override (CI may set it)."""
    monkeypatch.delenv(ENV, raising=False)


def _identity_factory(role):
    return lowprec.IdentityQuantizer()


# (constructor, expected default fields) — literal values from SPEC section 4 / Transformer Engine.
DEFAULTS = {
    "DelayedScaling": (DelayedScaling, dict(margin=0, fp8_format=Format.HYBRID,
                                            amax_history_len=1024, amax_compute_algo="max",
                                            reduce_amax=True)),
    "Float8CurrentScaling": (Float8CurrentScaling, dict(fp8_format=Format.HYBRID,
                                                        use_power_2_scales=False)),
    "Float8BlockScaling": (Float8BlockScaling, dict(x_block_scaling_dim=1, w_block_scaling_dim=2,
                                                    grad_block_scaling_dim=1)),
    "MXFP8BlockScaling": (MXFP8BlockScaling, dict(enable_2d_quantization=False)),
    "NVFP4BlockScaling": (NVFP4BlockScaling, dict(disable_rht=False,
                                                  disable_stochastic_rounding=False,
                                                  disable_2d_quantization=False)),
    "CustomRecipe": (lambda **kw: CustomRecipe(_identity_factory, **kw),
                     dict(qfactory=_identity_factory)),
}
ALL = sorted(DEFAULTS)
# Recipes that accept every backward mode (DelayedScaling only takes "default").
NON_DELAYED = [n for n in ALL if n != "DelayedScaling"]


def make(name, **kw):
    return DEFAULTS[name][0](**kw)


# ---- construction, defaults, immutability ---------------------------------------------------
@pytest.mark.parametrize("name", ALL)
def test_defaults(name):
    r = make(name)
    assert isinstance(r, lowprec.recipe.Recipe)
    for field, value in DEFAULTS[name][1].items():
        assert getattr(r, field) == value, field
    assert r.backward_mode == "default"


@pytest.mark.parametrize("name", ALL)
def test_frozen(name):
    r = make(name)
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.backward_mode = "high_precision"
    for field in DEFAULTS[name][1]:
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(r, field, getattr(r, field))
    assert r.backward_mode == "default"


def test_top_level_names_are_the_recipe_classes():
    # SPEC: every name importable from the top-level package, recipes also from lowprec.recipe.
    for name in ALL + ["Format"]:
        assert getattr(lowprec, name) is getattr(lowprec.recipe, name)


def test_equal_recipes_compare_equal_and_pickle():
    # Modules cache per-recipe state by comparing recipes: equal fields must compare equal.
    assert Float8CurrentScaling() == Float8CurrentScaling()
    assert Float8CurrentScaling() != Float8CurrentScaling(use_power_2_scales=True)
    assert NVFP4BlockScaling(disable_rht=True) != NVFP4BlockScaling()
    r = CustomRecipe(mxfp8_factory, backward_mode="dequant")  # module-level factory pickles
    r2 = pickle.loads(pickle.dumps(r))
    assert r2 == r and r2.qfactory is mxfp8_factory and r2.backward_mode == "dequantized"


# ---- validation ---------------------------------------------------------------------------------
@pytest.mark.parametrize("ctor", [DelayedScaling, Float8CurrentScaling, Float8BlockScaling,
                                  MXFP8BlockScaling])
@pytest.mark.parametrize("bad", ["E4M3", Format.E2M1, torch.float8_e4m3fn, None])
def test_bad_fp8_format(ctor, bad):
    with pytest.raises(ValueError, match="fp8_format"):
        ctor(fp8_format=bad)


@pytest.mark.parametrize("ctor", [DelayedScaling, Float8CurrentScaling, Float8BlockScaling,
                                  MXFP8BlockScaling])
@pytest.mark.parametrize("fmt", [Format.E4M3, Format.E5M2, Format.HYBRID])
def test_good_fp8_formats(ctor, fmt):
    assert ctor(fp8_format=fmt).fp8_format is fmt


@pytest.mark.parametrize("field", ["x_block_scaling_dim", "w_block_scaling_dim",
                                   "grad_block_scaling_dim"])
@pytest.mark.parametrize("bad", [0, 3, -1, "1"])
def test_bad_block_dims(field, bad):
    with pytest.raises(ValueError, match=field):
        Float8BlockScaling(**{field: bad})


@pytest.mark.parametrize("field", ["x_block_scaling_dim", "w_block_scaling_dim",
                                   "grad_block_scaling_dim"])
@pytest.mark.parametrize("dim", [1, 2])
def test_good_block_dims(field, dim):
    assert getattr(Float8BlockScaling(**{field: dim}), field) == dim


@pytest.mark.parametrize("bad", [0, -4, 2.5])
def test_bad_amax_history_len(bad):
    with pytest.raises(ValueError, match="amax_history_len"):
        DelayedScaling(amax_history_len=bad)


def test_amax_history_len_one_is_valid():
    assert DelayedScaling(amax_history_len=1).amax_history_len == 1


@pytest.mark.parametrize("bad", ["mean", "", None, 3])
def test_bad_amax_compute_algo(bad):
    with pytest.raises(ValueError, match="amax_compute_algo"):
        DelayedScaling(amax_compute_algo=bad)


@pytest.mark.parametrize("algo", ["max", "most_recent", lambda h: h.amax(dim=0)])
def test_good_amax_compute_algo(algo):
    assert DelayedScaling(amax_compute_algo=algo).amax_compute_algo is algo


def test_bad_margin():
    with pytest.raises(ValueError, match="margin"):
        DelayedScaling(margin=-1)


@pytest.mark.parametrize("bad", [None, "mxfp8", 3, torch.float8_e4m3fn])
def test_custom_recipe_needs_callable(bad):
    with pytest.raises(TypeError, match="qfactory"):
        CustomRecipe(bad)


def test_nvfp4_rejects_other_fp4_format():
    with pytest.raises(ValueError, match="fp4_format"):
        NVFP4BlockScaling(fp4_format=Format.E4M3)


# ---- backward modes ------------------------------------------------------------------------------
@pytest.mark.parametrize("name", NON_DELAYED)
@pytest.mark.parametrize("mode", MODES)
def test_backward_mode_values(name, mode):
    assert make(name, backward_mode=mode).backward_mode == mode


@pytest.mark.parametrize("name", NON_DELAYED)
@pytest.mark.parametrize("alias,resolved", sorted(ALIASES.items()))
def test_backward_mode_aliases(name, alias, resolved):
    r = make(name, backward_mode=alias)
    assert r.backward_mode == resolved
    # The stored value is canonical, so an alias and its target make equal recipes.
    assert r == make(name, backward_mode=resolved)


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("bad", ["quantized", "DEFAULT", "high-precision", ""])
def test_invalid_backward_mode_lists_valid_ones(name, bad):
    with pytest.raises(ValueError) as err:
        make(name, backward_mode=bad)
    msg = str(err.value)
    for mode in MODES:
        assert mode in msg, (mode, msg)


def test_backward_mode_is_keyword_only():
    # backward_mode must not shift positional fields (DelayedScaling(0, HYBRID) keeps meaning).
    with pytest.raises(TypeError):
        Float8CurrentScaling(Format.E4M3, False, "high_precision")


@pytest.mark.parametrize("name", NON_DELAYED)
@pytest.mark.parametrize("env,resolved", [("high_precision", "high_precision"),
                                          ("dequantized", "dequantized"),
                                          ("unquant", "high_precision"),
                                          ("dequant", "dequantized"), ("default", "default")])
def test_env_supplies_default(monkeypatch, name, env, resolved):
    monkeypatch.setenv(ENV, env)
    assert make(name).backward_mode == resolved


@pytest.mark.parametrize("name", NON_DELAYED)
@pytest.mark.parametrize("explicit", MODES)
def test_explicit_field_beats_env(monkeypatch, name, explicit):
    env = "dequant" if explicit != "dequantized" else "unquant"
    monkeypatch.setenv(ENV, env)
    assert make(name, backward_mode=explicit).backward_mode == explicit


def test_env_is_read_at_construction(monkeypatch):
    before = Float8CurrentScaling()
    monkeypatch.setenv(ENV, "unquant")
    after = Float8CurrentScaling()
    assert before.backward_mode == "default" and after.backward_mode == "high_precision"


def test_invalid_env_raises(monkeypatch):
    monkeypatch.setenv(ENV, "bogus")
    with pytest.raises(ValueError) as err:
        MXFP8BlockScaling()
    assert ENV in str(err.value) and "bogus" in str(err.value)
    # An explicit valid field does not consult the environment at all.
    assert MXFP8BlockScaling(backward_mode="default").backward_mode == "default"


@pytest.mark.parametrize("mode", ["high_precision", "dequantized", "unquant", "dequant"])
def test_delayed_scaling_rejects_non_default_mode(mode):
    with pytest.raises(ValueError, match="DelayedScaling"):
        DelayedScaling(backward_mode=mode)


@pytest.mark.parametrize("mode", ["high_precision", "dequantized", "unquant", "dequant"])
def test_delayed_scaling_rejects_non_default_mode_from_env(monkeypatch, mode):
    monkeypatch.setenv(ENV, mode)
    with pytest.raises(ValueError, match="DelayedScaling"):
        DelayedScaling()


def test_delayed_scaling_explicit_default_beats_env(monkeypatch):
    monkeypatch.setenv(ENV, "high_precision")
    assert DelayedScaling(backward_mode="default").backward_mode == "default"
    monkeypatch.setenv(ENV, "default")
    assert DelayedScaling().backward_mode == "default"


# ---- Format -------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt,fwd,bwd", [
    (Format.E4M3, torch.float8_e4m3fn, torch.float8_e4m3fn),
    (Format.E5M2, torch.float8_e5m2, torch.float8_e5m2),
    (Format.HYBRID, torch.float8_e4m3fn, torch.float8_e5m2),
])
def test_format_dtypes(fmt, fwd, bwd):
    assert fmt.fwd_dtype == fwd
    assert fmt.bwd_dtype == bwd


def test_format_members():
    assert {f.name for f in Format} == {"E4M3", "E5M2", "HYBRID", "E2M1"}


# ---- field types: flags must be bools, counts ints ------------------------------------------
# every bool field of every recipe, written out (a new one must be added here too)
BOOL_FIELDS = [("DelayedScaling", "reduce_amax"), ("Float8CurrentScaling", "use_power_2_scales"),
               ("MXFP8BlockScaling", "enable_2d_quantization"),
               ("NVFP4BlockScaling", "disable_rht"),
               ("NVFP4BlockScaling", "disable_stochastic_rounding"),
               ("NVFP4BlockScaling", "disable_2d_quantization")]
INT_FIELDS = [("DelayedScaling", "amax_history_len"), ("Float8BlockScaling", "x_block_scaling_dim"),
              ("Float8BlockScaling", "w_block_scaling_dim"),
              ("Float8BlockScaling", "grad_block_scaling_dim")]


def test_bool_field_list_is_complete():
    declared = {(cls.__name__, f.name)
                for cls in (DelayedScaling, Float8CurrentScaling, Float8BlockScaling,
                            MXFP8BlockScaling, NVFP4BlockScaling, CustomRecipe)
                for f in dataclasses.fields(cls) if f.type in ("bool", bool)}
    assert declared == set(BOOL_FIELDS)


def test_nvfp4_disable_rht_string_from_a_config_is_rejected():
    # "false" is truthy: taken as a bool it would switch RHT off silently
    with pytest.raises(ValueError) as err:
        NVFP4BlockScaling(disable_rht="false")
    msg = str(err.value)
    assert "NVFP4BlockScaling" in msg and "disable_rht" in msg and "'false'" in msg
    assert "bool" in msg


# (recipe, field, the word the message uses, a value it must reject)
_BAD_OPTIONS = (
    [(n, f, "bool", bad) for n, f in BOOL_FIELDS for bad in ["false", "True", "", 0, 1, None, 1.0]]
    + [(n, f, "int", bad) for n, f in INT_FIELDS for bad in [True, False, "1", 1.0, None]])


@pytest.mark.parametrize("name,field,kind,bad", _BAD_OPTIONS)
def test_bool_and_int_fields_reject_other_types(name, field, kind, bad):
    with pytest.raises(ValueError) as err:
        make(name, **{field: bad})
    msg = str(err.value)
    assert name in msg and field in msg and repr(bad) in msg and kind in msg


@pytest.mark.parametrize("name,field", BOOL_FIELDS)
@pytest.mark.parametrize("value", [True, False])
def test_bool_fields_take_bools_and_numpy_bools(name, field, value):
    np = pytest.importorskip("numpy")
    assert getattr(make(name, **{field: value}), field) is value
    r = make(name, **{field: np.bool_(value)})
    assert getattr(r, field) is value  # a plain bool: hashes and compares like one
    assert r == make(name, **{field: value})


@pytest.mark.parametrize("name,field", INT_FIELDS)
def test_int_fields_take_numpy_ints(name, field):
    np = pytest.importorskip("numpy")
    value = getattr(make(name, **{field: np.int64(2)}), field)
    assert value == 2 and type(value) is int


@pytest.mark.parametrize("bad", [True, "1", None, float("nan"), float("inf"), 128, 1e9, -0.5],
                         ids=["bool", "str", "none", "nan", "inf", "128", "1e9", "negative"])
def test_margin_must_be_a_number_in_range(bad):
    with pytest.raises(ValueError) as err:
        DelayedScaling(margin=bad)
    msg = str(err.value)
    assert "DelayedScaling" in msg and "margin" in msg and repr(bad) in msg and "127" in msg


@pytest.mark.parametrize("margin", [0, 1, 0.5, 127])
def test_margin_takes_ints_and_floats(margin):
    assert DelayedScaling(margin=margin).margin == margin


def test_margin_numpy_scalars_become_python_numbers():
    np = pytest.importorskip("numpy")
    for value, kind in ((np.int64(2), int), (np.float32(0.5), float)):
        margin = DelayedScaling(margin=value).margin
        assert margin == value and type(margin) is kind


# ---- named recipes -----------------------------------------------------------------------
def test_recipe_names_cover_the_compare_list():
    assert lowprec.recipe.Recipe.names() == (
        "bf16", "fp8_delayed", "fp8_current", "fp8_block", "mxfp8", "nvfp4",
        "mxfp8_fwd_nvfp4_bwd", "fp8_row_mxfp8_col", "nvfp4_fp8_head")


@pytest.mark.parametrize("name,expected", [
    ("bf16", lambda: None),
    ("fp8_delayed", lambda: lowprec.DelayedScaling()),
    ("delayed", lambda: lowprec.DelayedScaling()),
    ("fp8_current", lambda: lowprec.Float8CurrentScaling()),
    ("current", lambda: lowprec.Float8CurrentScaling()),
    ("fp8_block", lambda: lowprec.Float8BlockScaling()),
    ("block", lambda: lowprec.Float8BlockScaling()),
    ("mxfp8", lambda: lowprec.MXFP8BlockScaling()),
    ("nvfp4", lambda: lowprec.NVFP4BlockScaling()),
    ("mxfp8_fwd_nvfp4_bwd",
     lambda: lowprec.CustomRecipe(qfactory=factories.mxfp8_fwd_nvfp4_bwd_factory)),
    ("fp8_row_mxfp8_col",
     lambda: lowprec.CustomRecipe(qfactory=factories.fp8_row_mxfp8_col_factory)),
    ("nvfp4_fp8_head",
     lambda: lowprec.CustomRecipe(qfactory=factories.NVFP4ExceptLayers(("lm_head",)))),
])
def test_recipe_from_name(name, expected):
    got = lowprec.recipe.Recipe.from_name(name)
    assert got == expected()
    assert type(got) is type(expected())
    assert isinstance(lowprec.recipe.Recipe.describe(name), str)
    if got is not None and not isinstance(got, lowprec.DelayedScaling):
        assert lowprec.recipe.Recipe.from_name(
            name, backward_mode="dequant").backward_mode == "dequantized"


def test_recipe_from_name_passes_fields():
    assert lowprec.recipe.Recipe.from_name("fp8_delayed", amax_history_len=4) == \
        lowprec.DelayedScaling(amax_history_len=4)


def test_recipe_from_bad_name():
    with pytest.raises(ValueError, match=r"'fp9'.*fp8_current.*nvfp4_fp8_head"):
        lowprec.recipe.Recipe.from_name("fp9")
    with pytest.raises(ValueError, match=r"'fp9'.*fp8_current.*nvfp4_fp8_head"):
        lowprec.recipe.Recipe.describe("fp9")
    with pytest.raises(TypeError, match=r"Recipe.describe takes a recipe name string, got int"):
        lowprec.recipe.Recipe.describe(3)


# ---- backward modes ------------------------------------------------------------------------
def test_backward_mode_enum_equals_strings():
    from lowprec.recipe.recipes import BackwardMode
    assert BackwardMode.DEFAULT == "default" and str(BackwardMode.DEQUANTIZED) == "dequantized"
    assert tuple(BackwardMode) == tuple(BackwardMode(m) for m in lowprec.recipe.BACKWARD_MODES)
    r = lowprec.Float8CurrentScaling(backward_mode=BackwardMode.HIGH_PRECISION)
    assert r.backward_mode == "high_precision" and type(r.backward_mode) is str
    assert r == lowprec.Float8CurrentScaling(backward_mode="unquant")


def test_bad_backward_mode_names_value_and_accepted():
    with pytest.raises(ValueError, match=r"'fast'.*default.*high_precision.*dequantized"):
        lowprec.MXFP8BlockScaling(backward_mode="fast")
    x, w = torch.randn(2, 32), torch.randn(4, 32)
    with pytest.raises(ValueError, match=r"'fast'.*dequantized"):
        lowprec.linear.function.quantized_linear(x, w, backward_mode="fast")


@pytest.mark.parametrize("mode", ["default", "high_precision", "dequantized"])
@pytest.mark.parametrize("needs_dgrad", [False, True])
@pytest.mark.parametrize("needs_wgrad", [False, True])
def test_operand_usages_table(mode, needs_dgrad, needs_wgrad):
    from lowprec.recipe.recipes import BackwardMode, operand_usages
    got = operand_usages(mode, needs_dgrad, needs_wgrad)
    default = mode == "default"
    # fprop reads x and W rowwise; only default mode keeps columnwise copies: W's for dgrad,
    # x's for wgrad
    assert got.input == (True, default and needs_wgrad)
    assert got.weight == (True, default and needs_dgrad)
    assert operand_usages(BackwardMode(mode), needs_dgrad, needs_wgrad) == got
