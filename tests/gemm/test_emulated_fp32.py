"""The fp32 emulation's product (``gemm.fp32_product``): one BLAS call whatever layout its
operands arrive in, so an eager call and a compiled graph (which lay out a transposed
operand differently) sum in the same order: bit-identical results for every layout of the
same values, at sizes where single-thread CPU BLAS blocks the K sum."""

from __future__ import annotations

import pytest
import torch

from lowprec.gemm import fp32_product


def _layouts(t: torch.Tensor):
    """``t``'s values row-major, as a transposed view of a column-major copy, and as a
    strided slice of a wider tensor."""
    wide = torch.zeros(t.shape[0], 2 * t.shape[1])
    wide[:, ::2] = t
    return [t.contiguous(), t.t().contiguous().t(), wide[:, ::2]]


@pytest.mark.parametrize("m,n,k", [(128, 512, 1024), (1024, 512, 128), (33, 70, 257)])
def test_every_layout_gives_the_same_bits(m, n, k):
    g = torch.Generator().manual_seed(m + n + k)
    a = torch.randn(m, k, generator=g)
    b = torch.randn(n, k, generator=g)
    want = fp32_product(a, b)
    torch.testing.assert_close(want, a.double().mm(b.double().t()).float(), rtol=1e-5,
                               atol=1e-4)
    for a_l in _layouts(a):
        for b_l in _layouts(b):
            assert torch.equal(fp32_product(a_l, b_l), want)
