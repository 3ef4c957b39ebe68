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
