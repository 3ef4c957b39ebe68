"""Block-scaled FP8 (1x128 / 128x128): bit-exact checks against a float64 model of SPEC §2.

The expected values below are computed independently of lowprec's reference
module: float64 math that rounds to fp32 wherever the SPEC does fp32
arithmetic, and rounds to the fp8 grid via frexp.
"""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch

import lowprec.formats.base as base
from lowprec.formats.block import Float8BlockQuantizer, Float8BlockwiseTensor

base.register_safe_globals(Float8BlockQuantizer, Float8BlockwiseTensor)

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
# (emin, mantissa bits, max finite)
FP8_FORMATS = {E4M3: (-6, 3, 448.0), E5M2: (-14, 2, 57344.0)}
FP32_MAX = float(torch.finfo(torch.float32).max)
B = 128


# ---- independent float64 model ------------------------------------------------------------
def f32(t: torch.Tensor) -> torch.Tensor:
    """Round float64 values to fp32 (RNE, overflow to inf) and back to float64."""
    return t.to(torch.float32).to(torch.float64)


def round_fp8(v: torch.Tensor, fp8_dtype) -> torch.Tensor:
    """Saturate, then round finite float64 values to the fp8 grid, nearest-even."""
    emin, mbits, fmax = FP8_FORMATS[fp8_dtype]
    v = v.clamp(-fmax, fmax)
    _, e = torch.frexp(v)  # |v| = m * 2**e, m in [0.5, 1): floor(log2|v|) = e - 1
    ulp = torch.ldexp(torch.ones_like(v), (torch.clamp(e - 1, min=emin) - mbits))
    return torch.round(v / ulp) * ulp


