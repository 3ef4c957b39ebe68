"""NVFP4 Triton kernels against the reference path, bit for bit (CUDA + Triton only).

Each case quantizes the same input through the kernels and through the pure-torch
reference on the GPU, with the same seed (stochastic rounding draws the same uniforms),
and compares every inner tensor byte for byte. tests/slow/test_fuzz_kernels_nvfp4.py runs a
much larger matrix of cases (``pytest -m slow``).
"""

import pytest
import torch
from helpers import GPU_ONLY

from lowprec.formats.nvfp4 import NVFP4Quantizer
from lowprec.formats.rht import rht_signs
from lowprec.kernels import reference_only

pytestmark = GPU_ONLY


def _input(shape, dtype, dist, seed):
    g = torch.Generator().manual_seed(seed)
    k = shape[-1]
    m = 1
    for s in shape[:-1]:
        m *= s
    x = torch.randn(m, k, generator=g)
    if dist == "wide":
        x = x * torch.exp(torch.randn(m, k, generator=g) * 4)
    elif dist == "special":
        x = x * 10
        x[0, :16] = 0.0
        if m >= 32 and k >= 32:
            x[16:32, 16:32] = 0.0
        if m >= 48 and k >= 48:
            z = torch.zeros(16, 3)
            z[torch.rand(16, 3, generator=g) < 0.5] = -0.0
            x[32:48, 33:36] = z
        x[min(2, m - 1), min(5, k - 1)] = float("nan")
        x[min(5, m - 1), min(20, k - 1)] = float("inf")
        x[min(17, m - 1), min(40, k - 1)] = -float("inf")
        x[min(3, m - 1), :] = -0.0
    elif dist == "saturate":
        x = x * (1e38 if dtype != torch.float16 else 2e4)
    return x.to(dtype).reshape(shape).cuda()


def _raw(t):
    return t.view(torch.uint8) if t.element_size() == 1 else t.view(torch.int32)


def _check(q, x, seed=0):
    torch.manual_seed(seed)
    qk = q.quantize(x)
    with reference_only():
        torch.manual_seed(seed)
        qr = q.quantize(x)
    for name in qr._inner:
        a, b = getattr(qk, name), getattr(qr, name)
        assert (a is None) == (b is None), name
        if a is not None:
            assert a.shape == b.shape and a.dtype == b.dtype, name
            assert torch.equal(_raw(a), _raw(b)), name
    return qk


