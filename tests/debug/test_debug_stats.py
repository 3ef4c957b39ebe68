"""direction_stats on quantized tensors of every format, against independent counts."""

from __future__ import annotations

import math

import pytest
import torch

import lowprec
from lowprec.debug.stats import StepStats, direction_stats, signal_noise, sqnr_db
from lowprec.formats import ExactTensor

#: relative tolerance of an SQNR against an fp64 computation: the recorder accumulates its
#: sums of squares in fp32 (about 1e-7 relative each; a wrong value is off by far more)
FP32_SUMS = 1e-6


def _x(m=64, k=128, seed=0, scale=1.0):
    return torch.randn(m, k, generator=torch.Generator().manual_seed(seed)) * scale


def _same(a, b) -> bool:
    """Two DirectionStats equal (the same sums over the same values)."""
    return all(x == y or (isinstance(x, float) and x == pytest.approx(y, rel=1e-12))
               for x, y in zip(vars(a).values(), vars(b).values()))


def test_delayed_scale_saturation_and_scale():
    x = _x(scale=40.0)
    q = lowprec.Float8Quantizer(torch.tensor([4.0]), torch.zeros(1))
    qt = q.quantize(x)
    want = int(((x * 4.0).abs() > 448).sum())
    assert want > 20
    for usage in ("rowwise", "columnwise"):
        s = direction_stats(x, qt, usage, q)
        assert s.saturated == want and s.scale == 4.0 and s.block_scale_min is None
        assert s.amax == float(x.abs().amax()) and s.numel == x.numel()


def test_nvfp4_saturation_matches_the_format_rules():
    """Saturation where a block's E4M3 decode scale rounded down: counted from the spec's
    formulas (S = 2688 / amax, d = e4m3(block_amax / 6 * S), v = x * S / d)."""
    x = _x()
    q = lowprec.NVFP4Quantizer()
    s_enc = torch.tensor([2688.0]) / x.abs().amax().reshape(1)
    blocks = x.reshape(64, 8, 16)
    d = ((blocks.abs().amax(-1, keepdim=True) / 6.0) * s_enc).to(torch.float8_e4m3fn).float()
    want = int(((blocks * s_enc) / d).abs().gt(6.0).sum())
    s = direction_stats(x, q.quantize(x), "rowwise", q)
    assert want > 0 and s.saturated == want
    assert s.scale == float(s_enc)
    assert s.block_scale_min == pytest.approx(float((d / s_enc).min()), rel=1e-6)


def test_nvfp4_block_flushed_to_zero():
    """A block whose decode scale underflows E4M3 comes back as zeros."""
    x = _x(16, 64)
    x[0, :16] = 1e-9
    q = lowprec.NVFP4Quantizer()
    qt = q.quantize(x)
    deq = qt.dequantize(torch.float32)
    want = int(((x != 0) & (deq == 0)).sum())
    s = direction_stats(x, qt, "rowwise", q)
    assert want >= 16 and s.flushed == want and s.nonzero == x.numel()
    assert s.block_scale_min == 0.0


def test_block_formats_do_not_saturate():
    x = _x(128, 128, scale=1e3)
    for q in (lowprec.MXFP8Quantizer(), lowprec.Float8BlockQuantizer(
            torch.float8_e4m3fn, block_scaling_dim=2), lowprec.MXFP8Quantizer(
            with_2d_quantization=True)):
        qt = q.quantize(x)
        for usage in ("rowwise", "columnwise"):
            s = direction_stats(x, qt, usage, q)
            assert s.saturated == 0 and s.flushed == 0 and s.scale is None
            assert 0 < s.block_scale_min <= s.block_scale_max
            want = sqnr_db(x, qt.dequantize(torch.float32, usage))
            assert 10 * math.log10(s.signal / s.noise) == pytest.approx(want, rel=FP32_SUMS)


def test_hybrid_reads_each_direction_in_its_format():
    x = _x()
    q = lowprec.HybridQuantizer(lowprec.MXFP8Quantizer(),
                                lowprec.Float8CurrentScalingQuantizer())
    qt = q.quantize(x)
    row, col = (direction_stats(x, qt, u, q) for u in ("rowwise", "columnwise"))
    assert row.scale is None and row.block_scale_min is not None
    assert col.scale == pytest.approx(448.0 / float(x.abs().amax()), rel=1e-6)
    assert col.block_scale_min is None


@pytest.mark.parametrize("q", [lowprec.MXFP8Quantizer(),
                               lowprec.NVFP4Quantizer(with_rht=True),
                               lowprec.NVFP4Quantizer(with_2d_quantization=True)],
                         ids=["mxfp8", "nvfp4_rht", "nvfp4_2d"])
def test_exact_tensor_gives_the_same_stats(q):
    """An operand kept only as exact values (what GPU kernels return for dY) reads back
    like the quantized tensor it stands for: its scales are recomputed from the input."""
    x = _x()
    qt = q.quantize(x)
    for usage in ("rowwise", "columnwise"):
        values, divisor = qt.bf16_operand(usage)
        source = "mxfp8" if isinstance(q, lowprec.MXFP8Quantizer) else "nvfp4"
        exact = ExactTensor(x.shape, x.dtype, **ExactTensor.one_usage_fields(
            usage, values, divisor, source_format=source, rht=getattr(q, "with_rht", False)))
        got, want = direction_stats(x, exact, usage, q), direction_stats(x, qt, usage, q)
        assert _same(got, want), (got, want)
        assert direction_stats(x, exact, usage, None).saturated is None  # no settings


