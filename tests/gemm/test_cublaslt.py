"""The cuBLASLt GEMM with a device-side output scale (``lowprec.gemm.cublaslt``).

Against the fp32-output path (fp32 GEMM, then ``(acc / div_a) / div_b`` in a kernel), which
runs where cuBLASLt does not, on the same bf16 operands:

* fp32 output: normwise relative difference <= 1e-6 on operands whose fp32 sums are exact
  (few significant bits): only alpha, one rounded factor instead of two divisions, differs
  (a few fp32 ulps per element, ~1e-7 normwise). On random bf16 values with K = 16384 the
  summation orders may differ too (another cuBLAS algorithm, split-K): <= 1e-5, the bound
  of tests/gemm/test_backends_gpu.py for the same situation (~sqrt(K) * 2**-24 ~ 8e-6 worst).
* bf16 output (cuBLASLt has no bf16 x bf16 -> fp16 GEMM; that output takes the fp32-output
  path): each element equals that path's or is one unit in the last place
  away (a few fp32 ulps can only move the final rounding across one boundary), and at
  least 99% are identical (a boundary is crossed with probability ~2**-15 per element).

The alpha kernel is compared bit for bit with its fp64 torch definition (zero, negative,
infinite and NaN divisors included), and the GPU cases assert that cuBLASLt actually ran (a
silent fall-back would pass the value checks). The CPU test checks the torch definition of
alpha against Python's fp64 arithmetic.
"""

from __future__ import annotations

import pytest
import torch

import lowprec
import lowprec.gemm
from lowprec import NVFP4Quantizer
from lowprec.gemm import cublaslt, kernels

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
F32_MAX = torch.finfo(torch.float32).max


def test_alpha_torch_definition_cpu():
    a = torch.tensor([3.0e-3, 1.0, 7.0e30, 2.0e-30, 3.0e38])
    b = torch.tensor([5.0e2, 0.75, 9.0e30, 1.0e-30, 3.0e38])
    for i in range(a.numel()):
        got = kernels.gemm_alpha_torch(a[i:i + 1], b[i:i + 1])
        exact = 1.0 / (float(a[i]) * float(b[i]))   # Python floats are fp64
        want = min(torch.tensor(exact, dtype=torch.float64).float().item(), F32_MAX)
        assert got.item() == want, (a[i], b[i])
    assert kernels.gemm_alpha_torch(None, b[:1]).item() == torch.tensor(1 / 5.0e2).float().item()


@pytest.fixture
def lt_calls(monkeypatch):
    """Counts cuBLASLt launches that found an algorithm."""
    calls = []
    real = cublaslt.mm_scaled

    def spy(*args):
        out = real(*args)
        calls.append(out is not None)
        return out
    monkeypatch.setattr(cublaslt, "mm_scaled", spy)
    return calls


def _old_path(am, bm, div_a, div_b, bias, out_dtype):
    acc = torch.mm(am, bm.t(), out_dtype=torch.float32)
    return kernels.scale_bias_epilogue(acc, div_a, div_b, bias, out_dtype)


def _exactish_bf16(rows, cols, gen):
    """bf16 values with few significant bits (like the exact NVFP4 products) and a spread
    of magnitudes."""
    v = torch.randint(-12, 13, (rows, cols), generator=gen, device="cuda").float() * 0.25
    return (v * torch.exp2(torch.randint(-6, 6, (rows, 1), generator=gen,
                                         device="cuda").float())).to(torch.bfloat16)


