"""A linear whose feature dimensions are not whole blocks of its formats pads them with
zeros (``lowprec.linear.padding.feature_padding``): a partial block scales by its own
values, as Transformer Engine's does. Outputs and gradients equal those of the same layer
zero-padded by hand, bit for bit, for every block format (NVFP4's stochastic rounding
included), with bias and without."""

from __future__ import annotations

import pytest
import torch
from same_run import RECIPES

import lowprec
from lowprec.linear.function import LinearQuantizers
from lowprec.linear.padding import feature_padding

#: (recipe, in_features, out_features, multiple of K, multiple of N). The hybrid's weight is
#: MXFP8 along K and NVFP4 (16) along N, its dY NVFP4: N pads to 16 only (a wider dY would
#: draw other stochastic-rounding bits)
CASES = [("block", 576, 960, 128, 128), ("block", 200, 72, 128, 128),
         ("mxfp8", 48, 80, 32, 32), ("nvfp4", 24, 40, 16, 16), ("hybrid", 48, 72, 32, 16),
         ("current", 50, 30, 1, 1)]


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _step(m, x, recipe, n=None):
    x = x.detach().clone().requires_grad_(True)
    torch.manual_seed(5)  # NVFP4's stochastic rounding
    with lowprec.autocast(recipe=recipe):
        y = m(x)
    y = y if n is None else y[:, :n]
    y.square().sum().backward()
    return y.detach(), x.grad


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("rname,k,n,k_multiple,n_multiple", CASES,
                         ids=[f"{c[0]}-{c[1]}x{c[2]}" for c in CASES])
def test_padded_linear_equals_padding_by_hand(rname, k, n, k_multiple, n_multiple, bias,
                                             device):
    recipe = RECIPES[rname]()
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    torch.manual_seed(0)
    m = lowprec.Linear(k, n, bias=bias, name="l", device=device, params_dtype=dtype)
    kp, np_ = -(-k // k_multiple) * k_multiple, -(-n // n_multiple) * n_multiple
    ref = lowprec.Linear(kp, np_, bias=bias, name="l", device=device, params_dtype=dtype)
    with torch.no_grad():
        ref.weight.zero_()
        ref.weight[:n, :k] = m.weight
        if bias:
            ref.bias.zero_()
            ref.bias[:n] = m.bias
    x = torch.randn(256, k, generator=torch.Generator().manual_seed(1)).to(device, dtype)
    y, dx = _step(m, x, recipe)
    y_ref, dx_ref = _step(ref, torch.nn.functional.pad(x, (0, kp - k)), recipe, n)
    assert torch.equal(y, y_ref) and torch.equal(dx, dx_ref[:, :k])
    assert torch.equal(m.weight.grad, ref.weight.grad[:n, :k])
    if bias:
        assert torch.equal(m.bias.grad, ref.bias.grad[:n])


def test_feature_padding_rules():
    """K is padded for x's and W's blocks, N for W's columnwise and dY's rowwise blocks;
    quantized operands and boundary outputs are never padded."""
    q = lowprec.Float8BlockQuantizer(block_scaling_dim=2)
    d = lowprec.Float8BlockQuantizer(block_scaling_dim=1)
    lq = LinearQuantizers(input=d, weight=q, grad_output=d)
    x, w = torch.empty(4, 576), torch.empty(960, 576)
    assert feature_padding(lq, x, w) == (64, 64)
    assert feature_padding(None, x, w) == (0, 0)
    assert feature_padding(LinearQuantizers(input=d, weight=q, grad_output=d, output=d), x,
                           w) == (0, 0)
    assert feature_padding(LinearQuantizers(input=None, weight=None), x, w) == (0, 0)
