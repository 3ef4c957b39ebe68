"""The per-group FP8 cast kernel (``launch.fp8_cast_rows``) against the reference's ops, bit
for bit: every group its own scale, unaligned shapes, NaN and out-of-range values, both
fp8 formats."""

from __future__ import annotations

import pytest
import torch

import lowprec
from lowprec.formats.float8 import grouped, launch
from lowprec.kernels import use_kernels

CUDA = pytest.mark.skipif(not torch.cuda.is_available() or not use_kernels(
    torch.empty(0, device="cuda" if torch.cuda.is_available() else "cpu")),
    reason="needs CUDA and Triton")


@CUDA
@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("shape,sizes", [((64, 256), (5, 0, 37, 22)), ((129, 200), (129,)),
                                         ((300, 48), (100, 0, 0, 200))])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cast_rows_bit_identical_to_reference(fp8, shape, sizes, dtype):
    g = torch.Generator(device="cuda").manual_seed(0)
    x = (torch.randn(shape, generator=g, device="cuda") * 30).to(dtype)
    x[3, 7] = float("nan")
    x[-1, 0] = 1e30 if dtype == torch.float32 else 3e38
    ids = torch.repeat_interleave(torch.arange(len(sizes), device="cuda"),
                                  torch.tensor(sizes, device="cuda"), output_size=shape[0])
    scale = torch.rand(len(sizes), generator=g, device="cuda") * 100
    got = launch.fp8_cast_rows(x, scale, ids, fp8 == torch.float8_e5m2).view(fp8)
    ref = grouped.quantize_rows(x, scale[ids], fp8)
    assert torch.equal(got.view(torch.uint8), ref.view(torch.uint8))
    # the pass that also writes the transpose: the same codes in both layouts
    rows, cols = launch.fp8_cast_rows_both(x, scale, ids, fp8 == torch.float8_e5m2)
    assert torch.equal(rows, ref.view(torch.uint8))
    assert torch.equal(cols, ref.view(torch.uint8).t())


@CUDA
def test_quantize_groups_kernel_path_equals_each_group():
    q = lowprec.Float8CurrentScalingQuantizer(torch.float8_e4m3fn)
    sizes = (17, 0, 40, 7)
    x = torch.randn(64, 128, device="cuda", dtype=torch.bfloat16)
    ids = torch.repeat_interleave(torch.arange(4, device="cuda"),
                                  torch.tensor(sizes, device="cuda"), output_size=64)
    data, scale = grouped.quantize_groups(x, ids, 4, q)
    for g, xg in enumerate(torch.split(x, list(sizes))):
        if xg.shape[0]:
            ref = q.quantize(xg)
            start = sum(sizes[:g])
            assert torch.equal(scale[g:g + 1], ref.shared_scale)
            assert torch.equal(data[start:start + xg.shape[0]].view(torch.uint8),
                               ref.rowwise_data.view(torch.uint8))


@CUDA
@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("pow2, eps", [(False, 0.0), (True, 0.0), (False, 1e-3)])
def test_group_scales_kernel_gives_the_rules_bits(fp8, pow2, eps):
    """One launch's encode scales against ``scale_from_amax`` (bit for bit) and its decode
    scales against ``torch.reciprocal``: amaxes of every size, zero, tiny (scale past the fp32 max),
    Inf and NaN; more groups than one program's."""
    from lowprec.formats.casting import scale_from_amax
    g = torch.Generator(device="cuda").manual_seed(1)
    amax = torch.exp(torch.randn(300, generator=g, device="cuda") * 30)
    amax[:6] = torch.tensor([0.0, 1e-45, 1e-40, float("inf"), float("nan"), 448.0])
    scale, decode = launch.fp8_group_scales(amax, fp8 == torch.float8_e5m2, pow2, eps)
    ref = scale_from_amax(amax, torch.finfo(fp8).max, eps=eps, pow2=pow2)
    assert torch.equal(scale.view(torch.int32), ref.view(torch.int32))
    # the same values; a NaN's payload may differ
    torch.testing.assert_close(decode, torch.reciprocal(ref), rtol=0, atol=0, equal_nan=True)
