"""kernels.transpose: the kernel's transpose is torch's, bit for bit, on random data of
aligned and unaligned shapes and every element size it moves."""

from __future__ import annotations

import pytest
import torch

from lowprec.kernels import triton_available
from lowprec.kernels.transpose import transpose_contiguous

DEVICES = ["cpu"] + (["cuda"] if triton_available() else [])
SHAPES = [(1, 1), (3, 77), (65, 130), (128, 4096), (4096, 96), (1000, 1)]
DTYPES = [torch.uint8, torch.float8_e4m3fn, torch.float8_e5m2, torch.int16, torch.bfloat16,
          torch.float32, torch.int32]


def _random(shape, dtype, device):
    g = torch.Generator().manual_seed(sum(shape))
    bits = torch.randint(0, 256, (*shape[:-1], shape[-1] * dtype.itemsize), generator=g,
                         dtype=torch.uint8)
    return bits.view(dtype).to(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_transpose_is_torchs(shape, dtype, device):
    x = _random(shape, dtype, device)
    got = transpose_contiguous(x)
    want = x.t().contiguous()
    assert got.dtype == dtype and got.shape == want.shape and got.is_contiguous()
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


@pytest.mark.parametrize("device", DEVICES)
def test_row_strided_input(device):
    x = _random((64, 256), torch.uint8, device)[:, 16:200]  # rows apart by 256, not 184
    assert torch.equal(transpose_contiguous(x), x.t().contiguous())
