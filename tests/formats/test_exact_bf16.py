"""Exact bf16 GEMM operands written by the MXFP8 and NVFP4 quantize kernels
(``Quantizer.quantize_for_gemm``).

GPU: each record is bit for bit what the dequantize kernel makes of the stored data (the
operand the bf16 GEMM emulation would otherwise compute), the quantized data is unchanged
by asking for records, and GEMMs and Linear steps give the same bits with and without
them. CPU: the bookkeeping (no records where they could not be checked; a dropped
direction drops its record).
"""

from __future__ import annotations

import pytest
import torch
from format_inputs import spread

import lowprec
import lowprec.kernels
from lowprec.formats import Kind
from lowprec.formats.base import QuantizedTensor
from lowprec.formats.mxfp8.quantizer import MXFP8Quantizer
from lowprec.formats.nvfp4.launch import dequantize_unscaled_bf16
from lowprec.formats.nvfp4.quantizer import NVFP4Quantizer
from lowprec.gemm import bf16_domain
from lowprec.gemm import kernels as gemm_kernels
from lowprec.gemm.dispatch import gemm
from lowprec.gemm.exact_bf16 import bf16_operand
from lowprec.linear.eager_plan import eager_plans_off

gpu = pytest.mark.skipif(not lowprec.kernels.triton_available(),
                         reason="needs a CUDA device and Triton")

BOTH = ("rowwise", "columnwise")
USAGES = {"both": (True, True), "row": (True, False), "col": (False, True)}


def _input(m, k, dtype, dist, seed, device="cuda"):
    g = torch.Generator(device=device).manual_seed(seed)
    x = spread(torch.randn(m, k, generator=g, device=device), dtype, dist, g)
    if dist == "special":
        x[: min(m, 32), : min(k, 32)] = 0
        x[min(5, m - 1), min(40, k - 1)] = float("nan")
        x[m - 1, k - 1] = float("-inf")
        x[m // 2, 0] = float("inf")
    return x


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16)


def _assert_fields_equal(a: QuantizedTensor, b: QuantizedTensor):
    for name, ta in a.inner_tensors().items():
        tb = getattr(b, name)
        assert (ta is None) == (tb is None), name
        if ta is not None:
            assert torch.equal(ta.view(torch.uint8) if ta.element_size() == 1 else ta,
                               tb.view(torch.uint8) if tb.element_size() == 1 else tb), name


def _mx_dequant(qt, usage):
    return gemm_kernels.mxfp8_dequantize_bf16(getattr(qt, f"{usage}_data"),
                                              getattr(qt, f"{usage}_scale"),
                                              32 if qt.with_2d_quantization else 1)


def _check_records(q, x, usages, exact, dequant):
    q.set_usage(rowwise=usages[0], columnwise=usages[1])
    plain = q.quantize(x)
    q.set_usage(rowwise=usages[0], columnwise=usages[1])
    qt = q.quantize_for_gemm(x, exact)
    _assert_fields_equal(plain, qt)
    for usage, on in zip(BOTH, usages):
        rec = qt._read_derived(f"_exact_{usage}", getattr(qt, f"{usage}_data")) if on else None
        if on and usage in exact:
            assert rec is not None, f"no {usage} record"
            want = dequant(qt, usage)
            assert rec.dtype == torch.bfloat16 and rec.shape == want.shape
            assert torch.equal(_bits(rec), _bits(want)), f"{usage} record differs"
        else:
            assert rec is None
    return qt


