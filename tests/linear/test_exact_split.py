"""The sliced Linear for formats emulated on bf16 GEMMs (lowprec/linear/exact_split.py).

On CPU the slices are quantized tensors and the GEMMs the fp32 emulation: the sliced path
must give the unsliced path's bits. On the GPU the slices are exact bf16 values from the
quantize kernels, checked bit for bit against the same rows/columns of a whole-tensor
quantize; the Linear is compared with the unsliced one, where only a GEMM of another size
may pick another accumulation order (bf16 outputs within 2 ulps), and its peak memory with
a bf16 Linear's.
"""

from __future__ import annotations

import pytest
import torch

import lowprec
import lowprec.linear.exact_split as exact_split
import lowprec.linear.grad_split as grad_split
from lowprec.formats.base import QuantizedTensor
from lowprec.formats.exact import ExactTensor

M, K, N = 512, 128, 1024

needs_gpu = pytest.mark.skipif(
    not torch.cuda.is_available() or not lowprec.kernels.triton_available(),
    reason="needs CUDA and Triton")


def _took(y) -> bool:
    """Whether the call ran the exact split (the eager Function's flag; an eager call that
    runs the traced plan never splits: ``plan_for`` leaves those calls to the Function)."""
    return getattr(y.grad_fn, "exact_split", False)


@pytest.fixture
def small_slices(monkeypatch):
    """Every loop runs in 128-long slices (the budget would take one at these sizes)."""
    monkeypatch.setattr(exact_split, "_slice_len", lambda size, per_unit, free: 128)


