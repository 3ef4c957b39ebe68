"""Constructor options of every quantizer: flags must be bools and amax_epsilon a real
number that stays finite in fp32, else a ValueError naming the quantizer, the option and
the value (the recipes' fields are in ``recipe/test_recipe.py``); and the public API's other
arguments a value of the wrong kind would silently change (a truthy string taken as True, a
falsy int ignored), which raise naming the argument."""

from __future__ import annotations

import math

import pytest
import torch

import lowprec
from lowprec import (
    Float8BlockQuantizer,
    Float8CurrentScalingQuantizer,
    MXFP8Quantizer,
    NVFP4Quantizer,
)

FP32_MAX = float(torch.finfo(torch.float32).max)

# every bool constructor option of every quantizer, written out
FLAGS = [(Float8CurrentScalingQuantizer, "force_pow_2_scales"),
         (Float8BlockQuantizer, "force_pow_2_scales"),
         (MXFP8Quantizer, "with_2d_quantization"),
         (NVFP4Quantizer, "with_rht"), (NVFP4Quantizer, "with_2d_quantization"),
         (NVFP4Quantizer, "stochastic_rounding")]
EPSILON_QUANTIZERS = [Float8CurrentScalingQuantizer, Float8BlockQuantizer]


def _ids(params):
    return [f"{cls.__name__}.{name}" for cls, name in params]


@pytest.mark.parametrize("cls,flag", FLAGS, ids=_ids(FLAGS))
@pytest.mark.parametrize("bad", ["false", "True", "", 0, 1, None, 1.0],
                         ids=["false", "True", "empty", "0", "1", "none", "float"])
def test_flags_reject_non_bools(cls, flag, bad):
    with pytest.raises(ValueError) as err:
        cls(**{flag: bad})
    msg = str(err.value)
    assert cls.__name__ in msg and flag in msg and repr(bad) in msg and "bool" in msg


@pytest.mark.parametrize("cls,flag", FLAGS, ids=_ids(FLAGS))
@pytest.mark.parametrize("value", [True, False])
def test_flags_take_bools_and_numpy_bools(cls, flag, value):
    np = pytest.importorskip("numpy")
    assert getattr(cls(**{flag: value}), flag) is value
    assert getattr(cls(**{flag: np.bool_(value)}), flag) is value


@pytest.mark.parametrize("cls", EPSILON_QUANTIZERS)
@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan, 1e39, -1e-3, "1e-3", None, True],
                         ids=["inf", "-inf", "nan", "1e39", "negative", "str", "none", "bool"])
def test_amax_epsilon_rejects_values_not_finite_in_fp32(cls, bad):
    with pytest.raises(ValueError) as err:
        cls(amax_epsilon=bad)
    msg = str(err.value)
    assert cls.__name__ in msg and "amax_epsilon" in msg and repr(bad) in msg
    assert ">= 0" in msg and repr(FP32_MAX) in msg


@pytest.mark.parametrize("cls", EPSILON_QUANTIZERS)
def test_amax_epsilon_takes_numpy_scalars(cls):
    np = pytest.importorskip("numpy")
    for value in (np.float32(1e-3), np.float64(0.25), np.int64(0)):
        eps = cls(amax_epsilon=value).amax_epsilon
        assert eps == float(value) and type(eps) is float
    with pytest.raises(ValueError, match="amax_epsilon"):
        cls(amax_epsilon=np.float64(1e39))


@pytest.mark.parametrize("cls", EPSILON_QUANTIZERS)
def test_large_finite_amax_epsilon_quantizes_to_finite_values(cls):
    # legal however large: the amax is raised to it, the scale stays a positive fp32 number
    x = torch.full((128, 128), 0.5)
    assert torch.isfinite(cls(amax_epsilon=1e30).quantize(x).dequantize()).all()


# ---- the public API's other arguments ----------------------------------------------------------
def _quantized():
    return Float8CurrentScalingQuantizer(torch.float8_e4m3fn).quantize(torch.randn(4, 32))


