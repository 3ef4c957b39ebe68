"""NVFP4 of grouped rows (one global scale per group): the torch path against one quantize
per group, and the kernels against the torch path bit for bit."""

from __future__ import annotations

import pytest
import torch

import lowprec
from lowprec.formats.nvfp4.draws import draw_key
from lowprec.formats.nvfp4.grouped import group_scales, grouped_exact
from lowprec.formats.nvfp4.launch import dequantize_unscaled_bf16
from lowprec.kernels import triton_available


def _grouped_rows(blocks_per_group, k, seed=0, device="cpu"):
    """bf16 rows of groups of the given 16-row block counts (the last rows of each group
    zero, as the grouped layout pads them), the block groups (int32), and the bounds."""
    g = torch.Generator().manual_seed(seed)
    m = 16 * sum(blocks_per_group)
    x = torch.randn(m, k, generator=g)
    bounds, start = [], 0
    for i, b in enumerate(blocks_per_group):
        end = start + 16 * b
        if b:
            x[start:end] *= 2.0 ** (3 * i - 4)  # each group its own range
            x[end - 5:end] = 0.0
        bounds.append((start, end))
        start = end
    groups = torch.repeat_interleave(torch.arange(len(blocks_per_group)),
                                     torch.tensor(blocks_per_group)).to(torch.int32)
    return x.bfloat16().to(device), groups.to(device), bounds


SHAPES = [((2, 0, 5, 1), 64), ((0, 3), 48), ((1,), 16), ((4, 4, 0, 0, 2), 128)]


@pytest.mark.parametrize("blocks,k", SHAPES)
@pytest.mark.parametrize("rht", [False, True])
def test_group_scales_are_each_groups_own(blocks, k, rht):
    x, groups, bounds = _grouped_rows(blocks, k)
    got = group_scales(x, groups, len(blocks), rht)
    assert got.shape == (len(blocks), 2) and got.dtype == torch.float32
    for g, (a, b) in enumerate(bounds):
        q = lowprec.NVFP4Quantizer(with_rht=rht)
        if a == b:
            assert got[g].tolist() == [1.0, 1.0]
            continue
        row, col = q._global_scales(x[a:b])
        assert torch.equal(got[g], torch.cat([row, col]))


@pytest.mark.parametrize("blocks,k", SHAPES)
@pytest.mark.parametrize("rht,two_d", [(False, False), (True, False), (False, True)])
def test_grouped_exact_is_each_groups_own_quantize(blocks, k, rht, two_d):
    x, groups, bounds = _grouped_rows(blocks, k, seed=1)
    scales = group_scales(x, groups, len(blocks), rht)
    rows, cols = grouped_exact(x, scales[:, 0][groups], scales[:, 1][groups], None, None,
                               rht, two_d)
    assert rows.shape == x.shape and cols.shape == (k, x.shape[0])
    for a, b in bounds:
        if a == b:
            continue
        q = lowprec.NVFP4Quantizer(with_rht=rht, with_2d_quantization=two_d)
        qt = q.quantize(x[a:b])
        assert torch.equal(rows[a:b], dequantize_unscaled_bf16(qt, "rowwise")[0])
        assert torch.equal(cols[:, a:b], dequantize_unscaled_bf16(qt, "columnwise")[0])


def test_grouped_exact_rowwise_draws_are_the_whole_matrix_uniforms():
    """Stochastic rounding: the element at (r, c) draws index r * K + c of the one key, the
    draws a row slice of the whole tensor makes (``NVFP4Quantizer.gemm_slicer``)."""
    blocks, k = (2, 3), 64
    x, groups, bounds = _grouped_rows(blocks, k, seed=2)
    scales = group_scales(x, groups, len(blocks), False)
    key = draw_key(torch.Generator().manual_seed(5), "cpu")
    rows, empty = grouped_exact(x, scales[:, 0][groups], None, key, None, False, False)
    assert empty.numel() == 0
    q = lowprec.NVFP4Quantizer(stochastic_rounding=True)
    for g, (a, b) in enumerate(bounds):
        fields = q._reference_fields(x[a:b], True, False, (key, None),
                                     (scales[g, :1], None), (a * k, 0))
        values = (fields["rowwise_data"], fields["rowwise_scale"])
        ref = lowprec.formats.nvfp4.reference.dequantize_matrix(
            *values, torch.ones(1), two_d=False).bfloat16()
        assert torch.equal(rows[a:b], ref)


def test_bad_shapes_are_refused():
    x = torch.zeros(24, 32, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="multiples of 16"):
        group_scales(x, torch.zeros(1, dtype=torch.int32), 1, False)
    x = torch.zeros(32, 32, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="one group a 16-row block"):
        group_scales(x, torch.zeros(3, dtype=torch.int32), 1, False)
    with pytest.raises(ValueError, match="one scale a 16-row block"):
        grouped_exact(x, torch.ones(3), None, None, None, False, False)


gpu = pytest.mark.skipif(not (torch.cuda.is_available() and triton_available()),
                         reason="needs CUDA and Triton")


@gpu
@pytest.mark.parametrize("blocks,k", SHAPES + [((7, 1, 0, 9), 2064)])
@pytest.mark.parametrize("rht,two_d,sr", [(False, False, False), (True, False, True),
                                          (False, True, False), (True, False, False)])
def test_kernels_equal_the_torch_path(blocks, k, rht, two_d, sr):
    x, groups, _ = _grouped_rows(blocks, k, seed=3, device="cuda")
    x[7, 3] = float("inf")  # a poisoned block (and not the amax)
    scales = group_scales(x, groups, len(blocks), rht)
    ref_scales = group_scales(x.cpu(), groups.cpu(), len(blocks), rht)
    assert torch.equal(scales.cpu(), ref_scales)
    keys = [draw_key(None, "cuda") for _ in range(2)] if sr else [None, None]
    row_s, col_s = scales[:, 0][groups], scales[:, 1][groups]
    got = grouped_exact(x, row_s, col_s, *keys, rht, two_d)
    ref = grouped_exact(x.cpu(), row_s.cpu(), col_s.cpu(),
                        *[k_ if k_ is None else k_.cpu() for k_ in keys], rht, two_d)
    for a, b in zip(got, ref):
        a = a.cpu()
        assert torch.equal(a.isnan(), b.isnan())  # the poisoned block's values
        assert torch.equal(a.nan_to_num(0.0), b.nan_to_num(0.0))
