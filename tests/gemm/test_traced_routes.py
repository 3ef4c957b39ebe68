"""The traced GEMM table (lowprec/gemm/traced.py): eager's backend for each pair of operand
kinds, and a route for every pair on every device."""

from __future__ import annotations

import itertools

import pytest
import torch

from lowprec.formats import Kind
from lowprec.gemm import ROUTES, route

E4, E5, BF16 = torch.float8_e4m3fn, torch.float8_e5m2, torch.bfloat16

#: every kind a traced form gives (``formats/*/graph.py``)
KINDS = ([Kind("fp8", dt) for dt in (E4, E5)]
         + [Kind("blocks", dt, dim, pow2=p) for dt in (E4, E5) for dim in (1, 2)
            for p in (True, False)]
         + [Kind("exact", rht=r, divisor=d, bf16=b) for r in (False, True)
            for d in (False, True) for b in (False, True)]
         + [Kind("plain", dtype=dt) for dt in (BF16, torch.float16, torch.float32)])


@pytest.mark.parametrize("cuda", [False, True])
@pytest.mark.parametrize("out_dtype", [BF16, torch.float16, torch.float32])
def test_every_pair_has_a_route(cuda, out_dtype):
    """Total: whatever two kinds meet, in whatever shape, the table names a route it runs
    (the fp32 emulation where no tensor-core route takes the pair)."""
    for a, b in itertools.product(KINDS, repeat=2):
        for m, n, k in ((256, 512, 512), (40, 24, 100)):
            for bias in (False, True):
                got = route(a, b, m, n, k, out_dtype, bias, cuda)
                assert got in ROUTES, (a, b, m, n, k, out_dtype, bias, cuda, got)


def test_block_pairs_cublas_does_not_take_route_as_eager():
    """The traced GEMM table picks eager's backend for block FP8 pairs on CUDA: cuBLAS's
    block GEMM where it takes the pair, else (128x128 scales over K/128 not a multiple of 4,
    128x128 x 128x128, E5M2 x E5M2) the bf16 GEMM of the exact values, which power-of-two
    scales make exact; scales not known to be powers of two take the fp32 emulation, as
    eager does (its operands dequantized by eager's ops)."""
    e4, e5, bf16 = torch.float8_e4m3fn, torch.float8_e5m2, torch.bfloat16
    x, w, dy = Kind("blocks", e4, 1), Kind("blocks", e4, 2), Kind("blocks", e5, 1)
    assert route(x, w, 256, 512, 512, bf16, False, True) == "cublas_fp8_block"
    assert route(x, w, 256, 512, 768, bf16, False, True) == "exact_bf16"  # 768 / 128 = 6
    assert route(w, w, 256, 512, 512, bf16, False, True) == "exact_bf16"
    assert route(dy, dy, 256, 512, 512, bf16, False, True) == "exact_bf16"
    assert route(dy, x, 256, 512, 512, bf16, False, True) == "cublas_fp8_block"
    assert route(x, Kind("fp8", e4), 256, 512, 512, bf16, False, True) == "exact_bf16"
    unknown = Kind("blocks", e4, 2, pow2=False)
    assert route(x, unknown, 256, 512, 768, bf16, False, True) == "emulated"
    assert route(x, w, 256, 512, 768, bf16, False, False) == "emulated"  # CPU


