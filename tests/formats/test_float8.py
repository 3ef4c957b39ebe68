"""Per-tensor FP8 (current and delayed scaling) against an independent float64 model.

The expected values are computed here from the SPEC formulas in float64 (fp32
steps are modelled by rounding the float64 result to fp32 once, which is exact
for a single +, *, / of fp32 operands); lowprec's reference module is never
used for expectations.
"""

from __future__ import annotations

import math
import zlib

import pytest
import torch

from lowprec.formats.float8 import Float8CurrentScalingQuantizer, Float8Quantizer, Float8Tensor

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
# emin: exponent of the smallest normal; mbits: stored mantissa bits.
FMT = {E4M3: dict(emin=-6, mbits=3, fmax=448.0, bias=7),
       E5M2: dict(emin=-14, mbits=2, fmax=57344.0, bias=15)}
FP32_MAX = float(torch.finfo(torch.float32).max)
HP_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SHAPES = [(96,), (16, 48), (3, 8, 20)]
DISTS = ["normal", "uniform", "lognormal", "student_t", "outliers", "binades"]


# ---- independent float64 model ------------------------------------------------------------
def f32(v: float) -> float:
    """Round a python float to the nearest fp32 (RNE; overflow gives inf)."""
    return torch.tensor(v, dtype=torch.float64).to(torch.float32).item()


def to_f32(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.float32).to(torch.float64)


def round_fp8(v: torch.Tensor, fp8_dtype) -> torch.Tensor:
    """float64 values -> nearest fp8 grid value (RNE), saturated to the fp8 max; NaN stays."""
    f = FMT[fp8_dtype]
    a = v.abs().clamp_max(2 * f["fmax"])  # anything >= fmax saturates; keeps frexp finite
    _, e = torch.frexp(a)
    ulp = torch.exp2((torch.clamp_min(e.to(torch.float64) - 1, f["emin"]) - f["mbits"]))
    r = torch.clamp_max(torch.round(a / ulp) * ulp, f["fmax"])
    return torch.copysign(r, v)


def fp8_bits(q: torch.Tensor, fp8_dtype) -> torch.Tensor:
    """Encode finite fp8 grid values (float64) as their uint8 bit patterns."""
    f = FMT[fp8_dtype]
    a = q.abs()
    normal = a >= 2.0 ** f["emin"]
    _, e = torch.frexp(a)
    e = e.to(torch.float64) - 1
    exp_field = torch.where(normal, e + f["bias"], torch.zeros_like(e))
    frac = torch.where(normal, a / torch.exp2(e) - 1, a / 2.0 ** f["emin"])
    mant = frac * 2 ** f["mbits"]
    bits = exp_field.to(torch.int64) * 2 ** f["mbits"] + mant.to(torch.int64)
    bits = bits + 128 * torch.signbit(q).to(torch.int64)
    return bits.to(torch.uint8)


def expected_current_scale(x: torch.Tensor, fp8_dtype, pow2: bool, eps: float) -> float:
    amax = x.double().abs().max().item()
    if not math.isfinite(amax):
        return math.nan
    a = max(amax, f32(eps))
    if a == 0:
        return 1.0
    s = f32(FMT[fp8_dtype]["fmax"] / a)
    if math.isinf(s):
        s = FP32_MAX
    if pow2:
        s = 2.0 ** (math.frexp(s)[1] - 1)
    return s


def expected(x: torch.Tensor, scale: float, fp8_dtype):
    """(fp8 grid values (M, K) float64, dequantized fp32 (M, K)) for x quantized with scale."""
    k = x.shape[-1]
    x2 = x.double().reshape(-1, k)
    if math.isnan(scale):
        nan = torch.full_like(x2, math.nan)
        return nan, nan.float()
    q = round_fp8(to_f32(x2 * scale), fp8_dtype)  # x*scale is one fp32 multiply
    return q, (q / scale).to(torch.float32)


# ---- comparison helpers -------------------------------------------------------------------
def int_bits(t: torch.Tensor) -> torch.Tensor:
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return t.view(ints[t.element_size()])


def assert_bits_equal_nan(actual: torch.Tensor, want: torch.Tensor) -> None:
    """Same dtype, shape, NaN mask, and identical bits elsewhere (signed zeros included)."""
    assert actual.dtype == want.dtype and actual.shape == want.shape
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(actual), nan)
    assert torch.equal(int_bits(actual)[~nan], int_bits(want)[~nan])


