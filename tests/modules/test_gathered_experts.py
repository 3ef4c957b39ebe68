"""GroupedExperts whose expert weights are the quantized forms an FSDP2 quantized all-gather
brings (``Float8Experts``, ``Float8BlockExperts``, ``NVFP4Experts``): eager and under
``torch.compile(fullgraph=True)`` the same outputs and gradients, bit for bit, as the
high-precision experts quantized in the module, the gradients reaching the quantized
parameters as plain tensors."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import lowprec
from lowprec.distributed import experts_gather
from lowprec.recipe.recipes import Float8BlockScaling, Float8CurrentScaling, NVFP4BlockScaling

E, H, I, K, T = 4, 128, 128, 2, 24
RECIPES = {"current": (Float8CurrentScaling, "Float8Experts"),
           "block": (Float8BlockScaling, "Float8BlockExperts"),
           "nvfp4": (lambda: NVFP4BlockScaling(disable_stochastic_rounding=True),
                     "NVFP4Experts")}


def _module():
    torch.manual_seed(0)
    return lowprec.GroupedExperts(E, H, I, name="experts")


def _gathered(module, recipe):
    """``module``'s expert weights replaced by what a quantized gather of all of them
    makes (a world of one rank holding every expert)."""
    state = module._state("forward", recipe, torch.device("cpu"))
    for name, slots in module._expert_weights().items():
        w = getattr(module, name)
        plan = experts_gather._pick([state.quantizers[3 * j + 1] for j in slots],
                                    [state.quantizers[3 * j] for j in slots], *w.shape[1:])
        inputs, meta = experts_gather._quantize(plan, w.detach())
        fields = experts_gather._fields(inputs, meta)
        setattr(module, name, nn.Parameter(
            experts_gather._experts(meta, fields, *w.shape[1:], w.dtype)))


def _data():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(T, H, generator=g)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    return x, idx, torch.rand(T, K, generator=g)


def _step(fn, module, recipe):
    x, idx, w = _data()
    x.requires_grad_(True)
    with lowprec.autocast(recipe=recipe):
        y = fn(x, idx, w)
    y.backward(torch.ones_like(y))
    grads = [module.gate_up_proj.grad, module.down_proj.grad]
    module.zero_grad(set_to_none=True)
    return y.detach(), x.grad, grads


@pytest.mark.parametrize("rname", list(RECIPES))
def test_gathered_experts_eager_and_compiled_equal_high_precision(rname):
    make, cls = RECIPES[rname]
    recipe = make()
    hp = _module()
    want = _step(hp, hp, recipe)
    q = _module()
    _gathered(q, recipe)
    assert type(q.gate_up_proj).__name__ == cls == type(q.down_proj).__name__
    compiled = torch.compile(q, fullgraph=True, backend="aot_eager")
    for fn in (q, compiled):
        got = _step(fn, q, recipe)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        for a, b in zip(got[2], want[2]):
            assert type(a) is torch.Tensor and torch.equal(a, b)
