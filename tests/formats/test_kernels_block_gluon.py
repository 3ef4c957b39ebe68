"""The Gluon 1x128 block kernel (``formats/block/gluon_kernels.py``) against the reference,
bit for bit, in each mode the launcher can pick: columnwise only, both usages from one read,
and the rowwise Triton launch beside the Gluon columnwise one."""

from __future__ import annotations

import pytest
import torch
from format_inputs import spread

import lowprec.kernels
from lowprec.formats.block import launch
from lowprec.formats.block.quantizer import Float8BlockQuantizer
from lowprec.kernels import launch as kernel_launch
from lowprec.kernels import reference_only, tuning

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not (lowprec.kernels.triton_available()
                            and lowprec.kernels.gluon_available()),
                       reason="needs a CUDA device, Triton and Gluon"),
]

# (M, K): M a multiple of 128 (1x128 columnwise blocks run along M); K aligned, unaligned
# (columnwise only), narrower than one tile, and several tiles wide
SHAPES = [(128, 128), (256, 384), (384, 200), (128, 40), (1024, 1152)]
USAGES = {"both": (True, True), "col": (False, True)}


def _input(m, k, dtype, dist, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = spread(torch.randn(m, k + 64, generator=g, device="cuda"), dtype, dist, g)
    if dist == "special":
        x[: min(m, 32), : min(k, 64)] = 0
        x[5, 7] = float("nan")
        x[m - 1, k - 1] = float("-inf")
        x[m // 2, 0] = float("inf")
    return x[:, :k]  # rows further apart than K (stride(0) > K)


def _same(a, b, what):
    assert (a is None) == (b is None), what
    if a is None:
        return
    assert a.dtype == b.dtype and a.shape == b.shape, what
    if a.dtype.is_floating_point and a.element_size() == 4:
        nan_a, nan_b = torch.isnan(a), torch.isnan(b)
        assert torch.equal(nan_a, nan_b), what
        a, b = a.view(torch.int32)[~nan_a], b.view(torch.int32)[~nan_b]
    else:
        a, b = a.view(torch.uint8), b.view(torch.uint8)
    assert torch.equal(a, b), what


#: launch modes: the default configs, the grid along M instead of K, and for both usages
#: smaller row chunks, 8 warps and no L2 eviction hints
MODES = {"gluon_col": {}, "gluon_both": {}, "gluon_col/mfast": {"col": (8, 8, 4, 0)},
         "gluon_both/mfast": {"both": (32, 8, 8, 4, 0, 1)},
         "gluon_both/w8": {"both": (16, 8, 16, 8, 1, 0)}}


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("dist", ["normal", "wide", "special"])
@pytest.mark.parametrize("usage", list(USAGES))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("fp8_dtype", [torch.float8_e4m3fn, torch.float8_e5m2],
                         ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("pow2", [True, False], ids=["pow2", "exact"])
def test_gluon_matches_reference(pow2, fp8_dtype, dtype, usage, dist, mode, monkeypatch):
    calls = []
    orig = launch._gluon_call
    monkeypatch.setattr(launch, "_gluon_call", lambda *a: calls.append(a[2]) or orig(*a))
    gluon_configs = {**tuning.tuning.block_gluon_configs, **MODES[mode]}
    # unbound: every call picks its launches (a bound kind reruns them without asking)
    with tuning.override(block_gluon=True, block_gluon_both=mode.startswith("gluon_both"),
                         block_gluon_configs=gluon_configs), kernel_launch.unbound_calls():
        launched = 0
        row, col = USAGES[usage]
        for i, (m, k) in enumerate(SHAPES):
            x = _input(m, k, dtype, dist, seed=i)

            def quantizer():
                return Float8BlockQuantizer(fp8_dtype, block_scaling_dim=1,
                                            force_pow_2_scales=pow2).set_usage(row, col)
            try:
                with reference_only():
                    ref = quantizer().quantize(x)
            except ValueError:
                with pytest.raises(ValueError):
                    quantizer().quantize(x)
                continue
            # through the quantizer (a contiguous copy of x) and through the op on the strided
            # view itself (rows further apart than K)
            got = quantizer().quantize(x)
            for name, t in got.inner_tensors().items():
                _same(t, ref.inner_tensors()[name], f"{(m, k)} {name}")
            for u in ("rowwise", "columnwise"):
                if getattr(ref, f"{u}_scale") is not None:
                    _same(got.decode_scale(u), ref.decode_scale(u), f"{(m, k)} {u} decode")
                    record = getattr(got, f"_decode_{u}")
                    if quantizer()._whole_blocks(x.shape, m, k) != (m, k):
                        assert record is None  # partial blocks: no padded-layout records
                    else:
                        assert got.decode_scale(u) is record[2]
            assert x.stride(0) > k
            if quantizer()._whole_blocks(x.shape, m, k) != (m, k):
                # the op takes whole blocks; the quantizer pads partial ones first (above)
                launched += 1
                continue
            outs = launch.fp8_block_quantize(x, fp8_dtype == torch.float8_e5m2, 1, pow2, 0.0, row,
                                             col, 0, [])
            want = [ref.rowwise_data, ref.rowwise_scale,
                    ref.decode_scale("rowwise") if row else None,
                    ref.columnwise_data, ref.columnwise_scale, ref.decode_scale("columnwise")]
            for name, a, b in zip(("rq", "rs", "rd", "cq", "cs", "cd"), outs, want):
                if b is not None:
                    _same(a.view(b.dtype), b, f"{(m, k)} strided {name}")
            launched += 2
        # every quantize that the reference accepted went through the Gluon kernel, in the mode
        # asked for (its third argument: the rowwise usage from the same read)
        assert launched >= 6 and len(calls) == launched
        assert set(calls) == {usage == "both" and mode.startswith("gluon_both")}


def test_gluon_not_used_where_it_does_not_apply(monkeypatch):
    """Row-only, 128x128 blocks and non-unit inner strides stay on the Triton kernel."""
    calls = []
    orig = launch._gluon_call
    monkeypatch.setattr(launch, "_gluon_call", lambda *a: calls.append(1) or orig(*a))
    x = torch.randn(256, 384, device="cuda", dtype=torch.bfloat16)
    Float8BlockQuantizer(torch.float8_e4m3fn, block_scaling_dim=1).set_usage(True, False) \
        .quantize(x)
    Float8BlockQuantizer(torch.float8_e4m3fn, block_scaling_dim=2).quantize(x)
    rq, rs, rd, cq, cs, cd = launch.fp8_block_quantize(x.t(), False, 1, True, 0.0, True, True,
                                                       0, [])
    assert calls == []
    with reference_only():
        ref = Float8BlockQuantizer(torch.float8_e4m3fn, block_scaling_dim=1).quantize(x.t())
    _same(rq.view(ref.rowwise_data.dtype), ref.rowwise_data, "rowwise")
    _same(cq.view(ref.columnwise_data.dtype), ref.columnwise_data, "columnwise")
    _same(cs, ref.columnwise_scale, "columnwise scale")


def test_gluon_both_unaligned_rows(monkeypatch):
    """An input whose rows do not start 16-byte aligned (the kernel's loads cannot be
    vectorized) goes through the both-usage kernel all the same, with the same bytes."""
    calls = []
    orig = launch._gluon_call
    monkeypatch.setattr(launch, "_gluon_call", lambda *a: calls.append(a[2]) or orig(*a))
    with tuning.override(block_gluon_both=True):
        flat = torch.randn(256 * 384 + 8, device="cuda", dtype=torch.bfloat16)
        x = flat[1:1 + 256 * 384].view(256, 384)
        assert x.data_ptr() % 16 != 0
        rq, rs, rd, cq, cs, cd = launch.fp8_block_quantize(x, False, 1, True, 0.0, True, True, 0,
                                                           [])
        assert calls == [True]
        with reference_only():
            ref = Float8BlockQuantizer(torch.float8_e4m3fn, block_scaling_dim=1).quantize(x)
        _same(rq.view(ref.rowwise_data.dtype), ref.rowwise_data, "rowwise")
        _same(rs, ref.rowwise_scale, "rowwise scale")
        _same(cq.view(ref.columnwise_data.dtype), ref.columnwise_data, "columnwise")
        _same(cs, ref.columnwise_scale, "columnwise scale")


@pytest.mark.parametrize("dim,usage", [(1, "both"), (1, "col"), (1, "row"), (2, "both")])
def test_bound_launches_keep_the_bits(dim, usage):
    """The launcher binds a kind's launches at its second call; every later call of the kind
    (new tensors in place) gives the reference's bits."""
    row, col = {"both": (True, True), "col": (False, True), "row": (True, False)}[usage]
    m, k = 256, 384
    for seed in range(4):
        x = _input(m, k, torch.bfloat16, "wide", seed).contiguous()
        with reference_only():
            ref = Float8BlockQuantizer(torch.float8_e4m3fn, block_scaling_dim=dim
                                       ).set_usage(row, col).quantize(x)
        outs = launch.fp8_block_quantize(x, False, dim, True, 0.0, row, col, 0, [])
        want = [ref.rowwise_data, ref.rowwise_scale, ref.columnwise_data, ref.columnwise_scale]
        for name, a, b in zip(("rq", "rs", "cq", "cs"), (outs[0], outs[1], outs[3], outs[4]),
                              want):
            if b is not None:
                _same(a.view(b.dtype), b, f"call {seed} {name}")
    kind = launch._kind(x, False, dim, True, 0.0, row, col)
    assert isinstance(launch._QUANTIZES._kinds.get(kind), tuple)  # bound