def check_quantized(qt, x, scale: float, fp8_dtype, *, rowwise=True, columnwise=True):
    assert isinstance(qt, Float8Tensor)
    assert qt.shape == x.shape and qt.dtype == x.dtype
    s = qt.shared_scale
    assert s.dtype == torch.float32 and s.numel() == 1
    assert (math.isnan(s.item()) and math.isnan(scale)) or s.item() == scale
    q, deq = expected(x, scale, fp8_dtype)
    m, k = q.shape
    for usage, held in (("rowwise", rowwise), ("columnwise", columnwise)):
        data = getattr(qt, f"{usage}_data")
        assert (data is not None) == held, usage
        assert qt.has_usage(usage) == held
        if not held:
            continue
        assert data.dtype == fp8_dtype
        want_q = q if usage == "rowwise" else q.t()
        assert data.shape == want_q.shape and data.is_contiguous()
        if not math.isnan(scale):
            assert torch.equal(data.view(torch.uint8), fp8_bits(want_q, fp8_dtype).contiguous())
        else:
            assert torch.isnan(data.to(torch.float32)).all()
        assert_bits_equal_nan(qt.dequantize(torch.float32, usage=usage), deq.reshape(x.shape))
        for dt in HP_DTYPES:
            assert_bits_equal_nan(qt.dequantize(dt, usage=usage), deq.reshape(x.shape).to(dt))
        assert qt.dequantize(usage=usage).dtype == x.dtype


def seeded(*key) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def sample(dist: str, shape, dtype, gen: torch.Generator) -> torch.Tensor:
    n = math.prod(shape)
    if dist == "normal":
        v = torch.randn(n, generator=gen)
    elif dist == "uniform":
        v = (torch.rand(n, generator=gen) * 2 - 1) * 3
    elif dist == "lognormal":
        v = torch.exp(2 * torch.randn(n, generator=gen)) * torch.randn(n, generator=gen).sign()
    elif dist == "student_t":  # 3 degrees of freedom
        chi2 = torch.randn(3, n, generator=gen).pow(2).sum(0)
        v = torch.randn(n, generator=gen) / torch.sqrt(chi2 / 3)
    elif dist == "outliers":
        v = torch.randn(n, generator=gen)
        v[torch.randint(0, n, (3,), generator=gen)] *= 3000.0
    elif dist == "binades":
        lo, hi = (-22, 14) if dtype == torch.float16 else (-60, 60)
        v = torch.exp2(torch.rand(n, generator=gen) * (hi - lo) + lo)
        v = v * torch.randn(n, generator=gen).sign()
    else:
        raise AssertionError(dist)
    return v.reshape(shape).to(dtype)


def delayed(scale: float, fp8_dtype=E4M3) -> Float8Quantizer:
    return Float8Quantizer(torch.tensor([scale]), torch.zeros(1), fp8_dtype)


