"""Constructor options of every quantizer: flags must be bools and amax_epsilon a real
number that stays finite in fp32, else a ValueError naming the quantizer, the option and
the value (the recipes' fields are in ``recipe/test_recipe.py``)."""

from __future__ import annotations

import math

import pytest
import torch

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