def _step(context, *, recipe=lowprec.MXFP8BlockScaling, device="cpu", bias=True, shape3d=False,
          retain=False, seed=0):
    torch.manual_seed(seed)
    lin = lowprec.Linear(K, N, bias=bias, params_dtype=torch.bfloat16, device=device)
    xs = (4, M // 4, K) if shape3d else (M, K)
    x = torch.randn(*xs, dtype=torch.bfloat16, device=device, requires_grad=True)
    dy = torch.randn(*xs[:-1], N, dtype=torch.bfloat16, device=device)
    with context(), lowprec.autocast(enabled=True, recipe=recipe()):
        y = lin(x)
    took = _took(y)
    y.backward(dy, retain_graph=retain)
    grads = [y.detach(), x.grad.clone(), lin.weight.grad.clone()]
    if bias:
        grads.append(lin.bias.grad.clone())
    return grads, took, y


#: Recipes whose quantizers all have a gemm_slicer. NVFP4BlockScaling's defaults exercise
#: every piece a slice shares with the whole tensor: global scales, the RHT'd columnwise
#: amax, stochastic-rounding draws at the slice's indices, 16x16 weight blocks.
RECIPES = [lowprec.MXFP8BlockScaling, lowprec.NVFP4BlockScaling,
           lambda: lowprec.NVFP4BlockScaling(disable_rht=True, disable_2d_quantization=True)]
RECIPE_IDS = ["mxfp8", "nvfp4", "nvfp4_1d_no_rht"]


@pytest.mark.parametrize("recipe", RECIPES, ids=RECIPE_IDS)
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape3d", [False, True])
def test_cpu_sliced_equals_unsliced(small_slices, recipe, bias, shape3d):
    ref, took_ref, _ = _step(grad_split.unsliced, recipe=recipe, bias=bias, shape3d=shape3d)
    got, took, _ = _step(grad_split.sliced, recipe=recipe, bias=bias, shape3d=shape3d)
    assert took and not took_ref
    for a, b in zip(ref, got):
        assert torch.equal(a, b)


@pytest.mark.parametrize("recipe", RECIPES, ids=RECIPE_IDS)
def test_cpu_budget_slices_equal_unsliced(recipe):
    ref, _, _ = _step(grad_split.unsliced, recipe=recipe)
    got, took, _ = _step(grad_split.sliced, recipe=recipe)
    assert took
    for a, b in zip(ref, got):
        assert torch.equal(a, b)


def test_applies_only_where_it_should():
    # default mode and unsliced(): never; per-tensor/block FP8: never
    for context in (grad_split.unsliced, lambda: _Nothing()):
        _, took, _ = _step(context)
        assert not took
    for recipe in (lowprec.Float8CurrentScaling, lowprec.Float8BlockScaling):
        _, took, _ = _step(grad_split.sliced, recipe=recipe)
        assert not took, recipe
    # a frozen weight (no dW) keeps the default path
    lin = lowprec.Linear(K, N, params_dtype=torch.bfloat16)
    lin.weight.requires_grad_(False)
    x = torch.randn(M, K, dtype=torch.bfloat16, requires_grad=True)
    with grad_split.sliced(), lowprec.autocast(enabled=True, recipe=lowprec.MXFP8BlockScaling()):
        y = lin(x)
    assert not _took(y)


class _Nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.mark.parametrize("recipe", RECIPES[:2], ids=RECIPE_IDS[:2])
def test_retained_graph_runs_backward_twice(small_slices, recipe):
    torch.manual_seed(0)
    lin = lowprec.Linear(K, N, params_dtype=torch.bfloat16)
    x = torch.randn(M, K, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(M, N, dtype=torch.bfloat16)
    with grad_split.sliced(), lowprec.autocast(enabled=True, recipe=recipe()):
        y = lin(x)
    torch.manual_seed(1)
    y.backward(dy, retain_graph=True)
    first = (x.grad.clone(), lin.weight.grad.clone())
    x.grad, lin.weight.grad = None, None
    torch.manual_seed(1)  # the same stochastic-rounding draws for dY as the first time
    y.backward(dy)
    assert torch.equal(first[0], x.grad) and torch.equal(first[1], lin.weight.grad)


def test_budget_is_a_bf16_backward_peak():
    assert exact_split.budget(16384, 4096, 4096, 2) == 416 << 20
    assert exact_split.budget(16384, 14336, 4096, 2) == 816 << 20
    assert exact_split.budget(16384, 4096, 14336, 2) == 1136 << 20


def test_held_bytes_counts_inner_tensors():
    q = lowprec.MXFP8Quantizer()
    t = q.quantize(torch.randn(64, 128, dtype=torch.bfloat16))
    assert isinstance(t, QuantizedTensor)
    want = sum(v.numel() * v.element_size() for v in t.inner_tensors().values() if v is not None)
    assert exact_split.held_bytes(t) == want == 2 * (64 * 128 + 64 * 128 // 32)
    assert exact_split.held_bytes(torch.empty(3, 5)) == 60
    assert exact_split.held_bytes(None) == 0


# ---- GPU ----------------------------------------------------------------------------------
SLICED_QUANTIZERS = {
    "mxfp8": lambda: lowprec.MXFP8Quantizer(),
    "mxfp8_2d": lambda: lowprec.MXFP8Quantizer(with_2d_quantization=True),
    "nvfp4": lambda: lowprec.NVFP4Quantizer(),
    "nvfp4_rht_sr": lambda: lowprec.NVFP4Quantizer(with_rht=True, stochastic_rounding=True),
    "nvfp4_2d_sr": lambda: lowprec.NVFP4Quantizer(with_2d_quantization=True,
                                                  stochastic_rounding=True),
}


@needs_gpu
@pytest.mark.parametrize("name", list(SLICED_QUANTIZERS))
@pytest.mark.parametrize("shape", [(512, 1024), (384, 2080), (1056, 640)])
def test_gpu_gemm_slices_match_whole_quantize(name, shape):
    """Row slices (contiguous) and column slices (read in place, row-strided) equal the same
    rows/columns of one whole-tensor quantize: exact values and codes, bit for bit (NVFP4:
    the whole tensor's global scales and stochastic-rounding draws)."""
    m, n = shape
    torch.manual_seed(3)
    x = torch.randn(m, n, device="cuda", dtype=torch.bfloat16) * 3
    q = SLICED_QUANTIZERS[name]().set_usage(rowwise=True, columnwise=True)
    torch.manual_seed(7)
    whole = q.quantize_for_gemm(x, ("rowwise", "columnwise"), codes=False)
    torch.manual_seed(7)
    whole_codes = q.quantize(x)
    assert isinstance(whole, ExactTensor)
    torch.manual_seed(7)
    slicer = q.gemm_slicer(x)
    for a in range(0, m, 128):
        part = slicer(a, a + 128, "rowwise")
        assert isinstance(part, ExactTensor) and not part.has_usage("columnwise")
        assert torch.equal(part.rowwise_data, whole.rowwise_data[a:a + 128])
        assert torch.equal(part.dequantize(), whole.dequantize()[a:a + 128])
    for a in range(0, n, 256):
        part = slicer(a, a + 256, "columnwise")
        assert torch.equal(part.columnwise_data, whole.columnwise_data[a:a + 256])
        assert torch.equal(part.dequantize(usage="columnwise"),
                           whole.dequantize(usage="columnwise")[:, a:a + 256])
        codes = slicer.codes(a, a + 256, "columnwise")
        assert torch.equal(codes.columnwise_data, whole_codes.columnwise_data[a:a + 256])
        assert torch.equal(codes.dequantize(usage="columnwise"),
                           whole_codes.dequantize(usage="columnwise")[:, a:a + 256])
    assert q.rowwise_usage and q.columnwise_usage  # the slicer leaves the usages as they were


@needs_gpu
@pytest.mark.parametrize("name", ["nvfp4_rht_sr", "nvfp4_2d_sr"])
def test_gpu_gemm_slices_with_64bit_indices(monkeypatch, name):
    """The kernels' 64-bit offset path (normally for > 2**31 elements, forced here) gives the
    slices the same values."""
    from lowprec.formats.nvfp4 import launch
    monkeypatch.setattr(launch, "_idx64", lambda rows, cols, base=0: True)
    test_gpu_gemm_slices_match_whole_quantize(name, (384, 2080))


@needs_gpu
def test_gpu_as_exact_matches_dequantize():
    from lowprec.gemm.exact_bf16 import as_exact
    x = torch.randn(256, 384, device="cuda", dtype=torch.bfloat16)
    t = lowprec.MXFP8Quantizer().set_usage(rowwise=False, columnwise=True).quantize(x)
    e = as_exact(t, "columnwise")
    assert isinstance(e, ExactTensor) and not e.has_usage("rowwise")
    assert torch.equal(e.dequantize(usage="columnwise"), t.dequantize(usage="columnwise"))
    assert as_exact(t, "rowwise") is t  # no rowwise data: unchanged


def _close_bf16(a: torch.Tensor, b: torch.Tensor):
    # Another GEMM size may pick another fp32 accumulation order: 2 bf16 ulps, and an
    # absolute floor for values near 0 (relative to the tensor's scale).
    torch.testing.assert_close(a.float(), b.float(), rtol=2 ** -7,
                               atol=2 ** -7 * b.float().abs().max().item() * 2 ** -6)


@needs_gpu
@pytest.mark.parametrize("recipe", RECIPES, ids=RECIPE_IDS)
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("sliced_small", [True, False])
def test_gpu_sliced_matches_unsliced(monkeypatch, recipe, bias, sliced_small):
    if sliced_small:
        monkeypatch.setattr(exact_split, "_slice_len", lambda size, per_unit, free: 128)
    ref, _, _ = _step(grad_split.unsliced, recipe=recipe, device="cuda", bias=bias)
    got, took, _ = _step(grad_split.sliced, recipe=recipe, device="cuda", bias=bias)
    assert took
    for a, b in zip(got, ref):
        _close_bf16(a, b)


@needs_gpu
@pytest.mark.parametrize("recipe", RECIPES[:2], ids=RECIPE_IDS[:2])
@pytest.mark.parametrize("m,k,n", [(16384, 4096, 4096), (16384, 4096, 14336),
                                   (16384, 14336, 4096)])
def test_gpu_peak_memory_at_most_bf16(recipe, m, k, n):
    """On the benchmark shapes the sliced step peaks at or below a bf16 nn.Linear step
    (the bf16 input made inside the step, as bench_memory does). Smaller shapes leave the
    wide one's dgrad less room than one 128-row slice."""
    def peak(step):
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base

    torch.manual_seed(0)
    x0 = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    ref = torch.nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
    lin = lowprec.Linear(k, n, bias=False, params_dtype=torch.bfloat16, device="cuda")

    def bf16_step():
        ref(x0 * 1.0).backward(dy)
        ref.weight.grad = x0.grad = None

    def sliced_step():
        with grad_split.sliced(), lowprec.autocast(enabled=True, recipe=recipe()):
            y = lin(x0 * 1.0)
        y.backward(dy)
        lin.weight.grad = x0.grad = None

    bf16_step(), sliced_step()  # warm-up (cuBLAS workspaces, kernels)
    bf16, ours = peak(bf16_step), peak(sliced_step)
    assert ours <= bf16, (ours / 2**20, bf16 / 2**20)


@pytest.mark.parametrize("recipe", RECIPES[:2], ids=RECIPE_IDS[:2])
def test_gemms_run_in_slices(small_slices, monkeypatch, recipe):
    calls = []
    real = exact_split.gemm

    def spy(a, a_usage, b, b_usage, **kw):
        calls.append((tuple(a.shape), a_usage, b_usage))
        return real(a, a_usage, b, b_usage, **kw)
    monkeypatch.setattr(exact_split, "gemm", spy)
    _step(grad_split.sliced, recipe=recipe)
    fprop = [((128, K), "rowwise", "rowwise")] * (M // 128)
    wgrad = [((M, 128), "columnwise", "columnwise")] * (N // 128)
    dgrad = [((128, N), "rowwise", "columnwise")] * (M // 128)
    assert calls == fprop + wgrad + dgrad


def test_gradient_quantized_upstream_is_used_whole(small_slices):
    """A dY that arrives quantized (a downstream grad_input quantizer) cannot be sliced: the
    backward consumes it whole, as the default path does."""
    from lowprec.linear.function import LinearQuantizers, quantized_linear
    torch.manual_seed(0)
    w = torch.randn(N, K, dtype=torch.bfloat16, requires_grad=True)
    x = torch.randn(M, K, dtype=torch.bfloat16, requires_grad=True)
    dy = lowprec.MXFP8Quantizer().quantize(torch.randn(M, N, dtype=torch.bfloat16))
    grads = []
    for context in (grad_split.unsliced, grad_split.sliced):
        q = LinearQuantizers(input=lowprec.MXFP8Quantizer(), weight=lowprec.MXFP8Quantizer(),
                             grad_output=lowprec.MXFP8Quantizer())
        with context():
            y = quantized_linear(x, w, quantizers=q)
        assert _took(y) == (context is grad_split.sliced)
        x.grad = w.grad = None
        y.backward(dy)
        grads.append((x.grad.clone(), w.grad.clone()))
    assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1])


def test_slice_inputs_are_checked():
    """Bad slice requests raise before any kernel runs (CPU: the checks come first)."""
    from lowprec.formats.gemm_slicer import GemmSlicer
    from lowprec.formats.nvfp4 import launch
    q = lowprec.NVFP4Quantizer()
    x = torch.randn(64, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="2-D"):
        GemmSlicer(q, x.reshape(4, 16, 128), lambda *a: {}, None)
    slicer = q.gemm_slicer(x)
    with pytest.raises(ValueError, match="usage='diagonal'"):
        slicer(0, 16, "diagonal")
    one = torch.ones(1)
    with pytest.raises(ValueError, match="cover every direction"):
        launch.nvfp4_quantize(x, None, None, True, True, False, False, False, False, True,
                              one, None)
    with pytest.raises(ValueError, match="offsets are for slices"):
        launch.nvfp4_quantize(x, None, None, True, False, False, False, False, False, True,
                              None, None, 128)
    with pytest.raises(ValueError, match="int64 \\(2,\\)"):
        launch.nvfp4_exact_slice(x, one, torch.zeros(3, dtype=torch.int64), 0, True, False,
                                 False)


def test_cpu_nvfp4_slices_match_whole_quantize():
    """The CPU slicer (reference path): every slice's codes equal the same rows/columns of
    one whole-tensor quantize, with RHT and stochastic rounding (odd slice counts)."""
    torch.manual_seed(5)
    x = torch.randn(384, 208, dtype=torch.bfloat16) * 4
    q = lowprec.NVFP4Quantizer(with_rht=True, stochastic_rounding=True)
    torch.manual_seed(9)
    whole = q.quantize(x)
    torch.manual_seed(9)
    slicer = q.gemm_slicer(x)
    for a in range(0, 384, 128):
        part = slicer(a, a + 128, "rowwise")
        assert torch.equal(part.rowwise_data, whole.rowwise_data[a:a + 128])
        assert torch.equal(part.dequantize(), whole.dequantize()[a:a + 128])
    for a in range(0, 208, 128):
        part = slicer(a, a + 128, "columnwise")
        assert torch.equal(part.columnwise_data, whole.columnwise_data[a:a + 128])
        assert torch.equal(part.dequantize(usage="columnwise"),
                           whole.dequantize(usage="columnwise")[:, a:a + 128])
