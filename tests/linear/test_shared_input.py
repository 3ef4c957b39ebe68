"""lowprec/linear/shared_input.py: Linears that read one input in a row (q/k/v, gate/up)
share one quantize of it under stateless formats, bit for bit what separate quantizes give,
and their backward graphs hold one columnwise copy between them."""

from __future__ import annotations

import copy

import pytest
import torch

import lowprec
from lowprec.formats.base import QuantizedTensor, Quantizer
from lowprec.recipe.recipes import (
    DelayedScaling,
    Float8BlockScaling,
    Float8CurrentScaling,
    MXFP8BlockScaling,
    NVFP4BlockScaling,
)

SHARED = {"current": Float8CurrentScaling, "block": Float8BlockScaling,
          "mxfp8": MXFP8BlockScaling}


@pytest.fixture
def quantizes(monkeypatch):
    """The class name of every quantize run, in order."""
    calls = []
    original = Quantizer.quantize

    def counting(self, x):
        calls.append(type(self).__name__)
        return original(self, x)

    monkeypatch.setattr(Quantizer, "quantize", counting)
    return calls


def _three(seed=0):
    torch.manual_seed(seed)
    return [lowprec.Linear(128, 128, name=n) for n in ("q", "k", "v")]


def _step(layers, x, recipe, inputs):
    """Forward the three layers on ``inputs(x)`` (one call per layer), backward a fixed
    loss; (outputs, x.grad, weight grads)."""
    x = x.detach().clone().requires_grad_(True)
    with lowprec.autocast(recipe=recipe):
        ys = [layer(inputs(x)) for layer in layers]
    sum((y * (i + 1)).sum() for i, y in enumerate(ys)).backward()
    return [y.detach() for y in ys] + [x.grad] + [layer.weight.grad for layer in layers]


@pytest.mark.parametrize("name", sorted(SHARED))
def test_one_quantize_same_bits(name, quantizes):
    recipe = SHARED[name]()
    layers = _three()
    twins = copy.deepcopy(layers)
    x = torch.randn(2, 64, 128)
    shared = _step(layers, x, recipe, lambda t: t)
    n_shared = len(quantizes)
    quantizes.clear()
    # a fresh view per call: the same values, but not the same tensor, so nothing is shared
    apart = _step(twins, x, recipe, lambda t: t.view_as(t))
    assert n_shared == len(quantizes) - 2  # 3 weights + 1 input + 3 dY, against 3 inputs
    for a, b in zip(shared, apart):
        assert torch.equal(a, b)


@pytest.mark.parametrize("recipe", [DelayedScaling(), NVFP4BlockScaling()],
                         ids=["delayed", "nvfp4"])
def test_stateful_formats_quantize_each_call(recipe, quantizes):
    """Delayed scaling records each layer's amax, NVFP4 draws; neither shares."""
    x = torch.randn(128, 128)
    with lowprec.autocast(recipe=recipe):
        for layer in _three():
            layer(x)
    assert len(quantizes) == 6


def test_input_changed_in_place_is_quantized_again(quantizes):
    q, k, v = _three()
    x = torch.randn(64, 128)
    recipe = Float8CurrentScaling()
    with lowprec.autocast(recipe=recipe):
        q(x)
        x.mul_(3)  # the version counter moves: k must not reuse q's quantize
        yk = k(x)
        yv = v(x)
    assert quantizes.count("Float8CurrentScalingQuantizer") == 5  # 3 weights, 2 inputs
    with lowprec.autocast(recipe=recipe):
        assert torch.equal(yk, k(x.clone())) and torch.equal(yv, v(x.clone()))


def test_different_usages_do_not_share(quantizes):
    """A layer whose weight is frozen needs no columnwise input: its own quantize."""
    q, k, v = _three()
    k.weight.requires_grad_(False)
    x = torch.randn(64, 128, requires_grad=True)
    with lowprec.autocast(recipe=Float8CurrentScaling()):
        for layer in (q, k, v):
            layer(x)
    assert len(quantizes) == 3 + 3  # q shares with v only: k's input comes between


def test_backward_graphs_share_one_columnwise_copy():
    saved = []

    def pack(t):
        if isinstance(t, QuantizedTensor) and t.has_usage("columnwise") and t.shape[-1] == 128:
            saved.append(t)
        return t

    x = torch.randn(64, 128, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with lowprec.autocast(recipe=Float8CurrentScaling()):
            ys = [layer(x) for layer in _three()]
    inputs = [t for t in saved if tuple(t.shape) == (64, 128)]
    assert len(inputs) == 3
    assert len({t.columnwise_data.data_ptr() for t in inputs}) == 1
    assert all(not t.has_usage("rowwise") for t in inputs)  # fprop's rowwise copy not kept
    sum(y.sum() for y in ys).backward()
