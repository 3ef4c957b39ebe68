"""The Gluon 1x32 MXFP8 kernel (``formats/mxfp8/gluon_kernels.py``) against the reference,
bit for bit: codes, E8M0 scales and exact bf16 values, for each usage it takes (columnwise
alone, both), each launch config, and the scale rule at the amaxes where it is closest to
going wrong (both kernels, Gluon and Triton, share that rule)."""

from __future__ import annotations

import pytest
import torch

import lowprec.kernels
from lowprec.formats.mxfp8 import launch
from lowprec.formats.mxfp8.quantizer import MXFP8Quantizer
from lowprec.formats.mxfp8.reference import block_exponents, dequantize_blocks
from lowprec.kernels import gluon_available, reference_only

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not (lowprec.kernels.triton_available() and gluon_available()),
                       reason="needs a CUDA device, Triton and Gluon"),
]

E4, E5 = torch.float8_e4m3fn, torch.float8_e5m2
# (M, K), both multiples of 32: one block, K narrower than a tile, K not a multiple of any
# tile width, several tiles in both directions
SHAPES = [(32, 32), (64, 96), (96, 288), (1056, 4128)]
CONFIGS = [(4, 8), (2, 8), (8, 8), (4, 4), (1, 4), (4, 8, 2, 1), (2, 4, 3, 0)]
# (rowwise, exact_row, exact_col, codes)
MODES = {"col": (False, False, False, True), "both": (True, False, False, True),
         "col+exact": (False, False, True, True), "both+exact_row": (True, True, False, True),
         "both+exact": (True, True, True, True), "exact_only": (True, True, True, False),
         "col_exact_only": (False, False, True, False)}


