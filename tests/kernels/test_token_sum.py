"""The token-sum kernel (lowprec/kernels/token_sum.py) against torch's adds, one slot at a
time: the same bits for 16- and 32-bit rows, any number of slots, tokens and features."""

from __future__ import annotations

import pytest
import torch

from lowprec.kernels import triton_available
from lowprec.kernels.token_sum import token_sum

GPU = pytest.mark.skipif(not (torch.cuda.is_available() and triton_available()),
                         reason="the token-sum kernel needs a GPU with Triton")


def _torch_adds(rows, idx):
    acc = rows.new_zeros((idx.shape[0], rows.shape[1]))
    for j in range(idx.shape[1]):
        acc = acc + rows[idx[:, j]]
    return acc


@GPU
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("t, k, h", [(37, 8, 100), (256, 2, 4096), (5, 1, 300)])
def test_kernel_gives_torch_adds_bits(t, k, h, dtype):
    g = torch.Generator().manual_seed(k)
    rows = (torch.randn(t * k + 7, h, generator=g) * 3).to(dtype).cuda()
    rows[0, :5] = -0.0  # negative zeros: 0 + -0.0 is +0.0, in torch and in the kernel
    idx = torch.stack([torch.randperm(rows.shape[0], generator=g)[:k] for _ in range(t)])
    idx = idx.sort(1).values.cuda()
    got, ref = token_sum(rows, idx), _torch_adds(rows, idx)
    assert torch.equal(got.view(torch.uint8), ref.view(torch.uint8))


def test_cpu_sums_in_slot_order():
    rows = torch.tensor([[1.0], [2.0 ** -8], [2.0 ** -8]], dtype=torch.bfloat16)
    idx = torch.tensor([[0, 1, 2]])
    # one add at a time, rounded: 1 + 2^-8 rounds back to 1 in bf16, twice
    assert token_sum(rows, idx).item() == 1.0
    assert token_sum(rows, torch.tensor([[1, 2, 0]])).item() == 1.0 + 2.0 ** -7


@GPU
@pytest.mark.parametrize("gate_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_gated_sum_and_its_gradients(gate_dtype):
    """With gates: the sum is ``(rows * gates[:, None]).to(rows.dtype)``'s, bit for bit; the
    rows' gradients are torch's bits, the gates' are torch's products summed in another
    order; a padding row (token T) gets zero gradients."""
    from lowprec.kernels.token_sum import gated_rows_grad
    g = torch.Generator().manual_seed(3)
    t, k, h = 40, 4, 300
    rows = torch.randn(t * k + 5, h, generator=g).bfloat16().cuda()
    gates = torch.rand(rows.shape[0], generator=g).to(gate_dtype).cuda()
    # each routed row one token's (the rows past t * k: padding)
    idx = torch.randperm(t * k, generator=g).view(t, k).sort(1).values.cuda()
    token_of = torch.full((rows.shape[0],), t, dtype=torch.int64)
    token_of[idx.cpu().reshape(-1)] = torch.arange(t).repeat_interleave(k)
    token_of = token_of.cuda()
    grad = torch.randn(t, h, generator=g).bfloat16().cuda()

    r = rows.clone().requires_grad_(True)
    gg = gates.clone().requires_grad_(True)
    ref = _torch_adds((r * gg[:, None]).to(rows.dtype), idx)
    ref.backward(grad)
    got = token_sum(rows, idx, gates)
    assert torch.equal(got.view(torch.int16), ref.detach().view(torch.int16))
    d_rows, d_gates = gated_rows_grad(grad, rows, gates, token_of)
    assert torch.equal(d_rows.view(torch.int16), r.grad.view(torch.int16))
    torch.testing.assert_close(d_gates, gg.grad, rtol=1e-2 if gate_dtype != torch.float32
                               else 1e-5, atol=1e-3)
    pad = token_of == t
    assert torch.all(d_rows[pad] == 0) and torch.all(d_gates[pad] == 0)
