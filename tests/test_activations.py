"""The activation registry (lowprec/activations.py): a one-op gradient run on bf16/fp16
operands directly is the fp32 gradient rounded once, bit for bit (the claim that lets
``activation_grad`` skip the fp32 copies)."""

from __future__ import annotations

import pytest
import torch

from lowprec.activations import REGISTRY, activation_grad, activation_grad_fp32

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _operands(dtype, device):
    g = torch.Generator().manual_seed(0)
    # every magnitude the dtype holds, both signs, zeros and the saturating tails of gelu
    x = torch.randn(1 << 16, generator=g) * torch.exp2(
        torch.randint(-14, 8, (1 << 16,), generator=g).float())
    x = torch.cat([x, torch.tensor([0.0, -0.0, 1e4, -1e4, 3.0, -3.0])])
    dy = torch.randn(x.shape, generator=g) * 4
    return x.to(device, dtype), dy.to(device, dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("name", [n for n, a in REGISTRY.items() if a.one_op_grad])
def test_one_op_grad_in_the_input_dtype_is_the_rounded_fp32_grad(name, dtype, device):
    x, dy = _operands(dtype, device)
    want = activation_grad_fp32(name, x, dy).to(dtype)
    got = activation_grad(name, x, dy)
    assert got.dtype == dtype
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))


@pytest.mark.parametrize("name", [n for n, a in REGISTRY.items() if not a.one_op_grad])
def test_other_grads_round_the_fp32_grad(name):
    x, dy = _operands(torch.bfloat16, "cpu")
    if REGISTRY[name].gated:
        x, dy = x[:-6].reshape(-1, 2048), dy[:(1 << 15)].reshape(-1, 1024)
    want = activation_grad_fp32(name, x, dy).to(torch.bfloat16)
    assert torch.equal(activation_grad(name, x, dy), want)
