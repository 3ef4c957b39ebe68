"""The SwiGLU kernels (lowprec/kernels/swiglu.py) against eager torch: the same bits for
the output and both halves of the gradient, with 16-bit inputs over the whole range
(exp overflowing and underflowing included), rows and halves of any size."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lowprec.kernels import triton_available
from lowprec.kernels.swiglu import swiglu

GPU = pytest.mark.skipif(not (torch.cuda.is_available() and triton_available()),
                         reason="the SwiGLU kernels need a GPU with Triton")


def _eager(h, da):
    h = h.clone().requires_grad_(True)
    gate, up = h.chunk(2, dim=-1)
    a = F.silu(gate) * up
    a.backward(da)
    return a.detach(), h.grad


def _ours(h, da):
    h = h.clone().requires_grad_(True)
    a = swiglu(h)
    a.backward(da)
    return a.detach(), h.grad


def _data(m, i, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(m, 2 * i, generator=g) * 4
    h[0, : 2 * i: 3] *= 40  # exp(-g) overflows and underflows
    h[1 % m, 1] = 0.0
    da = torch.randn(m, i, generator=g)
    return h.to(dtype).cuda(), da.to(dtype).cuda()


@GPU
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("shape", [(257, 768), (37, 100), (1, 14336)])
def test_kernels_give_eager_bits(shape, dtype):
    h, da = _data(*shape, dtype)
    ref, got = _eager(h, da), _ours(h, da)
    for a, b in zip(got, ref):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))


@GPU
def test_strided_rows_and_fallbacks():
    h, da = _data(64, 256, torch.bfloat16)
    wide = torch.zeros(64, 1024, dtype=torch.bfloat16, device="cuda")
    wide[:, :512] = h
    view = wide[:, :512]  # rows 1024 apart
    assert torch.equal(swiglu(view), _eager(h, da)[0])
    h32 = h.float()  # fp32: torch's own ops
    gate, up = h32.chunk(2, dim=-1)
    assert torch.equal(swiglu(h32), F.silu(gate) * up)