def _input(m, k, dtype, dist, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, k + 32, generator=g, device="cuda")
    if dist == "wide":
        span = 10 if dtype == torch.float16 else 60
        x = x * torch.exp2(torch.randint(-span, span, x.shape, generator=g, device="cuda").float())
    elif dist == "tiny":
        x = x * torch.finfo(dtype).tiny * 0.3
    x = x.to(dtype)
    if dist == "special":
        x[: min(m, 32), : min(k, 32)] = 0
        x[5, min(40, k - 1)] = float("nan")
        x[m - 1, k - 1] = float("-inf")
        x[m // 2, 0] = float("inf")
    return x[:, :k]  # rows further apart than K


def _same(got, want, what):
    assert got.dtype == want.dtype and got.shape == want.shape, what
    if got.dtype == torch.bfloat16:
        nan_g, nan_w = torch.isnan(got), torch.isnan(want)
        assert torch.equal(nan_g, nan_w), what
        got, want = got.view(torch.int16)[~nan_g], want.view(torch.int16)[~nan_w]
    assert torch.equal(got.view(torch.uint8) if got.element_size() == 1 else got,
                       want.view(torch.uint8) if want.element_size() == 1 else want), what


def _reference(x, fp8_dtype):
    with reference_only():
        ref = MXFP8Quantizer(fp8_dtype).set_usage(True, True).quantize(x)
    out = {}
    for usage in ("rowwise", "columnwise"):
        data, scale = getattr(ref, f"{usage}_data"), getattr(ref, f"{usage}_scale")
        out[usage] = (data.view(torch.uint8), scale,
                      dequantize_blocks(data, scale, block_rows=1).to(torch.bfloat16))
    return out


def _run(x, fp8_dtype, mode, config, monkeypatch):
    calls = []
    orig = launch._launch_gluon
    monkeypatch.setattr(launch, "_launch_gluon", lambda *a: calls.append(1) or orig(*a))
    monkeypatch.setattr(launch, "GLUON", True)
    rowwise, exact_row, exact_col, codes = MODES[mode]
    monkeypatch.setitem(launch.GLUON_CONFIGS, "both" if rowwise else "col", config)
    outs = launch.mxfp8_quantize(x, fp8_dtype == E5, False, rowwise, True, 0, [], exact_row,
                                 exact_col, codes)
    assert calls, "the Gluon kernel was not launched"
    return outs


def _check(x, fp8_dtype, mode, config, monkeypatch, what):
    rowwise, exact_row, exact_col, codes = MODES[mode]
    want = _reference(x, fp8_dtype)
    rq, rs, cq, cs, re, ce = _run(x, fp8_dtype, mode, config, monkeypatch)
    if codes:
        _same(cq, want["columnwise"][0], f"{what} columnwise data")
        _same(cs, want["columnwise"][1], f"{what} columnwise scale")
    else:
        assert cq.numel() == cs.numel() == 0
    if rowwise and codes:
        _same(rq, want["rowwise"][0], f"{what} rowwise data")
        _same(rs, want["rowwise"][1], f"{what} rowwise scale")
    else:
        assert rq.numel() == rs.numel() == 0
    if exact_col:
        _same(ce, want["columnwise"][2], f"{what} columnwise exact")
    if exact_row:
        _same(re, want["rowwise"][2], f"{what} rowwise exact")


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("dist", ["normal", "wide", "tiny", "special"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("fp8_dtype", [E4, E5], ids=["e4m3", "e5m2"])
def test_gluon_matches_reference(fp8_dtype, dtype, dist, mode, monkeypatch):
    config = launch.GLUON_CONFIGS["both" if MODES[mode][0] else "col"]
    for i, (m, k) in enumerate(SHAPES):
        _check(_input(m, k, dtype, dist, seed=i), fp8_dtype, mode, config, monkeypatch,
               f"{mode} {(m, k)}")


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: ".".join(map(str, c)))
@pytest.mark.parametrize("mode", ["col", "both+exact", "exact_only"])
def test_every_config_matches_reference(mode, config, monkeypatch):
    """Each launch config the sweep may pick (warps, rows a thread holds) is exact too."""
    for i, (m, k) in enumerate(SHAPES):
        for dist in ("wide", "special"):
            _check(_input(m, k, torch.bfloat16, dist, seed=i), E4, mode, config, monkeypatch,
                   f"{mode} {dist} {(m, k)}")


def _edge_amaxes(p: int) -> torch.Tensor:
    """fp32 amaxes around every place the integer scale rule could slip: the mantissa
    bound 0x600000 at many exponents, the pattern where the quotient rounds down to the
    smallest subnormal (exponent p), tiny and huge amaxes, zero, plus random ones."""
    mants = torch.tensor([0, 1, 0x5FFFFF, 0x600000, 0x600001, 0x600002, 0x7FFFFF],
                         dtype=torch.int64)
    exps = torch.tensor(sorted({0, 1, 2, p - 2, p - 1, p, p + 1, p + 2, 100, 127, 127 + p,
                                200, 253, 254}), dtype=torch.int64)
    bits = (exps[:, None] << 23 | mants[None, :]).reshape(-1)
    g = torch.Generator().manual_seed(p)
    rand = torch.randint(0, 0x7F800000, (4096,), generator=g, dtype=torch.int64)
    return torch.cat([bits, rand]).to(torch.int32).view(torch.float32)


@pytest.mark.parametrize("gluon", [True, False], ids=["gluon", "triton"])
@pytest.mark.parametrize("fp8_dtype", [E4, E5], ids=["e4m3", "e5m2"])
def test_scale_rule_at_edge_amaxes(fp8_dtype, gluon, monkeypatch):
    """The kernels get the E8M0 exponent from the amax's bits, no division; each row and
    each column of the input below is one block whose amax is a chosen fp32 pattern.
    (``benchmarks/check_kernels_fp8.py`` checks the rule on every finite fp32.)"""
    monkeypatch.setattr(launch, "GLUON", gluon)
    amax = _edge_amaxes(8 if fp8_dtype == E4 else 15)
    n = (amax.numel() + 31) // 32 * 32
    amax = torch.cat([amax, amax[: n - amax.numel()]]).cuda()
    # (n, 32): row i holds amax[i] at column i % 32 and smaller values elsewhere; its
    # transpose, quantized columnwise, makes the same blocks
    x = amax[:, None] * torch.rand(n, 32, device="cuda", generator=torch.Generator(
        device="cuda").manual_seed(0)) * 0.5
    x[torch.arange(n), torch.arange(n) % 32] = amax
    _, want = block_exponents(amax, fp8_dtype)
    _, rs, _, _, _, _ = launch.mxfp8_quantize(x, fp8_dtype == E5, False, True, True, 0, [])
    _same(rs.reshape(-1), want, "rowwise scales")
    _, _, _, cs, _, _ = launch.mxfp8_quantize(x.t().contiguous(), fp8_dtype == E5, False, True,
                                              True, 0, [])
    _same(cs.reshape(-1), want, "columnwise scales")
