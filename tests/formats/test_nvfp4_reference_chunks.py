"""The NVFP4 reference quantize rounds a large matrix in row chunks (outside graphs), to
bound its temporaries; the codes, scales and global scales are the one-shot ones bit for
bit. Small chunks are forced here, with row counts that leave a shorter last chunk."""

from __future__ import annotations

import pytest
import torch

from lowprec.formats.nvfp4 import NVFP4Quantizer
from lowprec.formats.nvfp4 import quantizer as nvq
from lowprec.formats.nvfp4.draws import draw_key

FIELDS = ("rowwise_data", "rowwise_scale", "rowwise_global", "columnwise_data",
          "columnwise_scale", "columnwise_global")


def _x(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g) * torch.logspace(-3, 3, cols)
    x[5, 7], x[rows - 3, 1] = float("inf"), float("nan")  # non-finite: skipped by the amax
    return x.to(torch.bfloat16)


def _fields(monkeypatch, chunk: int, q: NVFP4Quantizer, x, keys, scales=(None, None),
            offsets=(0, 0)) -> dict:
    monkeypatch.setattr(nvq, "REFERENCE_CHUNK_ELEMENTS", chunk)
    return q._reference_fields(x, True, True, keys, scales, offsets)


def _same(a: dict, b: dict) -> None:
    for name in FIELDS:
        assert torch.equal(a[name].view(torch.uint8), b[name].view(torch.uint8)), name


@pytest.mark.parametrize("rht", [False, True])
@pytest.mark.parametrize("two_d", [False, True])
@pytest.mark.parametrize("stochastic", [False, True])
def test_chunked_reference_is_one_shot(monkeypatch, rht, two_d, stochastic):
    x = _x(80, 48)  # 80 rows, 48 columns: chunks of 16/32 rows leave shorter last ones
    q = NVFP4Quantizer(with_rht=rht, with_2d_quantization=two_d)
    gen = torch.Generator().manual_seed(9)
    keys = ((draw_key(gen, "cpu"), draw_key(gen, "cpu")) if stochastic else (None, None))
    one = _fields(monkeypatch, 1 << 30, q, x, keys)
    for chunk in (16 * 48, 32 * 48 + 5, 16):  # 16 and 32 rows; the smallest is one block
        _same(_fields(monkeypatch, chunk, q, x, keys), one)


def test_chunked_slice_keeps_its_offsets_and_given_scales(monkeypatch):
    """A slice (``gemm_slicer``) quantizes with the whole tensor's global scales and draws
    from its own offset: chunked, the same."""
    x = _x(64, 32, seed=3)
    q = NVFP4Quantizer()
    gen = torch.Generator().manual_seed(4)
    keys = (draw_key(gen, "cpu"), draw_key(gen, "cpu"))
    scales = (torch.tensor([3.0]), torch.tensor([5.0]))
    offsets = (1000, (1 << 32) - 100)  # the columnwise draws cross 2**32
    one = _fields(monkeypatch, 1 << 30, q, x, keys, scales, offsets)
    _same(_fields(monkeypatch, 16 * 32, q, x, keys, scales, offsets), one)
    assert one["rowwise_global"].item() == 3.0 and one["columnwise_global"].item() == 5.0


def test_quantize_takes_the_chunked_path(monkeypatch):
    """``quantize`` on the CPU goes through the chunked reference: with chunks forced its
    result equals the one-shot quantize, and the chunk loop ran."""
    x = _x(96, 64, seed=5)
    ran = []
    draws = nvq._draws

    def counted(*a, **kw):
        ran.append(a[2])  # rows of the chunk drawn
        return draws(*a, **kw)

    def quantized(chunk):
        monkeypatch.setattr(nvq, "REFERENCE_CHUNK_ELEMENTS", chunk)
        q = NVFP4Quantizer(stochastic_rounding=True, generator=torch.Generator().manual_seed(1))
        return q.quantize(x)

    one = quantized(1 << 30)
    monkeypatch.setattr(nvq, "_draws", counted)
    chunked = quantized(32 * 64)
    assert ran and max(ran) < 96  # several chunks, none the whole matrix
    for name in ("rowwise_data", "columnwise_data"):
        assert torch.equal(getattr(one, name), getattr(chunked, name))