# ---- MXFP8 --------------------------------------------------------------------------------
@gpu
@pytest.mark.parametrize("shape", [(32, 32), (96, 160), (64, 4128), (1056, 96)])
@pytest.mark.parametrize("usage", list(USAGES))
@pytest.mark.parametrize("exact", [BOTH, ("rowwise",), ("columnwise",)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("dist", ["normal", "wide", "special"])
def test_mxfp8_records_match_dequantize(shape, usage, exact, dtype, dist):
    x = _input(*shape, dtype, dist, seed=hash((shape, usage, dist)) % 1000)
    _check_records(MXFP8Quantizer(), x, USAGES[usage], exact, _mx_dequant)


@gpu
@pytest.mark.parametrize("two_d", [False, True])
@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("usage", list(USAGES))
@pytest.mark.parametrize("dist", ["normal", "special"])
def test_mxfp8_records_formats(two_d, fp8, usage, dist):
    x = _input(160, 224, torch.bfloat16, dist, seed=7)
    _check_records(MXFP8Quantizer(fp8, with_2d_quantization=two_d), x, USAGES[usage], BOTH,
                   _mx_dequant)


@gpu
def test_mxfp8_odd_rows_rowwise():
    # rowwise 1x32 blocks need only K % 32 == 0: an odd row count
    x = _input(77, 96, torch.bfloat16, "normal", seed=3)
    _check_records(MXFP8Quantizer(), x, (True, False), BOTH, _mx_dequant)


# ---- NVFP4 --------------------------------------------------------------------------------
def _nv_dequant(qt, usage):
    return dequantize_unscaled_bf16(qt, usage)[0]


@gpu
@pytest.mark.parametrize("shape", [(16, 16), (64, 96), (80, 1040), (1040, 48)])
@pytest.mark.parametrize("usage", list(USAGES))
@pytest.mark.parametrize("rht,sr", [(False, False), (True, True), (False, True)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("dist", ["normal", "wide", "special"])
def test_nvfp4_records_match_dequantize(shape, usage, rht, sr, dtype, dist):
    x = _input(*shape, dtype, dist, seed=hash((shape, usage, dist, rht)) % 1000)

    def quantizer():
        # same generator state for the plain and the record-writing quantize
        return NVFP4Quantizer(with_rht=rht, stochastic_rounding=sr,
                              generator=torch.Generator(device="cuda").manual_seed(5))

    q = quantizer()
    q.set_usage(*USAGES[usage])
    plain = q.quantize(x)
    q = quantizer()
    q.set_usage(*USAGES[usage])
    qt = q.quantize_for_gemm(x, BOTH)
    _assert_fields_equal(plain, qt)
    for u, on in zip(BOTH, USAGES[usage]):
        if on:
            rec = qt._read_derived(f"_exact_{u}", getattr(qt, f"{u}_data"))
            assert rec is not None
            assert torch.equal(_bits(rec), _bits(_nv_dequant(qt, u))), f"{u} record differs"


@gpu
@pytest.mark.parametrize("exact", [("rowwise",), ("columnwise",)])
def test_nvfp4_2d_records(exact):
    x = _input(96, 160, torch.bfloat16, "special", seed=11)
    _check_records(NVFP4Quantizer(with_2d_quantization=True), x, (True, True), exact,
                   _nv_dequant)


# ---- GEMM and Linear with and without records -----------------------------------------------
@gpu
@pytest.mark.parametrize("make", [lambda: MXFP8Quantizer(),
                                  lambda: NVFP4Quantizer(with_rht=True)],
                         ids=["mxfp8", "nvfp4"])
def test_gemm_same_bits_with_records(make):
    q = make()
    a_hp = _input(256, 192, torch.bfloat16, "normal", seed=1)
    a_plain, a_ex = q.quantize(a_hp), q.quantize_for_gemm(a_hp, BOTH)
    # rowwise pairs contract K (b: N x K), columnwise pairs contract M (b: M x N)
    for usage, b_shape in (("rowwise", (128, 192)), ("columnwise", (256, 128))):
        b_hp = _input(*b_shape, torch.bfloat16, "normal", seed=2)
        b_plain, b_ex = q.quantize(b_hp), q.quantize_for_gemm(b_hp, BOTH)
        # the record is what the backend multiplies
        assert bf16_operand(a_ex, usage)[0] is getattr(a_ex, f"_exact_{usage}")[2]
        for out in (torch.bfloat16, torch.float32):
            want = gemm(a_plain, usage, b_plain, usage, out_dtype=out)
            got = gemm(a_ex, usage, b_ex, usage, out_dtype=out)
            assert torch.equal(got, want)


@gpu
def test_record_not_used_after_inplace_write():
    x = _input(64, 64, torch.bfloat16, "normal", seed=4)
    qt = MXFP8Quantizer().quantize_for_gemm(x, BOTH)
    assert bf16_operand(qt, "rowwise")[0] is qt._exact_rowwise[2]
    qt.rowwise_data.view(torch.uint8).zero_()  # bumps the version counter
    fresh, _ = bf16_operand(qt, "rowwise")
    assert fresh is not qt._exact_rowwise[2]
    assert torch.equal(fresh, torch.zeros_like(fresh))


@gpu
@pytest.mark.parametrize("recipe", ["mxfp8", "nvfp4"])
def test_linear_same_bits_with_and_without_records(recipe, monkeypatch):
    from lowprec.gemm import exact_bf16
    make = {"mxfp8": lowprec.MXFP8BlockScaling, "nvfp4": lowprec.NVFP4BlockScaling}[recipe]
    torch.manual_seed(0)
    mod = lowprec.Linear(192, 160, params_dtype=torch.bfloat16, device="cuda")
    x0 = torch.randn(4, 64, 192, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(4, 64, 160, device="cuda", dtype=torch.bfloat16)

    def step():
        torch.manual_seed(1)  # the same stochastic-rounding draws in both runs
        mod.zero_grad(set_to_none=True)
        x = x0.clone().requires_grad_(True)
        with lowprec.autocast(recipe=make()):
            y = mod(x)
        y.backward(dy)
        return y.detach(), x.grad, mod.weight.grad

    seen = []
    real = exact_bf16.bf16_operand

    def spy(t, usage):
        rec = getattr(t, f"_exact_{usage}", None)
        seen.append((type(t).__name__, usage, rec is not None))
        return real(t, usage)

    monkeypatch.setattr(exact_bf16, "bf16_operand", spy)
    # the eager Function's records (a call that runs the plan keeps its own forms instead)
    with eager_plans_off():
        with_records = step()
    src = {"mxfp8": "MXFP8Tensor", "nvfp4": "NVFP4Tensor"}[recipe]
    # fprop: x and W rowwise with records; wgrad: dY's exact columnwise values and the saved
    # x (dequantized); dgrad: dY's exact rowwise values and the saved W (dequantized)
    assert sorted(seen) == sorted([
        (src, "rowwise", True), (src, "rowwise", True),
        ("ExactTensor", "columnwise", False), (src, "columnwise", False),
        ("ExactTensor", "rowwise", False), (src, "columnwise", False)])
    monkeypatch.setattr(MXFP8Quantizer, "keeps_exact_bf16", False)
    monkeypatch.setattr(NVFP4Quantizer, "keeps_exact_bf16", False)
    seen.clear()
    with eager_plans_off():
        without = step()
    assert all(t != "ExactTensor" and not rec for t, _, rec in seen)
    for a, b in zip(with_records, without):
        assert torch.equal(a, b)


# ---- ExactTensor (codes=False) ------------------------------------------------------------
def _exact_pair(make, x, usages):
    q = make()
    q.set_usage(*usages)
    torch.manual_seed(3)
    normal = q.quantize_for_gemm(x, BOTH)
    q = make()
    q.set_usage(*usages)
    torch.manual_seed(3)
    exact = q.quantize_for_gemm(x, BOTH, codes=False)
    return normal, exact


NV_MAKERS = {
    "mxfp8": lambda: MXFP8Quantizer(),
    "mxfp8_2d": lambda: MXFP8Quantizer(with_2d_quantization=True),
    "nvfp4": lambda: NVFP4Quantizer(),
    "nvfp4_rht_sr": lambda: NVFP4Quantizer(with_rht=True, stochastic_rounding=True),
    "nvfp4_2d": lambda: NVFP4Quantizer(with_2d_quantization=True),
}


@gpu
@pytest.mark.parametrize("fmt", list(NV_MAKERS))
@pytest.mark.parametrize("usage", list(USAGES))
@pytest.mark.parametrize("shape", [(64, 96), (160, 1056)])
@pytest.mark.parametrize("dist", ["normal", "special"])
def test_exact_tensor_holds_the_records(fmt, usage, shape, dist):
    from lowprec.formats.exact import ExactTensor
    x = _input(*shape, torch.bfloat16, dist, seed=9)
    normal, exact = _exact_pair(NV_MAKERS[fmt], x, USAGES[usage])
    assert isinstance(exact, ExactTensor) and exact.shape == x.shape
    for u, on in zip(BOTH, USAGES[usage]):
        assert exact.has_usage(u) == on
        if not on:
            continue
        rec = getattr(normal, f"_exact_{u}")[2]
        assert torch.equal(_bits(getattr(exact, f"{u}_data")), _bits(rec))
        div = getattr(exact, f"{u}_divisor")
        if fmt.startswith("nvfp4"):
            assert torch.equal(div, getattr(normal, f"{u}_global"))
        else:
            assert div is None
        # dequantize: the same fp32 values, NaN where the source has NaN
        a, b = normal.dequantize(torch.float32, usage=u), exact.dequantize(torch.float32, usage=u)
        assert torch.equal(torch.isnan(a), torch.isnan(b))
        assert torch.equal(torch.nan_to_num(a), torch.nan_to_num(b))


@gpu
@pytest.mark.parametrize("fmt", ["mxfp8", "nvfp4_rht_sr"])
def test_exact_tensor_gemms(fmt):
    make = NV_MAKERS[fmt]
    a_hp = _input(256, 192, torch.bfloat16, "normal", seed=1)
    for usage, b_shape in (("rowwise", (128, 192)), ("columnwise", (256, 128))):
        b_hp = _input(*b_shape, torch.bfloat16, "normal", seed=2)
        torch.manual_seed(0)
        a_q, b_q = make().quantize(a_hp), make().quantize(b_hp)
        torch.manual_seed(0)
        a_x = make().quantize_for_gemm(a_hp, BOTH, codes=False)
        b_x = make().quantize_for_gemm(b_hp, BOTH, codes=False)
        for out in (torch.bfloat16, torch.float32):
            want = gemm(a_q, usage, b_q, usage, out_dtype=out)
            assert torch.equal(gemm(a_x, usage, b_q, usage, out_dtype=out), want)
            assert torch.equal(gemm(a_x, usage, b_x, usage, out_dtype=out), want)
        # the fp32 emulation (the fallback backend, dequantize() of each operand) agrees to
        # fp32 rounding of the sums
        from lowprec.gemm.emulated_fp32 import emulated_fp32_run
        ref = emulated_fp32_run(a_q, usage, b_q, usage, torch.float32, None)
        got = emulated_fp32_run(a_x, usage, b_x, usage, torch.float32, None)
        assert torch.equal(got, ref)  # same fp32 operands, same fp32 GEMM
        torch.testing.assert_close(want, ref, rtol=1e-5, atol=1e-4)


# ---- CPU bookkeeping --------------------------------------------------------------------------
def test_quantize_for_gemm_on_cpu_is_quantize():
    x = _input(64, 64, torch.float32, "normal", seed=0, device="cpu")
    for q in (MXFP8Quantizer(), NVFP4Quantizer()):
        a, b = q.quantize(x), q.quantize_for_gemm(x, BOTH)
        _assert_fields_equal(a, b)
        assert b._exact_rowwise is None and b._exact_columnwise is None
        assert q._exact == ()  # the request lasts one call


def test_exact_usages_off_in_inference_mode_and_for_other_formats():
    q = MXFP8Quantizer()
    q._exact = BOTH
    assert q.exact_usages() == BOTH
    with torch.inference_mode():
        assert q.exact_usages() == ()
    assert not lowprec.Float8CurrentScalingQuantizer().keeps_exact_bf16


def test_dropping_a_direction_drops_its_records():
    x = _input(64, 64, torch.float32, "normal", seed=0, device="cpu")
    qt = MXFP8Quantizer().quantize(x)
    for u in BOTH:
        setattr(qt, f"_exact_{u}", QuantizedTensor.derived_record(
            getattr(qt, f"{u}_data"), torch.zeros(64, 64, dtype=torch.bfloat16)))
    qt.update_usage(rowwise_usage=False)
    assert qt._exact_rowwise is None and qt._exact_columnwise is not None
    qt.release()
    assert qt._exact_columnwise is None


def test_codes_false_on_cpu_and_bad_requests():
    x = _input(64, 64, torch.float32, "normal", seed=0, device="cpu")
    q = MXFP8Quantizer()
    out = q.quantize_for_gemm(x, BOTH, codes=False)
    assert type(out).__name__ == "MXFP8Tensor"  # no kernels: the usual tensor
    with pytest.raises(ValueError, match="every direction in use"):
        q.quantize_for_gemm(x, ("rowwise",), codes=False)


def test_exact_tensor_on_cpu_dequantizes_and_multiplies_like_its_source():
    from lowprec.formats.exact import ExactTensor
    from lowprec.formats.nvfp4.launch import dequantize_unscaled_bf16 as nv_unscaled
    x = _input(64, 96, torch.float32, "normal", seed=2, device="cpu")
    w = _input(32, 96, torch.float32, "normal", seed=3, device="cpu")
    q = NVFP4Quantizer(with_rht=True)
    xq, wq = q.quantize(x), q.quantize(w)

    def exact_of(t):
        fields = {}
        for u in BOTH:
            v, s = nv_unscaled(t, u)
            fields.update({f"{u}_data": v, f"{u}_divisor": s})
        return ExactTensor(t.shape, t.dtype, source_format="nvfp4", columnwise_rht=True,
                           **fields)

    xe = exact_of(xq)
    for u in BOTH:
        assert torch.equal(xe.dequantize(usage=u), xq.dequantize(usage=u))
    assert torch.equal(gemm(xe, "rowwise", wq, "rowwise", out_dtype=torch.float32),
                       gemm(xq, "rowwise", wq, "rowwise", out_dtype=torch.float32))
    xe.update_usage(columnwise_usage=False)
    assert xe.columnwise_data is None and xe.columnwise_divisor is None


@pytest.mark.parametrize("make", [
    lambda: lowprec.MXFP8Quantizer(), lambda: lowprec.MXFP8Quantizer(with_2d_quantization=True),
    lambda: lowprec.NVFP4Quantizer(), lambda: lowprec.NVFP4Quantizer(with_2d_quantization=True),
    lambda: lowprec.Float8CurrentScalingQuantizer(torch.float8_e4m3fn),
    lambda: lowprec.Float8BlockQuantizer(torch.float8_e4m3fn, block_scaling_dim=2),
    lambda: lowprec.IdentityQuantizer(torch.bfloat16),
], ids=["mxfp8", "mxfp8_2d", "nvfp4", "nvfp4_2d", "fp8", "block", "identity"])
def test_tensor_bf16_operand_is_its_dequantized_values(make):
    """Each format's own ``bf16_operand``: bf16 values that, divided in fp32, are the
    format's dequantized values bit for bit."""
    qt = make().quantize(torch.randn(128, 256, generator=torch.Generator().manual_seed(3)))
    for usage in ("rowwise", "columnwise"):
        # the GEMM table's view: NVFP4's CPU tensors hold the reference's values, which the
        # fp32 emulation multiplies (as their traced form's do)
        want_domain = None if isinstance(qt, lowprec.NVFP4Tensor) else "original"
        assert bf16_domain(qt.gemm_kind(usage, read=True)) == want_domain
        values, divisor = qt.bf16_operand(usage)
        assert values.dtype == torch.bfloat16
        got = values.float() if divisor is None else values.float() / divisor
        want = qt.dequantize(torch.float32, usage=usage).reshape(-1, 256)
        assert torch.equal(got, want if usage == "rowwise" else want.t())


def test_tensor_without_exact_bf16_form():
    qt = lowprec.IdentityQuantizer().quantize(torch.randn(4, 32))  # fp32 values
    assert bf16_domain(qt.gemm_kind("rowwise")) is None
    qt = lowprec.NVFP4Quantizer(with_rht=True).quantize(torch.randn(32, 32))
    assert bf16_domain(qt.gemm_kind("columnwise")) is None  # the reference's fp32 values


@gpu
def test_nvfp4_kernel_tensor_kinds():
    """NVFP4's kernel tensors are exact in bf16 beside their global scale; the RHT'd
    columnwise values only in the Hadamard domain."""
    qt = lowprec.NVFP4Quantizer(with_rht=True).quantize(torch.randn(128, 128, device="cuda"))
    assert qt.gemm_kind("rowwise") == Kind("exact", divisor=True)
    assert bf16_domain(qt.gemm_kind("rowwise")) == "original"
    assert bf16_domain(qt.gemm_kind("columnwise")) == "rht"
