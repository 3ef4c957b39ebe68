"""Inference forwards of the modules (``torch.no_grad`` and ``torch.inference_mode`` inside
``lowprec.autocast``) quantize inputs and weights only rowwise, the direction the forward
GEMM reads, as Transformer Engine does, under every named recipe; a delayed-scaling
inference forward leaves the module's scaling state as it was; weights made by
``quantized_model_init`` keep every usage they hold.

The spy sees every quantized tensor made with columnwise data, whatever path made it (a
quantizer, a fused producer, a derived direction); the training forward of each case must
make some, so that an empty record under inference means something."""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch
from helpers import assert_inference_reads_rowwise_only

import lowprec
import lowprec.fused
from lowprec.formats.base import QuantizedTensor
from lowprec.modules import norms
from lowprec.modules.activations import get_activation
from lowprec.recipe.recipes import Recipe

#: every named recipe that quantizes ("bf16" is no recipe: autocast's default)
RECIPE_NAMES = [name for name in Recipe.names() if Recipe.from_name(name) is not None]
GRAD_MODES = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode}
HIDDEN, FFN, TOKENS = 64, 128, 32

MODULES = {
    "Linear": (lambda: lowprec.Linear(HIDDEN, FFN), lambda m, x: m(x)),
    "LayerNormLinear": (lambda: lowprec.LayerNormLinear(HIDDEN, FFN), lambda m, x: m(x)),
    "LayerNormLinear-rms": (lambda: lowprec.LayerNormLinear(HIDDEN, FFN, normalization="RMSNorm"),
                            lambda m, x: m(x)),
    "LayerNormMLP": (lambda: lowprec.LayerNormMLP(HIDDEN, FFN), lambda m, x: m(x)),
    "LayerNormMLP-swiglu-rms": (lambda: lowprec.LayerNormMLP(HIDDEN, FFN, activation="swiglu",
                                                             normalization="RMSNorm"),
                                lambda m, x: m(x)),
    "GroupedLinear": (lambda: lowprec.GroupedLinear(2, HIDDEN, FFN),
                      lambda m, x: m(x, [TOKENS // 2, TOKENS // 2])),
}
NORM_MODULES = [name for name in MODULES if name.startswith("LayerNorm")]


@pytest.fixture
def fused_producers(monkeypatch) -> list:
    """The fused norm and activation producers taken wherever a quantizer is set (on the CPU
    they never are: their kernels need a GPU), computed apart here; records the (rowwise,
    columnwise) usages each is asked for."""
    asked = []

    def norm_then_quantize(x, normalization, weight, bias, eps, zero_centered_gamma,
                           quantizer, rowwise, columnwise):
        asked.append(("norm", rowwise, columnwise))
        h = norms.apply_norm(x, normalization, weight, bias, eps, zero_centered_gamma)
        return quantizer.set_usage(rowwise=rowwise, columnwise=columnwise).quantize(h)

    def activation_then_quantize(h, activation, quantizer, rowwise, columnwise):
        asked.append(("activation", rowwise, columnwise))
        a = get_activation(activation)[0](h)
        return quantizer.set_usage(rowwise=rowwise, columnwise=columnwise).quantize(a)

    monkeypatch.setattr(lowprec.fused, "can_fuse",
                        lambda quantizer, x, mode: quantizer is not None
                        and mode != "high_precision")
    monkeypatch.setattr(lowprec.fused, "norm_then_quantize", norm_then_quantize)
    monkeypatch.setattr(lowprec.fused, "activation_then_quantize", activation_then_quantize)
    return asked


def _forward(module_name: str, recipe_name: str, context, *, module=None, scale: float = 1.0):
    build, call = MODULES[module_name]
    torch.manual_seed(0)
    m = build() if module is None else module
    # an input that requires grad: a training forward would then make W's columnwise data too
    x = (scale * torch.randn(TOKENS, HIDDEN)).requires_grad_()
    with context(), lowprec.autocast(recipe=Recipe.from_name(recipe_name)):
        return m, call(m, x)


@pytest.mark.parametrize("grad_mode", list(GRAD_MODES))
@pytest.mark.parametrize("recipe_name", RECIPE_NAMES)
@pytest.mark.parametrize("module_name", list(MODULES))
def test_inference_forward_makes_no_columnwise_data(module_name, recipe_name, grad_mode,
                                                    columnwise_made):
    assert_inference_reads_rowwise_only(lambda ctx: _forward(module_name, recipe_name, ctx),
                                        GRAD_MODES[grad_mode], columnwise_made)


@pytest.mark.parametrize("grad_mode", list(GRAD_MODES))
@pytest.mark.parametrize("recipe_name", RECIPE_NAMES)
@pytest.mark.parametrize("module_name", NORM_MODULES)
def test_fused_producers_of_an_inference_forward_quantize_rowwise_only(
        module_name, recipe_name, grad_mode, columnwise_made, fused_producers):
    """The fused norm (and LayerNormMLP's fused activation) that hand a GEMM its quantized
    input are asked for the rowwise direction alone."""
    _forward(module_name, recipe_name, contextlib.nullcontext)
    assert fused_producers and all(col for _, _, col in fused_producers)
    fused_producers.clear()
    columnwise_made.clear()
    _forward(module_name, recipe_name, GRAD_MODES[grad_mode])
    producers = 2 if module_name.startswith("LayerNormMLP") else 1
    assert [usages for _, *usages in fused_producers] == [[True, False]] * producers
    assert columnwise_made == []


@pytest.mark.parametrize("grad_mode", list(GRAD_MODES))
@pytest.mark.parametrize("module_name", list(MODULES))
def test_delayed_scaling_inference_forward_leaves_the_state(module_name, grad_mode):
    """A trained module's delayed-scaling state (scales, histories, amaxes since the last
    update) is the same after inference forwards: they record no amax."""
    m, y = _forward(module_name, "fp8_delayed", contextlib.nullcontext)
    y.sum().backward()
    before = m.scaling_state()
    before = {mode: {k: v.clone() for k, v in before[mode].items()} for mode in before}
    assert before["forward"]["amax_history"].any()  # the training forward recorded some
    for scale in (0.5, 4.0):  # amaxes unlike the training step's
        _forward(module_name, "fp8_delayed", GRAD_MODES[grad_mode], module=m, scale=scale)
    assert m.scaling_state() == before


@pytest.mark.parametrize("grad_mode", list(GRAD_MODES))
@pytest.mark.parametrize("recipe_name", ["fp8_current", "mxfp8"])
@pytest.mark.parametrize("module_name", list(MODULES))
def test_quantized_weights_keep_their_usages_in_inference(module_name, recipe_name, grad_mode,
                                                          columnwise_made):
    """A ``quantized_model_init`` weight holds both directions for the next training step:
    an inference forward neither drops one nor makes any other columnwise data."""
    with lowprec.quantized_model_init(recipe=Recipe.from_name(recipe_name)):
        m = MODULES[module_name][0]()
    weights = [p for p in m.parameters() if isinstance(p, QuantizedTensor)]
    assert weights and all(w.has_usage("rowwise") and w.has_usage("columnwise")
                           for w in weights)
    columnwise_made.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _forward(module_name, recipe_name, GRAD_MODES[grad_mode], module=m)
    assert columnwise_made == []
    assert all(w.has_usage("rowwise") and w.has_usage("columnwise") for w in weights)