@pytest.mark.parametrize("make, error, names", [
    (lambda: lowprec.Linear(4, 4, bias="no"), ValueError, "bias"),
    (lambda: lowprec.LayerNormLinear(8, 8, bias=1), ValueError, "bias"),
    (lambda: lowprec.GroupedLinear(2, 8, 8, bias="yes"), ValueError, "bias"),
    (lambda: lowprec.Linear(4, -1), ValueError, "out_features"),
    (lambda: lowprec.Linear(4.5, 4), ValueError, "in_features"),
    (lambda: lowprec.Linear(True, 4), ValueError, "in_features"),
    (lambda: lowprec.LayerNormMLP(8, -2), ValueError, "features"),
    (lambda: lowprec.autocast(enabled="no").__enter__(), TypeError, "enabled"),
    (lambda: lowprec.quantized_model_init(enabled="no").__enter__(), TypeError, "enabled"),
    (lambda: lowprec.autocast(recipe=lowprec.DelayedScaling(),
                              amax_reduction_group=5).__enter__(),
     TypeError, "amax_reduction_group"),
    (lambda: _quantized().update_usage(rowwise_usage=0), TypeError, "rowwise_usage"),
    (lambda: _quantized().update_usage(columnwise_usage="no"), TypeError, "columnwise_usage"),
    (lambda: _quantized().dequantize(dtype=torch.int32), TypeError, "dtype"),
    (lambda: _quantized().dequantize(dtype="x"), TypeError, "dtype"),
    (lambda: lowprec.attach_recipe(lowprec.Linear(4, 4), lowprec.DelayedScaling(),
                                   amax_reduction_group="world"),
     TypeError, "amax_reduction_group"),
    (lambda: lowprec.Linear(4, 4, name=3), TypeError, "name"),
    (lambda: lowprec.LayerNormLinear(8, 8, eps="1e-5"), ValueError, "eps"),
    (lambda: lowprec.LayerNormMLP(8, 16, eps=-1.0), ValueError, "eps"),
    (lambda: lowprec.RMSNorm(8, eps=math.nan), ValueError, "eps"),
    (lambda: lowprec.recipe.CustomRecipe(lambda: None), TypeError, "one argument"),
    (lambda: lowprec.recipe.CustomRecipe(lambda role, layer: None), TypeError, "one argument"),
    (lambda: lowprec.Linear(4, 4)([1.0, 2.0, 3.0, 4.0]), TypeError, "tensor input, got list"),
    (lambda: lowprec.LayerNormMLP(4, 8)(None), TypeError, "tensor input, got NoneType"),
    (lambda: lowprec.LayerNormLinear(0, 4), ValueError, "norm needs"),
    (lambda: lowprec.RMSNorm(0), ValueError, "norm needs"),
    (lambda: lowprec.LayerNormMLP(8, 0), ValueError, "ffn_hidden_size"),
], ids=["linear-bias", "layernorm_linear-bias", "grouped-bias", "out_features", "float-size",
        "bool-size", "mlp-ffn", "autocast-enabled", "init-enabled", "group", "update_usage-0",
        "update_usage-str", "dequantize-int", "dequantize-str", "attach-group", "name",
        "eps-str", "eps-negative", "eps-nan", "factory-no-argument", "factory-two-arguments",
        "list-input", "none-input", "norm-no-features", "rmsnorm-no-features",
        "mlp-no-hidden"])
def test_bad_arguments_raise_naming_them(make, error, names):
    with pytest.raises(error, match=names):
        make()


def test_sizes_and_flags_take_numpy_scalars_and_zero():
    np = pytest.importorskip("numpy")
    m = lowprec.Linear(np.int64(4), 0, bias=np.bool_(False))
    assert m.weight.shape == (0, 4) and m.bias is None
    assert _quantized().dequantize(dtype=torch.float64).dtype == torch.float64
    assert lowprec.LayerNormLinear(8, 8, eps=np.float32(0.5)).eps == 0.5
    # a factory whose further parameters have defaults
    lowprec.recipe.CustomRecipe(lambda role, scale=1: lowprec.IdentityQuantizer())
