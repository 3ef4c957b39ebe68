"""MXFP8Quantizer / MXFP8Tensor against an independent float64 evaluation of SPEC section 2.

The expected values below never call lowprec: block amax, the RCEIL exponent, fp8 rounding
and dequantization are re-derived here in float64 from the SPEC formulas.
"""

import copy
import io
import math
import pickle

import pytest
import torch

from lowprec.formats.base import register_safe_globals
from lowprec.formats.mxfp8 import MXFP8Quantizer, MXFP8Tensor
from lowprec.formats.mxfp8 import launch as mx_launch

register_safe_globals(MXFP8Quantizer, MXFP8Tensor)

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
# (emin, mantissa bits, max finite)
FMT = {E4M3: (-6, 3, 448.0), E5M2: (-14, 2, 57344.0)}
HP_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


# ---- independent float64 expectation ----------------------------------------------------
def fp8_round64(v, fp8_dtype):
    """Round float64 values to the fp8 grid: RNE, saturating to the max finite value."""
    emin, mbits, fmax = FMT[fp8_dtype]
    a = v.abs()
    _, ex = torch.frexp(torch.where(a > 0, a, torch.ones_like(a)))  # a = m * 2**ex, m in [0.5, 1)
    ulp = torch.pow(2.0, (torch.clamp_min(ex - 1, emin) - mbits).to(torch.float64))
    q = torch.round(v / ulp) * ulp  # torch.round is half-to-even; v / ulp is exact
    return q.clamp(-fmax, fmax)


def rceil_exponent(amax64, fp8_dtype):
    """Smallest e with 2**e >= fp32(amax / fp8_max), clamped to [-127, 127]; 0 quotient -> -127."""
    fmax = FMT[fp8_dtype][2]
    # fp64 division then rounding to fp32 equals the fp32 division: 53 >= 2*24 + 2, so this
    # double rounding is innocuous.
    v = (amax64 / fmax).to(torch.float32).to(torch.float64)
    pos = torch.isfinite(v) & (v > 0)
    vs = torch.where(pos, v, torch.ones_like(v))
    e = torch.ceil(torch.log2(vs))
    # float64 log2 may be off near powers of two: fix up so that 2**(e-1) < v <= 2**e
    e = torch.where(torch.pow(2.0, e - 1) >= vs, e - 1, e)
    e = torch.where(torch.pow(2.0, e) < vs, e + 1, e)
    assert bool(((torch.pow(2.0, e - 1) < vs) & (vs <= torch.pow(2.0, e))).all())
    e = e.clamp(-127, 127).to(torch.int64)
    e = torch.where(v == 0, torch.full_like(e, -127), e)
    return torch.where(pos | (v == 0), e, torch.zeros_like(e))  # NaN blocks: unused


