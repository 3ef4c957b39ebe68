"""Transformer Engine's recipe-state tests, ported to lowprec's public API on the CPU.

The cases of TE's ``tests/pytorch/test_recipe.py`` (class ``TestFP8Recipe``) on a module's
recipe state, with TE's shapes (32x32 layers, a batch of 32, fp32 parameters and inputs)
and TE's assertions:

* ``test_check_for_weight_tensor_and_recipe_correspondence`` (2 cases): a ``Linear`` whose
  weight ``quantized_model_init`` quantized under MXFP8 / FP8 block scaling, run under
  ``DelayedScaling``, raises ``RuntimeError("Recipe mismatch for ...")``.
* ``test_dynamic_recipe_update`` (2 cases): three training steps under ``DelayedScaling``
  build ``Float8Quantizer`` forward quantizers; the first forward under MXFP8 / FP8 block
  scaling warns ``Recipe type changed`` and rebuilds them as that recipe's quantizers; the
  following forwards warn nothing.
* ``test_quantizer_update`` (4 cases: ``Linear``, ``LayerNormLinear``, ``LayerNormMLP``,
  ``GroupedLinear``): weights quantized under ``DelayedScaling(amax_history_len=1024)``,
  a forward under ``DelayedScaling(amax_history_len=1)`` warns ``Quantizer is being
  updated, this may affect model behavior``.

* ``test_hybrid_weight_of_other_halves_is_a_recipe_mismatch`` (2 cases, eager and
  compiled): TE's hybrid quantization tests refuse a hybrid weight whose halves are not
  the active hybrid recipe's formats. lowprec compared only the tensor type (both
  ``HybridQuantizedTensor``) and ran it: a lowprec bug, fixed by comparing each half.

The first eight cases agree with TE: neither side is wrong, no case needed a change to lowprec.

lowprec's API differs from TE's in two places these tests touch, by design (neither
changes what is asserted):

* the forward quantizers TE's test reads as ``linear.quantizers["scaling_fwd"]`` are read
  from the module's forward recipe state (``module._recipe_states["forward"]``);
* the mismatch case also expects the ``Recipe type changed`` warning: the module's
  quantizers were built for the ``quantized_model_init`` recipe, and TE warns there too
  (its test does not turn warnings into errors, so it does not check either way).

Each test checks beyond TE's assertions only where a TE assertion alone could pass for
the wrong reason (the error names both formats; the updated-quantizer warning stays away
under the recipe the weights were made with).
"""

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

IN_FEATURES = OUT_FEATURES = BATCH = 32


def _forward_quantizers(module):
    # TE's ``module.quantizers["scaling_fwd"]``: lowprec keeps a module's forward
    # quantizers in its forward recipe state (no public accessor; the repo's own module
    # tests read them the same way)
    return module._recipe_states["forward"].quantizers


def _assert_forward_quantizers(module, quantizer_type) -> None:
    """The module has forward quantizers, every one a ``quantizer_type``."""
    quantizers = _forward_quantizers(module)
    assert len(quantizers) > 0
    for quantizer in quantizers:
        assert isinstance(quantizer, quantizer_type)


@pytest.mark.parametrize("model_init_recipe", [
    lowprec.MXFP8BlockScaling(),
    lowprec.Float8BlockScaling(),
], ids=["MXFP8BlockScaling", "Float8BlockScaling"])
def test_check_for_weight_tensor_and_recipe_correspondence(model_init_recipe):
    """TE: weights quantized under one recipe, a forward under ``DelayedScaling`` raises
    ``Recipe mismatch for``. lowprec agrees (``_check_quantized_weights`` in
    ``lowprec/modules/quantizers.py``)."""
    with lowprec.quantized_model_init(enabled=True, recipe=model_init_recipe):
        linear = lowprec.Linear(IN_FEATURES, OUT_FEATURES)
    weight_type = type(linear.weight).__name__
    assert weight_type != "Float8Tensor"  # else the check below could not fail

    x = torch.randn(BATCH, IN_FEATURES)
    with pytest.warns(UserWarning, match="Recipe type changed"):
        with lowprec.autocast(enabled=True, recipe=lowprec.DelayedScaling()):
            with pytest.raises(RuntimeError) as excinfo:
                _ = linear(x)
    assert "Recipe mismatch for " in str(excinfo.value)
    # the message names the weight's format and the recipe that refused it
    assert weight_type in str(excinfo.value) and "DelayedScaling" in str(excinfo.value)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_hybrid_weight_of_other_halves_is_a_recipe_mismatch(compiled):
    """TE's hybrid quantization refuses a weight quantized under one hybrid recipe in a
    forward under another whose halves are other formats. lowprec compares each half of a
    hybrid weight with its direction's quantizer: a weight of FP8 rows and MXFP8 columns
    under MXFP8-forward/NVFP4-backward raises (the tensor types alone, both
    ``HybridQuantizedTensor``, would pass), and under its own recipe it runs."""
    made_under = lowprec.recipe.Recipe.from_name("fp8_row_mxfp8_col")
    with lowprec.quantized_model_init(recipe=made_under):
        linear = lowprec.Linear(IN_FEATURES, OUT_FEATURES, params_dtype=torch.bfloat16)
    x = torch.randn(BATCH, IN_FEATURES, dtype=torch.bfloat16)
    run = torch.compile(linear, fullgraph=False) if compiled else linear
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the recipe type change's warning
        with lowprec.autocast(recipe=made_under):
            run(x)
        with pytest.raises(RuntimeError, match="Recipe mismatch for") as excinfo:
            with lowprec.autocast(recipe=lowprec.recipe.Recipe.from_name("mxfp8_fwd_nvfp4_bwd")):
                run(x)
    message = str(excinfo.value)
    assert "rowwise=Float8Tensor, columnwise=MXFP8Tensor" in message
    assert "rowwise=MXFP8Tensor, columnwise=NVFP4Tensor" in message