@pytest.mark.parametrize("rht", [False, True])
@pytest.mark.parametrize("two_d", [False, True])
@pytest.mark.parametrize("sr", [False, True])
@pytest.mark.parametrize("dist", ["normal", "wide", "special"])
def test_both_usages_bf16(rht, two_d, sr, dist):
    q = NVFP4Quantizer(with_rht=rht, with_2d_quantization=two_d, stochastic_rounding=sr)
    _check(q, _input((3, 80, 144), torch.bfloat16, dist, 1), seed=3)
    _check(q, _input((1040, 272), torch.bfloat16, dist, 2), seed=4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("dist", ["normal", "special", "saturate"])
@pytest.mark.parametrize("rht,two_d,sr", [(True, False, False), (False, True, True)])
def test_input_dtypes(dtype, dist, rht, two_d, sr):
    q = NVFP4Quantizer(with_rht=rht, with_2d_quantization=two_d, stochastic_rounding=sr)
    _check(q, _input((256, 512), dtype, dist, 5), seed=6)


def _near_max_input(dtype, seed):
    """(256, 96) with magnitudes log-uniform in [1e37, dtype max], plus column tiles (16 rows,
    the RHT's tiles of the columnwise side) at the transform's extremes and subnormal ones."""
    g = torch.Generator().manual_seed(seed)
    top = torch.finfo(dtype).max
    lo, hi = torch.log(torch.tensor([1e37, top], dtype=torch.float64))
    x = torch.exp(lo + (hi - lo) * torch.rand(256, 96, generator=g, dtype=torch.float64))
    x = x * torch.where(torch.rand(256, 96, generator=g) < 0.5, -1.0, 1.0).to(torch.float64)
    s = rht_signs(torch.float64)
    x[0:16, 0] = s * (top / 4)         # RHT (top, 0, ..., 0)
    x[16:32, 1] = s * top              # (inf, 0, ..., 0): one bad block
    x[32:48, 2] = 0.0
    x[32, 2] = x[40, 2] = top          # the first stage's pair sums at 2 top
    # subnormals; in fp32 with the low bits set, where x / 8 rounds
    x[:, 3:6] = torch.randint(-2 ** 23, 2 ** 23, (256, 3), generator=g).to(torch.float64) \
        * 2.0 ** -149
    return x.to(dtype).cuda()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("two_d,sr", [(False, False), (False, True), (True, False)],
                         ids=["1d", "1d_sr", "2d"])
def test_rht_near_fp32_max(dtype, two_d, sr):
    # Butterflies that would overflow with the RHT's 1/4 applied last: kernels and reference
    # both keep them finite, with the same bits (global scale from the amax pass included).
    x = _near_max_input(dtype, 24)
    for rowwise in (True, False):
        q = NVFP4Quantizer(with_rht=True, with_2d_quantization=two_d, stochastic_rounding=sr)
        qt = _check(q.set_usage(rowwise=rowwise), x, seed=25)
        assert torch.isfinite(qt.columnwise_global).all() and qt.columnwise_global.item() > 0
        bad = torch.isnan(qt.columnwise_scale.to(torch.float32))
        assert bad[0 if two_d else 1, 1] and 0 < bad.float().mean() < 0.9
        if not two_d:
            assert not bad[0, 0] and not bad[2, 2] and not bad[3:6].any()
    _check(NVFP4Quantizer(with_rht=True), x.t().contiguous(), seed=26)


@pytest.mark.parametrize("shape", [(7, 32), (33, 48), (5, 3, 64)])
@pytest.mark.parametrize("sr", [False, True])
def test_rowwise_only_any_m(shape, sr):
    q = NVFP4Quantizer(with_rht=True, stochastic_rounding=sr).set_usage(columnwise=False)
    qt = _check(q, _input(shape, torch.bfloat16, "special", 7), seed=8)
    assert qt.columnwise_data is None


@pytest.mark.parametrize("shape", [(48, 40), (96, 10), (2, 64, 24)])
@pytest.mark.parametrize("sr", [False, True])
def test_columnwise_only_any_k(shape, sr):
    q = NVFP4Quantizer(with_rht=True, stochastic_rounding=sr).set_usage(rowwise=False)
    qt = _check(q, _input(shape, torch.bfloat16, "special", 9), seed=10)
    assert qt.rowwise_data is None


def test_non_contiguous():
    x = _input((256, 512), torch.bfloat16, "special", 11)
    q = NVFP4Quantizer(with_rht=True, stochastic_rounding=True)
    _check(q, x.t().contiguous().t(), seed=12)
    _check(q, torch.cat([x, x], dim=1)[:, :512], seed=13)


def test_large_multi_tile():
    x = _input((4096, 2048), torch.bfloat16, "wide", 14)
    _check(NVFP4Quantizer(with_rht=True, stochastic_rounding=True), x, seed=15)
    _check(NVFP4Quantizer(with_2d_quantization=True), x)


@pytest.mark.parametrize("two_d", [False, True])
def test_dequantize_unscaled_bf16(two_d):
    from lowprec.formats.nvfp4.launch import _dequantize_unscaled_torch, dequantize_unscaled_bf16
    x = _input((256, 512), torch.bfloat16, "special", 16)
    qt = NVFP4Quantizer(with_rht=True, with_2d_quantization=two_d).quantize(x)
    for usage in ("rowwise", "columnwise"):
        out, s = dequantize_unscaled_bf16(qt, usage)
        assert out.dtype == torch.bfloat16
        assert s is getattr(qt, f"{usage}_global")
        ref = _dequantize_unscaled_torch(getattr(qt, f"{usage}_data"),
                                         getattr(qt, f"{usage}_scale"), two_d)
        nan = torch.isnan(ref)
        assert torch.equal(torch.isnan(out), nan)
        assert torch.equal(out.view(torch.int16)[~nan], ref.view(torch.int16)[~nan])
        full = qt.dequantize_stored(usage)
        assert torch.equal((out.float() / s)[~nan], full[~nan])


def test_compile_fullgraph():
    from lowprec.formats.nvfp4.launch import quantize_2d
    x = _input((256, 128), torch.bfloat16, "normal", 17)

    def f(t):
        return quantize_2d(t, rowwise=True, columnwise=True, with_rht=True, two_d=False)
    eager = f(x)
    comp = torch.compile(f, fullgraph=True)(x)
    for k in eager:
        assert torch.equal(_raw(eager[k]), _raw(comp[k])), k


# ---- rounding decisions at the edges ------------------------------------------------------------
def _edge_values():
    """fp32 magnitudes where the E2M1 decisions are delicate: grid points, nearest-even
    midpoints and their fp32 neighbours, the 2**-23 cut of stochastic rounding below 1,
    values under every fp32 bit the kernels keep, and the saturation at 6."""
    pts = torch.tensor([0.0, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0,
                        5.0, 6.0])
    bits = pts.view(torch.int32)
    near = torch.cat([(bits + k).view(torch.float32) for k in (-2, -1, 1, 2)])
    tiny = torch.tensor([2.0 ** -23, 2.0 ** -23 * 1.5, 2.0 ** -24, 2.0 ** -25 * 3, 2.0 ** -30,
                         1e-38, 1e-44, 0.5 + 2.0 ** -24, 0.75 + 2.0 ** -24,
                         0.25 + 2.0 ** -25, 1.0 - 2.0 ** -24, 0.5 - 2.0 ** -25])
    return torch.cat([pts, near[near > 0], tiny])


@pytest.mark.parametrize("sr", [False, True])
@pytest.mark.parametrize("rht", [False, True])
def test_rounding_edges(sr, rht):
    # Blocks of 16 whose first element is 6: with a global amax of 6, S = 448 and d = 448,
    # so v = x * 448 / 448 lands on the edge values themselves (rowwise, without the RHT).
    # The last block leads with 4.4 instead: its d rounds down to 320 and its largest v
    # (6.16) saturates. Signs vary, -0.0 included.
    vals = _edge_values()
    n = (vals.numel() + 14) // 15 * 15
    vals = torch.cat([vals, vals[: n - vals.numel()]]).reshape(-1, 15)
    lead = torch.full((vals.shape[0], 1), 6.0)
    lead[-1] = 4.4
    blocks = torch.cat([lead, vals], dim=1)                                    # (B, 16)
    x = blocks.repeat(16, 4)[:, :64]                                           # (16 B, 64)
    x = x[: x.shape[0] // 16 * 16]
    sign = torch.where(torch.arange(x.numel()) % 3 == 1, -1.0, 1.0).reshape(x.shape)
    x = (x * sign).cuda()
    x[0, 5] = -0.0
    for seed in range(4):
        _check(NVFP4Quantizer(with_rht=rht, stochastic_rounding=sr), x, seed=seed)
        _check(NVFP4Quantizer(with_rht=rht, stochastic_rounding=sr), x.t().contiguous(),
               seed=seed)


# ---- stochastic-rounding uniforms: in-register hash vs draws.uniforms_at -------------------------
def _probe_kernel():
    import triton
    import triton.language as tl

    from lowprec.formats.nvfp4.triton_kernels import _sr_uniform

    @triton.jit
    def probe(key_ptr, idx_ptr, out_ptr, N, IDX64: tl.constexpr, B: tl.constexpr):
        o = tl.program_id(0) * B + tl.arange(0, B)
        m = o < N
        idx = tl.load(idx_ptr + o, mask=m, other=0)
        if not IDX64:
            idx = idx.to(tl.int32)
        tl.store(out_ptr + o, _sr_uniform(key_ptr, idx, IDX64), mask=m)

    return probe


@pytest.mark.parametrize("idx64", [False, True])
def test_sr_uniform_matches_torch_definition(idx64):
    import triton

    from lowprec.formats.nvfp4.draws import uniforms_at
    g = torch.Generator().manual_seed(21)
    top = (1 << 62) if idx64 else (1 << 31) - 1
    idx = torch.cat([torch.arange(0, 4096), torch.randint(0, top, (100000,), generator=g),
                     torch.tensor([top - 1, (1 << 32) + 1 if idx64 else 3])]).cuda()
    for key in ([0, 0], [0xFFFFFFFF, 0xFFFFFFFF], [0x9E3779B9, 0x12345]):
        key = torch.tensor(key, device="cuda")
        out = torch.empty(idx.numel(), dtype=torch.float32, device="cuda")
        _probe_kernel()[(triton.cdiv(idx.numel(), 512),)](key, idx, out, idx.numel(),
                                                           IDX64=idx64, B=512)
        assert torch.equal(out, uniforms_at(key, idx))


def test_sr_with_64bit_offsets(monkeypatch):
    # The 64-bit index path normally needs > 2**31 elements; force it on a small input.
    from lowprec.formats.nvfp4 import launch
    monkeypatch.setattr(launch, "_idx64", lambda rows, cols, base=0: True)
    x = _input((272, 160), torch.bfloat16, "wide", 22)
    for two_d in (False, True):
        _check(NVFP4Quantizer(with_rht=not two_d, with_2d_quantization=two_d,
                              stochastic_rounding=True), x, seed=23)

