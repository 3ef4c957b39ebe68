"""A module under a recipe other than the one it last ran (or had its weights quantized)
under, as Transformer Engine's recipe tests expect: a change of recipe type warns once and
rebuilds the quantizers; weights quantized in another format than the active recipe's
weight quantizer makes are refused with an error naming both."""

from __future__ import annotations

import warnings

import pytest
import torch

import lowprec
from lowprec.formats import (
    Float8BlockQuantizer,
    Float8Quantizer,
    MXFP8Quantizer,
)

BF16 = torch.bfloat16


def _module(cls):
    if cls is lowprec.GroupedLinear:
        return cls(1, 128, 128, params_dtype=BF16)
    return cls(128, 128, params_dtype=BF16)


def _forward(m, x):
    return m(x, [x.shape[0]]) if isinstance(m, lowprec.GroupedLinear) else m(x)


def _forward_quantizers(m):
    return m._recipe_states["forward"].quantizers


def _step(m, recipe):
    x = torch.randn(64, 128, dtype=BF16, requires_grad=True)
    with lowprec.autocast(recipe=recipe):
        y = _forward(m, x)
    y.float().mean().backward()


@pytest.mark.parametrize("target, quantizer", [
    (lowprec.MXFP8BlockScaling, MXFP8Quantizer),
    (lowprec.Float8BlockScaling, Float8BlockQuantizer),
])
def test_recipe_type_change_warns_once_and_rebuilds_quantizers(target, quantizer):
    m = lowprec.Linear(128, 128, params_dtype=BF16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning while the recipe stays
        for _ in range(3):
            _step(m, lowprec.DelayedScaling())
    assert all(isinstance(q, Float8Quantizer) for q in _forward_quantizers(m))
    with pytest.warns(UserWarning, match="Recipe type changed from DelayedScaling to "
                                         f"{target.__name__}"):
        _step(m, target())
    assert all(isinstance(q, quantizer) for q in _forward_quantizers(m))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(2):
            _step(m, target())


def test_same_recipe_type_with_other_settings_does_not_warn():
    m = lowprec.Linear(128, 128, params_dtype=BF16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _step(m, lowprec.DelayedScaling(amax_history_len=16))
        _step(m, lowprec.DelayedScaling(amax_history_len=1))


@pytest.mark.parametrize("cls", [lowprec.Linear, lowprec.LayerNormLinear, lowprec.LayerNormMLP,
                                 lowprec.GroupedLinear])
@pytest.mark.parametrize("init, run", [
    (lowprec.MXFP8BlockScaling, lowprec.DelayedScaling),
    (lowprec.Float8BlockScaling, lowprec.DelayedScaling),
    (lowprec.NVFP4BlockScaling, lowprec.Float8CurrentScaling),
    (lowprec.Float8CurrentScaling, lowprec.MXFP8BlockScaling),
])
def test_weights_quantized_in_another_format_are_refused(cls, init, run):
    with lowprec.quantized_model_init(enabled=True, recipe=init()):
        m = _module(cls)
    x = torch.randn(64, 128, dtype=BF16)
    with pytest.warns(UserWarning, match="Recipe type changed"), \
            pytest.raises(RuntimeError, match="Recipe mismatch for ") as err:
        with lowprec.autocast(recipe=run()):
            _forward(m, x)
    weight = type(next(p for p in m.parameters() if p.dim() == 2)).__name__
    assert weight in str(err.value) and run.__name__ in str(err.value)


@pytest.mark.parametrize("init, run", [
    (lowprec.DelayedScaling, lowprec.Float8CurrentScaling),
    (lowprec.Float8CurrentScaling, lowprec.DelayedScaling),
    (lowprec.MXFP8BlockScaling, lowprec.MXFP8BlockScaling),
])
def test_weights_of_the_format_the_recipe_makes_run(init, run):
    """Per-tensor FP8 weights serve both per-tensor recipes (the same tensor type)."""
    with lowprec.quantized_model_init(enabled=True, recipe=init()):
        m = lowprec.Linear(128, 128, params_dtype=BF16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the recipe-type and quantizer-update warnings
        with lowprec.autocast(recipe=run()):
            y = m(torch.randn(64, 128, dtype=BF16))
    assert y.shape == (64, 128) and torch.isfinite(y.float()).all()


@pytest.mark.parametrize("cls", [lowprec.Linear, lowprec.LayerNormLinear, lowprec.LayerNormMLP,
                                 lowprec.GroupedLinear])
def test_quantized_weights_under_other_settings_warn(cls):
    """Transformer Engine's quantizer-update warning: weights made under one DelayedScaling,
    a forward under another (same format, other settings)."""
    with lowprec.quantized_model_init(recipe=lowprec.DelayedScaling(amax_history_len=1024)):
        m = _module(cls)
    x = torch.randn(64, 128, dtype=BF16)
    with pytest.warns(UserWarning, match="Quantizer is being updated"):
        with lowprec.autocast(recipe=lowprec.DelayedScaling(amax_history_len=1)):
            _forward(m, x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # under the recipe the weights were made with: silent
        with lowprec.autocast(recipe=lowprec.DelayedScaling(amax_history_len=1024)):
            _forward(m, x)
