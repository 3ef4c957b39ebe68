"""NVFP4Quantizer / NVFP4Tensor against an independent float64 evaluation of SPEC section 2.

The expected values below never call lowprec's reference code: every fp32 operation of the
SPEC formulas is done in float64 and rounded to fp32 right after (exact for one +, -, *, /
of fp32 operands, since float64 holds more than 2*24+2 bits), E4M3 and E2M1 rounding are
written from their definitions, and the RHT butterfly is emulated stage by stage.
"""

import copy
import io
import math
import pickle

import pytest
import torch

from lowprec.formats.base import register_safe_globals
from lowprec.formats.nvfp4 import NVFP4Quantizer, NVFP4Tensor, rht_forward, rht_inverse, rht_matrix
from lowprec.formats.nvfp4.draws import draw_key, uniforms

register_safe_globals(NVFP4Quantizer, NVFP4Tensor)

F64 = torch.float64
FP32_MAX = torch.finfo(torch.float32).max
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=F64)
SIGNS = torch.tensor([1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1], dtype=F64)


# ---- independent float64 model ---------------------------------------------------------------
def f32(t):
    return t.to(torch.float32).to(F64)


def e4m3(v):
    """RNE to E4M3 (emin -6, 3 mantissa bits), saturating at 448; v >= 0."""
    safe = torch.where(v > 0, v, torch.ones_like(v))
    ulp = torch.exp2(torch.clamp(torch.floor(torch.log2(safe)), min=-6) - 3)
    r = torch.clamp(torch.round(safe / ulp) * ulp, max=448.0)
    return torch.where(v > 0, r, torch.zeros_like(v))


def e2m1_rne(v):
    """RNE of |v| onto the E2M1 grid (emin 0, 1 mantissa bit, max 6)."""
    a = v.abs()
    safe = torch.where(a > 0, a, torch.ones_like(a))
    ulp = torch.exp2(torch.clamp(torch.floor(torch.log2(safe)), min=0) - 1)
    r = torch.clamp(torch.round(safe / ulp) * ulp, max=6.0)
    return torch.where(a > 0, r, torch.zeros_like(a))


def e2m1_sr(v, rand):
    """SR of |v| cut toward zero to a multiple of 2**-23 (22 bits under the grid step below
    1, as fp32 has from 1 up), with 22-bit draws ``rand``."""
    a = v.abs().clamp(max=6.0)
    a = torch.where(a < 1, torch.floor(a * 2.0 ** 23) / 2.0 ** 23, a)
    lo_idx = (torch.searchsorted(E2M1, a.contiguous(), right=True) - 1).clamp(0, 7)
    hi_idx = (lo_idx + 1).clamp(max=7)
    lo, hi = E2M1[lo_idx], E2M1[hi_idx]
    p = torch.where(hi > lo, (a - lo) / (hi - lo).clamp(min=1e-300), torch.zeros_like(a))
    return torch.where(rand < p, hi, lo)


def butterfly_f64(t):
    """Stages at strides 8, 4, 2, 1, each element rounded to fp32."""
    t = t.clone()
    for h in (8, 4, 2, 1):
        new = t.clone()
        for i in range(16):
            if not i & h:
                a, b = t[..., i], t[..., i + h]
                new[..., i], new[..., i + h] = f32(a + b), f32(a - b)
        t = new
    return t


def rht_f64(mat):
    """Signs and 1/8 (one fp32 rounding), butterflies, * 2 (rht.py's arrangement)."""
    tiles = mat.reshape(*mat.shape[:-1], -1, 16)
    return f32(butterfly_f64(f32(tiles * SIGNS * 0.125)) * 2.0).reshape(mat.shape)


def rht_inv_f64(mat):
    tiles = mat.reshape(*mat.shape[:-1], -1, 16)
    return f32(butterfly_f64(f32(tiles * 0.125)) * 2.0 * SIGNS).reshape(mat.shape)


