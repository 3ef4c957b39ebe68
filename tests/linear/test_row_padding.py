"""Token counts (M) that do not fill the blocks along M: the quantized linear pads its
wgrad operands with zero rows, bit-identical to an input padded by hand (and its gradient
padded with zeros); the feature dimensions are never padded and keep their clear error."""

from __future__ import annotations

import copy

import pytest
import torch
from same_run import RECIPES

import lowprec
from lowprec.recipe.recipes import MXFP8BlockScaling, NVFP4BlockScaling

#: The multiple of M each recipe's wgrad operands need (the hybrid: NVFP4 columnwise x and dY)
MULTIPLE = {"current": 1, "delayed": 1, "block": 128, "mxfp8": 32, "nvfp4": 16, "custom": 16,
            "hybrid": 16}
K, N = 128, 256
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _grad_run(module, x, g, recipe, seed=7):
    x = x.detach().requires_grad_(True)
    torch.manual_seed(seed)  # the same stochastic-rounding draws in both runs
    with lowprec.autocast(recipe=recipe):
        y = module(x)
    y.backward(g)
    return y, x.grad


def _hand_padded(module, x, g, recipe, multiple):
    """The module run on ``x`` with zero rows appended by hand, the padding cut afterwards."""
    x2d, g2d = x.reshape(-1, K), g.reshape(-1, N)
    pad = -x2d.shape[0] % multiple
    xp = torch.cat([x2d, x2d.new_zeros(pad, K)])
    gp = torch.cat([g2d, g2d.new_zeros(pad, N)])
    y, dx = _grad_run(module, xp, gp, recipe)
    m = x2d.shape[0]
    return y[:m].reshape(g.shape), dx[:m].reshape(x.shape)