@pytest.mark.parametrize("target_recipe_class, expected_quantizer_type", [
    pytest.param(lowprec.MXFP8BlockScaling, MXFP8Quantizer,
                 id="DelayedScaling->MXFP8BlockScaling"),
    pytest.param(lowprec.Float8BlockScaling, Float8BlockQuantizer,
                 id="DelayedScaling->Float8BlockScaling"),
])
def test_dynamic_recipe_update(target_recipe_class, expected_quantizer_type):
    """TE: a change of recipe type warns once (``Recipe type changed``) and rebuilds the
    module's quantizers for the new recipe. lowprec agrees
    (``_warn_on_recipe_type_change`` in ``lowprec/modules/scaling.py``)."""
    linear = lowprec.Linear(IN_FEATURES, OUT_FEATURES)
    initial_recipe = lowprec.DelayedScaling()

    # Run initial iterations with DelayedScaling
    for _ in range(3):
        x = torch.randn(BATCH, IN_FEATURES)
        with lowprec.autocast(enabled=True, recipe=initial_recipe):
            y = linear(x)
        loss = y.mean()
        loss.backward()

    _assert_forward_quantizers(linear, Float8Quantizer)

    # Change recipe
    target_recipe = target_recipe_class()

    # Run subsequent iterations with the target recipe
    for i in range(3):
        x = torch.randn(BATCH, IN_FEATURES)
        if i == 0:
            # Expect a warning on the first iteration with the new recipe
            with pytest.warns(UserWarning, match="Recipe type changed"):
                with lowprec.autocast(enabled=True, recipe=target_recipe):
                    y = linear(x)
            _assert_forward_quantizers(linear, expected_quantizer_type)
        else:
            # No warning expected on subsequent iterations
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # Raise error if unexpected warning occurs
                with lowprec.autocast(enabled=True, recipe=target_recipe):
                    y = linear(x)
        loss = y.mean()
        loss.backward()

    # Final check
    _assert_forward_quantizers(linear, expected_quantizer_type)


@pytest.mark.parametrize("module_class", [
    lowprec.Linear,
    lowprec.LayerNormLinear,
    lowprec.LayerNormMLP,
    lowprec.GroupedLinear,
], ids=lambda c: c.__name__)
def test_quantizer_update(module_class):
    """TE: weights quantized under one ``DelayedScaling``, a forward under another (same
    format, other settings) warns ``Quantizer is being updated``. lowprec agrees
    (``_check_quantized_weights`` in ``lowprec/modules/quantizers.py``)."""
    recipe = lowprec.DelayedScaling(amax_history_len=1024)
    with lowprec.quantized_model_init(recipe=recipe):
        if module_class == lowprec.GroupedLinear:
            module = module_class(1, IN_FEATURES, OUT_FEATURES)
        else:
            module = module_class(IN_FEATURES, OUT_FEATURES)

    x = torch.randn(BATCH, IN_FEATURES)

    def forward():
        if module_class == lowprec.GroupedLinear:
            return module(x, [BATCH])
        return module(x)

    # Not in TE's test: under the recipe the weights were made with, no warning (so the
    # warning below is about the other settings, not about any forward).
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with lowprec.autocast(enabled=True, recipe=recipe):
            forward()

    recipe = lowprec.DelayedScaling(amax_history_len=1)
    with lowprec.autocast(enabled=True, recipe=recipe):
        warn_msg = "Quantizer is being updated, this may affect model behavior"
        with pytest.warns(UserWarning, match=warn_msg):
            y = forward()
    assert y.shape == (BATCH, OUT_FEATURES) and torch.isfinite(y).all()
