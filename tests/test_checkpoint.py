"""Activation checkpointing (SPEC section 6): ``lowprec.checkpoint`` recomputes every
lowprec forward exactly as it ran, so outputs, gradients and the delayed-scaling state are
bit-identical to running without checkpointing; the plain ``torch.utils.checkpoint``
raises where it would silently be wrong."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.utils.checkpoint as torch_checkpoint
from same_run import RECIPES as SHARED_RECIPES
from same_run import assert_same_run, delayed_states

import lowprec
import lowprec.ops as ops
from lowprec import autocast
from lowprec.recipe import DelayedScaling, Float8CurrentScaling

D = 128  # every block divides it (128x128 FP8 blocks, MXFP8 32, NVFP4 16)


RECIPES = {k: SHARED_RECIPES[k] for k in ("current", "delayed", "block", "mxfp8", "nvfp4",
                                          "custom")}


class Block(torch.nn.Module):
    """Several modules, a norm and an activation between them."""

    def __init__(self) -> None:
        super().__init__()
        self.ln_lin = lowprec.LayerNormLinear(D, D, name="qkv")
        self.lin = lowprec.Linear(D, D, name="proj")
        self.mlp = lowprec.LayerNormMLP(D, 2 * D, activation="swiglu", name="mlp")

    def forward(self, x):
        h = x + self.lin(torch.nn.functional.gelu(self.ln_lin(x)))
        return h + self.mlp(h)


MODELS = {
    "linear": lambda: lowprec.Linear(D, D, name="l"),
    "layernorm_linear": lambda: lowprec.LayerNormLinear(D, D, name="l"),
    "layernorm_mlp": lambda: lowprec.LayerNormMLP(D, 2 * D, name="m"),
    "ops": lambda: ops.Sequential(ops.LayerNorm(D), ops.Linear(D, 2 * D), ops.GELU(),
                                  ops.Linear(2 * D, D)),
    "block": Block,
}


def _pair(model):
    torch.manual_seed(0)
    m = MODELS[model]()
    return m, copy.deepcopy(m)


def _step(m, x, recipe, seed, how, reentrant, autocast_inside):
    """One forward and backward; ``how``: 'plain' (no checkpoint), 'lowprec' or 'torch'."""
    def fn(t):
        if autocast_inside:
            with autocast(recipe=recipe):
                return m(t)
        return m(t)

    torch.manual_seed(seed)  # NVFP4's stochastic rounding draws from the default generator
    ctx = autocast(recipe=recipe) if not autocast_inside else contextlib.nullcontext()
    with ctx:
        if how == "plain":
            y = fn(x)
        elif how == "lowprec":
            y = lowprec.checkpoint(fn, x, use_reentrant=reentrant)
        else:
            y = torch_checkpoint.checkpoint(fn, x, use_reentrant=reentrant)
    g = torch.randn(y.shape, generator=torch.Generator().manual_seed(seed))
    y.backward(g)
    return y.detach()


def _compare(rname, model, reentrant, autocast_inside, steps=2):
    recipe = RECIPES[rname]()
    a, b = _pair(model)
    xa = torch.randn(2, D // 2, D, requires_grad=True)
    xb = xa.detach().clone().requires_grad_(True)
    for step in range(steps):
        ya = _step(a, xa, recipe, 10 + step, "plain", reentrant, autocast_inside)
        yb = _step(b, xb, recipe, 10 + step, "lowprec", reentrant, autocast_inside)
        assert_same_run(a, b, xa, xb, ya, yb)


@pytest.mark.parametrize("reentrant", [False, True], ids=["nonreentrant", "reentrant"])
@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("rname", list(RECIPES))
def test_checkpoint_bit_identical(rname, model, reentrant):
    _compare(rname, model, reentrant, autocast_inside=False)


@pytest.mark.parametrize("reentrant", [False, True], ids=["nonreentrant", "reentrant"])
@pytest.mark.parametrize("rname", list(RECIPES))
def test_checkpoint_with_autocast_inside_bit_identical(rname, reentrant):
    _compare(rname, "block", reentrant, autocast_inside=True)


def test_delayed_scaling_amaxes_recorded_once_and_scales_of_the_forward_used():
    """Three steps whose inputs grow: the recompute must use the scales the forward used
    (the region's exit moves them before backward) and record nothing."""
    recipe = DelayedScaling(amax_history_len=4, amax_compute_algo="most_recent")
    for reentrant in (False, True):
        a, b = _pair("layernorm_mlp")
        for step in range(3):
            xa = (torch.randn(D, D) * 4 ** step).requires_grad_(True)
            xb = xa.detach().clone().requires_grad_(True)
            ya = _step(a, xa, recipe, step, "plain", reentrant, False)
            yb = _step(b, xb, recipe, step, "lowprec", reentrant, False)
            assert_same_run(a, b, xa, xb, ya, yb)


@pytest.mark.parametrize("reentrant", [False, True], ids=["nonreentrant", "reentrant"])
@pytest.mark.parametrize("rname", list(RECIPES))
def test_plain_torch_checkpoint_raises_with_autocast_outside(rname, reentrant):
    recipe = RECIPES[rname]()
    m, _ = _pair("block")
    x = torch.randn(D, D, requires_grad=True)
    with pytest.raises(RuntimeError, match="lowprec.checkpoint"):
        _step(m, x, recipe, 0, "plain", reentrant, False)  # warm: ran under autocast
        _step(m, x, recipe, 0, "torch", reentrant, False)


@pytest.mark.parametrize("reentrant", [False, True], ids=["nonreentrant", "reentrant"])
def test_plain_torch_checkpoint_raises_under_delayed_scaling_inside(reentrant):
    m, _ = _pair("linear")
    x = torch.randn(D, D, requires_grad=True)
    with pytest.raises(RuntimeError, match="DelayedScaling forward inside a backward"):
        _step(m, x, RECIPES["delayed"](), 0, "torch", reentrant, True)


@pytest.mark.parametrize("reentrant", [False, True], ids=["nonreentrant", "reentrant"])
@pytest.mark.parametrize("rname", ["current", "mxfp8", "nvfp4"])
def test_plain_torch_checkpoint_with_stateless_autocast_inside_is_exact(rname, reentrant):
    """A stateless recipe whose autocast sits inside the checkpointed function: the
    recompute enters it again and quantizes the same (documented as supported)."""
    recipe = RECIPES[rname]()
    a, b = _pair("block")
    xa = torch.randn(D, D, requires_grad=True)
    xb = xa.detach().clone().requires_grad_(True)
    ya = _step(a, xa, recipe, 3, "plain", reentrant, True)
    yb = _step(b, xb, recipe, 3, "torch", reentrant, True)
    assert_same_run(a, b, xa, xb, ya, yb)


def test_modules_outside_autocast_checkpoint_as_usual():
    a, b = _pair("block")
    x = torch.randn(D, D, requires_grad=True)
    for reentrant in (False, True):
        ya, yb = a(x), torch_checkpoint.checkpoint(b, x, use_reentrant=reentrant)
        assert torch.equal(ya, yb)
        lowprec.checkpoint(b, x, use_reentrant=reentrant).sum().backward()


def test_recompute_calling_other_modules_raises():
    recipe = Float8CurrentScaling()
    m1, m2 = lowprec.Linear(D, D), lowprec.Linear(D, D)
    calls = []

    def fn(t):
        calls.append(None)
        return (m1 if len(calls) == 1 else m2)(t)

    x = torch.randn(D, D, requires_grad=True)
    with autocast(recipe=recipe):
        y = lowprec.checkpoint(fn, x)
    with pytest.raises(RuntimeError, match="same lowprec modules in the same order"):
        y.sum().backward()


def test_bad_arguments():
    with pytest.raises(TypeError, match="use_reentrant"):
        lowprec.checkpoint(lambda t: t, torch.randn(2, requires_grad=True), use_reentrant=None)


@pytest.mark.parametrize("inner_reentrant", [False, True], ids=["inner_nonre", "inner_re"])
@pytest.mark.parametrize("reentrant", [False, True], ids=["nonreentrant", "reentrant"])
def test_nested_checkpoints_bit_identical(reentrant, inner_reentrant):
    """A checkpointed function that checkpoints part of itself: the inner original forward
    runs again during the outer recompute and records what the outer replays."""
    recipe = RECIPES["delayed"]()
    a, b = _pair("block")

    def outer(t):
        h = t + b.lin(torch.nn.functional.gelu(b.ln_lin(t)))
        return lowprec.checkpoint(lambda u: u + b.mlp(u), h, use_reentrant=inner_reentrant)

    xa = torch.randn(D, D, requires_grad=True)
    xb = xa.detach().clone().requires_grad_(True)
    for step in range(2):
        ya = _step(a, xa, recipe, step, "plain", reentrant, False)
        torch.manual_seed(step)
        with autocast(recipe=recipe):
            yb = lowprec.checkpoint(outer, xb, use_reentrant=reentrant)
        yb.backward(torch.randn(yb.shape, generator=torch.Generator().manual_seed(step)))
        assert_same_run(a, b, xa, xb, ya, yb.detach())


@pytest.mark.parametrize("reentrant", [False, True], ids=["nonreentrant", "reentrant"])
def test_checkpoint_under_no_grad_is_an_evaluation(reentrant):
    recipe = RECIPES["delayed"]()
    m, _ = _pair("layernorm_mlp")
    x = torch.randn(D, D)
    _step(m, x.clone().requires_grad_(True), recipe, 0, "plain", reentrant, False)
    before = copy.deepcopy(delayed_states(m))
    with torch.no_grad(), autocast(recipe=recipe):
        expected = m(x * 50)
        y = lowprec.checkpoint(m, x * 50, use_reentrant=reentrant)
    assert torch.equal(y, expected)
    after = delayed_states(m)
    for key in before:
        for k in before[key]:
            assert torch.equal(before[key][k], after[key][k]), (key, k)
