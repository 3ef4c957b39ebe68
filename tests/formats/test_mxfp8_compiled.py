"""lowprec/formats/mxfp8/compiled.py: the reference's MXFP8 values from bit-level torch ops,
eager and compiled by inductor (whose fp32 division is not exact on the GPU)."""

from __future__ import annotations

import pytest
import torch
from helpers import cases

from lowprec.formats.mxfp8 import compiled, reference

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _inputs(device) -> torch.Tensor:
    """Values over the whole fp32 range, and blocks at the edges of the E8M0 range: zero,
    subnormal, exactly and just above 448 * 2**-127, near the fp32 max, NaN, Inf."""
    g = torch.Generator().manual_seed(0)
    n = 1 << 16
    v = torch.randn(n, generator=g) * torch.exp2(
        torch.randint(-150, 128, (n,), generator=g).float())
    x = v.reshape(-1, 128)
    x[0, 3] = float("nan")
    x[1, 40] = float("inf")
    x[2, :32] = 0
    x[3, :32] = 1e-45
    x[4, :32] = 448 * 2.0 ** -127
    x[5, :32] = 448 * 2.0 ** -127 * 1.0000001
    x[6, :32] = 3.4e38
    x[7, :32] = -57344 * 2.0 ** 20
    return x.to(device)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equal, NaNs in the same places (whatever their payload)."""
    nan = torch.isnan(a)
    return torch.equal(nan, torch.isnan(b)) and torch.equal(
        a.masked_fill(nan, 0).view(torch.int32), b.masked_fill(nan, 0).view(torch.int32))


@pytest.mark.parametrize("transposed, fp8_dtype, device", cases(
    {"transposed": [False, True],
     "fp8_dtype": {"fp8_dtype0": torch.float8_e4m3fn, "fp8_dtype1": torch.float8_e5m2},
     "device": DEVICES},
    # on the CPU each format and layout once (each case builds four inductor kernels, tens
    # of seconds on an empty cache); on CUDA, where inductor's division is not exact, all
    lambda transposed, fp8_dtype, device: device != "cpu"
    or transposed == (fp8_dtype == torch.float8_e5m2)))
def test_dequantized_1x32_is_the_reference(device, fp8_dtype, transposed):
    x = _inputs(device)
    x = x.t() if transposed else x
    data, scale = reference.quantize_1x32(x.cpu(), fp8_dtype)
    want = reference.dequantize_blocks(data, scale, block_rows=1)
    eager = compiled.dequantized_1x32(x, fp8_dtype)
    comp = torch.compile(compiled.dequantized_1x32, fullgraph=True)(x, fp8_dtype)
    assert _same(eager.cpu(), want) and _same(comp.cpu(), want)
    # the columnwise form, computed along the rows of the untransposed matrix
    src = x.t()
    eager = compiled.dequantized_32x1(src, fp8_dtype)
    comp = torch.compile(compiled.dequantized_32x1, fullgraph=True)(src, fp8_dtype)
    assert _same(eager.contiguous().cpu(), want) and _same(comp.contiguous().cpu(), want)


@pytest.mark.parametrize("device", DEVICES)
def test_pow2_is_exact(device):
    e = torch.arange(-127, 128, dtype=torch.int32, device=device)
    want = torch.ldexp(torch.ones(255), torch.arange(-127, 128, dtype=torch.int32))
    assert torch.equal(compiled.pow2(e).cpu(), want)
    assert torch.equal(torch.compile(compiled.pow2)(e).cpu(), want)