def to_blocks(mat, two_d):
    r, c = mat.shape
    if not two_d:
        return mat.reshape(r, c // 16, 16)
    return mat.reshape(r // 16, 16, c // 16, 16).permute(0, 2, 1, 3).reshape(r // 16, c // 16, 256)


def from_blocks(b, shape, two_d):
    r, c = shape
    if not two_d:
        return b.reshape(r, c)
    return b.reshape(r // 16, c // 16, 16, 16).permute(0, 2, 1, 3).reshape(r, c)


def expected_direction(mat, two_d, rand=None):
    """(codes (R, C) uint8, d per block, S, dequantized (R, C)) for one stored direction."""
    fin = torch.isfinite(mat)
    amax = mat.abs()[fin].max().item() if fin.any() else 0.0
    s = 1.0 if amax == 0 else f32(torch.tensor(2688.0 / amax, dtype=F64)).item()
    s = FP32_MAX if math.isinf(s) else s
    b = to_blocks(mat, two_d)
    bad = ~torch.isfinite(b).all(-1)
    bamax = torch.where(bad, torch.zeros_like(bad, dtype=F64), b.abs().amax(-1))
    d = e4m3(f32(f32(bamax / 6.0) * s))
    d = torch.where(bad, torch.full_like(d, float("nan")), d)
    ok = (d > 0)[..., None]
    v = torch.where(ok, f32(f32(b * s) / torch.where(ok, d[..., None], 1.0)), 0.0)
    q = e2m1_rne(v) if rand is None else e2m1_sr(v, to_blocks(rand.to(F64), two_d))
    codes = torch.searchsorted(E2M1, q.contiguous()).to(torch.uint8)
    codes |= torch.signbit(v).to(torch.uint8) << 3
    q = torch.where(torch.signbit(v), -q, q)
    deq = f32(f32(q * d[..., None]) / s)
    return (from_blocks(codes, mat.shape, two_d), d, s, from_blocks(deq, mat.shape, two_d))


def expected(x, usage, *, two_d=False, rht=False, rand=None):
    x64 = x.to(torch.float32).to(F64).reshape(-1, x.shape[-1])
    mat = x64 if usage == "rowwise" else x64.t()
    if usage == "columnwise" and rht:
        mat = rht_f64(mat)
    codes, d, s, deq = expected_direction(mat, two_d, rand)
    if usage == "columnwise":
        deq = (rht_inv_f64(deq) if rht else deq).t()
    return codes, d, s, deq.reshape(x.shape)


def assert_bits_equal(actual, exp64):
    exp = exp64.to(torch.float32)
    nan = torch.isnan(exp)
    assert torch.equal(torch.isnan(actual), nan)
    assert torch.equal(actual[~nan], exp[~nan])


def pack(codes):
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def check_against_model(q, x, rands=None):
    qt = q.quantize(x)
    assert isinstance(qt, NVFP4Tensor) and qt.shape == x.shape and qt.dtype == x.dtype
    for usage, on in (("rowwise", q.rowwise_usage), ("columnwise", q.columnwise_usage)):
        if not on:
            assert getattr(qt, f"{usage}_data") is None and getattr(qt, f"{usage}_scale") is None
            continue
        rand = None if rands is None else rands[usage]
        codes, d, s, deq = expected(x, usage, two_d=q.with_2d_quantization, rht=q.with_rht,
                                    rand=rand)
        assert torch.equal(getattr(qt, f"{usage}_data"), pack(codes))
        scale = getattr(qt, f"{usage}_scale")
        assert scale.dtype == torch.float8_e4m3fn and tuple(scale.shape) == tuple(d.shape)
        assert_bits_equal(scale.to(torch.float32), d)
        g = getattr(qt, f"{usage}_global")
        assert g.dtype == torch.float32 and g.shape == (1,) and g.item() == s
        assert qt.dequantize(usage=usage).dtype == x.dtype
        out = qt.dequantize(torch.float32, usage=usage)
        assert out.shape == x.shape
        assert_bits_equal(out, deq)
    return qt


# ---- data -------------------------------------------------------------------------------------
def make(dist, shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    n = math.prod(shape)
    if dist == "normal":
        x = torch.randn(n, generator=g)
    elif dist == "uniform":
        x = torch.rand(n, generator=g) * 2 - 1
    elif dist == "lognormal":
        x = torch.exp(torch.randn(n, generator=g) * 2) * torch.sign(torch.randn(n, generator=g))
    elif dist == "student_t":
        x = torch.randn(n, generator=g) / torch.sqrt(torch.rand(n, generator=g).clamp_min(1e-4))
    elif dist == "outliers":
        x = torch.randn(n, generator=g)
        x[torch.randint(0, n, (3,), generator=g)] = 3e4
    else:  # binades
        span = 60 if dtype == torch.float32 else 22
        x = torch.exp2((torch.rand(n, generator=g) - 0.5) * span) * torch.sign(
            torch.randn(n, generator=g))
    return x.reshape(shape).to(dtype)


DISTS = ["normal", "uniform", "lognormal", "student_t", "outliers", "binades"]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SHAPES = [(32, 64), (2, 16, 48), (48, 32), (16, 16)]
CONFIGS = [dict(), dict(with_rht=True), dict(with_2d_quantization=True),
           dict(with_rht=True, with_2d_quantization=True)]


@pytest.mark.parametrize("cfg", CONFIGS, ids=["1d", "rht", "2d", "2d_rht"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("dist", DISTS)
def test_matches_float64_model(dist, dtype, cfg):
    i = DISTS.index(dist) + DTYPES.index(dtype)
    x = make(dist, SHAPES[i % len(SHAPES)], dtype, seed=i)
    check_against_model(NVFP4Quantizer(**cfg), x)


def test_one_dim_and_three_dim_rowwise_only():
    q = NVFP4Quantizer().set_usage(columnwise=False)
    check_against_model(q, make("normal", (80,), torch.float32))
    check_against_model(q, make("lognormal", (3, 5, 32), torch.bfloat16))


def test_two_d_scales_are_shared_between_directions():
    x = make("lognormal", (32, 48), torch.float32)
    qt = check_against_model(NVFP4Quantizer(with_2d_quantization=True), x)
    assert torch.equal(qt.columnwise_scale.view(torch.uint8),
                       qt.rowwise_scale.view(torch.uint8).t())
    assert torch.equal(qt.columnwise_global, qt.rowwise_global)
    assert qt.rowwise_scale.shape == (2, 3) and qt.columnwise_data.shape == (48, 16)


# ---- edge cases -------------------------------------------------------------------------------
def test_grid_ties_and_saturation():
    # Global amax 6 gives S = 448 and d = 448 for this block, so x * S / d == x exactly.
    vals = [6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 5.9, -0.25, 0.26, -6.0, 2.9, 0.0, -0.0, 1.0]
    want = [6.0, 0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, -0.0, 0.5, -6.0, 3.0, 0.0, -0.0, 1.0]
    x = torch.tensor(vals).reshape(1, 16).repeat(16, 1)
    qt = check_against_model(NVFP4Quantizer(), x)
    assert qt.rowwise_global.item() == 448.0 and (qt.rowwise_scale.float() == 448.0).all()
    assert torch.equal(qt.dequantize()[0], torch.tensor(want))
    # Element 2i in the low nibble; sign in bit 3 (negative zero keeps it).
    assert qt.rowwise_data[0, 4].item() == 0x87  # 5.9 -> 6 (code 7), -0.25 -> -0 (code 8)
    assert qt.rowwise_data[0, 7].item() == 0x28  # -0.0 -> code 8, 1.0 -> code 2


def test_block_scale_saturates_at_448():
    # Find an amax A whose fp32 (A / 6) * (2688 / A) rounds above 448: the cast must clamp.
    a = 1.0 + torch.arange(1, 4000, dtype=torch.float32) * 2.0 ** -20
    prod = (a / 6.0) * (torch.tensor(2688.0) / a)
    hit = a[prod > 448.0]
    assert hit.numel() > 0
    x = torch.randn(16, 32) * 0.1
    x[3, 5] = hit[0]
    qt = check_against_model(NVFP4Quantizer(), x)
    assert qt.rowwise_scale.float()[3, 0].item() == 448.0
    assert qt.rowwise_data[3, 2].item() >> 4 == 7  # A * S / 448 > 6 saturates to 6


def test_block_scale_order_of_operations():
    # fp32 (b / 6) * S and (b * S) / 6 differ for some block amaxes b; near an E4M3 rounding
    # midpoint that changes d. Find such blocks; the stored d must follow the SPEC order.
    amax, s = torch.tensor(3.0), torch.tensor(2688.0) / 3.0
    vals = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    vals = vals[torch.isfinite(vals) & (vals > 0)].unique()
    mids = (vals[:-1] + vals[1:]) / 2
    b = (mids[:, None] * 6 / s * (1 + torch.arange(-64, 65).float() * 2.0 ** -22)).flatten()
    b = b[(b > 0) & (b <= amax)]
    cast = lambda t: t.clamp(-448, 448).to(torch.float8_e4m3fn).float()  # noqa: E731
    differ = b[cast((b / 6) * s) != cast((b * s) / 6)][:16]
    assert differ.numel() == 16
    x = torch.linspace(-1, 1, 16).repeat(16, 2) * 0.5
    x[:, :16] = torch.linspace(-0.9, 0.9, 16) * differ[:, None]
    x[:, 15] = differ
    x[0, 20] = amax
    qt = check_against_model(NVFP4Quantizer(), x)
    assert torch.equal(qt.rowwise_scale.float()[:, 0], cast((differ / 6) * s))


def test_zero_blocks_tiny_blocks_and_all_zero_tensor():
    x = make("normal", (32, 64), torch.float32)
    x[:, :16] = 0.0  # all-zero rowwise blocks
    x[0, 16:32] = 1e-9 * torch.randn(16)  # d underflows to 0 next to O(1) blocks
    x[1, 16:32] = 1e-5 * torch.randn(16)  # d lands in the E4M3 subnormal range
    qt = check_against_model(NVFP4Quantizer(with_rht=True), x)
    sc = qt.rowwise_scale.float()
    assert (sc[:, 0] == 0).all() and sc[0, 1] == 0 and 0 < sc[1, 1] < 2.0 ** -6
    assert (qt.rowwise_data[:, :8] == 0).all() and (qt.rowwise_data[0, 8:16] == 0).all()
    assert (qt.dequantize()[0, 16:32] == 0).all()
    z = check_against_model(NVFP4Quantizer(), torch.zeros(16, 32, dtype=torch.bfloat16))
    assert z.rowwise_global.item() == 1.0 and (z.dequantize() == 0).all()


def test_one_huge_value_in_a_block():
    x = make("normal", (32, 64), torch.float32)
    x[2, 40] = 1e4
    qt = check_against_model(NVFP4Quantizer(with_rht=True), x)
    assert qt.dequantize()[2, 40] == 1e4 and qt.rowwise_scale.float()[2, 2] == 448.0
    # Its neighbours are below half a grid step of the block (1e4 / 12) and flush to zero.
    assert (qt.dequantize()[2, 32:48] == 0).sum() == 15


def test_tiny_block_next_to_huge_one_quantizes_to_zero():
    x = torch.zeros(16, 32)
    x[:, :16] = 1e30
    x[:, 16:] = 1e20 * torch.linspace(-1, 1, 16)
    qt = check_against_model(NVFP4Quantizer(with_2d_quantization=True), x)
    assert (qt.rowwise_scale.float()[:, 1] == 0).all()
    assert (qt.rowwise_data[:, 8:] == 0).all() and (qt.dequantize()[:, 16:] == 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_subnormal_inputs(dtype):
    if dtype == torch.float32:
        x = torch.randn(32, 32) * 1e-39  # fp32 subnormals: S overflows and clamps to fp32 max
    else:
        x = (torch.randn(32, 32) * 1e-6).to(dtype)  # fp16 subnormals
    qt = check_against_model(NVFP4Quantizer(with_rht=True), x)
    if dtype == torch.float32:
        assert qt.rowwise_global.item() == FP32_MAX
    assert qt.dequantize(torch.float32).abs().sum() > 0


@pytest.mark.parametrize("cfg", CONFIGS, ids=["1d", "rht", "2d", "2d_rht"])
def test_nan_and_inf_poison_only_their_block(cfg):
    x = make("normal", (32, 64), torch.float32)
    x[0, 3], x[5, 20], x[17, 50] = float("nan"), float("inf"), float("-inf")
    qt = check_against_model(NVFP4Quantizer(**cfg), x)
    row, col = qt.dequantize(), qt.dequantize(usage="columnwise")
    if cfg.get("with_2d_quantization"):
        assert torch.isnan(row[:16, :16]).all() and torch.isnan(row[:16, 16:32]).all()
        assert torch.isnan(row[16:, 48:]).all() and torch.isnan(col[16:, 48:]).all()
    else:
        assert torch.isnan(row[0, :16]).all() and torch.isnan(row[5, 16:32]).all()
        assert torch.isnan(col[:16, 3]).all() and torch.isnan(col[16:, 50]).all()
    assert torch.isfinite(row).sum() == 64 * 32 - 3 * (256 if cfg.get("with_2d_quantization")
                                                      else 16)
    nan_scales = torch.isnan(qt.rowwise_scale.float())
    assert nan_scales.sum() == 3 and ((qt.rowwise_scale.view(torch.uint8) & 0x7F)[nan_scales]
                                      == 0x7F).all()


# ---- usages, empty/update, copies, serialization ----------------------------------------------
def test_usages_and_update_usage():
    x = make("normal", (32, 48), torch.bfloat16)
    qt = check_against_model(NVFP4Quantizer(with_rht=True).set_usage(rowwise=False), x)
    assert qt.rowwise_global is None
    with pytest.raises(RuntimeError):
        qt.dequantize(usage="rowwise")
    assert torch.equal(qt.dequantize(), qt.dequantize(usage="columnwise"))
    with pytest.raises(RuntimeError, match="derive"):
        qt.update_usage(rowwise_usage=True)
    full = NVFP4Quantizer().quantize(x)
    full.update_usage(columnwise_usage=False)
    assert full.columnwise_data is None and full.columnwise_scale is None
    assert full.columnwise_global is None and full.has_usage("rowwise")
    with pytest.raises(ValueError):
        full.update_usage(rowwise_usage=False)


def bits(t):
    return t.view(torch.uint8) if t.dtype.itemsize == 1 and t.dtype.is_floating_point else t


@pytest.mark.parametrize("shape", [(64, 64), (48, 80), (33, 47), (16, 17)])
@pytest.mark.parametrize("usage", ["rowwise", "columnwise"])
def test_16x16_tiles_derive_the_other_direction_bit_for_bit(shape, usage):
    """In 16x16 tiles without the transform a direction is the other's codes, tiles and
    global scale transposed: update_usage derives it as a quantize would make it (odd and
    partial dimensions included). 1x16 blocks and the transform refuse."""
    x = make("normal", shape, torch.float32)
    q = NVFP4Quantizer(with_2d_quantization=True)
    full = q.quantize(x)
    other = "columnwise" if usage == "rowwise" else "rowwise"
    one = q.set_usage(**{usage: True, other: False}).quantize(x)
    one.update_usage(**{f"{other}_usage": True})
    for name in full._inner:
        assert torch.equal(bits(getattr(one, name)), bits(getattr(full, name))), name
    for refused in (NVFP4Quantizer(), NVFP4Quantizer(with_2d_quantization=True, with_rht=True)):
        t = refused.set_usage(rowwise=True, columnwise=False).quantize(x)
        with pytest.raises(RuntimeError, match="derive"):
            t.update_usage(columnwise_usage=True)


def assert_same_tensor(a, b):
    assert type(a) is type(b) and a.shape == b.shape and a.dtype == b.dtype
    assert a.metadata() == b.metadata()
    for name, t in a.inner_tensors().items():
        u = getattr(b, name)
        assert (t is None) == (u is None)
        if t is not None:
            assert t.dtype == u.dtype and torch.equal(bits(t), bits(u))


def _torch_round_trip(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


@pytest.mark.parametrize("cfg", CONFIGS + [dict(stochastic_rounding=True, with_rht=True)])
@pytest.mark.parametrize("usage", ["both", "rowwise", "columnwise"])
def test_make_empty_then_update_quantized(cfg, usage):
    q = NVFP4Quantizer(**cfg).set_usage(rowwise=usage != "columnwise",
                                        columnwise=usage != "rowwise")
    x = make("student_t", (2, 16, 64), torch.float16)
    torch.manual_seed(7)
    ref = q.quantize(x)
    empty = q.make_empty(x.shape, dtype=torch.float16)
    buffers = {}
    for name, t in empty.inner_tensors().items():
        if t is not None:
            bits(t).fill_(0x7E if t.dtype != torch.float32 else 0)  # garbage to overwrite
            buffers[name] = t.data_ptr()
    torch.manual_seed(7)
    assert q.update_quantized(x, empty) is empty
    assert_same_tensor(empty, ref)
    assert {n: t.data_ptr() for n, t in empty.inner_tensors().items() if t is not None} == buffers


def test_tensor_round_trips():
    x = make("outliers", (32, 32), torch.bfloat16)
    x[0, 0] = float("nan")
    qt = NVFP4Quantizer(with_rht=True, with_2d_quantization=True).quantize(x)
    for back in (pickle.loads(pickle.dumps(qt)), copy.deepcopy(qt), _torch_round_trip(qt),
                 qt.detach(), qt.clone()):
        assert_same_tensor(back, qt)
        assert_bits_equal(back.dequantize(torch.float32, usage="columnwise"),
                          qt.dequantize(torch.float32, usage="columnwise").to(F64))
    v = qt.view(2, 16, 32)
    assert v.shape == (2, 16, 32)
    assert torch.equal(v.dequantize(torch.float32, usage="columnwise").isnan(),
                       qt.dequantize(torch.float32, usage="columnwise").reshape(2, 16, 32).isnan())


@pytest.mark.parametrize("how", ["pickle", "deepcopy", "torch_save"])
def test_quantizer_copy_and_round_trips(how):
    g = torch.Generator().manual_seed(11)
    q = NVFP4Quantizer(with_rht=True, stochastic_rounding=True, generator=g).set_usage(
        columnwise=False)
    c = q.copy()
    assert c is not q and c.generator is g and c.with_rht and c.stochastic_rounding
    c.set_usage(columnwise=True)
    assert not q.columnwise_usage
    clone = {"pickle": lambda o: pickle.loads(pickle.dumps(o)), "deepcopy": copy.deepcopy,
             "torch_save": _torch_round_trip}[how](q)
    assert clone.generator is not g and torch.equal(clone.generator.get_state(), g.get_state())
    assert (clone.with_rht, clone.with_2d_quantization, clone.stochastic_rounding,
            clone.rowwise_usage, clone.columnwise_usage) == (True, False, True, True, False)
    # Equal state, independent objects: both draw the same bits once each.
    x = make("normal", (16, 32), torch.float32)
    assert_same_tensor(clone.quantize(x), q.quantize(x))
    assert torch.equal(clone.generator.get_state(), g.get_state())
    plain = {"pickle": lambda o: pickle.loads(pickle.dumps(o)), "deepcopy": copy.deepcopy,
             "torch_save": _torch_round_trip}[how](NVFP4Quantizer(with_2d_quantization=True))
    assert plain.generator is None and plain.with_2d_quantization


def test_ops_outside_the_table_run_on_the_dequantized_values():
    qt = NVFP4Quantizer().quantize(make("normal", (16, 32), torch.float32))
    ref, w = qt.dequantize(), torch.randn(32, 4)
    for fn in (lambda t: torch.add(t, 1.0), lambda t: t.sum(), lambda t: torch.matmul(t, w)):
        got = fn(qt)
        assert type(got) is torch.Tensor and torch.equal(got, fn(ref))


# ---- stochastic rounding ----------------------------------------------------------------------
@pytest.mark.parametrize("cfg", [dict(), dict(with_rht=True), dict(with_2d_quantization=True)],
                         ids=["1d", "rht", "2d"])
def test_stochastic_rounding_matches_float64_model_with_same_draws(cfg):
    x = make("lognormal", (32, 48), torch.bfloat16, seed=3)
    q = NVFP4Quantizer(stochastic_rounding=True, **cfg)
    g = torch.Generator().manual_seed(123)
    # The quantizer draws a key per direction, rowwise (M, K) first, then columnwise (K, M).
    rands = {"rowwise": uniforms(draw_key(g, "cpu"), 32, 48),
             "columnwise": uniforms(draw_key(g, "cpu"), 48, 32)}
    torch.manual_seed(123)
    check_against_model(q, x, rands)


def test_stochastic_rounding_picks_a_grid_neighbour():
    x = make("student_t", (64, 64), torch.float32, seed=5)
    torch.manual_seed(0)
    qt = NVFP4Quantizer(stochastic_rounding=True, with_rht=True).quantize(x)
    for usage in ("rowwise", "columnwise"):
        mat = x.to(F64) if usage == "rowwise" else rht_f64(x.to(F64).t())
        d = getattr(qt, f"{usage}_scale").to(F64).repeat_interleave(16, dim=1)
        s = getattr(qt, f"{usage}_global").item()
        v = f32(f32(mat * s) / d).abs().clamp(max=6.0)
        lo = E2M1[(torch.searchsorted(E2M1, v.contiguous(), right=True) - 1).clamp(0, 7)]
        hi = E2M1[torch.searchsorted(E2M1, v.contiguous()).clamp(max=7)]
        data = getattr(qt, f"{usage}_data")
        codes = torch.stack((data & 0xF, data >> 4), dim=-1).reshape(mat.shape)
        got = E2M1[(codes & 7).long()]
        assert torch.equal(torch.signbit(mat.contiguous()), (codes & 8) != 0)
        assert ((got == lo) | (got == hi)).all()
        assert ((v == lo) <= (got == lo)).all()  # on-grid values are kept


def test_stochastic_rounding_is_unbiased():
    # Every row equals `row`, whose amax is 6: S = 448, d = 448 and v = x exactly. Each of the
    # N rows is an independent draw; a Bernoulli choice between lo and hi has a standard
    # deviation <= (hi - lo) / 2, so the mean over N rows lies within 5 * (hi - lo) / (2 sqrt N)
    # of v except with probability < 1e-6 per column (and the seed is fixed).
    row = torch.tensor([6.0, 0.3, 0.6, 1.1, 1.3, 1.6, 2.2, 2.7, 3.3, 3.9, 4.4, 5.5, -0.3, -1.1,
                        -2.9, -5.1])
    n = 4096
    x = row.repeat(n, 1)
    torch.manual_seed(1)
    qt = NVFP4Quantizer(stochastic_rounding=True).set_usage(columnwise=False).quantize(x)
    assert qt.rowwise_global.item() == 448.0 and (qt.rowwise_scale.float() == 448.0).all()
    q = qt.dequantize()
    a = row.abs().to(F64)
    lo = E2M1[(torch.searchsorted(E2M1, a.contiguous(), right=True) - 1).clamp(0, 7)]
    hi = E2M1[torch.searchsorted(E2M1, a.contiguous()).clamp(max=7)]
    tol = 5 * (hi - lo) / (2 * math.sqrt(n))
    err = (q.to(F64).mean(0) - row.to(F64)).abs()
    assert (err <= tol).all(), (err, tol)
    # Round-to-nearest is biased on the same data by far more than the tolerance.
    rne = NVFP4Quantizer().set_usage(columnwise=False).quantize(x).dequantize()
    rne_err = (rne.to(F64).mean(0) - row.to(F64)).abs()
    assert (rne_err[1:] > 2 * tol[1:]).all()


def test_stochastic_rounding_seeds_and_generator():
    x = make("normal", (32, 32), torch.float32)
    q = NVFP4Quantizer(stochastic_rounding=True, with_rht=True)
    torch.manual_seed(5)
    a = q.quantize(x)
    torch.manual_seed(5)
    b = q.quantize(x)
    torch.manual_seed(6)
    c = q.quantize(x)
    assert_same_tensor(a, b)
    assert not torch.equal(a.rowwise_data, c.rowwise_data)
    assert not torch.equal(a.columnwise_data, c.columnwise_data)
    # An explicit generator is used, and the default generator is left alone.
    torch.manual_seed(5)
    before = torch.get_rng_state()
    qg = NVFP4Quantizer(stochastic_rounding=True, with_rht=True,
                        generator=torch.Generator().manual_seed(5))
    d = qg.quantize(x)
    assert torch.equal(torch.get_rng_state(), before)
    assert_same_tensor(d, a)
    e = qg.quantize(x)  # the generator advanced
    assert not torch.equal(e.rowwise_data, d.rowwise_data)


# ---- RHT --------------------------------------------------------------------------------------
def test_rht_matrix_is_orthogonal_and_matches_forward():
    r = rht_matrix()
    assert r.dtype == F64 and r.shape == (16, 16)
    assert torch.equal(r @ r.t(), torch.eye(16, dtype=F64))
    h = torch.tensor([[(-1) ** bin(i & j).count("1") for j in range(16)] for i in range(16)],
                     dtype=F64)
    assert torch.equal(r, torch.diag(SIGNS) @ h / 4)
    x = make("normal", (5, 48), torch.float32)
    y = rht_forward(x)
    assert y.dtype == torch.float32 and y.shape == x.shape
    # Forward is y = v @ R per tile, exactly the fp32 butterfly of the float64 model.
    assert torch.equal(y.to(F64), rht_f64(x.to(F64)))
    assert torch.allclose(y.to(F64), (x.to(F64).reshape(5, 3, 16) @ r).reshape(5, 48),
                          rtol=0, atol=1e-6)


def test_rht_inverse_round_trip():
    x = make("binades", (4, 3, 64), torch.float32)
    back = rht_inverse(rht_forward(x))
    assert torch.equal(rht_inverse(x).to(F64), rht_inv_f64(x.to(F64)))
    # Each of the 8 butterfly adds rounds at the tile's magnitude: bound by its amax.
    tile_amax = x.reshape(4, 3, 4, 16).abs().amax(-1, keepdim=True)
    err = (back - x).reshape(4, 3, 4, 16).abs()
    assert (err <= 2.0 ** -20 * tile_amax).all()
    y = make("normal", (8, 32), torch.float32)
    assert torch.allclose(rht_inverse(rht_forward(y)), y, rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="16"):
        rht_forward(torch.randn(3, 24))


def test_rht_cancels_in_the_wgrad_product():
    # dW = dY.T @ X contracts over M; both columnwise operands carry the RHT along M.
    a, b = make("normal", (64, 32), torch.float32, 1), make("lognormal", (64, 48), torch.float32, 2)
    plain = a.t().to(F64) @ b.to(F64)
    ra, rb = rht_forward(a.t()), rht_forward(b.t())
    scale = a.t().abs().to(F64) @ b.abs().to(F64)
    assert ((ra.to(F64) @ rb.to(F64).t() - plain).abs() <= 1e-5 * scale).all()
    # Quantized: the stored-domain product equals the product of the original-domain
    # dequantized operands (what a GEMM over two RHT operands must return).
    q = NVFP4Quantizer(with_rht=True).set_usage(rowwise=False)
    qa, qb = q.quantize(a), q.quantize(b)
    stored = qa.dequantize_stored("columnwise").to(F64) @ qb.dequantize_stored("columnwise").to(
        F64).t()
    orig = qa.dequantize(usage="columnwise").to(F64).t() @ qb.dequantize(usage="columnwise").to(F64)
    assert ((stored - orig).abs() <= 1e-5 * scale).all()


# ---- RHT at the ends of the fp32 range ---------------------------------------------------------
def rht_quarter_at_end(x, inverse=False):
    """fp32 RHT with the whole 1/4 applied after the butterflies (signs first for the
    forward, last for the inverse): rht.py's result wherever no value of this formula
    overflows or has to round below 2**-126 (powers of two commute with fp32 rounding)."""
    s = SIGNS.to(torch.float32)
    t = x.to(torch.float32).reshape(*x.shape[:-1], -1, 16)
    if not inverse:
        t = t * s
    for h in (8, 4, 2, 1):
        halves = t.reshape(*t.shape[:-1], 16 // (2 * h), 2, h).unbind(-2)
        t = torch.stack((halves[0] + halves[1], halves[0] - halves[1]), -2).reshape(t.shape)
    t = t * 0.25
    if inverse:
        t = t * s
    return t.reshape(x.shape)


def f32_bits(t):
    return t.contiguous().view(torch.int32)


def log_uniform(shape, lo, hi, seed):
    """fp32 values with log-uniform magnitudes in [lo, hi] and random signs."""
    g = torch.Generator().manual_seed(seed)
    mag = torch.exp(torch.empty(shape, dtype=F64).uniform_(math.log(lo), math.log(hi),
                                                           generator=g))
    sign = torch.where(torch.rand(shape, generator=g) < 0.5, -1.0, 1.0).to(F64)
    return (mag * sign).to(torch.float32)


def rht_exact(x):
    """float64 x @ R per tile (no intermediate rounding)."""
    return (x.to(F64).reshape(*x.shape[:-1], -1, 16) @ rht_matrix()).reshape(x.shape)


def tile_amax(x):
    t = x.to(F64).abs().reshape(*x.shape[:-1], -1, 16)
    return t.amax(-1, keepdim=True).expand(t.shape).reshape(x.shape)


def test_rht_same_bits_as_quarter_at_end_for_ordinary_inputs():
    g = torch.Generator().manual_seed(30)
    k = torch.randint(-2 ** 20, 2 ** 20, (8, 64), generator=g).to(F64)
    cases = [  # (x, whether y = RHT(x) is itself ordinary)
        (torch.randn(64, 256, generator=g), True),
        (log_uniform((64, 256), 1e-30, 1e30, 31), True),
        # the whole range the quarter-at-end formula survives: 16 max|x| < fp32 max
        (log_uniform((64, 256), 2.0 ** -123, 1e37, 32), False),
        # below 2**-123 only multiples of 2**-146 keep x / 8 exact; results subnormal too
        ((k * 2.0 ** -146).to(torch.float32), False),
        (torch.tensor([0.0, -0.0] * 8 + [1.0, -0.0] + [0.0] * 14), True),
    ]
    for x, y_ordinary in cases:
        y = rht_forward(x)
        assert torch.isfinite(y).all()
        assert torch.equal(f32_bits(y), f32_bits(rht_quarter_at_end(x)))
        assert torch.equal(f32_bits(rht_inverse(x)), f32_bits(rht_quarter_at_end(x, inverse=True)))
        if y_ordinary:
            assert torch.equal(f32_bits(rht_inverse(y)),
                               f32_bits(rht_quarter_at_end(y, inverse=True)))
    # non-finite inputs: the same infs and NaNs in the same places
    x = torch.randn(4, 32, generator=g)
    x[0, 3], x[1, 17], x[2, 0], x[2, 9] = float("inf"), float("nan"), float("inf"), -float("inf")
    y, old = rht_forward(x), rht_quarter_at_end(x)
    assert torch.equal(torch.isnan(y), torch.isnan(old))
    assert torch.equal(y[~torch.isnan(y)], old[~torch.isnan(old)])


def test_rht_near_fp32_max_is_finite_and_accurate():
    x = log_uniform((64, 256), 1e37, FP32_MAX, 33)
    assert not torch.isfinite(rht_quarter_at_end(x)).all()  # what the scaling is for
    y, exact = rht_forward(x), rht_exact(x)
    bound = 2.0 ** -20 * tile_amax(x)  # four stages rounding at <= 2, 4, 8, 16 max|x| / 8
    fits = exact.abs() <= FP32_MAX - bound
    over = exact.abs() >= FP32_MAX + bound
    assert fits.float().mean() > 0.5 and over.any()
    assert ((y.to(F64) - exact).abs()[fits] <= bound[fits]).all()
    # overflow stays with the elements whose own value is out of range: no NaN, no
    # spill-over into their tile
    assert torch.equal(y[over].to(F64), exact[over].sign() * math.inf)
    assert not torch.isnan(y).any()
    assert torch.equal(y.to(F64), rht_f64(x.to(F64)))
    # x near 1e38 with every result in range: a finite round trip
    x = log_uniform((32, 128), 1e37, 8e37, 34)
    y = rht_forward(x)
    assert torch.isfinite(y).all() and not torch.isfinite(rht_quarter_at_end(x)).all()
    assert ((y.to(F64) - rht_exact(x)).abs() <= 2.0 ** -20 * tile_amax(x)).all()
    back = rht_inverse(y)
    assert torch.equal(back.to(F64), rht_inv_f64(y.to(F64)))
    assert ((back - x).abs().to(F64) <= 2.0 ** -20 * tile_amax(x)).all()


def test_rht_extreme_tiles():
    s = SIGNS.to(torch.float32)
    one_hot = torch.zeros(16)
    one_hot[0] = FP32_MAX
    pair = torch.zeros(16)
    pair[0] = pair[8] = FP32_MAX
    x = torch.stack([
        s * one_hot,               # y = +-fp32 max / 4
        s * pair,                  # stage 1 reaches 2 fp32 max (unscaled); y in {0, fp32 max / 2}
        s * (FP32_MAX / 4),        # y = (fp32 max, 0, ..., 0)
        s * FP32_MAX,              # y = (inf, 0, ..., 0): only y_0 is out of range
        -s * FP32_MAX,
        # (0, inf, 0, ..., 0): stage 3 reaches +-2 fp32 max (unscaled) in one pair
        s * FP32_MAX * torch.tensor([1.0, -1.0] * 8),
    ])
    y = rht_forward(x)
    assert torch.equal(y, rht_exact(x).to(torch.float32))
    assert y[2, 0] == FP32_MAX and y[3, 0] == math.inf and y[4, 0] == -math.inf
    assert y[5, 1] == math.inf and (y[5, ::2] == 0).all()
    assert not torch.isnan(y).any()
    assert torch.equal(rht_inverse(y[:3]), x[:3])
    # the inverse likewise: an all-(fp32 max) y maps to (inf, 0, ...) times s
    back = rht_inverse(torch.full((16,), FP32_MAX))
    assert back[0] == math.inf and torch.equal(back[1:], torch.zeros(15))


def test_rht_subnormal_inputs():
    # x / 8 rounds for subnormal x that are not multiples of 2**-146: the bits are those of
    # rht.py's arrangement (the model), within fp32 accuracy of the exact transform.
    g = torch.Generator().manual_seed(35)
    sub = (torch.randint(-2 ** 23, 2 ** 23, (16, 64), generator=g).to(F64) * 2.0 ** -149)
    mixed = sub.clone()
    mixed[:, ::3] = torch.randn(16, 22, generator=g).to(F64) * 1e-30
    for x in (sub.to(torch.float32), mixed.to(torch.float32)):
        y = rht_forward(x)
        assert torch.equal(y.to(F64), rht_f64(x.to(F64)))
        assert torch.equal(rht_inverse(x).to(F64), rht_inv_f64(x.to(F64)))
        err = (y.to(F64) - rht_exact(x)).abs()
        assert (err <= 2.0 ** -20 * tile_amax(x) + 2.0 ** -145).all()


@pytest.mark.parametrize("two_d", [False, True], ids=["1d", "2d"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_rht_quantize_near_fp32_max(dtype, two_d):
    x = log_uniform((64, 48), 1e37, 8e37, 36).to(dtype)
    assert not torch.isfinite(rht_quarter_at_end(x.float().t())).all()
    qt = check_against_model(NVFP4Quantizer(with_rht=True, with_2d_quantization=two_d), x)
    amax = rht_exact(x.float().t()).abs().max().item()
    glob = qt.columnwise_global.item()
    assert math.isfinite(glob) and abs(glob * amax / 2688.0 - 1) < 2.0 ** -18
    assert torch.isfinite(qt.columnwise_scale.to(torch.float32)).all()
    deq = qt.dequantize(torch.float32, usage="columnwise")
    assert torch.isfinite(deq).all()
    assert (deq - x.float()).norm() <= 0.15 * x.float().norm()


def test_rht_with_its_cached_sign_factors_matches_fresh_ones_bit_for_bit():
    """The RHT's sign factors are made once per device (``casting.device_constant``): the
    same bits as built on every call, the overflow edge and subnormals included."""
    from lowprec.formats import rht

    g = torch.Generator().manual_seed(0)
    x = torch.randn(32, 256, generator=g) * 3.0
    x[0, :16] = torch.finfo(torch.float32).max * rht.rht_signs()  # the overflow edge
    x[1, :16] = 1e-40  # subnormal inputs
    fresh_fwd = (rht._butterflies(rht._tiles(x) * (rht.rht_signs() * 0.125)) * 2.0)
    fresh_inv = rht._butterflies(rht._tiles(x) * 0.125) * (rht.rht_signs() * 2.0)
    for got, want in ((rht.rht_forward(x), fresh_fwd.reshape(x.shape)),
                      (rht.rht_inverse(x), fresh_inv.reshape(x.shape))):
        assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    from lowprec.formats import casting
    casting._DEVICE_CONSTANTS.pop(("rht_fwd", torch.device("cpu")), None)
    with torch.inference_mode():  # a cache first filled here still serves autograd
        rht.rht_forward(torch.ones(16, 16))
    assert not casting._DEVICE_CONSTANTS[("rht_fwd", torch.device("cpu"))].is_inference()
    w = torch.ones(16, 16, requires_grad=True)
    rht.rht_forward(w).sum().backward()
    assert w.grad is not None
