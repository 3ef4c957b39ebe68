"""The per-group amax kernel (lowprec/kernels/group_amax.py) against its torch ops: the same
bits for 16- and 32-bit rows, groups of any size (empty ones included), rows of any width,
Inf and NaN where they occur; the torch ops against a plain per-group amax on the CPU."""

from __future__ import annotations

import pytest
import torch

from lowprec.kernels import triton_available
from lowprec.kernels.group_amax import group_amax, group_amax_torch

GPU = pytest.mark.skipif(not (torch.cuda.is_available() and triton_available()),
                         reason="the group-amax kernel needs a GPU with Triton")


def _rows(sizes, k, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(sum(sizes), k, generator=g) * 4).to(dtype)
    ids = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes))
    return x, ids


def test_torch_ops_are_each_groups_amax():
    sizes = (5, 0, 17, 1)
    x, ids = _rows(sizes, 33, torch.bfloat16)
    got = group_amax(x, ids, len(sizes))
    start = 0
    for g, n in enumerate(sizes):
        want = x[start:start + n].abs().amax().float() if n else torch.tensor(0.0)
        assert got[g] == want
        start += n


@GPU
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("sizes, k", [((5, 0, 17, 1), 33), ((1024, 0, 37, 300), 2048),
                                      ((16,) * 40, 768), ((3,), 1)])
def test_kernel_gives_torch_ops_bits(sizes, k, dtype):
    x, ids = _rows(sizes, k, dtype, seed=k)
    x, ids = x.cuda(), ids.cuda()
    got, ref = group_amax(x, ids, len(sizes)), group_amax_torch(x, ids, len(sizes))
    assert torch.equal(got.view(torch.int32), ref.view(torch.int32))


@GPU
def test_kernel_inf_nan_and_strided_rows():
    sizes = (40, 20, 64)
    x, ids = _rows(sizes, 600, torch.bfloat16)
    x[3, 7] = float("inf")
    x[45, 599] = float("nan")
    wide = torch.zeros(x.shape[0], 700, dtype=x.dtype)
    wide[:, :600] = x
    view = wide.cuda()[:, :600]  # rows 700 apart
    got = group_amax(view, ids.cuda(), 3)
    assert got[0] == float("inf") and torch.isnan(got[1])
    assert got[2] == x[60:].abs().amax().float()
    assert torch.equal(got[2:], group_amax_torch(x, ids, 3)[2:].cuda())