MODULES = {
    "linear": lambda: lowprec.Linear(K, N, params_dtype=torch.bfloat16),
    "ops_linear": lambda: lowprec.ops.Sequential(lowprec.ops.Linear(K, N,
                                                                    params_dtype=torch.bfloat16)),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rname", list(RECIPES))
@pytest.mark.parametrize("kind", list(MODULES))
@pytest.mark.parametrize("shape", [(3, 100), (1, 1), (2, 333)], ids=str)
def test_unaligned_tokens_equal_hand_padding(kind, rname, shape, device):
    torch.manual_seed(0)
    ref = MODULES[kind]().to(device)
    x = torch.randn(*shape, K, dtype=torch.bfloat16, device=device)
    g = torch.randn(*shape, N, dtype=torch.bfloat16, device=device)
    a, b = copy.deepcopy(ref), copy.deepcopy(ref)
    ya, dxa = _grad_run(a, x, g, RECIPES[rname]())
    yb, dxb = _hand_padded(b, x, g, RECIPES[rname](), MULTIPLE[rname])
    assert torch.equal(ya, yb) and torch.equal(dxa, dxb)
    for (name, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(p.grad, q.grad), name


GROUPED_RECIPES = {"block": RECIPES["block"], "mxfp8": RECIPES["mxfp8"],
                   # without SR: the groups draw one after the other, the references afresh
                   "nvfp4": lambda: NVFP4BlockScaling(disable_stochastic_rounding=True)}


@pytest.mark.parametrize("rname", list(GROUPED_RECIPES))
def test_grouped_linear_pads_each_group(rname):
    torch.manual_seed(0)
    grouped = lowprec.GroupedLinear(2, K, N, params_dtype=torch.bfloat16)
    x = torch.randn(300, K, dtype=torch.bfloat16)
    g = torch.randn(300, N, dtype=torch.bfloat16)
    splits = [100, 200]
    xg = x.detach().requires_grad_(True)
    torch.manual_seed(7)
    with lowprec.autocast(recipe=GROUPED_RECIPES[rname]()):
        y = grouped(xg, splits)
    y.backward(g)
    # each group equals a Linear with the group's weight, padded by hand
    for i, (xs, gs) in enumerate(zip(torch.split(x, splits), torch.split(g, splits))):
        lin = lowprec.Linear(K, N, params_dtype=torch.bfloat16)
        with torch.no_grad():
            lin.weight.copy_(getattr(grouped, f"weight{i}"))
            lin.bias.copy_(getattr(grouped, f"bias{i}"))
        yi, dxi = _hand_padded(lin, xs, gs, GROUPED_RECIPES[rname](), MULTIPLE[rname])
        rows = slice(sum(splits[:i]), sum(splits[:i + 1]))
        assert torch.equal(y[rows], yi) and torch.equal(xg.grad[rows], dxi)
        assert torch.equal(getattr(grouped, f"weight{i}").grad, lin.weight.grad)


@pytest.mark.parametrize("rname", ["block", "mxfp8", "nvfp4"])
def test_layernorm_linear_pads_after_the_norm(rname):
    # The padding goes into the GEMM operands, after the norm (a LayerNorm of a zero row is
    # its bias, not zero): the same as a LayerNorm, then a Linear padded by hand.
    torch.manual_seed(0)
    fused = lowprec.LayerNormLinear(K, N, params_dtype=torch.bfloat16)
    with torch.no_grad():
        fused.layer_norm_bias.normal_()
    norm = lowprec.LayerNorm(K, params_dtype=torch.bfloat16)
    lin = lowprec.Linear(K, N, params_dtype=torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(fused.layer_norm_weight)
        norm.bias.copy_(fused.layer_norm_bias)
        lin.weight.copy_(fused.weight)
        lin.bias.copy_(fused.bias)
    x = torch.randn(5, 41, K, dtype=torch.bfloat16)
    g = torch.randn(5, 41, N, dtype=torch.bfloat16)
    y, _ = _grad_run(fused, x, g, RECIPES[rname]())
    h = norm(x).detach()
    yi, _ = _hand_padded(lin, h, g, RECIPES[rname](), MULTIPLE[rname])
    assert torch.equal(y, yi)
    assert torch.equal(fused.weight.grad, lin.weight.grad)


@pytest.mark.parametrize("rname", ["block", "mxfp8", "nvfp4"])
def test_layernorm_mlp_and_ops_take_unaligned_tokens(rname):
    torch.manual_seed(0)
    mlp = lowprec.LayerNormMLP(K, 256, activation="swiglu")
    seq = lowprec.ops.Sequential(lowprec.ops.LayerNorm(K), lowprec.ops.Linear(K, 256),
                                 lowprec.ops.GELU(), lowprec.ops.Linear(256, K))
    x = torch.randn(3, 77, K)
    for m in (mlp, seq):
        ref = copy.deepcopy(m)
        xq = x.clone().requires_grad_(True)
        with lowprec.autocast(recipe=RECIPES[rname]()):
            y = m(xq)
        y.sum().backward()
        xr = x.clone().requires_grad_(True)
        yr = ref(xr)
        yr.sum().backward()
        # quantized vs fp32: the usual per-format closeness, no error
        assert torch.nn.functional.cosine_similarity(y.flatten(), yr.flatten(), dim=0) > 0.95
        assert torch.nn.functional.cosine_similarity(xq.grad.flatten(), xr.grad.flatten(),
                                                     dim=0) > 0.9


@pytest.mark.parametrize("recipe,quantizer,block",
                         [(MXFP8BlockScaling, lowprec.MXFP8Quantizer, 32),
                          (NVFP4BlockScaling, lowprec.NVFP4Quantizer, 16)])
def test_unaligned_features_are_padded_by_the_linear(recipe, quantizer, block):
    """The linear pads unaligned feature dimensions (test_feature_padding.py) for its GEMMs;
    a quantizer called directly takes the partial block as it is
    (tests/formats/test_partial_blocks.py)."""
    m = lowprec.Linear(block + 8, 64)
    with lowprec.autocast(recipe=recipe()):
        assert m(torch.randn(64, block + 8)).shape == (64, 64)
    qt = quantizer().quantize(torch.randn(64, block + 8))
    assert qt.partial("rowwise") and qt.rowwise_scale.shape[1] == 2


def test_no_padding_without_wgrad():
    # eval: only rowwise blocks (along K), any token count goes as it is
    m = lowprec.Linear(K, N)
    with torch.no_grad(), lowprec.autocast(recipe=RECIPES["block"]()):
        y = m(torch.randn(7, K))
    assert y.shape == (7, N)