def expected(x, fp8_dtype, block):
    """(dequantized fp32 (M, K), fp8 grid values float64 (M, K), E8M0 codes) for blocks br x bc.

    Blocks are taken on the untransposed (M, K) matrix: (1, 32) rowwise, (32, 1) columnwise,
    (32, 32) for 2D quantization.
    """
    br, bc = block
    x64 = x.detach().to(torch.float64)
    m, k = x64.reshape(-1, x64.shape[-1]).shape
    b = x64.reshape(m // br, br, k // bc, bc)
    finite = torch.isfinite(b).all(dim=3).all(dim=1)
    amax = torch.where(torch.isfinite(b), b.abs(), torch.zeros_like(b)).amax(dim=(1, 3))
    amax = torch.where(finite, amax, torch.full_like(amax, float("nan")))
    e = rceil_exponent(amax, fp8_dtype)
    pow_e = torch.pow(2.0, e.to(torch.float64))[:, None, :, None]
    q = fp8_round64(b / pow_e, fp8_dtype)
    deq = q * pow_e
    deq = torch.where(finite[:, None, :, None], deq, torch.full_like(deq, float("nan")))
    codes = torch.where(finite, e + 127, torch.full_like(e, 255)).to(torch.uint8)
    return deq.reshape(m, k).to(torch.float32), q.reshape(m, k), codes, finite


def assert_bits_equal(actual, want):
    assert actual.shape == want.shape, (actual.shape, want.shape)
    nan_a, nan_w = torch.isnan(actual), torch.isnan(want)
    assert torch.equal(nan_a, nan_w), "NaN masks differ"
    bad = ~nan_w & (actual != want)
    assert not bad.any(), f"{int(bad.sum())} mismatches, first {actual[bad][:4]} vs {want[bad][:4]}"


def fp8_bytes(q64, fp8_dtype):
    # q64 is on the fp8 grid, so this conversion is exact.
    return q64.to(torch.float32).to(fp8_dtype).view(torch.uint8)


def check_direction(qt, x, usage, fp8_dtype, two_d=False):
    """Compare one direction's dequantization, data bytes and scale codes to the expectation."""
    m = x.numel() // x.shape[-1]
    k = x.shape[-1]
    block = (32, 32) if two_d else ((1, 32) if usage == "rowwise" else (32, 1))
    deq, q, codes, finite = expected(x.reshape(m, k), fp8_dtype, block)
    out = qt.dequantize(torch.float32, usage=usage)
    assert out.shape == x.shape and out.dtype == torch.float32
    assert_bits_equal(out.reshape(m, k), deq)
    data, scale = getattr(qt, f"{usage}_data"), getattr(qt, f"{usage}_scale")
    assert data.dtype == fp8_dtype and scale.dtype == torch.uint8
    assert data.is_contiguous() and scale.is_contiguous()
    if usage == "columnwise":
        data, scale = data.t(), scale.t()  # stored (K, M): compare in the (M, K) frame
    assert data.shape == (m, k)
    if two_d:
        assert qt.columnwise_scale is None or qt.columnwise_scale.shape == (k // 32, m // 32)
    assert torch.equal(scale, codes)
    fin = finite.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
    assert torch.equal(data.view(torch.uint8)[fin], fp8_bytes(q, fp8_dtype)[fin])
    return out


# ---- input generators ------------------------------------------------------------------
def make_input(dist, shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    n = math.prod(shape)
    if dist == "normal":
        x = torch.randn(n, generator=g)
    elif dist == "uniform":
        x = torch.rand(n, generator=g) * 2 - 1
    elif dist == "lognormal":
        x = torch.exp(torch.randn(n, generator=g) * 3) * torch.sign(torch.randn(n, generator=g))
    elif dist == "student_t":
        # Student-t with 2 degrees of freedom: z / sqrt(chi2_2 / 2), chi2_2 / 2 = -log(U)
        u = torch.rand(n, generator=g).clamp_min(1e-12)
        x = torch.randn(n, generator=g) / torch.sqrt(-torch.log(u))
    elif dist == "outliers":
        x = torch.randn(n, generator=g)
        idx = torch.randint(0, n, (max(1, n // 200),), generator=g)
        x[idx] = torch.randn(idx.numel(), generator=g) * 1e4
    elif dist == "binades":
        lo, hi = {torch.float32: (-140, 120), torch.bfloat16: (-130, 120),
                  torch.float16: (-24, 15)}[dtype]
        ex = torch.randint(lo, hi, (n,), generator=g).to(torch.float64)
        mant = 1 + torch.rand(n, generator=g, dtype=torch.float64)
        sign = torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0).to(torch.float64)
        x = (sign * mant * torch.pow(2.0, ex)).to(torch.float32)
    else:
        raise ValueError(dist)
    if dtype == torch.float16:
        x = x.clamp(-60000, 60000)
    return x.reshape(shape).to(dtype)


DISTS = ("normal", "uniform", "lognormal", "student_t", "outliers", "binades")


@pytest.mark.parametrize("fp8_dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", HP_DTYPES, ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("dist", DISTS)
def test_random_1d_blocks(dist, dtype, fp8_dtype):
    for i, shape in enumerate([(64, 96), (2, 32, 64), (96, 32)]):
        x = make_input(dist, shape, dtype, seed=10 * DISTS.index(dist) + i)
        qt = MXFP8Quantizer(fp8_dtype)(x)
        assert isinstance(qt, MXFP8Tensor)
        assert qt.shape == x.shape and qt.dtype == dtype
        m, k = x.numel() // shape[-1], shape[-1]
        assert qt.rowwise_data.shape == (m, k) and qt.rowwise_scale.shape == (m, k // 32)
        assert qt.columnwise_data.shape == (k, m) and qt.columnwise_scale.shape == (k, m // 32)
        check_direction(qt, x, "rowwise", fp8_dtype)
        check_direction(qt, x, "columnwise", fp8_dtype)
        # Default dequantize: rowwise, in the nominal dtype.
        out = qt.dequantize()
        assert out.dtype == dtype
        assert torch.equal(out, qt.dequantize(torch.float32).to(dtype))


@pytest.mark.parametrize("fp8_dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", HP_DTYPES, ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("dist", DISTS)
def test_random_2d_blocks(dist, dtype, fp8_dtype):
    for i, shape in enumerate([(64, 96), (2, 32, 64)]):
        x = make_input(dist, shape, dtype, seed=500 + 10 * DISTS.index(dist) + i)
        qt = MXFP8Quantizer(fp8_dtype, with_2d_quantization=True)(x)
        m, k = x.numel() // shape[-1], shape[-1]
        assert qt.rowwise_scale.shape == (m // 32, k // 32)
        assert qt.columnwise_scale.shape == (k // 32, m // 32)
        assert torch.equal(qt.columnwise_data.view(torch.uint8),
                           qt.rowwise_data.view(torch.uint8).t())
        assert torch.equal(qt.columnwise_scale, qt.rowwise_scale.t())
        check_direction(qt, x, "rowwise", fp8_dtype, two_d=True)
        check_direction(qt, x, "columnwise", fp8_dtype, two_d=True)


@pytest.mark.parametrize("dtype", HP_DTYPES, ids=["fp32", "bf16", "fp16"])
def test_1d_input_rowwise(dtype):
    x = make_input("lognormal", (96,), dtype, seed=3)
    qt = MXFP8Quantizer().set_usage(columnwise=False)(x)
    assert qt.rowwise_scale.shape == (1, 3) and qt.columnwise_data is None
    check_direction(qt, x, "rowwise", E4M3)
    # both usages: the columnwise blocks of M = 1 are partial (tests/formats/test_partial_blocks.py)
    assert MXFP8Quantizer()(x).columnwise_scale.shape == (96, 1)


# ---- RCEIL boundaries --------------------------------------------------------------------
def _next(x, direction):
    return torch.nextafter(torch.tensor(x, dtype=torch.float32),
                           torch.tensor(direction, dtype=torch.float32)).item()


@pytest.mark.parametrize("fp8_dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_rceil_power_of_two_boundaries(fp8_dtype):
    fmax = FMT[fp8_dtype][2]
    ks = [k for k in range(-126, 113, 7)] + [-130, -128, -127, -125, -1, 0, 1]
    rows, want_codes, full_range_rows = [], [], []
    for k in ks:
        exact = fmax * 2.0 ** k  # amax / fp8_max == 2**k exactly
        # Slightly above: the next power of two, except where the quotient is an fp32
        # subnormal whose rounding lands back on 2**k (k <= -127), and the clamp at -127.
        above = k + 1 if k >= -126 else -127
        for amax, want_e in ((exact, max(k, -127)), (_next(exact, math.inf), above),
                             (_next(exact, 0.0), max(k, -127))):
            if not math.isfinite(amax):
                continue
            if amax == exact and k >= -127:
                full_range_rows.append(len(rows))
            row = torch.linspace(-1, 1, 32) * amax * 0.9
            row[5] = -amax
            rows.append(row)
            want_codes.append(want_e + 127)
    x = torch.stack(rows).to(torch.float32)
    x = torch.cat([x, x[: (-len(rows)) % 32]])  # pad M to a multiple of 32 for columnwise
    qt = MXFP8Quantizer(fp8_dtype)(x)
    codes = qt.rowwise_scale[: len(want_codes), 0].tolist()
    assert codes == want_codes
    # An exact-power-of-two block (unclamped) uses the full range: its amax lands on fp8_max.
    top = qt.rowwise_data[full_range_rows, 5].to(torch.float32)
    assert torch.equal(top, torch.full_like(top, -fmax))
    check_direction(qt, x, "rowwise", fp8_dtype)
    check_direction(qt, x, "columnwise", fp8_dtype)
    check_direction(MXFP8Quantizer(fp8_dtype, with_2d_quantization=True)(x), x, "rowwise",
                    fp8_dtype, two_d=True)


@pytest.mark.parametrize("fp8_dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_subnormal_quotient_saturates(fp8_dtype):
    # amax one ulp above fp8_max * 2**-127: fp32(amax / fp8_max) is subnormal and rounds to
    # 2**-127 exactly, so e = -127 and the largest element saturates to fp8_max.
    fmax = FMT[fp8_dtype][2]
    amax = _next(fmax * 2.0 ** -127, math.inf)
    x = torch.full((1, 32), amax / 4)
    x[0, 9] = -amax
    qt = MXFP8Quantizer(fp8_dtype).set_usage(columnwise=False)(x)
    assert qt.rowwise_scale.item() == 0
    assert qt.rowwise_data[0, 9].to(torch.float32).item() == -fmax
    check_direction(qt, x, "rowwise", fp8_dtype)


def test_rceil_rounds_up_not_down():
    # amax 449 > 448: RCEIL picks 2**1 (OCP's floor rule would pick 2**0 and saturate).
    x = torch.zeros(1, 32)
    x[0, 0] = 449.0
    qt = MXFP8Quantizer(E4M3).set_usage(columnwise=False)(x)
    assert qt.rowwise_scale.item() == 128
    assert qt.rowwise_data[0, 0].to(torch.float32).item() == 224.0
    check_direction(qt, x, "rowwise", E4M3)


# ---- edge cases ----------------------------------------------------------------------------
@pytest.mark.parametrize("two_d", [False, True])
def test_zero_block(two_d):
    x = make_input("normal", (64, 64), torch.float32, seed=1)
    x[:32, :32] = 0.0
    x[40, 32:] = -0.0
    qt = MXFP8Quantizer(with_2d_quantization=two_d)(x)
    if two_d:
        assert qt.rowwise_scale[0, 0].item() == 0
    else:
        assert (qt.rowwise_scale[:32, 0] == 0).all() and qt.rowwise_scale[40, 1].item() == 0
        assert (qt.columnwise_scale[:32, 0] == 0).all()
    assert (qt.rowwise_data[:32, :32].to(torch.float32) == 0).all()
    for usage in ("rowwise", "columnwise"):
        out = check_direction(qt, x, usage, E4M3, two_d=two_d)
        assert (out[:32, :32] == 0).all()


@pytest.mark.parametrize("fp8_dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_one_huge_value_in_block(fp8_dtype):
    x = make_input("normal", (32, 64), torch.float32, seed=2)
    x[3, 7] = 3e30
    x[10, 40] = -1e38
    x[20, 0] = 3.0e38  # close to fp32 max: largest block exponent
    qt = MXFP8Quantizer(fp8_dtype)(x)
    for usage in ("rowwise", "columnwise"):
        out = check_direction(qt, x, usage, fp8_dtype)
        assert torch.isfinite(out).all()
    # the small neighbours of the outlier flush to zero
    assert (qt.rowwise_data[3, 8:32].to(torch.float32) == 0).all()


@pytest.mark.parametrize("fp8_dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_saturation_boundary_and_ties(fp8_dtype):
    fmax = FMT[fp8_dtype][2]
    if fp8_dtype == E4M3:
        # grid near the top: 416, 448; 432 is the tie and goes to the even 448
        vals = [448.0, 432.0, _next(432.0, 0.0), _next(432.0, 1000.0), 447.9, 416.0, 400.0, 17.0]
        want = [448.0, 448.0, 416.0, 448.0, 448.0, 416.0, 384.0, 16.0]
    else:
        # grid near the top: 49152, 57344; the tie 53248 goes to the even 49152
        vals = [57344.0, 53248.0, _next(53248.0, 0.0), _next(53248.0, 1e5), 57000.0, 45056.0,
                40960.0, 5.0]
        # 45056 is the tie between 40960 and 49152: to the even 49152
        want = [57344.0, 49152.0, 49152.0, 57344.0, 57344.0, 49152.0, 40960.0, 5.0]
    row = torch.tensor(vals + [0.0] * (32 - len(vals)))
    x = torch.stack([row, -row, row * 2.0 ** -20, row * 2.0 ** 30])
    qt = MXFP8Quantizer(fp8_dtype).set_usage(columnwise=False)(x)
    assert qt.rowwise_scale[:, 0].tolist() == [127, 127, 107, 157]
    got = qt.rowwise_data.to(torch.float32)
    w = torch.tensor(want + [0.0] * (32 - len(want)))
    assert torch.equal(got, torch.stack([w, -w, w, w]))
    assert got.abs().max().item() == fmax
    check_direction(qt, x, "rowwise", fp8_dtype)


@pytest.mark.parametrize("fp8_dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_subnormals(fp8_dtype):
    emin, mbits, fmax = FMT[fp8_dtype]
    sub = 2.0 ** (emin - mbits)  # smallest fp8 subnormal
    x = torch.zeros(32, 64)
    # block with amax = fmax (e = 0) and fp8-subnormal neighbours, ties included
    x[0, :8] = torch.tensor([fmax, sub, 1.5 * sub, 2.5 * sub, 0.5 * sub, 0.51 * sub, 0.49 * sub,
                             -3 * sub])
    # fp32 subnormal inputs: quotient underflows or clamps the exponent at -127
    x[1, :4] = torch.tensor([1e-45, -1e-40, 3e-39, 1e-44])
    x[2, :2] = torch.tensor([2.0 ** -126, 2.0 ** -140])
    x[3, 32:] = torch.linspace(-1, 1, 32) * 1e-38
    x[4:, :] = make_input("binades", (28, 64), torch.float32, seed=9)
    qt = MXFP8Quantizer(fp8_dtype)(x)
    row0 = qt.rowwise_data[0, :8].to(torch.float32).tolist()
    assert row0 == [fmax, sub, 2 * sub, 2 * sub, 0.0, sub, 0.0, -3 * sub]
    assert qt.rowwise_scale[1, 0].item() == 0  # 2**-127
    assert check_direction(qt, x, "rowwise", fp8_dtype)[0, 1].item() == sub
    check_direction(qt, x, "columnwise", fp8_dtype)
    check_direction(MXFP8Quantizer(fp8_dtype, with_2d_quantization=True)(x), x, "rowwise",
                    fp8_dtype, two_d=True)


@pytest.mark.parametrize("dtype", HP_DTYPES, ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("two_d", [False, True])
def test_nan_inf_poison_only_their_block(dtype, two_d):
    x = make_input("normal", (64, 64), torch.float32, seed=4).to(dtype)
    x[1, 3] = float("nan")
    x[40, 50] = float("inf")
    x[63, 0] = float("-inf")
    qt = MXFP8Quantizer(with_2d_quantization=two_d)(x)
    for usage in ("rowwise", "columnwise"):
        out = check_direction(qt, x, usage, E4M3, two_d=two_d)
        assert torch.isnan(out[1, 3]) and torch.isnan(out[40, 50]) and torch.isnan(out[63, 0])
        assert torch.isfinite(out[10:30, 40:48]).all()
    if two_d:
        assert qt.rowwise_scale.tolist()[1] == [255, 255] and qt.rowwise_scale[0, 0] == 255
        assert qt.rowwise_scale[0, 1].item() != 255
    else:
        assert qt.rowwise_scale[1, 0].item() == 255 and qt.rowwise_scale[1, 1].item() != 255
        assert qt.rowwise_scale[40, 1].item() == 255 and qt.rowwise_scale[63, 0].item() == 255
        assert qt.columnwise_scale[3, 0].item() == 255 and qt.columnwise_scale[3, 1].item() != 255
        assert qt.columnwise_scale[50, 1].item() == 255
        assert int((qt.rowwise_scale == 255).sum()) == 3
    # The NaN stays NaN in the dequantized nominal dtype too.
    assert torch.isnan(qt.dequantize()[1, 3])


@pytest.mark.parametrize("two_d", [False, True])
def test_usages(two_d):
    x = make_input("lognormal", (64, 96), torch.bfloat16, seed=5)
    row = MXFP8Quantizer(with_2d_quantization=two_d).set_usage(columnwise=False)(x)
    assert row.columnwise_data is None and row.columnwise_scale is None
    assert row.has_usage("rowwise") and not row.has_usage("columnwise")
    col = MXFP8Quantizer(with_2d_quantization=two_d).set_usage(rowwise=False)(x)
    assert col.rowwise_data is None and col.rowwise_scale is None
    with pytest.raises(RuntimeError, match="columnwise"):
        row.dequantize(usage="columnwise")
    with pytest.raises(RuntimeError, match="rowwise"):
        col.dequantize(usage="rowwise")
    # a columnwise-only tensor dequantizes from what it holds
    assert torch.equal(col.dequantize(), col.dequantize(usage="columnwise"))
    with pytest.raises(ValueError):
        MXFP8Quantizer().set_usage(rowwise=False, columnwise=False)(x)
    both = MXFP8Quantizer(with_2d_quantization=two_d)(x)
    assert torch.equal(row.dequantize(torch.float32), both.dequantize(torch.float32))
    assert torch.equal(col.dequantize(torch.float32, usage="columnwise"),
                       both.dequantize(torch.float32, usage="columnwise"))
    # drop a direction
    both.update_usage(columnwise_usage=False)
    assert both.columnwise_data is None and both.columnwise_scale is None
    assert torch.equal(both.rowwise_data.view(torch.uint8), row.rowwise_data.view(torch.uint8))
    with pytest.raises(ValueError):
        both.update_usage(rowwise_usage=False)
    if two_d:
        # 32x32 blocks: each direction derives from the other, bit for bit
        full = MXFP8Quantizer(with_2d_quantization=True)(x)
        row.update_usage(columnwise_usage=True)
        col.update_usage(rowwise_usage=True)
        for t in (row, col):
            for name, ref in full.inner_tensors().items():
                assert torch.equal(getattr(t, name).view(torch.uint8), ref.view(torch.uint8))
                assert getattr(t, name).is_contiguous()
    else:
        with pytest.raises(RuntimeError, match="columnwise"):
            row.update_usage(columnwise_usage=True)
        with pytest.raises(RuntimeError, match="rowwise"):
            col.update_usage(rowwise_usage=True)


@pytest.mark.parametrize("two_d", [False, True])
@pytest.mark.parametrize("usage", [(True, True), (True, False), (False, True)])
def test_make_empty_update_quantized(two_d, usage):
    q = MXFP8Quantizer(E5M2, with_2d_quantization=two_d).set_usage(*usage)
    x = make_input("outliers", (2, 32, 64), torch.float16, seed=6)
    x[0, 0, 0] = float("nan")
    empty = q.make_empty(x.shape, dtype=torch.float16)
    assert empty.shape == x.shape and empty.dtype == torch.float16
    ptrs = {n: t.data_ptr() for n, t in empty.inner_tensors().items() if t is not None}
    out = q.update_quantized(x, empty)
    assert out is empty
    ref = q(x)
    for name, t in ref.inner_tensors().items():
        got = getattr(empty, name)
        if t is None:
            assert got is None
            continue
        assert got.data_ptr() == ptrs[name] and got.shape == t.shape and got.dtype == t.dtype
        assert torch.equal(got.view(torch.uint8), t.view(torch.uint8))
    with pytest.raises(ValueError):
        MXFP8Quantizer(E4M3, with_2d_quantization=two_d).set_usage(*usage).update_quantized(
            x, empty)


def test_copy():
    q = MXFP8Quantizer(E5M2, with_2d_quantization=True).set_usage(columnwise=False)
    c = q.copy()
    assert c is not q and c.fp8_dtype == E5M2 and c.with_2d_quantization
    assert (c.rowwise_usage, c.columnwise_usage) == (True, False)
    c.set_usage(columnwise=True)
    assert q.columnwise_usage is False
    x = make_input("normal", (64, 64), torch.float32, seed=7)
    assert torch.equal(q(x).rowwise_data.view(torch.uint8), c(x).rowwise_data.view(torch.uint8))
    assert q.format_name == "mxfp8"
    assert "with_2d_quantization=True" in repr(q)
    with pytest.raises(ValueError):
        MXFP8Quantizer(torch.float16)


def _roundtrips(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return [pickle.loads(pickle.dumps(obj)), copy.deepcopy(obj), torch.load(buf, weights_only=True)]


@pytest.mark.parametrize("fp8_dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("two_d", [False, True])
def test_serialization(fp8_dtype, two_d):
    q = MXFP8Quantizer(fp8_dtype, with_2d_quantization=two_d).set_usage(rowwise=False)
    for r in _roundtrips(q):
        assert type(r) is MXFP8Quantizer and r.fp8_dtype == fp8_dtype
        assert r.with_2d_quantization == two_d and not r.rowwise_usage and r.columnwise_usage
    x = make_input("binades", (64, 32), torch.bfloat16, seed=8)
    x[5, 5] = float("nan")
    for qt in (q(x), MXFP8Quantizer(fp8_dtype, with_2d_quantization=two_d)(x)):
        for r in _roundtrips(qt):
            assert type(r) is MXFP8Tensor and r.shape == qt.shape and r.dtype == qt.dtype
            assert r.metadata() == qt.metadata()
            for name, t in qt.inner_tensors().items():
                got = getattr(r, name)
                if t is None:
                    assert got is None
                else:
                    assert got.dtype == t.dtype
                    assert torch.equal(got.view(torch.uint8), t.view(torch.uint8))


def test_supported_and_unsupported_ops():
    x = make_input("normal", (2, 32, 64), torch.float32, seed=10)
    qt = MXFP8Quantizer()(x)
    ref = qt.dequantize()
    assert torch.equal(qt.detach().dequantize(), ref)
    assert torch.equal(qt.clone().dequantize(), ref)
    assert torch.equal(qt.view(64, 64).dequantize(), ref.view(64, 64))
    assert torch.equal(qt.reshape(-1, 64).dequantize(usage="columnwise"),
                       qt.dequantize(usage="columnwise").reshape(64, 64))
    half = qt.to(torch.bfloat16)
    assert half.dtype == torch.bfloat16 and torch.equal(half.dequantize(), ref.to(torch.bfloat16))
    # ops outside the table run on the dequantized values (a plain result)
    w = torch.randn(64, 8)
    for fn in (lambda t: t + 1, lambda t: torch.matmul(t, w), lambda t: t.sum()):
        got = fn(qt)
        assert type(got) is torch.Tensor and torch.equal(got, fn(ref))


def test_quantize_without_rowwise_codes_needs_exact_rowwise_values():
    """``row_codes=False`` leaves the rowwise direction only its exact values: without them
    it would hold nothing, which the launcher refuses before any launch."""
    with pytest.raises(ValueError, match="row_codes=False needs exact_row"):
        mx_launch.mxfp8_quantize(torch.zeros(32, 32), False, False, True, True, 0, [], False,
                                 False, True, False)
