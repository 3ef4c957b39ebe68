"""Quantizer.quantize_part: rows of a tensor quantized as the whole tensor's quantize
quantizes them, given the maximum of the parts' per-tensor statistic (what FSDP's
all-gather of quantized weight shards relies on)."""

from __future__ import annotations

import pytest
import torch

import lowprec
from lowprec.formats.base import USAGES

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])

QUANTIZERS = {
    "current": lambda: lowprec.Float8CurrentScalingQuantizer(),
    "current_e5m2_pow2": lambda: lowprec.Float8CurrentScalingQuantizer(
        torch.float8_e5m2, force_pow_2_scales=True),
    "block_2d": lambda: lowprec.Float8BlockQuantizer(block_scaling_dim=2),
    "block_1d": lambda: lowprec.Float8BlockQuantizer(block_scaling_dim=1),
    "mxfp8": lambda: lowprec.MXFP8Quantizer(),
    "mxfp8_2d": lambda: lowprec.MXFP8Quantizer(with_2d_quantization=True),
    "nvfp4": lambda: lowprec.NVFP4Quantizer(),
    "nvfp4_2d": lambda: lowprec.NVFP4Quantizer(with_2d_quantization=True),
}


def _parts_quantized(q, x, parts: int):
    """Each part quantized with reduce_max giving the maximum over every part (computed by
    running each part's statistic first, as an all-reduce would)."""
    rows = x.shape[0] // parts
    chunks = [x[i * rows:(i + 1) * rows] for i in range(parts)]
    seen = [[] for _ in chunks]

    def recorder(i):
        def reduce_max(t):
            seen[i].append(t.clone())
            return t
        return reduce_max

    for i, c in enumerate(chunks):  # first pass: each part's own statistics
        q.quantize_part(c, recorder(i))
    calls = len(seen[0])
    assert all(len(s) == calls for s in seen)  # every part calls it equally often
    out = []
    for i, c in enumerate(chunks):
        k = iter(range(calls))

        def reduce_max(t):
            j = next(k)
            return torch.stack([s[j] for s in seen]).amax(0)
        out.append(q.quantize_part(c, reduce_max))
    return out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", list(QUANTIZERS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_parts_are_rows_of_the_whole(name, dtype, device):
    q = QUANTIZERS[name]()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 256, generator=g)
    x[300:] *= 50  # the parts' amaxes differ: the whole one is the last part's
    x = x.to(device=device, dtype=dtype)
    whole = q.quantize(x)
    parts = _parts_quantized(q, x, 4)
    for usage in USAGES:
        want = whole.dequantize(usage=usage)
        got = torch.cat([p.dequantize(usage=usage) for p in parts])
        assert torch.equal(got, want), usage
        for name_, t in whole.inner_tensors().items():
            if t is None or t.dim() < 2:
                continue
            row_dim = 1 if name_.startswith("columnwise_") else 0
            cat = torch.cat([getattr(p, name_) for p in parts], dim=row_dim)
            assert torch.equal(cat.view(torch.uint8) if cat.dtype.itemsize == 1 else cat,
                               t.view(torch.uint8) if t.dtype.itemsize == 1 else t), name_


@pytest.mark.parametrize("device", DEVICES)
def test_nan_in_one_part_reaches_every_part(device):
    q = lowprec.Float8CurrentScalingQuantizer()
    x = torch.randn(64, 32, device=device)
    x[40, 3] = float("nan")
    parts = _parts_quantized(q, x, 2)
    assert all(torch.isnan(p.dequantize()).all() for p in parts)
    assert torch.isnan(q.quantize(x).dequantize()).all()


def test_empty_part_still_takes_part_in_the_reduction():
    q = lowprec.Float8CurrentScalingQuantizer()
    calls = []
    out = q.quantize_part(torch.zeros(0, 32), lambda t: calls.append(t) or t)
    assert out.shape == (0, 32) and len(calls) == 1


@pytest.mark.parametrize("q", [
    lowprec.Float8Quantizer(torch.ones(1), torch.zeros(1)),
    lowprec.NVFP4Quantizer(stochastic_rounding=True),
    lowprec.NVFP4Quantizer(with_rht=True),
], ids=["delayed", "nvfp4_sr", "nvfp4_rht"])
def test_formats_that_cannot_raise(q):
    assert not q.can_quantize_part()
    with pytest.raises(NotImplementedError, match="cannot quantize a part"):
        q.quantize_part(torch.randn(32, 32), lambda t: t)
    # NVFP4's RHT touches the columnwise side only: rowwise alone quantizes by parts
    if isinstance(q, lowprec.NVFP4Quantizer) and q.with_rht:
        with q.usages(rowwise=True, columnwise=False):
            assert q.can_quantize_part()


def test_part_must_be_2d():
    with pytest.raises(ValueError, match="2-D part"):
        lowprec.Float8CurrentScalingQuantizer().quantize_part(torch.randn(2, 3, 32), max)
