"""The sliced linear backward (lowprec/linear/grad_split.py) and the release of the saved input.

Slicing must not change a single bit: every slice of dY is quantized with the whole
tensor's statistics, so the quantized slices equal the matching parts of the whole
quantization, and the gradients equal those of the unsliced backward. The saved input is
freed after wgrad only when the graph is not retained.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

import lowprec
import lowprec.gemm
import lowprec.kernels
import lowprec.linear.grad_split as grad_split
from lowprec.formats.base import QuantizedTensor, Quantizer
from lowprec.formats.float8.quantizer import _PerTensorFloat8

M, K, N = 512, 128, 1024  # dY (512, 1024) is twice the size of dX + dW: slicing applies

SLICED = {
    "current": lambda: lowprec.Float8CurrentScaling(),
    "delayed": lambda: lowprec.DelayedScaling(),
    "block": lambda: lowprec.Float8BlockScaling(),
}
# MXFP8 and NVFP4 have no slice_quantizer (inside sliced() they take lowprec.linear.exact_split's
# path instead); a hybrid of the two has neither, so it keeps the whole backward everywhere.
UNSLICED = {"mxfp8": lambda: lowprec.MXFP8BlockScaling(),
            "nvfp4": lambda: lowprec.NVFP4BlockScaling(),
            "hybrid": lambda: lowprec.CustomRecipe(lambda role: lowprec.HybridQuantizer(
                rowwise_quantizer=lowprec.MXFP8Quantizer(),
                columnwise_quantizer=lowprec.NVFP4Quantizer()))}


@pytest.fixture
def slicing(monkeypatch):
    """Set whether the backward may slice dY (by its size threshold)."""
    def set_(on: bool):
        monkeypatch.setattr(grad_split, "MIN_COPY_BYTES", 0 if on else 1 << 62)
        monkeypatch.setattr(grad_split._MODE, "value", "always" if on else "never")
    return set_


def _count_gemms(monkeypatch):
    calls = []
    real = lowprec.gemm.gemm

    def spy(a, a_usage, b, b_usage, **kw):
        calls.append((tuple(a.shape), a_usage, b_usage))
        return real(a, a_usage, b, b_usage, **kw)
    monkeypatch.setattr(grad_split, "gemm", spy)
    monkeypatch.setattr(lowprec.linear.function, "gemm", spy)
    return calls


def _step(recipe, *, device="cpu", dtype=torch.bfloat16, retain=False, dy_scale=1.0, seed=0):
    torch.manual_seed(seed)
    lin = lowprec.Linear(K, N, params_dtype=dtype, device=device)
    x = torch.randn(M, K, dtype=dtype, device=device, requires_grad=True)
    dy = torch.randn(M, N, dtype=dtype, device=device) * dy_scale
    with lowprec.autocast(enabled=True, recipe=recipe):
        y = lin(x)
    saved_x = y.grad_fn.saved_tensors[0]
    y.backward(dy, retain_graph=retain)
    return x.grad.clone(), lin.weight.grad.clone(), saved_x, y, dy


# ---- the policy -----------------------------------------------------------------------------
def test_split_sizes_on_the_benchmark_shapes():
    # (m, n, k): dY (m, n), X (m, k), W (n, k), bf16 gradients
    assert grad_split.split_sizes(16384, 128256, 4096, 2, 2) == (512, 8064)  # a vocabulary
    assert grad_split.split_sizes(8192, 128256, 2048, 2, 2) == (128, 4096)
    assert grad_split.split_sizes(16384, 4096, 4096, 2, 2) is None   # dY copies < dX + dW
    assert grad_split.split_sizes(16384, 4096, 14336, 2, 2) is None
    assert grad_split.split_sizes(16384, 14336, 4096, 2, 2) is None  # one copy < 256 MiB
    assert grad_split.split_sizes(8192, 8192, 2048, 2, 2) is None
    with grad_split.sliced():  # from 16 MiB up
        assert grad_split.split_sizes(16384, 14336, 4096, 2, 2) == (4096, 7168)
        assert grad_split.split_sizes(8192, 8192, 2048, 2, 2) == (2048, 4096)
        assert grad_split.split_sizes(1024, 4096, 64, 2, 2) is None  # one copy < 16 MiB


def test_slicing_modes():
    current = lowprec.Float8CurrentScalingQuantizer()
    delayed = lowprec.Float8Quantizer(torch.ones(1), torch.zeros(1))
    block = lowprec.Float8BlockQuantizer(block_scaling_dim=1)
    mx = lowprec.MXFP8Quantizer()
    enabled = lambda: [grad_split.slicing_enabled(q) for q in (current, delayed, block, mx)]  # noqa: E731
    assert enabled() == [False, False, True, False]  # auto: only where slicing is free
    with grad_split.sliced():
        assert enabled() == [True, True, True, False]
        with grad_split.unsliced():
            assert enabled() == [False] * 4
        assert enabled() == [True, True, True, False]
    assert enabled() == [False, False, True, False]
    assert not grad_split.slicing_enabled(None)


def test_auto_mode_slices_block_but_not_per_tensor(monkeypatch):
    monkeypatch.setattr(grad_split, "AUTO_MIN_COPY_BYTES", 0)
    for rname, expect in (("block", True), ("current", False), ("delayed", False)):
        calls = _count_gemms(monkeypatch)
        _step(SLICED[rname]())
        wgrads = [c for c in calls if c[1] == "columnwise"]
        assert (len(wgrads) > 1) == expect, rname


@pytest.mark.parametrize("m,n,k", [(16384, 14336, 4096), (8192, 50304, 1024),
                                   (4096, 32768, 512), (12288, 40000, 2048)])
def test_split_sizes_are_aligned_even_and_bounded(m, n, k, monkeypatch):
    monkeypatch.setattr(grad_split, "AUTO_MIN_COPY_BYTES", 0)  # the shapes, not the floor
    rows, cols = grad_split.split_sizes(m, n, k, 2, 2)
    dx = m * k * 2
    for size, length, limit in ((m, rows, dx // 2 // n), (n, cols, dx // m)):
        assert length % grad_split.ALIGN == 0 or length == size
        assert length <= max(limit, grad_split.ALIGN) + grad_split.ALIGN - 1
        count = -(-size // length)
        assert size - (count - 1) * length > 0  # no empty slice
        assert count <= -(-size // max(limit, grad_split.ALIGN))  # no more than needed


# ---- slices equal the whole quantization -----------------------------------------------------
def _quantizers():
    return {
        "current": lowprec.Float8CurrentScalingQuantizer(torch.float8_e5m2),
        "current_pow2": lowprec.Float8CurrentScalingQuantizer(force_pow_2_scales=True),
        "block1": lowprec.Float8BlockQuantizer(torch.float8_e5m2, block_scaling_dim=1),
        "block2": lowprec.Float8BlockQuantizer(block_scaling_dim=2),
    }


def _assert_same_fields(part: QuantizedTensor, whole: QuantizedTensor, usage: str, sl):
    """``part`` (a slice's quantization) equals the rows/columns ``sl`` of ``whole``."""
    for name, t in part.inner_tensors().items():
        if t is None:
            continue
        ref = getattr(whole, name)
        if name.startswith("shared_"):
            assert torch.equal(t, ref), name
            continue
        # 128x128 scales have one row per 128 rows of data; all others one per data row
        step = 128 if name.endswith("_scale") and getattr(whole, "block_scaling_dim", 1) == 2 \
            else 1
        lo, hi = sl.start // step, -(-sl.stop // step)
        # rowwise data is (M, K): rows slice dim 0; columnwise (K, M) of a column slice: dim 0
        ref_part = ref[lo:hi]
        assert torch.equal(t.view(torch.uint8) if t.dtype.itemsize == 1 else t,
                           ref_part.view(torch.uint8) if ref_part.dtype.itemsize == 1
                           else ref_part), (name, usage)


@pytest.mark.parametrize("qname", list(_quantizers()))
def test_slices_equal_whole_quantization(qname):
    torch.manual_seed(1)
    x = torch.randn(384, 640, dtype=torch.bfloat16) * 3
    q = _quantizers()[qname]
    whole = q.copy().set_usage(rowwise=True, columnwise=True).quantize(x)
    slice_quantize = q.slice_quantizer(x)
    for a, b in [(0, 128), (128, 384)]:
        part = slice_quantize(x[a:b], "rowwise")
        assert part.has_usage("rowwise") and not part.has_usage("columnwise")
        _assert_same_fields(part, whole, "rowwise", slice(a, b))
    for a, b in [(0, 256), (256, 640)]:
        part = slice_quantize(x[:, a:b], "columnwise")
        assert part.has_usage("columnwise") and not part.has_usage("rowwise")
        assert tuple(part.shape) == (384, b - a)
        _assert_same_fields(part, whole, "columnwise", slice(a, b))
    assert (q.rowwise_usage, q.columnwise_usage) == (True, True)  # usage restored


@pytest.mark.parametrize("poison", [None, float("nan"), float("inf")])
def test_delayed_slices_record_the_whole_amax(poison):
    torch.manual_seed(2)
    x = torch.randn(256, 512, dtype=torch.bfloat16)
    x[200, 300] = 7.5 if poison is None else poison  # outside the first slices
    make = lambda: lowprec.Float8Quantizer(torch.tensor([16.0]), torch.zeros(1))  # noqa: E731
    q_whole, q_slices = make(), make()
    whole = q_whole.quantize(x)
    slice_quantize = q_slices.slice_quantizer(x)
    torch.testing.assert_close(q_slices.amax, q_whole.amax, rtol=0, atol=0, equal_nan=True)
    part = slice_quantize(x[:128], "rowwise")
    ref = whole.rowwise_data[:128].view(torch.uint8)
    assert torch.equal(part.rowwise_data.view(torch.uint8), ref)
    if poison is not None:  # a non-finite anywhere poisons every slice, as the whole
        assert part.dequantize().isnan().all()
    part = slice_quantize(x[:, 128:256], "columnwise")
    assert torch.equal(part.columnwise_data.view(torch.uint8),
                       whole.columnwise_data[128:256].view(torch.uint8))


def test_formats_without_slices_say_so():
    x = torch.randn(64, 64)
    assert lowprec.MXFP8Quantizer().slice_quantizer(x) is None
    assert lowprec.NVFP4Quantizer().slice_quantizer(x) is None


# ---- the module backward --------------------------------------------------------------------
@pytest.mark.parametrize("rname", list(SLICED))
def test_sliced_backward_is_bit_identical(rname, slicing, monkeypatch):
    slicing(False)
    dx_ref, dw_ref, *_ = _step(SLICED[rname]())
    slicing(True)
    calls = _count_gemms(monkeypatch)
    dx, dw, *_ = _step(SLICED[rname]())
    rows, cols = grad_split.split_sizes(M, N, K, 2, 2)
    wgrads = [c for c in calls if c[1] == "columnwise"]
    dgrads = [c for c in calls if c[1] == "rowwise" and c[2] == "columnwise"]
    assert len(wgrads) == -(-N // cols) > 1 and len(dgrads) == -(-M // rows) > 1
    assert torch.equal(dx, dx_ref) and torch.equal(dw, dw_ref)


def test_sliced_backward_delayed_amax_history_matches(slicing):
    def amaxes(on):
        slicing(on)
        recipe = lowprec.DelayedScaling(amax_history_len=4)
        torch.manual_seed(0)
        lin = lowprec.Linear(K, N, params_dtype=torch.bfloat16)
        x = torch.randn(M, K, dtype=torch.bfloat16, requires_grad=True)
        for i in range(2):
            with lowprec.autocast(enabled=True, recipe=recipe):
                y = lin(x)
            y.backward(torch.randn(M, N, dtype=torch.bfloat16) * (i + 1))
        return x.grad.clone(), lin.weight.grad.clone()
    a, b = amaxes(False), amaxes(True)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


@pytest.mark.parametrize("rname", ["hybrid"])
def test_formats_without_slices_keep_the_whole_backward(rname, slicing, monkeypatch):
    # (MXFP8 and NVFP4 slice inside sliced() through lowprec.linear.exact_split:
    # tests/linear/test_exact_split.py)
    slicing(True)
    calls = _count_gemms(monkeypatch)
    _step(UNSLICED[rname]())
    assert calls[1:] == [((M, N), "columnwise", "columnwise"), ((M, N), "rowwise", "columnwise")]


def test_sliced_backward_propagates_nonfinite_gradients(slicing):
    slicing(True)
    torch.manual_seed(0)
    lin = lowprec.Linear(K, N, params_dtype=torch.bfloat16)
    x = torch.randn(M, K, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(M, N, dtype=torch.bfloat16)
    dy[M - 1, N - 1] = float("inf")
    with lowprec.autocast(enabled=True, recipe=lowprec.Float8CurrentScaling()):
        y = lin(x)
    y.backward(dy)
    # as unsliced current scaling: the inf gives an infinite amax, a zero scale, NaN codes
    assert not torch.isfinite(x.grad).all() and not torch.isfinite(lin.weight.grad).all()


# ---- the saved input is freed after wgrad ---------------------------------------------------
@pytest.mark.parametrize("rname", list(SLICED) + list(UNSLICED))
@pytest.mark.parametrize("split", [False, True])
def test_saved_input_is_released_after_backward(rname, split, slicing):
    slicing(split)
    recipe = {**SLICED, **UNSLICED}[rname]()
    *_, saved_x, _, _ = _step(recipe)
    assert isinstance(saved_x, QuantizedTensor)
    assert all(t is None for t in saved_x.inner_tensors().values())
    with pytest.raises(RuntimeError, match="columnwise"):
        lowprec.gemm.gemm(saved_x, "columnwise", saved_x, "columnwise", out_dtype=torch.float32)


@pytest.mark.parametrize("rname", ["current", "block", "mxfp8"])
def test_retain_graph_keeps_the_saved_input(rname, slicing):
    slicing(True)
    recipe = {**SLICED, **UNSLICED}[rname]()
    dx1, dw1, saved_x, y, dy = _step(recipe, retain=True)
    assert saved_x.has_usage("columnwise")
    lin_grads = [dx1, dw1]
    y.backward(dy)  # a second backward through the same graph works and adds the same
    x_leaf, w = y.grad_fn.next_functions[0][0].variable, y.grad_fn.next_functions[1][0].variable
    assert torch.equal(x_leaf.grad, (lin_grads[0].float() * 2).to(x_leaf.grad.dtype))
    assert torch.equal(w.grad, (lin_grads[1].float() * 2).to(w.grad.dtype))


def test_input_quantized_outside_is_not_released():
    q = lowprec.Float8CurrentScalingQuantizer()
    torch.manual_seed(0)
    w = torch.randn(64, 64, requires_grad=True)
    xq = q.quantize(torch.randn(32, 64))
    quantizers = lowprec.linear.function.LinearQuantizers(
        input=lowprec.Float8CurrentScalingQuantizer(),
        weight=lowprec.Float8CurrentScalingQuantizer(),
        grad_output=lowprec.Float8CurrentScalingQuantizer(torch.float8_e5m2))
    y = lowprec.linear.function.quantized_linear(xq, w, quantizers=quantizers)
    y.backward(torch.randn(32, 64))
    assert xq.has_usage("rowwise") and xq.has_usage("columnwise")  # the caller's tensor


# ---- gemm out= -------------------------------------------------------------------------------
def test_gemm_out_writes_in_place_and_checks_its_argument():
    torch.manual_seed(0)
    q = lowprec.Float8CurrentScalingQuantizer()
    a, b = q.quantize(torch.randn(64, 32)), q.quantize(torch.randn(48, 32))
    ref = lowprec.gemm.gemm(a, "rowwise", b, "rowwise", out_dtype=torch.float32)
    big = torch.full((128, 48), 5.0)
    got = lowprec.gemm.gemm(a, "rowwise", b, "rowwise", out_dtype=torch.float32, out=big[32:96])
    assert got.data_ptr() == big[32:96].data_ptr() and torch.equal(big[32:96], ref)
    assert (big[:32] == 5).all() and (big[96:] == 5).all()
    with pytest.raises(ValueError, match=r"\(64, 48\) torch.float32"):
        lowprec.gemm.gemm(a, "rowwise", b, "rowwise", out_dtype=torch.float32,
                          out=torch.empty(64, 47))
    with pytest.raises(ValueError, match="contiguous"):
        lowprec.gemm.gemm(a, "rowwise", b, "rowwise", out_dtype=torch.float32,
                          out=torch.empty(48, 64).t())


# ---- the same on the GPU (kernels, cuBLAS with out=) ------------------------------------------
needs_gpu = pytest.mark.skipif(not lowprec.kernels.triton_available(),
                               reason="needs a CUDA device and Triton")


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("rname", list(SLICED))
def test_sliced_backward_gpu_matches_unsliced(rname, slicing):
    slicing(False)
    dx_ref, dw_ref, *_ = _step(SLICED[rname](), device="cuda")
    slicing(True)
    dx, dw, *_ = _step(SLICED[rname](), device="cuda")
    # Same quantized operands; cuBLAS may pick another algorithm for the smaller GEMMs, so
    # allow a last-bit difference of bf16 outputs of fp32 accumulations.
    torch.testing.assert_close(dx, dx_ref, rtol=2 ** -7, atol=0)
    torch.testing.assert_close(dw, dw_ref, rtol=2 ** -7, atol=0)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("qname", list(_quantizers()))
def test_slices_equal_whole_quantization_gpu(qname):
    torch.manual_seed(1)
    x = (torch.randn(384, 640, dtype=torch.bfloat16) * 3).cuda()
    q = _quantizers()[qname]
    whole = q.copy().set_usage(rowwise=True, columnwise=True).quantize(x)
    slice_quantize = q.slice_quantizer(x)
    for a, b in [(0, 128), (128, 384)]:
        _assert_same_fields(slice_quantize(x[a:b], "rowwise"), whole, "rowwise", slice(a, b))
    for a, b in [(0, 256), (256, 640)]:
        _assert_same_fields(slice_quantize(x[:, a:b], "columnwise"), whole, "columnwise",
                            slice(a, b))


# ---- the weight's columnwise copy: made after fprop, in backward for a parameter ----------
def _forward(rname, mode: str, *, amp: bool = False):
    torch.manual_seed(0)
    lin = lowprec.Linear(K, N, params_dtype=torch.float32 if amp else torch.bfloat16)
    x = torch.randn(M, K, dtype=torch.bfloat16, requires_grad=True)
    ctx = {"sliced": grad_split.sliced, "unsliced": grad_split.unsliced,
           "auto": grad_split._SetMode}[mode]()
    cast = torch.autocast("cpu", dtype=torch.bfloat16) if amp else contextlib.nullcontext()
    with ctx, cast, lowprec.autocast(enabled=True, recipe=SLICED[rname]()):
        y = lin(x)
    return lin, y


def _spy(monkeypatch):
    events, made = [], []
    real_gemm = lowprec.linear.function.gemm

    def gemm_spy(*args, **kw):
        events.append("gemm")
        return real_gemm(*args, **kw)

    monkeypatch.setattr(lowprec.linear.function, "gemm", gemm_spy)
    for cls in (Quantizer, _PerTensorFloat8):
        def usage_like_spy(self, *args, _real=cls.quantize_usage_like):
            events.append("usage_like")
            made.append(_real(self, *args))
            return made[-1]
        monkeypatch.setattr(cls, "quantize_usage_like", usage_like_spy)
    return events, made


def _assert_same_tensor(new, old):
    for name, t in old.inner_tensors().items():
        got = getattr(new, name)
        assert (t is None) == (got is None), name
        if t is not None:
            assert torch.equal(got.view(torch.uint8) if got.dtype.itemsize == 1 else got,
                               t.view(torch.uint8) if t.dtype.itemsize == 1 else t), name


@pytest.mark.parametrize("mode", ["auto", "sliced"])
@pytest.mark.parametrize("rname", list(SLICED))
def test_weight_columnwise_made_in_backward_equals_whole(rname, mode, monkeypatch):
    # whole: both directions of the weight in one quantize, saved by the forward
    _, y_old = _forward(rname, "unsliced")
    old = y_old.grad_fn.saved_tensors[1]
    events, made = _spy(monkeypatch)
    lin, y = _forward(rname, mode)
    # the forward saves the parameter itself (no copy lives until backward) ...
    assert y.grad_fn.saved_tensors[1] is lin.weight and events == ["gemm"]
    y.backward(torch.randn_like(y))
    # ... and the backward makes its columnwise copy first, with fprop's statistics
    assert events[:2] == ["gemm", "usage_like"] and not made[0].has_usage("rowwise")
    _assert_same_tensor(made[0], old)


@pytest.mark.parametrize("rname", list(SLICED))
def test_weight_columnwise_made_after_fprop_under_torch_autocast(rname, monkeypatch):
    # the weight GEMMs read is torch.autocast's bf16 copy: saving it would hold 2 bytes a
    # weight until backward, so its columnwise fp8 copy is made after fprop and saved
    _, y_old = _forward(rname, "unsliced", amp=True)
    old = y_old.grad_fn.saved_tensors[1]
    events, made = _spy(monkeypatch)
    lin, y = _forward(rname, "auto", amp=True)
    new = y.grad_fn.saved_tensors[1]
    assert events == ["gemm", "usage_like"] and not new.has_usage("rowwise")
    _assert_same_tensor(new, old)


# ---- quantize_usage_like: one usage after the other, same bits as both at once --------------
def _usage_like_quantizers():
    return {**_quantizers(), "delayed": lowprec.Float8Quantizer(torch.tensor([8.0]),
                                                                 torch.zeros(1))}


def _check_usage_like(qname, device, poison):
    torch.manual_seed(3)
    x = (torch.randn(384, 640, dtype=torch.bfloat16) * 3).to(device)
    if poison is not None:
        x[300, 500] = poison
    q = _usage_like_quantizers()[qname]
    whole = q.copy().set_usage(rowwise=True, columnwise=True).quantize(x)
    for first, second in (("rowwise", "columnwise"), ("columnwise", "rowwise")):
        one = q.copy().set_usage(rowwise=first == "rowwise",
                                 columnwise=first == "columnwise").quantize(x)
        assert q.can_quantize_usage_like()
        other = q.quantize_usage_like(x, one, second)
        assert other.has_usage(second) and not other.has_usage(first)
        for part in (one, other):
            for name, t in part.inner_tensors().items():
                if t is None:
                    continue
                ref = getattr(whole, name)
                if t.dtype.itemsize == 1:  # codes: bit for bit
                    assert torch.equal(t.view(torch.uint8), ref.view(torch.uint8)), name
                else:  # scales: the same values, NaN where the whole has NaN
                    torch.testing.assert_close(t, ref, rtol=0, atol=0, equal_nan=True)
    if poison is not None and "block" not in qname:
        assert other.dequantize(usage=second).isnan().all()


@pytest.mark.parametrize("poison", [None, float("nan"), float("inf")])
@pytest.mark.parametrize("qname", list(_usage_like_quantizers()))
def test_quantize_usage_like_equals_both_at_once(qname, poison):
    _check_usage_like(qname, "cpu", poison)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("poison", [None, float("nan")])
@pytest.mark.parametrize("qname", list(_usage_like_quantizers()))
def test_quantize_usage_like_equals_both_at_once_gpu(qname, poison):
    _check_usage_like(qname, "cuda", poison)


def test_formats_without_usage_like_say_so():
    x = torch.randn(128, 128)
    for q in (lowprec.MXFP8Quantizer(), lowprec.NVFP4Quantizer()):
        assert not q.can_quantize_usage_like()
        with pytest.raises(NotImplementedError, match="both usages at once"):
            q.quantize_usage_like(x, q.quantize(x), "columnwise")


def test_mode_is_per_thread():
    """sliced()/unsliced() set this thread's mode only: another thread keeps its own."""
    import threading

    seen = {}
    with grad_split.sliced():
        t = threading.Thread(target=lambda: seen.setdefault("other", grad_split.mode()))
        t.start()
        t.join()
        seen["this"] = grad_split.mode()
    assert seen == {"this": "always", "other": "auto"}
    assert grad_split.mode() == "auto"


def test_compiled_code_guards_on_the_mode():
    """A traced block plan reads the mode at trace time: the compiled code is guarded on it,
    so switching to unsliced() recompiles instead of running the old slices."""
    torch._dynamo.reset()
    f = torch.compile(lambda x: x * 2 if grad_split.slicing_allowed(False) else x,
                      fullgraph=True)
    assert torch.equal(f(torch.ones(2)), torch.full((2,), 2.0))
    with grad_split.unsliced():
        assert torch.equal(f(torch.ones(2)), torch.ones(2))
    torch._dynamo.reset()