def to_blocks(x: torch.Tensor, dim: int) -> torch.Tensor:
    r, c = x.shape
    if dim == 1:
        return x.reshape(r, c // B, B)
    return x.reshape(r // B, B, c // B, B).permute(0, 2, 1, 3).reshape(r // B, c // B, B * B)


def from_blocks(xb: torch.Tensor, dim: int, shape) -> torch.Tensor:
    r, c = shape
    if dim == 1:
        return xb.reshape(r, c)
    return xb.reshape(r // B, c // B, B, B).permute(0, 2, 1, 3).reshape(r, c)


def expected(x2d: torch.Tensor, fp8_dtype, dim: int, *, pow2: bool, eps: float = 0.0):
    """SPEC §2 block current scaling of an (R, C) matrix blocked along C.

    Returns (scale fp32, data grid values float64 (R, C), dequant fp32 (R, C),
    NaN-block mask (R, C)).
    """
    fmax = FP8_FORMATS[fp8_dtype][2]
    xb = to_blocks(x2d.to(torch.float64), dim)
    finite = torch.isfinite(xb).all(-1)
    amax = torch.where(finite, xb.abs().amax(-1), torch.zeros_like(finite, dtype=torch.float64))
    if eps > 0:
        amax = torch.clamp_min(amax, f32(torch.tensor(eps, dtype=torch.float64)))
    scale = f32(fmax / torch.where(amax == 0, torch.ones_like(amax), amax))
    scale = torch.where(amax == 0, torch.ones_like(scale), scale)
    scale = torch.where(torch.isinf(scale), torch.full_like(scale, FP32_MAX), scale)
    if pow2:
        _, e = torch.frexp(scale)
        scale = torch.ldexp(torch.ones_like(scale), e - 1)
    # fp32 product (exact in float64, then rounded once), then the fp8 cast.
    xs = torch.where(finite.unsqueeze(-1), xb, torch.zeros_like(xb))
    data = round_fp8(f32(xs * scale.unsqueeze(-1)), fp8_dtype)
    deq = f32(data / scale.unsqueeze(-1))
    nan_mask = (~finite).unsqueeze(-1).expand_as(xb)
    scale = torch.where(finite, scale, torch.full_like(scale, float("nan")))
    shape = x2d.shape
    return (scale.to(torch.float32), from_blocks(data, dim, shape),
            from_blocks(deq, dim, shape).to(torch.float32), from_blocks(nan_mask, dim, shape))


def assert_bits_equal(actual: torch.Tensor, want: torch.Tensor, nan_mask=None):
    """fp32 equality bit for bit (sign of zero included), NaN exactly where expected."""
    assert actual.dtype == want.dtype == torch.float32
    assert actual.shape == want.shape
    want_nan = torch.isnan(want) if nan_mask is None else nan_mask
    assert torch.equal(torch.isnan(actual), want_nan)
    a = torch.where(want_nan, torch.zeros_like(actual), actual).view(torch.int32)
    w = torch.where(want_nan, torch.zeros_like(want), want).view(torch.int32)
    assert torch.equal(a, w), f"{(a != w).sum()} mismatching elements"


def check_direction(q: Float8BlockQuantizer, qt, x, usage):
    """Compare one direction's stored data/scale and its dequantization with the model.

    Columnwise is modelled as the quantization of x2d.T (1x128 blocks for dim 1,
    128x128 for dim 2), which is exactly its stored (K, M) layout.
    """
    m, k = qt.shape_2d
    x2d = x.reshape(m, k)
    src = x2d if usage == "rowwise" else x2d.t()
    scale, data, deq, nan_mask = expected(src, q.fp8_dtype, q.block_scaling_dim,
                                          pow2=q.force_pow_2_scales, eps=q.amax_epsilon)
    stored_data, stored_scale = getattr(qt, f"{usage}_data"), getattr(qt, f"{usage}_scale")
    # Stored scale: exact fp32 values in the documented shape.
    assert stored_scale.dtype == torch.float32
    assert_bits_equal(stored_scale, scale)
    # Stored data: exact fp8 bytes outside NaN blocks, NaN inside them.
    assert stored_data.dtype == q.fp8_dtype and stored_data.is_contiguous()
    assert stored_data.shape == data.shape
    want_bytes = data.to(torch.float32).to(q.fp8_dtype).view(torch.uint8)
    got = stored_data.view(torch.uint8)
    assert torch.equal(torch.where(nan_mask, 0, got), torch.where(nan_mask, 0, want_bytes))
    assert bool(torch.isnan(stored_data.to(torch.float32))[nan_mask].all())
    # Dequantization comes back in the nominal (untransposed) shape.
    if usage == "columnwise":
        deq, nan_mask = deq.t(), nan_mask.t()
    out = qt.dequantize(torch.float32, usage=usage)
    assert out.shape == x.shape
    assert_bits_equal(out.reshape(m, k), deq.contiguous(), nan_mask=nan_mask)
    default = qt.dequantize(usage=usage)
    assert default.dtype == x.dtype
    assert torch.equal(default.isnan(), out.isnan())
    assert torch.equal(default.nan_to_num(0), out.to(x.dtype).nan_to_num(0))


def check_all(q: Float8BlockQuantizer, x: torch.Tensor):
    """Quantize x and check every direction q asks for against the model."""
    qt = q.quantize(x)
    assert isinstance(qt, Float8BlockwiseTensor)
    assert qt.shape == x.shape and qt.dtype == x.dtype
    for usage in ("rowwise", "columnwise"):
        if getattr(q, f"{usage}_usage"):
            check_direction(q, qt, x, usage)
        else:
            assert getattr(qt, f"{usage}_data") is None and getattr(qt, f"{usage}_scale") is None
    return qt


# ---- inputs ---------------------------------------------------------------------------------
def make_input(dist: str, shape, dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    n = torch.Size(shape).numel()
    if dist == "normal":
        x = torch.randn(n, generator=g) * 3.0
    elif dist == "uniform":
        x = torch.rand(n, generator=g) * 2 - 1
    elif dist == "lognormal":
        sign = torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0)
        x = torch.exp(torch.randn(n, generator=g) * 3.0) * sign
    elif dist == "student_t":
        z = torch.randn(n, generator=g)
        chi2 = (torch.randn(n, 2, generator=g) ** 2).sum(-1)  # 2 degrees of freedom
        x = z / torch.sqrt(chi2 / 2)
    elif dist == "outliers":
        x = torch.randn(n, generator=g)
        idx = torch.randint(0, n, (max(1, n // 1000),), generator=g)
        x[idx] = torch.randn(idx.numel(), generator=g) * 3e4
    elif dist == "binades":
        lo, hi = (-20, 14) if dtype == torch.float16 else (-60, 60)
        e = torch.randint(lo, hi, (n,), generator=g).to(torch.float32)
        sign = torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0)
        x = torch.exp2(e) * (1 + torch.rand(n, generator=g)) * sign
    else:
        raise AssertionError(dist)
    if dtype == torch.float16:
        x = x.clamp(-60000, 60000)
    return x.reshape(shape).to(dtype)


DISTS = ["normal", "uniform", "lognormal", "student_t", "outliers", "binades"]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SHAPES = {1: [(384,), (8, 256), (2, 128, 256), (128, 384)],
          2: [(128, 384), (2, 128, 256)]}


def usages_for(shape, dim):
    m, k = base.flatten_2d(shape)
    if dim == 2:
        return True, True
    return k % B == 0, m % B == 0


@pytest.mark.parametrize("dist", DISTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fp8_dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("dim", [1, 2])
def test_random_matches_spec(dist, dtype, fp8_dtype, dim):
    # Alternate pow2 over shapes and distributions so that every combination is
    # covered by some case while each case stays small.
    for i, shape in enumerate(SHAPES[dim]):
        row, col = usages_for(shape, dim)
        x = make_input(dist, shape, dtype, seed=1000 * DISTS.index(dist) + 10 * dim + i)
        pow2 = (i + DISTS.index(dist)) % 2 == 0
        q = Float8BlockQuantizer(fp8_dtype, block_scaling_dim=dim, force_pow_2_scales=pow2)
        q.set_usage(rowwise=row, columnwise=col)
        check_all(q, x)


def test_defaults_and_layout():
    q = Float8BlockQuantizer()
    assert (q.fp8_dtype, q.block_scaling_dim, q.force_pow_2_scales, q.amax_epsilon) == (
        E4M3, 2, True, 0.0)
    assert q.rowwise_usage and q.columnwise_usage
    assert q.format_name == "fp8_block"
    x = make_input("normal", (2, 128, 384), torch.bfloat16, 1)
    qt = q.quantize(x)
    assert qt.rowwise_data.shape == (256, 384) and qt.rowwise_scale.shape == (2, 3)
    assert qt.columnwise_data.shape == (384, 256) and qt.columnwise_scale.shape == (3, 2)
    # 128x128: both directions hold the same blocks.
    assert torch.equal(qt.columnwise_data.view(torch.uint8), qt.rowwise_data.view(torch.uint8).t())
    assert torch.equal(qt.columnwise_scale, qt.rowwise_scale.t())
    qt1 = Float8BlockQuantizer(block_scaling_dim=1).quantize(x)
    assert qt1.rowwise_data.shape == (256, 384) and qt1.rowwise_scale.shape == (256, 3)
    assert qt1.columnwise_data.shape == (384, 256) and qt1.columnwise_scale.shape == (384, 2)
    assert qt1.columnwise_data.is_contiguous() and qt1.columnwise_scale.is_contiguous()
    assert qt1.metadata() == {"fp8_dtype": E4M3, "block_scaling_dim": 1}


def test_amax_epsilon():
    x = make_input("normal", (128, 256), torch.float32, 2) * 1e-4
    x[:, :128] *= 1e-3  # these blocks have amax below eps
    for eps in (2.0 ** -12, 1e-3):
        for dim in (1, 2):
            for pow2 in (True, False):
                q = Float8BlockQuantizer(block_scaling_dim=dim, force_pow_2_scales=pow2,
                                         amax_epsilon=eps)
                qt = check_all(q, x)
                if not pow2:
                    eps32 = torch.tensor(eps, dtype=torch.float32)
                    assert qt.rowwise_scale[0, 0] == torch.tensor(448.0) / eps32


# ---- edge cases -----------------------------------------------------------------------------
@pytest.mark.parametrize("dim", [1, 2])
def test_zero_block(dim):
    x = make_input("normal", (256, 256), torch.float32, 3)
    x[:128, :128] = 0
    x[130, 128:] = -0.0
    for fp8_dtype in (E4M3, E5M2):
        qt = check_all(Float8BlockQuantizer(fp8_dtype, block_scaling_dim=dim), x)
        assert qt.rowwise_scale[0, 0] == 1.0
        assert not qt.rowwise_data[:128, :128].view(torch.uint8).any()
        assert torch.equal(qt.dequantize()[:128, :128], torch.zeros(128, 128))
        if dim == 1:
            assert qt.rowwise_scale[130, 1] == 1.0
            assert bool(qt.dequantize()[130, 128:].signbit().all())  # -0 stays -0


@pytest.mark.parametrize("dim", [1, 2])
def test_one_huge_value(dim):
    x = make_input("normal", (128, 256), torch.float32, 4)
    x[5, 17] = 3e30
    x[70, 200] = -2.5e12
    for pow2 in (True, False):
        qt = check_all(Float8BlockQuantizer(block_scaling_dim=dim, force_pow_2_scales=pow2), x)
        deq = qt.dequantize()
        assert deq[5, 17] == pytest.approx(3e30, rel=0.07)
        # The ordinary values of that block flush to zero next to the outlier.
        assert deq[5, :128].count_nonzero() == 1


@pytest.mark.parametrize("fp8_dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_saturation_boundary(fp8_dtype):
    fmax = FP8_FORMATS[fp8_dtype][2]
    # Block amaxes whose fp32 product amax * fp32(fmax / amax) rounds above fmax: the
    # explicit clamp must bring them back to fmax (not to NaN or the next binade).
    g = torch.Generator().manual_seed(5)
    cand = torch.rand(200000, generator=g) * 1000 + 1
    scaled = cand * (torch.tensor(fmax) / cand)
    over = cand[scaled > fmax][:256]
    assert over.numel() == 256
    x = make_input("uniform", (256, 256), torch.float32, 6)
    x[:, 0] = over  # one per 1x128 rowwise block of column block 0
    x[:, 130] = -over
    max_byte = torch.tensor(fmax).to(fp8_dtype).view(torch.uint8)
    qt = check_all(Float8BlockQuantizer(fp8_dtype, block_scaling_dim=1, force_pow_2_scales=False)
                   .set_usage(columnwise=False), x)
    assert torch.equal(qt.rowwise_data[:, 0].view(torch.uint8), max_byte.expand(256))
    assert torch.equal(qt.rowwise_data[:, 130].view(torch.uint8), (max_byte | 0x80).expand(256))
    # Values exactly at fmax with a pow2 scale of 1 survive unchanged.
    y = torch.full((128, 128), fmax)
    y[1::2] = -fmax
    for dim in (1, 2):
        qt = check_all(Float8BlockQuantizer(fp8_dtype, block_scaling_dim=dim), y)
        assert bool((qt.rowwise_scale == 1).all())
        assert torch.equal(qt.dequantize(), y)


def test_subnormals():
    tiny = torch.finfo(torch.float32).smallest_normal
    g = torch.Generator().manual_seed(7)
    # fp32 subnormal inputs: the scale overflows to inf and becomes the fp32 max.
    x = (torch.rand(128, 256, generator=g) - 0.5) * tiny
    x[0, 0] = 1.4e-45  # the smallest subnormal
    x[3, 130] = 2.0 ** -149
    for pow2 in (True, False):
        for dim in (1, 2):
            qt = check_all(Float8BlockQuantizer(block_scaling_dim=dim, force_pow_2_scales=pow2), x)
            want = 2.0 ** 127 if pow2 else FP32_MAX
            assert bool((qt.rowwise_scale == want).all())
            assert qt.dequantize().count_nonzero() > 0
    # Values that land in the fp8 subnormal range: block amax = fp8 max gives scale 1.
    for fp8_dtype in (E4M3, E5M2):
        emin, mbits, fmax = FP8_FORMATS[fp8_dtype]
        y = torch.exp2(torch.randint(emin - 5, emin + 1, (128, 256), generator=g).float())
        y = y * (1 + torch.rand(128, 256, generator=g)) * torch.where(
            torch.rand(128, 256, generator=g) < 0.5, -1.0, 1.0)
        y[:, 0] = y[:, 128] = fmax
        for dim in (1, 2):
            for dtype in DTYPES:
                qt = check_all(Float8BlockQuantizer(fp8_dtype, block_scaling_dim=dim), y.to(dtype))
                bits = qt.rowwise_data.view(torch.uint8)
                exp_field = (bits >> mbits) & (0x7F >> mbits)
                assert bool(((exp_field == 0) & (bits & ((1 << mbits) - 1) != 0)).any())


@pytest.mark.parametrize("dim", [1, 2])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_nan_inf_poison_their_block(dim, dtype):
    x = make_input("normal", (256, 256), dtype, 8)
    x[3, 5] = float("nan")
    x[200, 140] = float("inf")
    x[130, 7] = float("-inf")
    qt = check_all(Float8BlockQuantizer(block_scaling_dim=dim), x)
    row, col = qt.dequantize(torch.float32), qt.dequantize(torch.float32, usage="columnwise")
    if dim == 2:
        want = torch.zeros(256, 256, dtype=torch.bool)
        want[:128, :128] = want[128:, 128:] = want[128:, :128] = True
        assert torch.equal(row.isnan(), want) and torch.equal(col.isnan(), want)
    else:
        want_row = torch.zeros(256, 256, dtype=torch.bool)
        want_row[3, :128] = want_row[200, 128:] = want_row[130, :128] = True
        want_col = torch.zeros(256, 256, dtype=torch.bool)
        want_col[:128, 5] = want_col[128:, 140] = want_col[128:, 7] = True
        assert torch.equal(row.isnan(), want_row) and torch.equal(col.isnan(), want_col)
    assert int(qt.rowwise_scale.isnan().sum()) == 3


@pytest.mark.parametrize("dim", [1, 2])
def test_usages(dim):
    x = make_input("lognormal", (2, 128, 256), torch.bfloat16, 9)
    full = Float8BlockQuantizer(block_scaling_dim=dim).quantize(x)
    for row, col in [(True, False), (False, True)]:
        qt = check_all(Float8BlockQuantizer(block_scaling_dim=dim).set_usage(rowwise=row,
                                                                             columnwise=col), x)
        assert qt.has_usage("rowwise") == row and qt.has_usage("columnwise") == col
        missing = "columnwise" if row else "rowwise"
        with pytest.raises(RuntimeError, match=missing):
            qt.dequantize(usage=missing)
        held = "rowwise" if row else "columnwise"
        assert torch.equal(getattr(qt, f"{held}_data").view(torch.uint8),
                           getattr(full, f"{held}_data").view(torch.uint8))
    with pytest.raises(ValueError):
        Float8BlockQuantizer(block_scaling_dim=dim).set_usage(rowwise=False,
                                                              columnwise=False).quantize(x)


@pytest.mark.parametrize("dim", [1, 2])
def test_pow2_scales_known_without_reading_them(dim):
    """A GEMM backend asks ``pow2_scales`` instead of reading the scales back (a sync; under
    CUDA graph capture impossible): True only while the forced scales stay as made."""
    x = make_input("lognormal", (2, 128, 256), torch.bfloat16, 11)
    qt = Float8BlockQuantizer(block_scaling_dim=dim).quantize(x)
    for usage in ("rowwise", "columnwise"):
        scale = getattr(qt, f"{usage}_scale")
        mant, _ = torch.frexp(scale)
        assert bool((mant == 0.5).all()) and qt.pow2_scales(usage)
    assert not copy.deepcopy(qt).pow2_scales("rowwise")  # records are never copied
    qt.rowwise_scale.mul_(3.0)  # no longer powers of two: the record must not vouch for it
    assert not qt.pow2_scales("rowwise") and qt.pow2_scales("columnwise")
    qt.update_usage(rowwise_usage=False)  # dropping a usage drops its record
    assert qt._pow2_rowwise is None and qt.pow2_scales("columnwise")
    if dim == 2:  # rowwise derived again from the columnwise blocks: still powers of two
        qt.update_usage(rowwise_usage=True)
        assert qt.pow2_scales("rowwise")
    free = Float8BlockQuantizer(block_scaling_dim=dim, force_pow_2_scales=False).quantize(x)
    assert not free.pow2_scales("rowwise") and not free.pow2_scales("columnwise")


@pytest.mark.parametrize("dim", [1, 2])
def test_update_usage(dim):
    # Blocks with distinct scales on a non-square block grid, so a transposed scale
    # cannot pass for a reshaped one.
    x = make_input("lognormal", (2, 128, 384), torch.float32, 10)
    q = Float8BlockQuantizer(block_scaling_dim=dim)
    qt = q.quantize(x)
    ref = q.quantize(x)
    assert qt.update_usage(columnwise_usage=False) is qt
    assert qt.columnwise_data is None and qt.columnwise_scale is None
    assert torch.equal(qt.dequantize(), ref.dequantize())
    with pytest.raises(ValueError):
        qt.update_usage(rowwise_usage=False)
    if dim == 1:
        with pytest.raises(RuntimeError, match="cannot derive"):
            qt.update_usage(columnwise_usage=True)
        return
    assert not torch.equal(ref.rowwise_scale.t(), ref.rowwise_scale.reshape(3, 2))
    qt.update_usage(columnwise_usage=True)
    assert torch.equal(qt.columnwise_data.view(torch.uint8), ref.columnwise_data.view(torch.uint8))
    assert torch.equal(qt.columnwise_scale, ref.columnwise_scale)
    assert qt.columnwise_data.is_contiguous() and qt.columnwise_scale.is_contiguous()
    qt.update_usage(rowwise_usage=False)
    assert qt.rowwise_data is None and qt.rowwise_scale is None
    qt.update_usage(rowwise_usage=True)
    assert torch.equal(qt.rowwise_data.view(torch.uint8), ref.rowwise_data.view(torch.uint8))
    assert torch.equal(qt.rowwise_scale, ref.rowwise_scale)


@pytest.mark.parametrize("dim", [1, 2])
@pytest.mark.parametrize("usage", [(True, True), (True, False), (False, True)])
def test_make_empty_update_quantized(dim, usage):
    q = Float8BlockQuantizer(E5M2, block_scaling_dim=dim).set_usage(*usage)
    shape = (2, 128, 256)
    empty = q.make_empty(shape, dtype=torch.bfloat16, device="cpu")
    assert empty.shape == shape and empty.dtype == torch.bfloat16
    ptrs = {n: t.data_ptr() for n, t in empty.inner_tensors().items() if t is not None}
    for seed, dist in enumerate(["normal", "outliers"]):
        x = make_input(dist, shape, torch.bfloat16, 11 + seed)
        x[0, 0, 0] = float("nan")
        assert q.update_quantized(x, empty) is empty
        fresh = q.quantize(x)
        for name, t in fresh.inner_tensors().items():
            e = getattr(empty, name)
            assert (t is None) == (e is None)
            if t is not None:
                assert e.shape == t.shape and e.dtype == t.dtype and e.data_ptr() == ptrs[name]
                if t.dtype == torch.float32:
                    assert_bits_equal(e, t)
                else:
                    assert torch.equal(e.view(torch.uint8), t.view(torch.uint8))
    with pytest.raises(ValueError):
        Float8BlockQuantizer(E4M3, block_scaling_dim=dim).set_usage(*usage).update_quantized(
            x, empty)
    with pytest.raises(ValueError):
        q.update_quantized(x[:1], empty)


def test_copy():
    q = Float8BlockQuantizer(E5M2, block_scaling_dim=1, force_pow_2_scales=False,
                             amax_epsilon=1e-6).set_usage(columnwise=False)
    c = q.copy()
    assert type(c) is Float8BlockQuantizer and c is not q and repr(c) == repr(q)
    c.set_usage(columnwise=True)
    assert not q.columnwise_usage and c.columnwise_usage
    x = make_input("student_t", (128, 256), torch.float32, 12)
    assert torch.equal(q.quantize(x).dequantize(), c.quantize(x).dequantize())


def _same(a: Float8BlockwiseTensor, b: Float8BlockwiseTensor):
    assert type(a) is type(b) and a.shape == b.shape and a.dtype == b.dtype
    assert a.metadata() == b.metadata()
    for name, t in a.inner_tensors().items():
        u = getattr(b, name)
        assert (t is None) == (u is None)
        if t is not None:
            assert t.dtype == u.dtype
            assert torch.equal(t.view(torch.uint8), u.view(torch.uint8))


@pytest.mark.parametrize("dim", [1, 2])
def test_serialization_round_trips(dim):
    q = Float8BlockQuantizer(E5M2, block_scaling_dim=dim, amax_epsilon=1e-8)
    x = make_input("binades", (256, 128), torch.float16, 13)
    x[7, 7] = float("inf")
    for qq in (q, q.copy().set_usage(columnwise=False)):
        qt = qq.quantize(x)
        for clone in (pickle.loads(pickle.dumps(qt)), copy.deepcopy(qt)):
            _same(qt, clone)
        buf = io.BytesIO()
        torch.save({"qt": qt, "quantizer": qq}, buf)
        buf.seek(0)
        loaded = torch.load(buf, weights_only=True)
        _same(qt, loaded["qt"])
        assert repr(loaded["quantizer"]) == repr(qq)
        for qc in (pickle.loads(pickle.dumps(qq)), copy.deepcopy(qq)):
            assert repr(qc) == repr(qq)
            _same(qc.quantize(x), qt)


def test_supported_and_unsupported_ops():
    x = make_input("normal", (2, 128, 256), torch.float32, 14)
    qt = Float8BlockQuantizer(block_scaling_dim=1).quantize(x)
    want = qt.dequantize()
    assert torch.equal(qt.detach().dequantize(), want)
    assert torch.equal(qt.clone().dequantize(), want)
    v = qt.view(256, 256)
    assert v.shape == (256, 256) and torch.equal(v.dequantize(), want.reshape(256, 256))
    assert torch.equal(v.dequantize(usage="columnwise"), want.reshape(256, 256))
    assert qt.to(torch.bfloat16).dequantize().dtype == torch.bfloat16
    # ops outside the table run on the dequantized values (a plain result)
    w = torch.randn(256, 4)
    for fn in (lambda t: t + 1, lambda t: torch.matmul(t.view(256, 256), w), lambda t: t.sum()):
        got = fn(qt)
        assert type(got) is torch.Tensor and torch.equal(got, fn(want))
    with pytest.raises(TypeError):
        Float8BlockQuantizer().quantize(qt)


def test_constructor_validation():
    with pytest.raises(ValueError, match="3"):
        Float8BlockQuantizer(block_scaling_dim=3)
    with pytest.raises(ValueError, match="0"):
        Float8BlockQuantizer(block_scaling_dim=0)
    with pytest.raises(ValueError, match="True"):
        Float8BlockQuantizer(block_scaling_dim=True)
    with pytest.raises(ValueError, match="fp8_dtype"):
        Float8BlockQuantizer(torch.bfloat16)
    for eps in (-1e-6, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="amax_epsilon"):
            Float8BlockQuantizer(amax_epsilon=eps)
    with pytest.raises(TypeError):
        Float8BlockQuantizer(E4M3, 1)  # keyword-only options
    with pytest.raises(TypeError):
        Float8BlockQuantizer().quantize(torch.zeros(128, 128, dtype=torch.float64))


@pytest.mark.parametrize("dim", [1, 2])
def test_decode_scale_layout_and_private_record(dim):
    """``decode_scale(usage)`` is ``1 / scale`` in cuBLAS's layout (1x128: transposed, so
    (K/128, M) rowwise and (M/128, K) columnwise; 128x128: as the scale). A kernel's record
    of it is used only while its scale is unmodified, and no copy carries it."""
    import copy
    x = torch.randn(256, 384) * 5
    qt = Float8BlockQuantizer(E4M3, block_scaling_dim=dim).quantize(x)
    for usage in ("rowwise", "columnwise"):
        s = getattr(qt, f"{usage}_scale")
        d = qt.decode_scale(usage)
        want = torch.reciprocal(s.t() if dim == 1 else s)
        assert d.is_contiguous() and torch.equal(d, want)
    s = qt.rowwise_scale
    fake = torch.full_like(qt.decode_scale("rowwise"), 7.0)
    qt._decode_rowwise = Float8BlockwiseTensor.derived_record(s, fake)
    assert qt.decode_scale("rowwise") is fake
    names, _ = qt.__tensor_flatten__()
    assert not any(n.startswith("_decode") for n in names)
    for other in (copy.deepcopy(qt), qt.detach()):
        assert other._decode_rowwise is None
    s.mul_(2.0)  # an in-place write makes the record stale
    assert torch.equal(qt.decode_scale("rowwise"), torch.reciprocal(s.t() if dim == 1 else s))
    with torch.inference_mode():
        assert Float8BlockwiseTensor.derived_record(torch.ones(2), torch.ones(2)) is None


@pytest.mark.parametrize("eps", [float("inf"), 1e39, 2 * FP32_MAX, -1e-30, "0", None, True],
                         ids=["inf", "1e39", "2xfp32max", "negative", "str", "none", "bool"])
def test_amax_epsilon_must_be_finite_in_fp32(eps):
    with pytest.raises(ValueError) as err:
        Float8BlockQuantizer(amax_epsilon=eps)
    msg = str(err.value)
    assert "Float8BlockQuantizer" in msg and "amax_epsilon" in msg and repr(eps) in msg
    assert ">= 0" in msg and "fp32" in msg


def test_amax_epsilon_fp32_max_is_accepted():
    q = Float8BlockQuantizer(block_scaling_dim=1, amax_epsilon=FP32_MAX)
    assert q.amax_epsilon == FP32_MAX
    assert torch.isfinite(q.quantize(torch.ones(B, B)).dequantize()).all()


@pytest.mark.parametrize("bad", ["false", 0, 1, None])
def test_force_pow_2_scales_must_be_bool(bad):
    with pytest.raises(ValueError) as err:
        Float8BlockQuantizer(force_pow_2_scales=bad)
    msg = str(err.value)
    assert "force_pow_2_scales" in msg and repr(bad) in msg and "bool" in msg
