"""Inference forwards of ``lowprec.ops.Sequential`` (``torch.no_grad`` and
``torch.inference_mode`` inside ``lowprec.autocast``) quantize inputs and weights only
rowwise, the direction the forward GEMM reads, under every named recipe: a norm, bias,
activation or ``Quantize`` op that hands the next linear its input already quantized
quantizes it rowwise alone (it made the columnwise copy for a wgrad that cannot come). A
delayed-scaling inference forward leaves the linears' scaling state as it was, and
``quantized_model_init`` weights keep every usage they hold.

The spy sees every quantized tensor made with columnwise data, whatever path made it; the
training forward of each case must make some, so that an empty record under inference
means something."""

from __future__ import annotations

import contextlib

import pytest
import torch
from helpers import assert_inference_reads_rowwise_only

import lowprec
import lowprec.fused
import lowprec.ops as ops
from lowprec.formats.base import QuantizedTensor
from lowprec.modules import norms
from lowprec.recipe.recipes import Recipe

#: every named recipe that quantizes ("bf16" is no recipe: autocast's default)
RECIPE_NAMES = [name for name in Recipe.names() if Recipe.from_name(name) is not None]
GRAD_MODES = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode}
HIDDEN, FFN, TOKENS = 64, 128, 32
SPLITS = [TOKENS // 2, TOKENS // 2]

SEQUENCES = {
    "BasicLinear": lambda: ops.Sequential(ops.BasicLinear(HIDDEN, FFN)),
    "Linear": lambda: ops.Sequential(ops.Linear(HIDDEN, FFN)),
    "LayerNorm+Linear": lambda: ops.Sequential(ops.LayerNorm(HIDDEN), ops.Linear(HIDDEN, FFN)),
    "RMSNorm+BasicLinear+Bias+GELU+BasicLinear": lambda: ops.Sequential(
        ops.RMSNorm(HIDDEN), ops.BasicLinear(HIDDEN, FFN), ops.Bias(FFN), ops.GELU(),
        ops.BasicLinear(FFN, HIDDEN)),
    "Linear+SwiGLU+Linear": lambda: ops.Sequential(
        ops.Linear(HIDDEN, FFN), ops.SwiGLU(), ops.Linear(FFN // 2, HIDDEN)),
    "Quantize+Linear": lambda: ops.Sequential(ops.Quantize(), ops.Linear(HIDDEN, FFN)),
    "GroupedLinear": lambda: ops.Sequential(ops.GroupedLinear(2, HIDDEN, FFN)),
}
WITH_NORM = [name for name in SEQUENCES if "Norm" in name]


def _forward(name: str, recipe_name: str, context, *, seq=None, scale: float = 1.0):
    torch.manual_seed(0)
    seq = SEQUENCES[name]() if seq is None else seq
    # an input that requires grad: a training forward would then make W's columnwise data too
    x = (scale * torch.randn(TOKENS, HIDDEN)).requires_grad_()
    extra = [SPLITS] if name == "GroupedLinear" else []
    with context(), lowprec.autocast(recipe=Recipe.from_name(recipe_name)):
        return seq, seq(x, *extra)


@pytest.mark.parametrize("grad_mode", list(GRAD_MODES))
@pytest.mark.parametrize("recipe_name", RECIPE_NAMES)
@pytest.mark.parametrize("name", list(SEQUENCES))
def test_inference_forward_makes_no_columnwise_data(name, recipe_name, grad_mode,
                                                    columnwise_made):
    assert_inference_reads_rowwise_only(lambda ctx: _forward(name, recipe_name, ctx),
                                        GRAD_MODES[grad_mode], columnwise_made)


@pytest.mark.parametrize("grad_mode", list(GRAD_MODES))
@pytest.mark.parametrize("recipe_name", RECIPE_NAMES)
@pytest.mark.parametrize("name", WITH_NORM)
def test_fused_norm_of_an_inference_forward_quantizes_rowwise_only(name, recipe_name,
                                                                   grad_mode, monkeypatch):
    """The fused norm that hands the next linear its quantized input (taken here wherever a
    quantizer is set, computed apart: its kernels need a GPU) is asked for the rowwise
    direction alone; a training forward asks for both."""
    asked = []

    def norm_then_quantize(x, normalization, weight, bias, eps, zero_centered_gamma,
                           quantizer, rowwise, columnwise):
        asked.append((rowwise, columnwise))
        h = norms.apply_norm(x, normalization, weight, bias, eps, zero_centered_gamma)
        return quantizer.set_usage(rowwise=rowwise, columnwise=columnwise).quantize(h)

    monkeypatch.setattr(lowprec.fused, "can_fuse", lambda quantizer, x, mode: True)
    monkeypatch.setattr(lowprec.fused, "norm_then_quantize", norm_then_quantize)
    _forward(name, recipe_name, contextlib.nullcontext)
    assert asked == [(True, True)]
    asked.clear()
    _forward(name, recipe_name, GRAD_MODES[grad_mode])
    assert asked == [(True, False)]


@pytest.mark.parametrize("grad_mode", list(GRAD_MODES))
@pytest.mark.parametrize("name", list(SEQUENCES))
def test_delayed_scaling_inference_forward_leaves_the_state(name, grad_mode):
    """The linears' delayed-scaling state after a training step (scales, histories, amaxes
    since the last update) is the same after inference forwards: they record no amax."""
    seq, y = _forward(name, "fp8_delayed", contextlib.nullcontext)
    y.sum().backward()
    held = [m for m in seq.modules() if isinstance(m, lowprec.modules.base.LowprecModule)]

    def states():
        return [{mode: {k: v.clone() for k, v in sd.items()}
                 for mode, sd in m.scaling_state().items()} for m in held]

    before = states()
    assert all(s["forward"]["amax_history"].any() for s in before)  # training recorded some
    for scale in (0.5, 4.0):  # amaxes unlike the training step's
        _forward(name, "fp8_delayed", GRAD_MODES[grad_mode], seq=seq, scale=scale)
    after = states()
    assert all(torch.equal(a[mode][k], b[mode][k])
               for a, b in zip(after, before, strict=True) for mode in b for k in b[mode])


@pytest.mark.parametrize("grad_mode", list(GRAD_MODES))
@pytest.mark.parametrize("recipe_name", ["fp8_current", "mxfp8"])
@pytest.mark.parametrize("name", ["LayerNorm+Linear", "Quantize+Linear", "GroupedLinear"])
def test_quantized_weights_keep_their_usages_in_inference(name, recipe_name, grad_mode,
                                                          columnwise_made):
    """A ``quantized_model_init`` weight holds both directions for the next training step:
    an inference forward neither drops one nor makes any other columnwise data."""
    with lowprec.quantized_model_init(recipe=Recipe.from_name(recipe_name)):
        seq = SEQUENCES[name]()
    weights = [p for p in seq.parameters() if isinstance(p, QuantizedTensor)]
    assert weights and all(w.has_usage("rowwise") and w.has_usage("columnwise")
                           for w in weights)
    columnwise_made.clear()
    _forward(name, recipe_name, GRAD_MODES[grad_mode], seq=seq)
    assert columnwise_made == []
    assert all(w.has_usage("rowwise") and w.has_usage("columnwise") for w in weights)