def test_nan_input():
    x = _x()
    x[1, 2] = float("nan")
    q = lowprec.Float8CurrentScalingQuantizer()
    qt = q.quantize(x)
    assert torch.isnan(qt.dequantize(torch.float32)).all()  # the NaN poisons the scale
    s = direction_stats(x, qt, "rowwise", q)
    assert s.nonfinite == 1 and s.nonfinite_quantized is True
    assert math.isnan(s.amax) and s.nonzero == x.numel() - 1
    clean = _x()
    s = direction_stats(clean, q.quantize(clean), "rowwise", q)
    assert s.nonfinite == 0 and s.nonfinite_quantized is False and math.isfinite(s.amax)


def test_inf_input_and_inf_quantized():
    """An Inf counts as non-finite (not as nonzero); a finite input with a broken (Inf)
    delayed scale gives non-finite quantized values from a finite input."""
    x = _x()
    x[0, 0], x[5, 9], x[7, 7] = float("inf"), float("-inf"), 0.0
    q = lowprec.Float8Quantizer(torch.tensor([1.0]), torch.zeros(1))
    s = direction_stats(x, q.quantize(x), "columnwise", q)
    assert s.nonfinite == 2 and s.nonzero == x.numel() - 3 and s.amax == math.inf
    clean = _x()
    broken = lowprec.Float8Quantizer(torch.tensor([0.0]), torch.zeros(1))  # decode 1/0
    s = direction_stats(clean, broken.quantize(clean), "rowwise", broken)
    assert s.nonfinite == 0 and s.nonfinite_quantized is True


def test_step_stats_sum_calls():
    q = lowprec.Float8CurrentScalingQuantizer()
    step = StepStats()
    xs = [_x(seed=1), _x(seed=2, scale=3.0)]
    for x in xs:
        step.add(direction_stats(x, q.quantize(x), "rowwise", q), "fp8", tuple(x.shape))
    row = step.row()
    assert row["calls"] == 2 and row["amax"] == max(float(x.abs().amax()) for x in xs)
    whole = torch.cat(xs)
    deq = torch.cat([q.quantize(x).dequantize(torch.float32) for x in xs])
    assert row["sqnr_db"] == pytest.approx(sqnr_db(whole, deq), rel=FP32_SUMS)


def test_sqnr_db_edges():
    x = torch.ones(4)
    assert sqnr_db(x, x) == math.inf
    assert sqnr_db(torch.zeros(4), x) == -math.inf
    assert math.isnan(sqnr_db(torch.zeros(4), torch.zeros(4)))
    assert sqnr_db(x, x * 1.1) == pytest.approx(20.0)


@pytest.mark.parametrize("q", [lowprec.NVFP4Quantizer(with_rht=True),
                               lowprec.NVFP4Quantizer(with_2d_quantization=True)],
                         ids=["rht", "2d"])
def test_debug_nvfp4_dequantize_matches_the_format_bit_for_bit(q):
    from lowprec.debug.scaling import stored_values

    x = _x(64, 128, scale=5.0)
    x[3, :16] = 1e-9  # an underflowed block: zeros
    qt = q.quantize(x)
    for usage in ("rowwise", "columnwise"):
        got, want = stored_values(qt, usage), qt.dequantize_stored(usage)
        assert torch.equal(got.view(torch.int32), want.view(torch.int32)), usage


@pytest.mark.parametrize("shape", [(37, 129), (5, 3, 40), (1000,), (), (0, 8)])
@pytest.mark.parametrize("chunk", [1, 100, 1 << 24])
def test_signal_noise_chunks_give_the_whole_sums(shape, chunk):
    """The float64 sums over row chunks equal numpy's over the whole tensor (bf16 operand,
    fp32 approximation, as the compare probe passes them; a transposed view as well)."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(shape, generator=g).bfloat16()
    approx = x.float() + 0.01 * torch.randn(shape, generator=g)
    for xs, ap in ((x, approx), (x.mT, approx.mT) if x.dim() >= 2 else (x, approx)):
        x64, a64 = xs.double().numpy(), ap.double().numpy()
        signal, noise = signal_noise(xs, ap, chunk_elements=chunk)
        assert signal == pytest.approx(float((x64 * x64).sum()), rel=1e-12, abs=0)
        assert noise == pytest.approx(float(((x64 - a64) ** 2).sum()), rel=1e-12, abs=0)


def test_signal_noise_refuses_bad_input():
    with pytest.raises(ValueError, match=r"shape \(4, 4\) and approx \(4, 5\)"):
        signal_noise(torch.zeros(4, 4), torch.zeros(4, 5))
    with pytest.raises(ValueError, match="chunk_elements=0"):
        signal_noise(torch.zeros(4), torch.zeros(4), chunk_elements=0)
