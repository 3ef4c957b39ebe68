"""Quantized weights reused across micro-batches (``autocast(cache_weights=True)``): the
same outputs and gradients as quantizing in every call, one weight quantization per
optimizer step, and a re-quantization whenever the weight or the recipe changes."""

from __future__ import annotations

import copy

import pytest
import torch
from same_run import RECIPES as SHARED_RECIPES

import lowprec
from lowprec import autocast
from lowprec.linear import weight_cache
from lowprec.recipe.recipes import Float8CurrentScaling, MXFP8BlockScaling

D = 128


RECIPES = {**{k: v for k, v in SHARED_RECIPES.items() if k != "custom"},
           "current_dequantized": lambda: Float8CurrentScaling(backward_mode="dequantized")}


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.ln = lowprec.LayerNormLinear(D, D, name="ln")
        self.mlp = lowprec.LayerNormMLP(D, 2 * D, name="mlp")
        self.g = lowprec.GroupedLinear(2, D, D, name="g")

    def forward(self, x):
        h = self.mlp(self.ln(x))
        return self.g(h.reshape(-1, D), [128, 128]).reshape(h.shape)


def _train(model, recipe, cache, micro=3, steps=2):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(1)
    outs = []
    for _ in range(steps):
        for i in range(micro):
            x = torch.randn(2, 128, D, generator=gen)
            torch.manual_seed(100 + i)  # NVFP4's stochastic rounding of gradients
            # Delayed scaling with caching: the weight is quantized with the scale the
            # first micro-batch saw (as TE's is_first_microbatch), so the runs agree only
            # when no update moves the weight's scale in between; the regions here run
            # back to back under one autocast per step for that reason.
            with autocast(recipe=recipe, cache_weights=cache):
                y = model(x)
            y.backward(torch.ones_like(y))
            outs.append(y.detach())
        opt.step()
        opt.zero_grad()
    return outs


@pytest.mark.parametrize("rname", [r for r in RECIPES if r != "delayed"])
def test_cached_weights_bit_identical(rname):
    recipe = RECIPES[rname]()
    torch.manual_seed(0)
    a = Model()
    b = copy.deepcopy(a)
    ya = _train(a, recipe, cache=False)
    yb = _train(b, recipe, cache=True)
    for u, v in zip(ya, yb):
        assert torch.equal(u, v)
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(p, q), n


def _count_weight_quantizes(monkeypatch):
    """Counts quantizations of a (D, D) tensor: the weight (the inputs have 256 rows)."""
    calls = []
    orig_quantize = lowprec.Float8CurrentScalingQuantizer.quantize

    def counting(self, x):
        if x.shape == (D, D):
            calls.append(1)
        return orig_quantize(self, x)
    monkeypatch.setattr(lowprec.Float8CurrentScalingQuantizer, "quantize", counting)
    return calls


def test_once_per_optimizer_step_and_again_after_it(monkeypatch):
    recipe = Float8CurrentScaling()
    m = lowprec.Linear(D, D, name="l")
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    calls = _count_weight_quantizes(monkeypatch)
    for step in range(2):
        for _ in range(4):
            with autocast(recipe=recipe, cache_weights=True):
                m(torch.randn(256, D)).sum().backward()
        assert len(calls) == step + 1  # one weight quantization per step
        opt.step()
    with autocast(recipe=recipe):  # without the flag: every call quantizes
        m(torch.randn(256, D)).sum().backward()
        m(torch.randn(256, D)).sum().backward()
    assert len(calls) == 4


def test_a_changed_weight_or_recipe_quantizes_again():
    m = lowprec.Linear(D, D, name="l")
    x = torch.randn(128, D)
    r1, r2 = Float8CurrentScaling(), MXFP8BlockScaling()
    with torch.no_grad():
        with autocast(recipe=r1, cache_weights=True):
            y1 = m(x)
        m.weight.mul_(2)  # in place: the version counter moves
        with autocast(recipe=r1, cache_weights=True):
            y2 = m(x)
        with autocast(recipe=r2, cache_weights=True):
            y3 = m(x)
        with autocast(recipe=r2):
            y3_ref = m(x)
    assert not torch.equal(y1, y2)
    with torch.no_grad(), autocast(recipe=r1):
        assert torch.equal(y2, m(x))
    assert torch.equal(y3, y3_ref)


def test_cache_weights_must_be_a_bool():
    with pytest.raises(TypeError, match="cache_weights"):
        with autocast(recipe=Float8CurrentScaling(), cache_weights="yes"):
            pass


def test_clear_frees_the_copies():
    m = lowprec.Linear(D, D, name="l")
    with torch.no_grad(), autocast(recipe=Float8CurrentScaling(), cache_weights=True):
        m(torch.randn(128, D))
    assert len(weight_cache._CACHE) >= 1
    weight_cache.clear()
    assert len(weight_cache._CACHE) == 0