# ---- current scaling ----------------------------------------------------------------------
@pytest.mark.parametrize("pow2", [False, True], ids=["exact", "pow2"])
@pytest.mark.parametrize("fp8_dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", HP_DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dist", DISTS)
def test_current_scaling_matches_float64(dist, shape, dtype, fp8_dtype, pow2):
    x = sample(dist, shape, dtype, seeded(dist, shape, dtype, fp8_dtype))
    q = Float8CurrentScalingQuantizer(fp8_dtype, force_pow_2_scales=pow2)
    scale = expected_current_scale(x, fp8_dtype, pow2, 0.0)
    check_quantized(q.quantize(x), x, scale, fp8_dtype)
    if pow2:
        assert scale == 2.0 ** (math.frexp(scale)[1] - 1)


@pytest.mark.parametrize("fp8_dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_current_scaling_amax_element_maps_to_fp8_max(fp8_dtype):
    fmax = FMT[fp8_dtype]["fmax"]
    for dist in DISTS:
        x = sample(dist, (12, 40), torch.float32, seeded("max", dist))
        qt = Float8CurrentScalingQuantizer(fp8_dtype).quantize(x)
        assert qt.rowwise_data.to(torch.float32).abs().max().item() == fmax
        pow2 = Float8CurrentScalingQuantizer(fp8_dtype, force_pow_2_scales=True).quantize(x)
        assert fmax / 2 <= pow2.rowwise_data.to(torch.float32).abs().max().item() <= fmax
        # pow2 rounds the scale DOWN.
        assert pow2.shared_scale.item() <= qt.shared_scale.item() < 2 * pow2.shared_scale.item()


@pytest.mark.parametrize("pow2", [False, True], ids=["exact", "pow2"])
@pytest.mark.parametrize("fp8_dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("eps", [2.0 ** -10, 1e-3, 7.5])
def test_current_scaling_amax_epsilon(eps, fp8_dtype, pow2):
    q = Float8CurrentScalingQuantizer(fp8_dtype, force_pow_2_scales=pow2, amax_epsilon=eps)
    g = seeded("eps", eps)
    for x in (torch.randn(6, 10, generator=g) * 1e-5,  # amax < eps: eps is used
              torch.randn(6, 10, generator=g) * 100,  # amax > eps: eps has no effect
              torch.zeros(6, 10)):  # max(0, eps) = eps, so not the amax-0 rule
        scale = expected_current_scale(x, fp8_dtype, pow2, eps)
        check_quantized(q.quantize(x), x, scale, fp8_dtype)
    assert q.quantize(torch.zeros(3, 4)).shared_scale.item() != 1.0


@pytest.mark.parametrize("fp8_dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("pow2", [False, True], ids=["exact", "pow2"])
def test_current_scaling_zero_tensor_scale_is_one(fp8_dtype, pow2):
    x = torch.tensor([[0.0, -0.0, 0.0], [-0.0, 0.0, 0.0]])
    qt = Float8CurrentScalingQuantizer(fp8_dtype, force_pow_2_scales=pow2).quantize(x)
    assert qt.shared_scale.item() == 1.0
    assert qt.rowwise_data.view(torch.uint8).tolist() == [[0, 128, 0], [128, 0, 0]]
    check_quantized(qt, x, 1.0, fp8_dtype)


@pytest.mark.parametrize("fp8_dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("pow2", [False, True], ids=["exact", "pow2"])
def test_current_scaling_infinite_scale_becomes_fp32_max(fp8_dtype, pow2):
    want = 2.0 ** 127 if pow2 else FP32_MAX
    q = Float8CurrentScalingQuantizer(fp8_dtype, force_pow_2_scales=pow2)
    for x in (torch.tensor([2.0 ** -149, -0.0, 2.0 ** -149]),  # fp32 min subnormal
              torch.tensor([[2.0 ** -133, -(2.0 ** -130)]], dtype=torch.bfloat16)):
        qt = q.quantize(x)
        assert qt.shared_scale.item() == want
        check_quantized(qt, x, want, fp8_dtype)
    # amaxes around fmax / FP32_MAX, where the fp32 division starts to overflow.
    a = torch.tensor(f32(FMT[fp8_dtype]["fmax"] / FP32_MAX))
    for amax in (a, torch.nextafter(a, torch.tensor(0.0)), torch.nextafter(a, torch.tensor(1.0)),
                 a * 0.5, a * 2):
        x = torch.stack([amax, -amax / 3, amax / 7]).float()
        scale = expected_current_scale(x, fp8_dtype, pow2, 0.0)
        check_quantized(q.quantize(x), x, scale, fp8_dtype)


@pytest.mark.parametrize("dtype", HP_DTYPES, ids=str)
@pytest.mark.parametrize("fp8_dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_current_scaling_subnormal_inputs(dtype, fp8_dtype):
    tiny = torch.finfo(dtype).smallest_normal
    sub = [tiny / 2, -tiny / 8, tiny * 0.75, -tiny / 64]  # subnormals of the input dtype
    for x in (torch.tensor(sub, dtype=dtype),  # amax itself subnormal: huge scale
              torch.tensor(sub + [1.0, -3.0, 0.25], dtype=dtype)):  # subnormals flush to 0
        for pow2 in (False, True):
            q = Float8CurrentScalingQuantizer(fp8_dtype, force_pow_2_scales=pow2)
            check_quantized(q.quantize(x), x, expected_current_scale(x, fp8_dtype, pow2, 0.0),
                            fp8_dtype)


@pytest.mark.parametrize("fp8_dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("shape", [(1,), (7, 13), (5, 1, 3), (1, 1, 1), (2, 3, 4, 5)], ids=str)
def test_any_shape_is_accepted(shape, fp8_dtype):
    x = sample("normal", shape, torch.float32, seeded("shape", shape))
    check_quantized(Float8CurrentScalingQuantizer(fp8_dtype).quantize(x), x,
                    expected_current_scale(x, fp8_dtype, False, 0.0), fp8_dtype)


def test_empty_tensor_quantizes():
    qt = Float8CurrentScalingQuantizer(E4M3).quantize(torch.randn(0, 8))
    assert qt.dequantize().shape == (0, 8)


# ---- saturation and the fp8 subnormal range (delayed scaling, exact chosen scales) ---------
SATURATE = {
    E4M3: [448.0, 449.0, 456.0, 463.99, 464.0, 464.01, 479.0, 480.0, 1e6, 3e38],
    E5M2: [57344.0, 57345.0, 61439.0, 61440.0, 61441.0, 65504.0, 1e9, 3e38],
}


@pytest.mark.parametrize("fp8_dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("scale", [1.0, 0.5, 2.0 ** 20])
def test_saturation_boundary(fp8_dtype, scale):
    fmax = FMT[fp8_dtype]["fmax"]
    vals = torch.tensor(SATURATE[fp8_dtype]) / scale  # x * scale gives back the list
    vals = vals[torch.isfinite(vals)]  # (3e38 / 0.5 would already be an Inf input)
    x = torch.cat([vals, -vals]).reshape(2, -1)
    qt = delayed(scale, fp8_dtype).quantize(x)
    data = qt.rowwise_data.to(torch.float64)
    assert torch.equal(data, torch.full_like(data, fmax) * x.sign())  # never NaN or inf
    max_bits = {E4M3: 0x7E, E5M2: 0x7B}[fp8_dtype]
    assert set(qt.rowwise_data.view(torch.uint8).flatten().tolist()) == {max_bits, max_bits | 128}
    check_quantized(qt, x, f32(scale), fp8_dtype)


@pytest.mark.parametrize("fp8_dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_rounding_ties_and_fp32_overflow(fp8_dtype):
    if fp8_dtype == E4M3:  # ulp 32 in [256, 512): 400 ties to 384 (even), 432 to 448
        x = [400.0, 432.0, 440.0, 416.0, 3.125, 3.375, 3.0625, 3.1875]
        want = [384.0, 448.0, 448.0, 416.0, 3.0, 3.5, 3.0, 3.25]
    else:  # ulp 8192 in [32768, 65536)
        x, want = [36864.0, 45056.0, 2.25, 2.75], [32768.0, 49152.0, 2.0, 3.0]
    qt = delayed(1.0, fp8_dtype).quantize(torch.tensor(x))
    assert qt.rowwise_data.to(torch.float64).flatten().tolist() == want
    # x*scale is an fp32 multiply: the exact product lies just above a tie, but its fp32
    # rounding is the tie itself, which then goes to the even neighbour (not the upper one).
    s = 1 - 2.0 ** -24
    tie, lower = (400.0, 384.0) if fp8_dtype == E4M3 else (36864.0, 32768.0)
    xt = torch.tensor([tie, -tie]) + torch.tensor([1.0, -1.0]) * 2.0 ** (math.frexp(tie)[1] - 24)
    assert (xt.double() * s).abs().min().item() > tie and f32(xt[0].item() * s) == tie
    qt = delayed(s, fp8_dtype).quantize(xt)
    assert qt.rowwise_data.to(torch.float64).flatten().tolist() == [lower, -lower]
    check_quantized(qt, xt, s, fp8_dtype)
    # x * scale overflows fp32 to inf: that saturates, it is not a NaN/Inf input.
    xo = torch.tensor([2.0 ** 30, -(2.0 ** 30), 1.0])
    qt = delayed(2.0 ** 100, fp8_dtype).quantize(xo)
    fmax = FMT[fp8_dtype]["fmax"]
    assert qt.rowwise_data.to(torch.float64).flatten().tolist() == [fmax, -fmax, fmax]
    check_quantized(qt, xo, 2.0 ** 100, fp8_dtype)


@pytest.mark.parametrize("fp8_dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("scale", [1.0, 2.0 ** -8, 2.0 ** 127])
def test_fp8_subnormal_range(fp8_dtype, scale):
    f = FMT[fp8_dtype]
    step = 2.0 ** (f["emin"] - f["mbits"])  # smallest fp8 subnormal
    n_sub = 2 ** f["mbits"]
    halves = [k / 2 for k in range(0, 2 * n_sub + 3)]  # every subnormal, ties, min normal
    ks = halves + [0.49, 0.51, 1.01, 0.01]
    x = torch.tensor([k * step / scale for k in ks])
    exact = x[: len(halves)].double() * scale
    assert torch.equal(exact, torch.tensor(halves, dtype=torch.float64) * step)
    qt = delayed(scale, fp8_dtype).quantize(torch.cat([x, -x]))
    # Ties go to the even code: 0.5 -> 0, 1.5 -> 2, 2.5 -> 2, (n_sub - 0.5) -> min normal.
    def rne(k):
        return math.floor(k) + (1 if k % 1 > 0.5 or (k % 1 == 0.5 and math.floor(k) % 2) else 0)
    want = [rne(k) * step for k in ks]
    assert qt.rowwise_data.to(torch.float64).flatten().tolist() == want + [-w for w in want]
    codes = qt.rowwise_data.view(torch.uint8).flatten()[: len(ks)].tolist()
    assert codes == [rne(k) for k in ks]  # subnormal codes are the step count; 2^emin -> 1<<mbits
    check_quantized(qt, torch.cat([x, -x]), scale, fp8_dtype)


@pytest.mark.parametrize("dtype", HP_DTYPES, ids=str)
def test_input_subnormals_reach_fp8_normal_range(dtype):
    tiny = torch.finfo(dtype).smallest_normal
    x = torch.tensor([tiny / 2, -tiny / 4, tiny, tiny * 3 / 8], dtype=dtype)
    scale = 2.0 ** 127 if dtype != torch.float16 else 2.0 ** 16
    for fp8_dtype in (E4M3, E5M2):
        qt = delayed(scale, fp8_dtype).quantize(x)
        assert (qt.rowwise_data.to(torch.float32) != 0).all()
        check_quantized(qt, x, scale, fp8_dtype)


# ---- NaN / Inf inputs ----------------------------------------------------------------------
QUANTIZER_KINDS = {
    "current": lambda f: Float8CurrentScalingQuantizer(f),
    "current_pow2": lambda f: Float8CurrentScalingQuantizer(f, force_pow_2_scales=True),
    "current_eps": lambda f: Float8CurrentScalingQuantizer(f, amax_epsilon=1e-2),
    "delayed": lambda f: delayed(3.0, f),
}


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("dtype", HP_DTYPES, ids=str)
@pytest.mark.parametrize("fp8_dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("kind", list(QUANTIZER_KINDS))
def test_nan_inf_poisons_whole_tensor(kind, fp8_dtype, dtype, bad):
    q = QUANTIZER_KINDS[kind](fp8_dtype)
    x = sample("normal", (4, 3, 8), dtype, seeded("bad", kind))
    x[2, 1, 5] = bad
    qt = q.quantize(x)
    assert math.isnan(qt.shared_scale.item())
    for usage in ("rowwise", "columnwise"):
        for dt in HP_DTYPES:
            out = qt.dequantize(dt, usage=usage)
            assert out.shape == x.shape and torch.isnan(out).all()
    if kind == "delayed":
        assert q.scale.item() == 3.0  # the recipe-owned scale is untouched
        recorded = q.amax.item()
        assert math.isnan(recorded) if math.isnan(bad) else recorded == math.inf


# ---- delayed scaling -----------------------------------------------------------------------
@pytest.mark.parametrize("scale", [1.0, 0.1, 3.0, 2.0 ** -8, 1000.0, 2.0 ** 40])
@pytest.mark.parametrize("dtype", HP_DTYPES, ids=str)
@pytest.mark.parametrize("fp8_dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("dist", DISTS)
def test_delayed_matches_float64(dist, fp8_dtype, dtype, scale):
    shape = SHAPES[zlib.crc32(dist.encode()) % len(SHAPES)]
    x = sample(dist, shape, dtype, seeded("delayed", dist, dtype, scale))
    scale_t, amax_t = torch.tensor([scale]), torch.full((1,), -5.0)
    amax_ptr = amax_t.data_ptr()
    q = Float8Quantizer(scale_t, amax_t, fp8_dtype)
    qt = q.quantize(x)
    # The given scale is used as is (never rounded to a power of two, never recomputed).
    check_quantized(qt, x, f32(scale), fp8_dtype)
    assert q.amax is amax_t and amax_t.data_ptr() == amax_ptr
    assert amax_t.item() == x.double().abs().max().item()
    assert q.scale is scale_t and scale_t.item() == f32(scale)


def test_delayed_dequant_uses_scale_kept_at_quantize_time():
    q = delayed(4.0)
    x = sample("normal", (8, 16), torch.float32, seeded("keep"))
    qt = q.quantize(x)
    before = qt.dequantize(torch.float32)
    assert qt.shared_scale.data_ptr() != q.scale.data_ptr()
    q.scale.fill_(0.125)
    q.scale.mul_(3.0)
    assert_bits_equal_nan(qt.dequantize(torch.float32), before)
    assert_bits_equal_nan(qt.dequantize(torch.float32, usage="columnwise"), before)
    check_quantized(q.quantize(x), x, 0.375, E4M3)  # the next quantize uses the new scale


def test_delayed_zero_dim_state_tensors():
    scale, amax = torch.tensor(0.5), torch.tensor(0.0)
    x = sample("lognormal", (5, 6), torch.bfloat16, seeded("0d"))
    qt = Float8Quantizer(scale, amax, E5M2).quantize(x)
    assert amax.shape == () and amax.item() == x.double().abs().max().item()
    check_quantized(qt, x, 0.5, E5M2)


def test_constructor_validation():
    for bad in (2.0, torch.tensor([1.0], dtype=torch.float16), torch.ones(2),
                torch.ones(1, dtype=torch.float64)):
        with pytest.raises(TypeError, match="scale"):
            Float8Quantizer(bad, torch.zeros(1))
        with pytest.raises(TypeError, match="amax"):
            Float8Quantizer(torch.ones(1), bad)
    for bad_dtype in (torch.float16, torch.int8, "e4m3"):
        with pytest.raises(ValueError, match="fp8_dtype"):
            Float8CurrentScalingQuantizer(bad_dtype)
        with pytest.raises(ValueError, match="fp8_dtype"):
            Float8Quantizer(torch.ones(1), torch.zeros(1), bad_dtype)
    for eps in (-1e-3, math.nan):
        with pytest.raises(ValueError, match="amax_epsilon"):
            Float8CurrentScalingQuantizer(E4M3, amax_epsilon=eps)


# inf made every value NaN; 1e39 (inf once stored in fp32) failed only at quantize
@pytest.mark.parametrize("eps", [math.inf, -math.inf, 1e39, 2 * FP32_MAX, -1e-30, "0.1", None,
                                 True, torch.tensor(0.0)],
                         ids=["inf", "-inf", "1e39", "2xfp32max", "negative", "str", "none",
                              "bool", "tensor"])
def test_current_scaling_rejects_bad_amax_epsilon(eps):
    with pytest.raises(ValueError) as err:
        Float8CurrentScalingQuantizer(E4M3, amax_epsilon=eps)
    msg = str(err.value)
    assert "Float8CurrentScalingQuantizer" in msg and "amax_epsilon" in msg
    assert repr(eps) in msg and ">= 0" in msg and "fp32" in msg


@pytest.mark.parametrize("eps", [0, 1e-12, 0.5, FP32_MAX])
def test_current_scaling_accepts_amax_epsilon_up_to_fp32_max(eps):
    q = Float8CurrentScalingQuantizer(E4M3, amax_epsilon=eps)
    assert q.amax_epsilon == eps and type(q.amax_epsilon) is float
    x = torch.tensor([[0.0, 1.0, -2.0, 3.0]])
    assert torch.isfinite(q.quantize(x).dequantize()).all()


@pytest.mark.parametrize("bad", ["false", "True", 0, 1, None, 1.0])
def test_current_scaling_force_pow_2_scales_must_be_bool(bad):
    with pytest.raises(ValueError) as err:
        Float8CurrentScalingQuantizer(E4M3, force_pow_2_scales=bad)
    msg = str(err.value)
    assert "force_pow_2_scales" in msg and repr(bad) in msg and "bool" in msg


# ---- usages, derive, make_empty, copy -----------------------------------------------------
def expected_scale_for(q, x) -> float:
    if isinstance(q, Float8Quantizer):
        return q.scale.item()
    return expected_current_scale(x, q.fp8_dtype, q.force_pow_2_scales, q.amax_epsilon)


USAGES = {"rowwise": (True, False), "columnwise": (False, True), "both": (True, True)}


@pytest.mark.parametrize("usage", list(USAGES))
@pytest.mark.parametrize("kind", list(QUANTIZER_KINDS))
def test_usages_compute_only_requested_directions(kind, usage):
    row, col = USAGES[usage]
    q = QUANTIZER_KINDS[kind](E4M3)
    assert q.rowwise_usage and q.columnwise_usage  # a new quantizer has both on
    assert q.set_usage(rowwise=row, columnwise=col) is q
    x = sample("student_t", (3, 10, 12), torch.bfloat16, seeded("usage", kind))
    qt = q.quantize(x)
    check_quantized(qt, x, expected_scale_for(q, x), E4M3, rowwise=row, columnwise=col)


@pytest.mark.parametrize("fp8_dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("src", ["rowwise", "columnwise"])
@pytest.mark.parametrize("kind", list(QUANTIZER_KINDS))
def test_update_usage_derives_other_direction_bit_identically(kind, src, fp8_dtype):
    dst = "columnwise" if src == "rowwise" else "rowwise"
    x = sample("outliers", (6, 4, 10), torch.float16, seeded("derive", kind, src))
    q = QUANTIZER_KINDS[kind](fp8_dtype)
    direct = q.set_usage(**{src: False, dst: True}).quantize(x)
    qt = q.set_usage(**{src: True, dst: False}).quantize(x)
    assert not qt.has_usage(dst)
    assert qt.update_usage(**{f"{dst}_usage": True}) is qt
    got = getattr(qt, f"{dst}_data")
    assert got.is_contiguous() and got.shape == getattr(direct, f"{dst}_data").shape
    assert torch.equal(got.view(torch.uint8), getattr(direct, f"{dst}_data").view(torch.uint8))
    check_quantized(qt, x, expected_scale_for(q, x), fp8_dtype)
    # Switch direction in one call: derive dst, then drop src.
    qt2 = q.set_usage(**{src: True, dst: False}).quantize(x)
    qt2.update_usage(**{f"{src}_usage": False, f"{dst}_usage": True})
    assert not qt2.has_usage(src) and qt2.has_usage(dst)
    assert torch.equal(getattr(qt2, f"{dst}_data").view(torch.uint8), got.view(torch.uint8))


@pytest.mark.parametrize("drop", ["rowwise", "columnwise"])
def test_update_usage_drop(drop):
    keep = "columnwise" if drop == "rowwise" else "rowwise"
    x = sample("normal", (8, 12), torch.float32, seeded("drop"))
    qt = Float8CurrentScalingQuantizer(E4M3).quantize(x)
    before = qt.dequantize(usage=keep)
    qt.update_usage(**{f"{drop}_usage": False})
    assert getattr(qt, f"{drop}_data") is None and not qt.has_usage(drop)
    assert qt.shared_scale is not None
    assert torch.equal(qt.dequantize(usage=keep), before)
    with pytest.raises(RuntimeError, match=drop):
        qt.dequantize(usage=drop)


@pytest.mark.parametrize("usage", list(USAGES))
@pytest.mark.parametrize("dtype", HP_DTYPES, ids=str)
@pytest.mark.parametrize("kind", list(QUANTIZER_KINDS))
def test_make_empty_then_update_quantized_equals_quantize(kind, dtype, usage):
    row, col = USAGES[usage]
    shape = (2, 6, 10)
    q = QUANTIZER_KINDS[kind](E5M2).set_usage(rowwise=row, columnwise=col)
    empty = q.make_empty(shape, dtype=dtype, device="cpu")
    assert isinstance(empty, Float8Tensor) and empty.shape == shape and empty.dtype == dtype
    assert (empty.rowwise_data is not None) == row and (empty.columnwise_data is not None) == col
    if row:
        assert empty.rowwise_data.shape == (12, 10) and empty.rowwise_data.dtype == E5M2
    if col:
        assert empty.columnwise_data.shape == (10, 12) and empty.columnwise_data.dtype == E5M2
    ptrs = {n: t.data_ptr() for n, t in empty.inner_tensors().items() if t is not None}
    for i, dist in enumerate(("lognormal", "binades")):  # the second call overwrites the first
        x = sample(dist, shape, dtype, seeded("empty", kind, dtype, i))
        assert q.update_quantized(x, empty) is empty
        assert ptrs == {n: t.data_ptr() for n, t in empty.inner_tensors().items() if t is not None}
        fresh = q.quantize(x)
        for name, t in empty.inner_tensors().items():
            other = getattr(fresh, name)
            assert (t is None) == (other is None)
            if t is not None:
                assert torch.equal(int_bits(t), int_bits(other))
        check_quantized(empty, x, expected_scale_for(q, x), E5M2, rowwise=row, columnwise=col)


def test_update_quantized_uses_tensor_usages_and_validates():
    q = Float8CurrentScalingQuantizer(E4M3)
    target = q.copy().set_usage(columnwise=False).make_empty((4, 8))
    x = sample("uniform", (4, 8), torch.float32, seeded("uq"))
    q.update_quantized(x, target)
    assert target.columnwise_data is None  # the tensor's usages, not the quantizer's
    assert q.rowwise_usage and q.columnwise_usage  # and the quantizer's usages are restored
    with pytest.raises(ValueError, match=r"\(8, 4\)"):
        q.update_quantized(x.t().contiguous(), target)
    with pytest.raises(ValueError):
        Float8CurrentScalingQuantizer(E5M2).update_quantized(x, target)
    with pytest.raises(TypeError):
        q.update_quantized(x, x.clone())


def test_copy():
    q = Float8CurrentScalingQuantizer(E5M2, force_pow_2_scales=True, amax_epsilon=0.25)
    c = q.copy()
    assert type(c) is type(q) and c is not q
    assert (c.fp8_dtype, c.force_pow_2_scales, c.amax_epsilon) == (E5M2, True, 0.25)
    c.set_usage(rowwise=False)
    assert q.rowwise_usage and not c.rowwise_usage
    x = sample("normal", (5, 7), torch.float32, seeded("copy"))
    assert torch.equal(c.quantize(x).columnwise_data.view(torch.uint8),
                       q.quantize(x).columnwise_data.view(torch.uint8))
    d = delayed(0.5, E4M3)
    dc = d.copy()
    # Recipe-owned state stays shared: the copy records into the same amax.
    assert dc.scale is d.scale and dc.amax is d.amax
    dc.set_usage(columnwise=False)
    assert d.columnwise_usage
    dc.quantize(x)
    assert d.amax.item() == x.abs().max().item()


def test_decode_scale_is_reciprocal_and_private_record_is_not_carried():
    """``decode_scale()`` is ``1 / shared_scale``; the kernel's record of it (``_decode``,
    GPU only) is neither flattened, pickled nor deep-copied, so no copy can carry a decode
    scale that does not belong to its scale."""
    import copy
    import io
    x = torch.randn(16, 48) * 3
    qt = Float8CurrentScalingQuantizer(E4M3).quantize(x)
    assert torch.equal(qt.decode_scale(), torch.reciprocal(qt.shared_scale).reshape(()))
    qt._decode = (qt.shared_scale, qt.shared_scale._version, torch.tensor(123.0))
    assert qt.decode_scale().item() == 123.0  # the record is used while it matches
    names, _ = qt.__tensor_flatten__()
    assert "_decode" not in names
    buf = io.BytesIO()
    torch.save(qt, buf)
    buf.seek(0)
    for other in (copy.deepcopy(qt), torch.load(buf, weights_only=False), qt.detach()):
        assert other._decode is None
        assert torch.equal(other.decode_scale(), torch.reciprocal(qt.shared_scale).reshape(()))
    qt.shared_scale.mul_(2.0)  # an in-place change bumps the version: the record is stale
    assert torch.equal(qt.decode_scale(), torch.reciprocal(qt.shared_scale).reshape(()))


def test_kernel_fields_keep_no_decode_record_for_inference_tensors():
    """The launch helper that builds a kernel quantize's fields (no kernel runs here)."""
    from lowprec.formats.float8 import launch
    q = Float8CurrentScalingQuantizer(E4M3)
    row, col = torch.zeros(4, 8, dtype=torch.uint8), torch.zeros(8, 4, dtype=torch.uint8)
    scales = torch.arange(1.0, 1.0 + launch.SCALE_BUFFER)
    fields = launch._kernel_fields(q, row, col, scales)
    assert fields["_decode"][0] is fields["shared_scale"]
    assert fields["_decode"][2].item() == scales[launch.DECODE_AT].item()
    with torch.inference_mode():
        fields = launch._kernel_fields(q, row, col, torch.ones(launch.SCALE_BUFFER))
    assert fields["_decode"] is None


def test_tile_config_and_grid():
    """A tile config's optional items and the launch grid they give: ITERS tiles a
    program down M, and with K_FAST the grid's axes swapped (axis 0 along K)."""
    from lowprec.kernels.grid import tile_config, tile_grid
    assert tile_config((32, 128, 2)) == (32, 128, 2, 1, 1, False)
    assert tile_config((32, 128, 2, 4, 3, 1)) == (32, 128, 2, 4, 3, True)
    # 100 rows: 4 tiles of 32, 2 programs of 2 tiles; 300 columns: 3 tiles of 128
    assert tile_grid(100, 300, 32, 128, 2, False) == ((2, 3), False)
    assert tile_grid(100, 300, 32, 128, 2, True) == ((3, 2), True)
    # more than CUDA's 65535 programs down M: grid axis 1 cannot hold them, M-fast instead
    m = 32 * 2 * 65536
    assert tile_grid(m, 300, 32, 128, 2, True) == ((65536, 3), False)
    assert tile_grid(m - 64, 300, 32, 128, 2, True) == ((3, 65535), True)
    # too many programs along K for the M-fast order: K-fast instead; too many both ways
    assert tile_grid(100, 128 * 65536, 32, 128, 2, False) == ((65536, 2), True)
    with pytest.raises(ValueError, match="65535"):
        tile_grid(m, 128 * 65536, 32, 128, 2, True)
