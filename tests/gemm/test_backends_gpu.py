"""GPU GEMM backends against lowprec's exact fp32 emulation (CUDA only; skipped elsewhere).

Every pair runs through ``lowprec.gemm.gemm`` (which picks the GPU backend) and through
``lowprec.gemm.emulated_fp32.emulated_fp32_run`` (both operands dequantized in fp32,
fp32 matmul, TF32 off) on the same quantized operands. The check is the normwise relative error
``||out - ref|| / ||ref||`` with ``ref`` the emulation's fp32 result:

* bf16 tensor-core emulation (MXFP8, NVFP4, mixed pairs), fp32 output: <= 1e-5
  (only the summation order differs: exact bf16 products, fp32 accumulation);
* cuBLAS FP8 (per-tensor, block), fp32 output: <= 5e-4 (Hopper's FP8 tensor cores
  accumulate with fewer than fp32's bits inside each MMA, even with fast accumulation
  off: measured 1.5e-4 to 2.0e-4 on an H200, torch 2.11 / CUDA 13);
* any backend, bf16/fp16 output: <= 4e-3 (one rounding to 8 significant bits, 2**-9
  per element, on top of the above).

NaN blocks must give NaN exactly where the emulation does. Each case also asserts which
backend ran, so a silent fall-back to the emulation shows up as a failure.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch

import lowprec
import lowprec.gemm.dispatch as G
from lowprec import (
    Float8BlockQuantizer,
    Float8CurrentScalingQuantizer,
    IdentityQuantizer,
    MXFP8Quantizer,
    NVFP4Quantizer,
)
from lowprec.gemm.emulated_fp32 import emulated_fp32_run

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
BOUND_EMU_FP32 = 1e-5
BOUND_FP8_FP32 = 5e-4
BOUND_16BIT = 4e-3
SHAPES = [(256, 512, 384), (384, 1024, 256), (1024, 4096, 768)]

#: (case, backend, out dtype, relative error), filled by the tests, printed at the end.
REPORT: list = []


def _operand(q, rows, contraction, usage, gen, dist="normal", device="cuda"):
    """A quantized tensor whose mat(., usage) is (rows, contraction)."""
    shape = (rows, contraction) if usage == "rowwise" else (contraction, rows)
    if dist == "normal":
        x = torch.randn(shape, generator=gen, device=device)
    elif dist == "wide":  # magnitudes spread over many binades
        x = torch.randn(shape, generator=gen, device=device) * torch.exp2(
            torch.randint(-12, 12, shape, generator=gen, device=device).float())
    else:
        raise ValueError(dist)
    x = x.to(torch.bfloat16)
    return x if q is None else q.quantize(x)


def _rel(out, ref):
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def _bound(backend, out_dtype):
    if out_dtype != torch.float32:
        return BOUND_16BIT
    return BOUND_FP8_FP32 if backend.startswith("cublas") else BOUND_EMU_FP32


def _check(case, a, au, b, bu, out_dtype, *, backend, bias=None):
    chosen = G.select_route(a, au, b, bu, out_dtype, bias)
    assert chosen == backend, f"{case}: expected backend {backend}, got {chosen}"
    out = G.gemm(a, au, b, bu, out_dtype=out_dtype, bias=bias)
    ref = emulated_fp32_run(a, au, b, bu, torch.float32, None if bias is None else bias.float())
    torch.cuda.synchronize()
    assert out.dtype == out_dtype and out.shape == ref.shape
    nan_ref = torch.isnan(ref)
    assert torch.equal(torch.isnan(out), nan_ref), f"{case}: NaN pattern differs"
    if nan_ref.any():
        out = torch.where(nan_ref, torch.zeros_like(out), out)
        ref = torch.where(nan_ref, torch.zeros_like(ref), ref)
    rel = _rel(out, ref)
    # after a cuBLAS refusal the block backend hands over to the emulation: record what ran
    now = G.select_route(a, au, b, bu, out_dtype, bias)
    ran = chosen if now == chosen else f"{now} ({chosen} refused)"
    REPORT.append((case, ran, str(out_dtype).replace("torch.", ""), rel))
    bound = _bound(chosen, out_dtype)
    assert rel <= bound, f"{case}: relative error {rel:.3g} > {bound:g}"
    return rel


@pytest.fixture(autouse=True)
def _no_tf32():
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = saved


USAGE_PAIRS = [("rowwise", "rowwise"), ("rowwise", "columnwise"), ("columnwise", "columnwise")]


# ---- per-tensor FP8 through cuBLAS --------------------------------------------------------
@pytest.mark.parametrize("dtypes", [(E4M3, E4M3), (E4M3, E5M2), (E5M2, E4M3)])
@pytest.mark.parametrize("usages", USAGE_PAIRS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_tensorwise(dtypes, usages, shape, out_dtype):
    gen = torch.Generator(device="cuda").manual_seed(hash((dtypes, usages, shape)) % 2**31)
    m, k, n = shape
    a = _operand(Float8CurrentScalingQuantizer(dtypes[0]), m, k, usages[0], gen)
    b = _operand(Float8CurrentScalingQuantizer(dtypes[1]), n, k, usages[1], gen, dist="wide")
    _check(f"fp8 {dtypes} {usages} {shape}", a, usages[0], b, usages[1], out_dtype,
           backend="cublas_fp8")


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_tensorwise_bias(out_dtype):
    gen = torch.Generator(device="cuda").manual_seed(1)
    a = _operand(Float8CurrentScalingQuantizer(E4M3), 272, 512, "rowwise", gen)
    b = _operand(Float8CurrentScalingQuantizer(E4M3), 384, 512, "rowwise", gen)
    bias = torch.randn(384, device="cuda", generator=gen).to(out_dtype)
    _check("fp8 bias", a, "rowwise", b, "rowwise", out_dtype, backend="cublas_fp8", bias=bias)


def test_tensorwise_nan():
    gen = torch.Generator(device="cuda").manual_seed(2)
    x = torch.randn(256, 512, device="cuda", generator=gen)
    x[3, 7] = float("nan")
    a = Float8CurrentScalingQuantizer(E4M3).quantize(x)
    b = _operand(Float8CurrentScalingQuantizer(E4M3), 128, 512, "rowwise", gen)
    out = G.gemm(a, "rowwise", b, "rowwise", out_dtype=torch.float32)
    assert torch.isnan(out).all()


def test_tensorwise_unaligned_falls_through():
    gen = torch.Generator(device="cuda").manual_seed(3)
    a = _operand(Float8CurrentScalingQuantizer(E4M3), 64, 40, "rowwise", gen)  # K % 16 != 0
    b = _operand(Float8CurrentScalingQuantizer(E4M3), 64, 40, "rowwise", gen)
    _check("fp8 K=40", a, "rowwise", b, "rowwise", torch.float32, backend="exact_bf16")


# ---- block FP8 ----------------------------------------------------------------------------
BLOCK_PAIRS = [(1, 2), (2, 1), (1, 1)]


@pytest.mark.parametrize("dims", BLOCK_PAIRS)
@pytest.mark.parametrize("usages", USAGE_PAIRS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_blockwise_e4m3(dims, usages, shape, out_dtype):
    gen = torch.Generator(device="cuda").manual_seed(hash((dims, usages, shape)) % 2**31)
    m, k, n = shape
    a = _operand(Float8BlockQuantizer(E4M3, block_scaling_dim=dims[0]), m, k, usages[0], gen,
                 dist="wide")
    b = _operand(Float8BlockQuantizer(E4M3, block_scaling_dim=dims[1]), n, k, usages[1], gen,
                 dist="wide")
    _check(f"block {dims} {usages} {shape}", a, usages[0], b, usages[1], out_dtype,
           backend="cublas_fp8_block")


@pytest.mark.parametrize("dtypes", [(E4M3, E5M2), (E5M2, E4M3)])
@pytest.mark.parametrize("dims", BLOCK_PAIRS)
def test_blockwise_e5m2_mixed(dtypes, dims):
    """cuBLAS may or may not take E5M2 blocks: either way the result must match."""
    gen = torch.Generator(device="cuda").manual_seed(5)
    a = _operand(Float8BlockQuantizer(dtypes[0], block_scaling_dim=dims[0]), 512, 1024,
                 "rowwise", gen)
    b = _operand(Float8BlockQuantizer(dtypes[1], block_scaling_dim=dims[1]), 256, 1024,
                 "rowwise", gen)
    chosen = G.select_route(a, "rowwise", b, "rowwise", torch.float32)
    out = G.gemm(a, "rowwise", b, "rowwise", out_dtype=torch.float32)
    ref = emulated_fp32_run(a, "rowwise", b, "rowwise", torch.float32, None)
    now = G.select_route(a, "rowwise", b, "rowwise", torch.float32)
    ran = chosen if now == chosen else f"{now} ({chosen} refused)"
    rel = _rel(out, ref)
    REPORT.append((f"block {dtypes} {dims}", ran, "float32", rel))
    assert rel <= BOUND_FP8_FP32


def test_blockwise_2x2_and_unaligned_go_to_bf16():
    gen = torch.Generator(device="cuda").manual_seed(6)
    a = _operand(Float8BlockQuantizer(E4M3, block_scaling_dim=2), 256, 512, "rowwise", gen)
    b = _operand(Float8BlockQuantizer(E4M3, block_scaling_dim=2), 256, 512, "rowwise", gen)
    _check("block 2x2", a, "rowwise", b, "rowwise", torch.float32, backend="exact_bf16")
    a = _operand(Float8BlockQuantizer(E4M3, block_scaling_dim=1), 256, 384, "rowwise", gen)
    b = _operand(Float8BlockQuantizer(E4M3, block_scaling_dim=2), 256, 384, "rowwise", gen)
    _check("block K/128=3", a, "rowwise", b, "rowwise", torch.float32, backend="exact_bf16")


def test_blockwise_non_pow2_goes_to_fp32():
    gen = torch.Generator(device="cuda").manual_seed(7)
    q = Float8BlockQuantizer(E5M2, block_scaling_dim=1, force_pow_2_scales=False)
    a = _operand(q, 256, 512, "rowwise", gen)
    b = _operand(Float8BlockQuantizer(E5M2, block_scaling_dim=1, force_pow_2_scales=False),
                 256, 512, "rowwise", gen)
    _check("block e5m2 non-pow2", a, "rowwise", b, "rowwise", torch.float32,
           backend="emulated")


def test_blockwise_nan_block():
    gen = torch.Generator(device="cuda").manual_seed(8)
    x = torch.randn(256, 512, device="cuda", generator=gen)
    x[5, 200] = float("inf")
    a = Float8BlockQuantizer(E4M3, block_scaling_dim=1).quantize(x)
    b = _operand(Float8BlockQuantizer(E4M3, block_scaling_dim=2), 256, 512, "rowwise", gen)
    _check("block NaN", a, "rowwise", b, "rowwise", torch.float32, backend="cublas_fp8_block")


# ---- MXFP8 / NVFP4 / mixed through the bf16 emulation ------------------------------------
def _mx(dtype=E4M3, two_d=False):
    return MXFP8Quantizer(dtype, with_2d_quantization=two_d)


@pytest.mark.parametrize("qa,qb", [
    ("mx", "mx"), ("mx2d", "mx"), ("mx_e5m2", "mx"), ("nv", "nv"), ("nv", "nv2d"),
    ("mx", "nv"), ("fp8", "mx"), ("bf16", "mx"), ("nv", "bf16"), ("block1", "mx"),
    ("fp8_e5m2", "nv"),
])
@pytest.mark.parametrize("usages", USAGE_PAIRS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_exact_bf16(qa, qb, usages, shape, out_dtype):
    makers = {
        "mx": lambda: _mx(), "mx2d": lambda: _mx(two_d=True), "mx_e5m2": lambda: _mx(E5M2),
        "nv": lambda: NVFP4Quantizer(), "nv2d": lambda: NVFP4Quantizer(with_2d_quantization=True),
        "fp8": lambda: Float8CurrentScalingQuantizer(E4M3),
        "fp8_e5m2": lambda: Float8CurrentScalingQuantizer(E5M2),
        "bf16": lambda: IdentityQuantizer(),
        "block1": lambda: Float8BlockQuantizer(E4M3, block_scaling_dim=1),
    }
    gen = torch.Generator(device="cuda").manual_seed(hash((qa, qb, usages, shape)) % 2**31)
    m, k, n = shape
    a = _operand(makers[qa](), m, k, usages[0], gen, dist="wide")
    b = _operand(makers[qb](), n, k, usages[1], gen)
    _check(f"{qa}x{qb} {usages} {shape}", a, usages[0], b, usages[1], out_dtype,
           backend="exact_bf16")


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_emulated_bias(out_dtype):
    gen = torch.Generator(device="cuda").manual_seed(9)
    for qa, qb in ((_mx(), _mx()), (NVFP4Quantizer(), NVFP4Quantizer())):
        a = _operand(qa, 512, 1024, "rowwise", gen)
        b = _operand(qb, 384, 1024, "rowwise", gen)
        bias = torch.randn(384, device="cuda", generator=gen).to(out_dtype)
        _check(f"{type(qa).__name__} bias", a, "rowwise", b, "rowwise", out_dtype,
               backend="exact_bf16", bias=bias)


def test_nvfp4_rht_both_sides_cancel():
    gen = torch.Generator(device="cuda").manual_seed(10)
    q = NVFP4Quantizer(with_rht=True)
    a = _operand(q, 512, 2048, "columnwise", gen)
    b = _operand(NVFP4Quantizer(with_rht=True, stochastic_rounding=True), 384, 2048,
                 "columnwise", gen, dist="wide")
    _check("nvfp4 rht x rht", a, "columnwise", b, "columnwise", torch.float32,
           backend="exact_bf16")


def test_nvfp4_rht_one_side_goes_to_fp32():
    gen = torch.Generator(device="cuda").manual_seed(11)
    a = _operand(NVFP4Quantizer(with_rht=True), 512, 2048, "columnwise", gen)
    b = _operand(_mx(), 384, 2048, "columnwise", gen)
    _check("nvfp4 rht x mx", a, "columnwise", b, "columnwise", torch.float32,
           backend="emulated")


def test_emulated_nan_and_tiny_blocks():
    gen = torch.Generator(device="cuda").manual_seed(12)
    x = torch.randn(256, 512, device="cuda", generator=gen)
    x[7, 40] = float("nan")            # one MXFP8 block NaN
    x[9, 64:96] *= 1e-30                # a block with a tiny scale
    a = _mx().quantize(x)
    b = _operand(_mx(), 128, 512, "rowwise", gen)
    _check("mx NaN/tiny", a, "rowwise", b, "rowwise", torch.float32, backend="exact_bf16")
    xn = torch.randn(256, 512, device="cuda", generator=gen)
    xn[3, 16:32] = float("inf")
    a = NVFP4Quantizer().quantize(xn)
    b = _operand(NVFP4Quantizer(), 128, 512, "rowwise", gen)
    _check("nv NaN", a, "rowwise", b, "rowwise", torch.float32, backend="exact_bf16")


def test_mxfp8_dequant_kernel_matches_torch():
    from lowprec.gemm import kernels
    gen = torch.Generator(device="cuda").manual_seed(13)
    for two_d in (False, True):
        x = torch.randn(320, 640, device="cuda", generator=gen) * 1e3
        x[0, :32] = 0
        x[1, :32] = float("nan")
        x[2, 32:64] *= 1e-36
        t = _mx(two_d=two_d).quantize(x)
        br = 32 if two_d else 1
        for usage in ("rowwise", "columnwise"):
            d, s = getattr(t, f"{usage}_data"), getattr(t, f"{usage}_scale")
            got = kernels.mxfp8_dequantize_bf16(d, s, br)
            want = kernels.mxfp8_dequantize_bf16_torch(d, s, br)
            assert torch.equal(torch.isnan(got), torch.isnan(want))
            both = ~torch.isnan(want)
            assert torch.equal(got[both], want[both])
            ref32 = t._dequantize_2d(usage)
            ok = ~torch.isnan(ref32) & ((ref32.abs() >= 2.0 ** -126) | (ref32 == 0))
            assert torch.equal(got.float()[ok], ref32[ok])


def test_epilogue_kernel_matches_torch():
    from lowprec.gemm import kernels
    gen = torch.Generator(device="cuda").manual_seed(14)
    acc = torch.randn(300, 1000, device="cuda", generator=gen) * 1e3
    da = torch.rand(1, device="cuda", generator=gen) + 0.3
    db = torch.rand(1, device="cuda", generator=gen) * 1e-3
    for out_dtype in (torch.float32, torch.bfloat16, torch.float16):
        bias = torch.randn(1000, device="cuda", generator=gen).to(out_dtype)
        for args in ((da, db, bias), (da, None, None), (None, None, bias)):
            got = kernels.scale_bias_epilogue(acc, *args, out_dtype)
            want = kernels.scale_bias_epilogue_torch(acc, *args, out_dtype)
            assert torch.equal(got, want), (out_dtype, [a is None for a in args])


# ---- whole modules: GPU backends vs the fp32 emulation -----------------------------------
def _emulation_only():
    return G.use_backends(("plain", "emulated"))


RECIPES = {name: functools.partial(lowprec.recipe.Recipe.from_name, name)
           for name in ("current", "delayed", "block", "mxfp8", "nvfp4")}


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_linear_matches_emulation(recipe):
    torch.manual_seed(0)
    template = lowprec.Linear(1024, 768, params_dtype=torch.bfloat16, device="cuda")
    x0 = torch.randn(512, 1024, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(512, 768, device="cuda", dtype=torch.bfloat16)

    def run():
        torch.manual_seed(1)  # same stochastic-rounding draws in both runs
        x = x0.clone().requires_grad_(True)
        lin = copy.deepcopy(template)  # fresh recipe state (delayed scaling) for each run
        with lowprec.autocast(recipe=RECIPES[recipe]()):
            y = lin(x)
        y.backward(dy)
        return y.float(), x.grad.float(), lin.weight.grad.float()

    fast = run()
    with _emulation_only():
        slow = run()
    for name, f, s in zip(("y", "dx", "dw"), fast, slow):
        rel = _rel(f, s)
        REPORT.append((f"Linear {recipe} {name}", "auto", "bfloat16", rel))
        assert rel <= BOUND_16BIT, f"{recipe} {name}: {rel:.3g}"


def test_zz_report():
    """Prints the error table (run last)."""
    if not REPORT:
        pytest.skip("nothing recorded")
    worst = {}
    for case, backend, dt, rel in REPORT:
        key = (case.split(" ")[0], backend, dt)
        worst[key] = max(worst.get(key, 0.0), rel)
    print("\nworst normwise relative error per (kind, backend, out dtype):")
    for (kind, backend, dt), rel in sorted(worst.items()):
        print(f"  {kind:24s} {backend:32s} {dt:9s} {rel:.3e}")
