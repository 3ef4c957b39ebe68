"""Dequantizing holds one fp32 copy of the operand at a time: the in-place and chunked
forms give the values of the one-shot formulas bit for bit, on every path (chunks forced
small here, so that tensors of test size take the chunked branches)."""

from __future__ import annotations

import pytest
import torch

import lowprec
from lowprec.formats import casting, rht
from lowprec.formats.nvfp4.reference import BLOCK, dequantize_matrix, quantize_matrix


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def test_e2m1_decode_in_chunks_is_the_one_shot_lookup(monkeypatch):
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (37, 53), generator=g, dtype=torch.uint8)
    codes[0, :16] = torch.arange(16, dtype=torch.uint8)  # every code, -0.0 (code 8) too
    grid = torch.tensor(casting.E2M1_GRID, dtype=torch.float32)
    want = torch.where((codes & 8) != 0, -grid[(codes & 7).long()], grid[(codes & 7).long()])
    whole = casting.e2m1_codes_to_float(codes)
    monkeypatch.setattr(casting, "E2M1_DECODE_CHUNK", 7)
    chunked = casting.e2m1_codes_to_float(codes)
    assert whole.dtype == chunked.dtype == torch.float32 and chunked.shape == codes.shape
    assert torch.equal(_bits(whole), _bits(want)) and torch.equal(_bits(chunked), _bits(want))
    assert torch.signbit(chunked[0, 8]) and chunked[0, 8] == 0


@pytest.mark.parametrize("shape", [(40, 48), (1, 16), (33, 160)])
def test_rht_inverse_in_place_by_chunks_is_rht_inverse(monkeypatch, shape):
    y = torch.randn(shape, generator=torch.Generator().manual_seed(1)) * 3
    want = rht.rht_inverse(y)
    monkeypatch.setattr(rht, "RHT_CHUNK_ELEMENTS", 48)
    mine = y.clone()
    got = rht.rht_inverse_(mine)
    assert got is mine and torch.equal(_bits(got), _bits(want))


@pytest.mark.parametrize("two_d", [False, True])
def test_nvfp4_dequantize_matrix_in_place_is_the_formula(two_d):
    x = torch.randn(64, 96, generator=torch.Generator().manual_seed(2)) * 5
    packed, scales, s = quantize_matrix(x, two_d=two_d)
    got = dequantize_matrix(packed, scales, s, two_d=two_d)
    q = casting.e2m1_codes_to_float(casting.unpack_e2m1(packed))
    r, c = q.shape
    if two_d:
        d = scales.float().repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)
    else:
        d = scales.float().repeat_interleave(BLOCK, 1)
    assert torch.equal(_bits(got), _bits((q * d[:r, :c]) / s))


@pytest.mark.parametrize("make", [
    lambda: lowprec.Float8CurrentScalingQuantizer(torch.float8_e4m3fn),
    lambda: lowprec.Float8BlockQuantizer(block_scaling_dim=1),
    lambda: lowprec.Float8BlockQuantizer(block_scaling_dim=2),
    lambda: lowprec.MXFP8Quantizer(),
    lambda: lowprec.NVFP4Quantizer(with_rht=True),
], ids=["current", "block1", "block2", "mxfp8", "nvfp4_rht"])
def test_dequantize_leaves_the_stored_data_alone(make, monkeypatch):
    """In-place arithmetic runs on the dequantize's own copies: dequantizing twice (with
    chunked paths forced) gives the same values and the quantized tensor's data is as it
    was."""
    monkeypatch.setattr(casting, "E2M1_DECODE_CHUNK", 100)
    monkeypatch.setattr(rht, "RHT_CHUNK_ELEMENTS", 256)
    x = torch.randn(256, 384, generator=torch.Generator().manual_seed(3)).bfloat16()
    qt = make().quantize(x)
    before = {k: v.clone() for k, v in qt.inner_tensors().items() if v is not None}
    for usage in ("rowwise", "columnwise"):
        if qt.has_usage(usage):
            a = qt.dequantize(dtype=torch.float32, usage=usage)
            b = qt.dequantize(dtype=torch.float32, usage=usage)
            assert torch.equal(_bits(a), _bits(b)), usage
    after = qt.inner_tensors()
    for k, v in before.items():
        raw = after[k].reshape(-1).view(torch.uint8)
        assert torch.equal(v.reshape(-1).view(torch.uint8), raw), k
