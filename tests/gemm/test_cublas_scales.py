"""The decode-scale layouts the cuBLAS block GEMM backend hands to ``torch._scaled_mm``.

Runs on the CPU (the layouts are plain torch): for every operand pair the block backend
takes (1x128 x 128x128, 1x128 x 1x128, 128x128 x 1x128) the scales must be ``1 / scale``
of the stored encode scales, with

* a 1x128 first operand: (M, K/128), M-contiguous (strides (1, M));
* a 128x128 first operand: (M/128, K/128), K-blocks contiguous;
* a 1x128 second operand: (K/128, N), contiguous (the 1x128 blocks of mat(b).T);
* a 128x128 second operand: (K/128, N/128), the transpose view of a contiguous
  (N/128, K/128).
"""

from __future__ import annotations

import pytest
import torch

import lowprec
from lowprec.gemm.cublas_fp8 import _block_scales

E4M3 = torch.float8_e4m3fn


def _quantized(rows: int, cols: int, dim: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    # a spread of magnitudes so that the block scales differ
    x = torch.randn(rows, cols, generator=g) * torch.logspace(-3, 3, cols)
    return lowprec.Float8BlockQuantizer(E4M3, block_scaling_dim=dim).quantize(x)


@pytest.mark.parametrize("dim_a,dim_b", [(1, 2), (1, 1), (2, 1)])
@pytest.mark.parametrize("usage_a,usage_b", [("rowwise", "rowwise"), ("columnwise", "columnwise")])
def test_block_scales_values_and_layouts(dim_a, dim_b, usage_a, usage_b):
    m, k, n = 384, 512, 256
    # mat(a) is (M, K) and mat(b) is (N, K) in the asked usage: build the tensors so
    a = _quantized(*((m, k) if usage_a == "rowwise" else (k, m)), dim_a, 1)
    b = _quantized(*((n, k) if usage_b == "rowwise" else (k, n)), dim_b, 2)
    sa, sb = getattr(a, f"{usage_a}_scale"), getattr(b, f"{usage_b}_scale")
    scale_a, scale_b = _block_scales(a, usage_a, b, usage_b)
    assert scale_a.dtype == scale_b.dtype == torch.float32
    if dim_a == 1:
        assert scale_a.shape == (m, k // 128) and scale_a.stride() == (1, m)
        want_a = torch.reciprocal(sa)
    else:
        assert scale_a.shape == (m // 128, k // 128) and scale_a.is_contiguous()
        want_a = torch.reciprocal(sa)
    if dim_b == 1:
        assert scale_b.shape == (k // 128, n) and scale_b.is_contiguous()
        want_b = torch.reciprocal(sb).t()
    else:
        assert scale_b.shape == (k // 128, n // 128) and scale_b.t().is_contiguous()
        want_b = torch.reciprocal(sb).t()
    assert torch.equal(scale_a, want_a)
    assert torch.equal(scale_b, want_b)
    # the scales really differ from block to block (a layout mix-up would show)
    assert scale_a.unique().numel() > 1 and scale_b.unique().numel() > 1