def _operands(seed: int, m: int, n: int, k: int, div_a: float, div_b: float):
    """(a (m, k), b (n, k), div_a, div_b) on the GPU: exactish bf16 operands, (1,) divisors."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    am, bm = _exactish_bf16(m, k, gen), _exactish_bf16(n, k, gen)
    return am, bm, torch.tensor([div_a], device="cuda"), torch.tensor([div_b], device="cuda")


def _assert_close(got, want, out_dtype, fp32_bound=1e-6):
    assert got.dtype == out_dtype and got.shape == want.shape
    if out_dtype == torch.float32:
        rel = ((got.double() - want.double()).norm() / want.double().norm()).item()
        assert rel <= fp32_bound, rel
        return
    g, w = got.float(), want.float()
    same = g == w
    spacing = torch.where(w == 0, torch.zeros_like(w),
                          torch.exp2(torch.floor(torch.log2(w.abs())))
                          * torch.finfo(out_dtype).eps)
    assert bool(((g - w).abs() <= spacing).all()), "more than one ulp apart"
    assert same.float().mean().item() >= 0.99, same.float().mean().item()


@gpu
def test_library_loads():
    assert cublaslt.available(), "libcublasLt not found in the process or beside torch"


@gpu
@pytest.mark.parametrize("shape", [(256, 512, 384), (333, 1024, 77), (1, 64, 8),
                                   (4096, 4096, 1024)])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("divs", ["both", "a", "none"])
def test_matches_fp32_epilogue_path(shape, out_dtype, divs, lt_calls):
    m, k, n = shape
    gen = torch.Generator(device="cuda").manual_seed(m * 7 + k + n)
    am, bm = _exactish_bf16(m, k, gen), _exactish_bf16(n, k, gen)
    div_a = torch.rand(1, device="cuda", generator=gen) * 1e3 + 0.5 if divs != "none" else None
    div_b = torch.rand(1, device="cuda", generator=gen) * 1e-2 + 1e-4 if divs == "both" else None
    assert cublaslt.shape_ok(am, bm, out_dtype)
    got = kernels.scaled_mm_lt(am, bm, div_a, div_b, out_dtype)
    assert lt_calls == [True]
    _assert_close(got, _old_path(am, bm, div_a, div_b, None, out_dtype), out_dtype)


@gpu
def test_alpha_kernel_matches_torch():
    gen = torch.Generator(device="cuda").manual_seed(3)
    vals = torch.cat([torch.rand(64, device="cuda", generator=gen) * 1e3,
                      torch.exp2(torch.randint(-120, 120, (64,), device="cuda",
                                               generator=gen).float()) * 1.37,
                      torch.tensor([F32_MAX, 1e-38, 1.0, 3.0, 0.0, -0.0, -2.5, float("inf"),
                                    float("nan"), 1e-45], device="cuda")])
    for i in range(0, vals.numel() - 1):
        a, b = vals[i:i + 1], vals[i + 1:i + 2]
        for da, db in ((a, b), (a, None), (None, b)):
            got = kernels.gemm_alpha(da, db)
            want = kernels.gemm_alpha_torch(da, db)
            assert got.shape == want.shape == (1,)
            # bit patterns (-0 and 0 differ), except that any NaN matches any NaN (the
            # payload of inf * NaN is not specified)
            both_nan = bool(got.isnan().all() and want.isnan().all())
            assert both_nan or torch.equal(got.view(torch.int32), want.view(torch.int32)), \
                (da, db, got, want)


@gpu
def test_out_of_range_alpha_keeps_zero_rows(lt_calls):
    # div_a * div_b underflows fp32: alpha is clamped, so a zero row gives 0, not NaN
    gen = torch.Generator(device="cuda").manual_seed(4)
    am, bm = _exactish_bf16(128, 256, gen), _exactish_bf16(64, 256, gen)
    am[5] = 0
    tiny = torch.tensor([1e-30], device="cuda")
    out = kernels.scaled_mm_lt(am, bm, tiny, tiny, torch.float32)
    assert lt_calls == [True]
    assert bool((out[5] == 0).all())
    assert not bool(out.isnan().any())


@gpu
def test_unaligned_and_strided_operands(lt_calls):
    gen = torch.Generator(device="cuda").manual_seed(5)
    big = _exactish_bf16(300, 1032, gen)
    am = big[1:, 8:1032 - 8]          # 16-byte aligned start, row pitch 1032 elements
    bm = _exactish_bf16(96, 1016, gen)
    div = torch.tensor([3.0], device="cuda")
    assert cublaslt.shape_ok(am, bm, torch.bfloat16)
    got = kernels.scaled_mm_lt(am, bm, div, None, torch.bfloat16)
    _assert_close(got, _old_path(am, bm, div, None, None, torch.bfloat16), torch.bfloat16)
    # a 2-byte aligned operand: an algorithm for it or the fp32-output path; same values
    store = _exactish_bf16(96 * 1016 + 1, 1, gen).reshape(-1)
    bm_odd = store[1:].reshape(96, 1016)
    got = kernels.scaled_mm_lt(am, bm_odd, div, None, torch.bfloat16)
    _assert_close(got, _old_path(am, bm_odd, div, None, None, torch.bfloat16), torch.bfloat16)
    assert lt_calls[0] is True and len(lt_calls) == 2
    # fp16 output (cuBLASLt has no bf16 x bf16 -> fp16 GEMM) and a row pitch that is not a
    # multiple of 8 elements: refused before any launch
    assert not cublaslt.shape_ok(am, bm, torch.float16)
    odd = _exactish_bf16(64, 1001, gen)[:, :1000]
    assert not cublaslt.shape_ok(odd, bm[:, :1000], torch.bfloat16)


def test_strides_ok_cpu():
    store = torch.zeros(64, 1001, dtype=torch.bfloat16)
    rows = torch.zeros(32, 1000, dtype=torch.bfloat16)
    assert cublaslt.strides_ok(rows, rows[:16])
    assert not cublaslt.strides_ok(store[:, :1000], rows)       # row pitch 1001 elements
    assert not cublaslt.strides_ok(rows, rows.t().contiguous().t()[:16])  # columns contiguous
    assert not cublaslt.strides_ok(rows[:1].expand(32, 1000), rows)       # overlapping rows


@gpu
def test_in_graph_op_takes_the_strides_cublaslt_refuses(lt_calls):
    # a graph's call leaves the strides to the op (a traced backward must not read them):
    # where cuBLASLt takes them, eager's bits; where not, eager's fp32 path's, without a launch
    am, bm, da, db = _operands(8, 64, 96, 1000, 7.0, 0.01)
    workspace = am.new_empty(cublaslt.WORKSPACE_BYTES, dtype=torch.uint8)
    got = kernels.scaled_mm_lt_in_graph(am, bm, da, db, workspace, torch.bfloat16)
    assert lt_calls == [True]
    assert torch.equal(got, kernels.scaled_mm_lt(am, bm, da, db, torch.bfloat16))
    lt_calls.clear()
    gen = torch.Generator(device="cuda").manual_seed(9)
    odd = _exactish_bf16(64, 1001, gen)[:, :1000]
    assert cublaslt.shape_ok(odd, bm, torch.bfloat16, strides=False)
    assert not cublaslt.shape_ok(odd, bm, torch.bfloat16)
    got = kernels.scaled_mm_lt_in_graph(odd, bm, da, db, workspace, torch.bfloat16)
    assert lt_calls == []
    assert torch.equal(got, _old_path(odd, bm, da, db, None, torch.bfloat16))


@gpu
def test_under_compile_and_cuda_graph(lt_calls):
    am, bm, da, db = _operands(6, 512, 256, 768, 7.0, 0.01)
    eager = kernels.scaled_mm_lt(am, bm, da, db, torch.bfloat16)
    compiled = torch.compile(lambda a, b: kernels.scaled_mm_lt(a, b, da, db, torch.bfloat16),
                             fullgraph=True)
    assert torch.equal(compiled(am, bm), eager)
    assert lt_calls and all(lt_calls)
    # captured first on a fresh stream: no workspace, alpha and beta written inside the graph
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        captured = kernels.scaled_mm_lt(am, bm, da, db, torch.bfloat16)
    # the replay reads the live operands and divisors
    am.copy_(_exactish_bf16(512, 768, torch.Generator(device="cuda").manual_seed(7)))
    da.fill_(3.0)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, kernels.scaled_mm_lt(am, bm, da, db, torch.bfloat16))
    _assert_close(captured, _old_path(am, bm, da, db, None, torch.bfloat16), torch.bfloat16)


@gpu
@pytest.mark.parametrize("bias", [False, True])
def test_nvfp4_linear_gemms(bias, lt_calls):
    """All three GEMMs of an NVFP4 Linear go through cuBLASLt; with a bias, fprop keeps the
    fp32-output path (cuBLASLt's bias epilogue rounds differently)."""
    torch.manual_seed(0)
    lin = lowprec.Linear(512, 384, bias=bias, params_dtype=torch.bfloat16, device="cuda")
    x = torch.randn(256, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    with lowprec.autocast(recipe=lowprec.NVFP4BlockScaling()):
        y = lin(x)
    y.backward(torch.randn_like(y))
    assert lt_calls == ([True, True] if bias else [True, True, True])


@gpu
def test_disabled_takes_the_fp32_output_path(lt_calls):
    gen = torch.Generator(device="cuda").manual_seed(7)
    am, bm = _exactish_bf16(64, 128, gen), _exactish_bf16(32, 128, gen)
    with cublaslt.disabled():
        assert not cublaslt.available()
        a = NVFP4Quantizer().quantize(am.float())
        b = NVFP4Quantizer().quantize(bm.float())
        lowprec.gemm.gemm(a, "rowwise", b, "rowwise", out_dtype=torch.bfloat16)
    assert lt_calls == [] and cublaslt.available()


@gpu
def test_plan_cache_evicts_and_rebuilds(monkeypatch, lt_calls):
    monkeypatch.setattr(cublaslt, "MAX_PLANS", 2)
    destroyed = []
    real_destroy = cublaslt._Plan.destroy
    monkeypatch.setattr(cublaslt._Plan, "destroy",
                        lambda self: (destroyed.append(self), real_destroy(self)))
    gen = torch.Generator(device="cuda").manual_seed(8)
    div = torch.tensor([5.0], device="cuda")
    bm = _exactish_bf16(64, 256, gen)
    for _ in range(2):
        for m in (40, 48, 56, 72):   # four shapes through a cache of two
            am = _exactish_bf16(m, 256, gen)
            got = kernels.scaled_mm_lt(am, bm, div, None, torch.bfloat16)
            assert len(cublaslt._State.plans) <= 2
            _assert_close(got, _old_path(am, bm, div, None, None, torch.bfloat16),
                          torch.bfloat16)
    # every call missed (each shape was evicted before it came back) and rebuilt its plan
    assert len(lt_calls) == 8 and all(lt_calls) and len(destroyed) >= 6


@gpu
def test_long_contraction_random_values(lt_calls):
    """Small output, long K (where split-K algorithms are chosen) and values whose fp32
    sums are inexact: a reduction through bf16 partial sums would break the bounds."""
    gen = torch.Generator(device="cuda").manual_seed(9)
    am = torch.randn(64, 16384, device="cuda", generator=gen).to(torch.bfloat16)
    bm = torch.randn(96, 16384, device="cuda", generator=gen).to(torch.bfloat16)
    div = torch.tensor([0.37], device="cuda")
    for out_dtype in (torch.bfloat16, torch.float32):
        got = kernels.scaled_mm_lt(am, bm, div, div, out_dtype)
        _assert_close(got, _old_path(am, bm, div, div, None, out_dtype), out_dtype,
                      fp32_bound=1e-5)
    assert lt_calls == [True, True]


@gpu
def test_out_is_written_in_place(lt_calls):
    am, bm, div_a, div_b = _operands(11, 384, 256, 512, 3.0, 0.125)
    want = kernels.scaled_mm_lt(am, bm, div_a, div_b, torch.bfloat16)
    big = torch.full((640, 256), 7.0, dtype=torch.bfloat16, device="cuda")
    got = kernels.scaled_mm_lt(am, bm, div_a, div_b, torch.bfloat16, out=big[128:512])
    assert got.data_ptr() == big[128:512].data_ptr() and lt_calls == [True, True]
    assert torch.equal(big[128:512], want)
    assert bool((big[:128] == 7).all()) and bool((big[512:] == 7).all())
    with pytest.raises(ValueError, match="float32"):
        kernels.scaled_mm_lt(am, bm, div_a, div_b, torch.bfloat16,
                             out=torch.empty(384, 256, device="cuda"))
    with pytest.raises(ValueError, match="contiguous"):
        kernels.scaled_mm_lt(am, bm, div_a, div_b, torch.bfloat16,
                             out=torch.empty(256, 384, dtype=torch.bfloat16, device="cuda").t())


@gpu
def test_alpha_is_reused_only_while_the_divisors_are_unchanged(monkeypatch):
    """A loop of GEMMs with the same divisors makes alpha once; an in-place change to a
    divisor, or another divisor tensor, makes it again (and the result follows)."""
    launches = []
    real = kernels._alpha_launch

    def spy(*args):
        launches.append(1)
        return real(*args)
    monkeypatch.setattr(kernels, "_alpha_launch", spy)
    monkeypatch.setattr(kernels._LastAlpha, "entry", None)
    am, bm, div_a, div_b = _operands(12, 256, 128, 256, 4.0, 0.5)
    first = kernels.scaled_mm_lt(am, bm, div_a, div_b, torch.float32)
    again = kernels.scaled_mm_lt(am, bm, div_a, div_b, torch.float32)
    assert len(launches) == 1 and torch.equal(first, again)
    div_a.mul_(2.0)
    halved = kernels.scaled_mm_lt(am, bm, div_a, div_b, torch.float32)
    assert len(launches) == 2 and torch.equal(halved, first / 2)
    other = torch.tensor([8.0], device="cuda")
    assert torch.equal(kernels.scaled_mm_lt(am, bm, other, div_b, torch.float32), halved)
    assert len(launches) == 3
