"""The Gluon 1x32 MXFP8 kernel of both usages (``formats/mxfp8/gluon_kernels.py``), bit for
bit: its codes and E8M0 scales against the pure-torch reference, and every output it
writes (codes, scales, exact bf16 values) against the Triton kernel's, at each launch
config the tests pick."""

from __future__ import annotations

import pytest
import torch
from format_inputs import spread

import lowprec.kernels
from lowprec.formats.mxfp8 import launch
from lowprec.formats.mxfp8.quantizer import MXFP8Quantizer
from lowprec.kernels import reference_only, tuning

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not (lowprec.kernels.triton_available()
                            and lowprec.kernels.gluon_available()),
                       reason="needs a CUDA device, Triton and Gluon"),
]

E4, E5 = torch.float8_e4m3fn, torch.float8_e5m2
# (M, K), multiples of 32: one block, M and K short of a tile and not a multiple of one,
# several tiles each way
SHAPES = [(32, 32), (64, 96), (96, 160), (256, 384), (1056, 1184)]
#: (RB, warps, K-fast, eviction hints): the default (2 warps), 4 warps, the grid along M,
#: smaller chunks and no hints, 8 warps
CONFIGS = [tuning.tuning.mxfp8_gluon_config, (32, 4, 1, 1), (32, 4, 0, 1), (16, 4, 1, 0),
           (16, 2, 1, 1), (32, 8, 1, 1)]
#: exact bf16 records asked for (quantize_for_gemm), and none
REQUESTS = {"none": (), "row": ("rowwise",), "both": ("rowwise", "columnwise")}


def _input(m, k, dtype, dist, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = spread(torch.randn(m, k + 32, generator=g, device="cuda"), dtype, dist, g)
    if dist == "special":
        x[:32, :32] = 0
        x[5, 7] = float("nan")
        x[m - 1, k - 1] = float("-inf")
        x[m // 2, 0] = float("inf")
    return x[:, :k]  # rows further apart than K


def _outputs(qt):
    outs = {n: t.view(torch.uint8) for n, t in qt.inner_tensors().items()
            if t is not None and t.element_size() == 1}
    for usage in ("rowwise", "columnwise"):
        rec = getattr(qt, f"_exact_{usage}", None)
        if rec:
            outs[f"exact {usage}"] = rec[2].view(torch.int16)
    return outs


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: ".".join(map(str, c)))
@pytest.mark.parametrize("dist", ["normal", "wide", "tiny", "special"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("fp8_dtype", [E4, E5], ids=["e4m3", "e5m2"])
def test_gluon_matches_reference_and_triton(fp8_dtype, dtype, dist, config, monkeypatch):
    calls = []
    orig = launch._gluon_applies
    monkeypatch.setattr(launch, "_gluon_applies",
                        lambda *a: (orig(*a) and not calls.append(1)))
    with tuning.override(mxfp8_gluon_config=config):
        for i, (m, k) in enumerate(SHAPES):
            x = _input(m, k, dtype, dist, seed=i)
            with reference_only():
                ref = MXFP8Quantizer(fp8_dtype).quantize(x)
            for req, exact in REQUESTS.items():
                with tuning.override(mxfp8_gluon=True):
                    got = MXFP8Quantizer(fp8_dtype).quantize_for_gemm(x, exact)
                with tuning.override(mxfp8_gluon=False):
                    want = MXFP8Quantizer(fp8_dtype).quantize_for_gemm(x, exact)
                for name in ("rowwise_data", "rowwise_scale", "columnwise_data",
                             "columnwise_scale"):
                    assert torch.equal(getattr(got, name).view(torch.uint8),
                                       getattr(ref, name).view(torch.uint8)), f"{(m, k)} {name}"
                g, w = _outputs(got), _outputs(want)
                assert g.keys() == w.keys()
                for name in g:
                    assert torch.equal(g[name], w[name]), f"{(m, k)} {req}: {name}"
            # the exact values alone (no codes written), through the op on the strided view
            e5m2 = fp8_dtype == E5
            with tuning.override(mxfp8_gluon=True):
                outs = launch.mxfp8_quantize(x, e5m2, False, True, True, 0, [], True, True, False)
            with tuning.override(mxfp8_gluon=False):
                want = launch.mxfp8_quantize(x, e5m2, False, True, True, 0, [], True, True, False)
            for a, b in zip(outs, want):
                assert a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))
            # an input's forward: the rowwise exact values and the columnwise codes, no
            # rowwise codes; the same bits as the whole quantize's
            keep = (e5m2, False, True, True, 0, [], True, False, True, False)
            with tuning.override(mxfp8_gluon=True):
                outs = launch.mxfp8_quantize(x, *keep)
            with tuning.override(mxfp8_gluon=False):
                want = launch.mxfp8_quantize(x, *keep)
                whole = launch.mxfp8_quantize(x, *keep[:-1])
            assert outs[0].numel() == outs[1].numel() == outs[5].numel() == 0
            for a, b in zip(outs, want):
                assert a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))
            for i in (2, 3, 4):
                assert torch.equal(outs[i].view(torch.uint8), whole[i].view(torch.uint8)), i
        # every quantize that asked for the Gluon kernel went through it
        assert len(calls) == len(SHAPES) * (len(REQUESTS) + 2)


def test_gluon_not_used_where_it_does_not_apply(monkeypatch):
    """One usage, 32x32 blocks or a non-unit inner stride take the Triton kernel."""
    calls = []
    orig = launch._gluon_applies
    monkeypatch.setattr(launch, "_gluon_applies",
                        lambda *a: (orig(*a) and not calls.append(1)))
    x = torch.randn(256, 384, device="cuda", dtype=torch.bfloat16)
    MXFP8Quantizer(E4).set_usage(True, False).quantize(x)
    MXFP8Quantizer(E4).set_usage(False, True).quantize(x)
    MXFP8Quantizer(E4, with_2d_quantization=True).quantize(x)
    launch.mxfp8_quantize(x.t(), False, False, True, True, 0, [])
    assert calls == []
    MXFP8Quantizer(E4).quantize(x)
    assert calls == [1]
