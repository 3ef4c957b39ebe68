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
    """Each part quantized with the maximum of every part's statistic (what an all-reduce
    MAX over the processes holding them gives)."""
    rows = x.shape[0] // parts
    chunks = [x[i * rows:(i + 1) * rows] for i in range(parts)]
    stats = [q.part_statistic(c) for c in chunks]
    stat = None if stats[0] is None else torch.stack(stats).amax(0)
    return [q.quantize_part(c, stat) for c in chunks]


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


def test_empty_part_has_a_neutral_statistic():
    q = lowprec.Float8CurrentScalingQuantizer()
    empty = torch.zeros(0, 32)
    assert q.part_statistic(empty).tolist() == [0]  # the maximum ignores it
    assert q.quantize_part(empty, torch.zeros(1, dtype=torch.int32)).shape == (0, 32)


def test_statistic_is_required_where_the_format_has_one():
    with pytest.raises(ValueError, match="needs the statistic"):
        lowprec.Float8CurrentScalingQuantizer().quantize_part(torch.randn(8, 32))
    assert lowprec.MXFP8Quantizer().part_statistic(torch.randn(32, 32)) is None


@pytest.mark.parametrize("q", [
    lowprec.Float8Quantizer(torch.ones(1), torch.zeros(1)),
    lowprec.NVFP4Quantizer(stochastic_rounding=True),
    lowprec.NVFP4Quantizer(with_rht=True),
], ids=["delayed", "nvfp4_sr", "nvfp4_rht"])
def test_formats_that_cannot_raise(q):
    assert not q.can_quantize_part()
    with pytest.raises(NotImplementedError, match="cannot quantize a part"):
        q.quantize_part(torch.randn(32, 32))
    # NVFP4's RHT touches the columnwise side only: rowwise alone quantizes by parts
    if isinstance(q, lowprec.NVFP4Quantizer) and q.with_rht:
        with q.usages(rowwise=True, columnwise=False):
            assert q.can_quantize_part()


def test_part_must_be_2d():
    with pytest.raises(ValueError, match="2-D part"):
        lowprec.Float8CurrentScalingQuantizer().quantize_part(torch.randn(2, 3, 32))
