"""Norms and activations in bf16/fp16 are computed in fp32 and rounded once to the output
dtype, forward and backward (as Transformer Engine's kernels and lowprec's fused Triton
kernels compute them).

Each check has two references, both from the same bf16/fp16 inputs:

* the same math written with torch's fp32 ops (independently of lowprec), rounded once:
  lowprec must equal it bit for bit;
* float64 math, unrounded: lowprec must be within one unit in the last place of the output
  dtype (plus, for reductions and cancelling sums, the fp32 rounding error those carry).

Rounding inside the computation (``weight + 1`` in bf16, a bf16 accumulator for the
parameter gradients, one rounding per torch op of an activation) breaks the first, and the
second where the error it adds exceeds an ulp.
"""

from __future__ import annotations

import importlib

import pytest
import torch
import torch.nn.functional as F
from helpers import randn

import lowprec
from lowprec.modules.activations import ACTIVATIONS

DTYPES = (torch.bfloat16, torch.float16)
MANTISSA_BITS = {torch.bfloat16: 7, torch.float16: 10}
MIN_SUBNORMAL = {torch.bfloat16: 2.0 ** -133, torch.float16: 2.0 ** -24}
FP32_U = 2.0 ** -24


def _ulp(ref64: torch.Tensor, dtype) -> torch.Tensor:
    """The spacing of ``dtype`` at each |ref64| (float64)."""
    _, e = torch.frexp(ref64.abs())
    return torch.maximum(torch.ldexp(torch.ones_like(ref64), e - 1 - MANTISSA_BITS[dtype]),
                         torch.full_like(ref64, MIN_SUBNORMAL[dtype]))


def _assert_within_one_ulp(got, ref64, dtype, what, slack=None):
    err = (got.double() - ref64).abs()
    bound = _ulp(ref64, dtype) + (0 if slack is None else slack)
    bad = err > bound
    assert not bool(bad.any()), (f"{what}: {int(bad.sum())} of {bad.numel()} elements more than "
                                 f"one ulp from float64; worst err/bound "
                                 f"{float((err / bound).max()):.3g}")


def _assert_bits_equal(got, want, what):
    assert got.dtype == want.dtype, what
    same = (got == want) | (torch.isnan(got) & torch.isnan(want))
    assert bool(same.all()), (f"{what}: {int((~same).sum())} of {same.numel()} elements differ "
                              f"from the fp32-computed value rounded once")


# ================================================================================================
# norms
# ================================================================================================
def _norm_params(normalization, k, dtype, zero_centered, seed):
    # Zero-centered weights are small (gamma - 1): their + 1 does not fit a bf16/fp16 mantissa.
    w = randn(k, seed=seed, scale=0.05, shift=0.0 if zero_centered else 1.0, dtype=dtype)
    b = (randn(k, seed=seed + 1, scale=0.2, dtype=dtype) if normalization == "LayerNorm"
         else None)
    return w, b


def _norm_ref32(x, normalization, w, b, eps, zero_centered):
    """torch's fp32 norm of the same values, not yet rounded (autograd leaves of fp32 copies)."""
    gamma = w.float() + 1 if zero_centered else w.float()
    if normalization == "LayerNorm":
        return F.layer_norm(x.float(), (x.shape[-1],), gamma, b.float(), eps)
    return F.rms_norm(x.float(), (x.shape[-1],), gamma, eps)


def _norm_ref64(x, normalization, w, b, eps, zero_centered):
    x = x.double()
    gamma = w.double() + 1 if zero_centered else w.double()
    if normalization == "LayerNorm":
        mu = x.mean(-1, keepdim=True)
        var = (x - mu).pow(2).mean(-1, keepdim=True)
        return (x - mu) / torch.sqrt(var + eps) * gamma + b.double()
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * gamma


def _make_norm(normalization, k, dtype, zero_centered, w, b):
    m = getattr(lowprec, normalization)(k, eps=1e-5, zero_centered_gamma=zero_centered,
                                        params_dtype=dtype)
    with torch.no_grad():
        m.weight.copy_(w)
        if b is not None:
            m.bias.copy_(b)
    return m


@pytest.mark.parametrize("zero_centered", [False, True], ids=["gamma", "zero_centered"])
@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_norm_forward_fp32_rounded_once(dtype, normalization, zero_centered):
    k = 256
    x = randn((4, 64, k), seed=1, scale=2.0, shift=0.3, dtype=dtype)
    w, b = _norm_params(normalization, k, dtype, zero_centered, seed=2)
    m = _make_norm(normalization, k, dtype, zero_centered, w, b)
    with torch.no_grad():
        y = m(x)
    want = _norm_ref32(x, normalization, w, b, 1e-5, zero_centered).to(dtype)
    assert y.dtype == dtype
    _assert_bits_equal(y, want, f"{normalization} forward")
    ref64 = _norm_ref64(x, normalization, w, b, 1e-5, zero_centered)
    # fp32 rounding of the terms (statistics, scaled value, bias), where they cancel to a
    # result far below them: a few fp32 units of the terms
    b64 = torch.zeros(k, dtype=torch.float64) if b is None else b.double()
    terms = (ref64 - b64).abs() + b64.abs()
    _assert_within_one_ulp(y, ref64, dtype, f"{normalization} forward vs float64",
                           slack=16 * FP32_U * terms)


@pytest.mark.parametrize("module", ["LayerNormLinear", "LayerNormMLP"])
@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
def test_fused_modules_norm_zero_centered_gamma(module, normalization, monkeypatch):
    """LayerNormLinear/LayerNormMLP's norm (zero-centered gamma, bf16 parameters) is the same
    fp32 norm, seen as the input of their first GEMM."""
    dtype, k = torch.bfloat16, 64
    mod = getattr(lowprec, module)(k, 32, normalization=normalization, zero_centered_gamma=True,
                                   params_dtype=dtype)
    w, b = _norm_params(normalization, k, dtype, True, seed=3)
    with torch.no_grad():
        mod.layer_norm_weight.copy_(w)
        if b is not None:
            mod.layer_norm_bias.copy_(b)
    x = randn((2, 16, k), seed=4, scale=2.0, shift=0.3, dtype=dtype)
    where = importlib.import_module(type(mod).__module__)
    gemm_inputs = []
    original = where.quantized_linear
    monkeypatch.setattr(where, "quantized_linear",
                        lambda inp, *a, **kw: gemm_inputs.append(inp) or original(inp, *a, **kw))
    with torch.no_grad():
        mod(x)
    want = _norm_ref32(x, normalization, w, b, mod.eps, True).to(dtype)
    _assert_bits_equal(gemm_inputs[0], want, f"{module} norm output")


def test_bf16_layernorm_bias_grad_accumulates_in_fp32():
    """Transformer Engine's case: hidden 2048, an all-ones output gradient over 2048 rows.
    The bias gradient is the sum of 2048 ones: a bf16 accumulator stalls at 256/512 (its
    spacing there reaches 2), fp32 accumulation rounded once gives exactly 2048."""
    hidden, rows = 2048, 2048
    m = lowprec.LayerNorm(hidden, params_dtype=torch.bfloat16)
    x = randn((rows, hidden), seed=5, dtype=torch.bfloat16).requires_grad_(True)
    y = m(x)
    y.backward(torch.ones_like(y))
    assert m.bias.grad.dtype == torch.bfloat16
    assert torch.equal(m.bias.grad, torch.full((hidden,), 2048.0, dtype=torch.bfloat16))
    # the weight gradient: column sums of the normalized input (|sum| ~ sqrt(rows)), within
    # one bf16 ulp plus the fp32 error of a sum over the rows
    xhat = _norm_ref64(x.detach(), "LayerNorm", torch.ones(hidden), torch.zeros(hidden), m.eps,
                       False)
    _assert_within_one_ulp(m.weight.grad, xhat.sum(0), torch.bfloat16, "weight grad",
                           slack=(rows + 8) * FP32_U * xhat.abs().sum(0))


@pytest.mark.parametrize("zero_centered", [False, True], ids=["gamma", "zero_centered"])
@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_norm_backward_fp32_rounded_once(dtype, normalization, zero_centered):
    k, rows = 256, 512
    x = randn((rows, k), seed=6, scale=2.0, shift=0.3, dtype=dtype)
    dy = randn((rows, k), seed=7, dtype=dtype)
    w, b = _norm_params(normalization, k, dtype, zero_centered, seed=8)
    m = _make_norm(normalization, k, dtype, zero_centered, w, b)
    xl = x.clone().requires_grad_(True)
    m(xl).backward(dy)
    got = [xl.grad, m.weight.grad] + ([m.bias.grad] if b is not None else [])
    assert [t.dtype for t in got] == [dtype] * len(got)

    # torch's fp32 autograd of the fp32 norm, each gradient rounded once
    leaves32 = [t.float().requires_grad_(True) for t in [x, w] + ([b] if b is not None else [])]
    y32 = _norm_ref32(leaves32[0], normalization, leaves32[1],
                      leaves32[2] if b is not None else None, m.eps, zero_centered)
    want = torch.autograd.grad(y32, leaves32, dy.float())
    for name, g, r in zip(["x", "weight", "bias"], got, want):
        _assert_bits_equal(g, r.to(dtype), f"{normalization} {name} grad")

    # float64
    leaves64 = [t.double().requires_grad_(True) for t in [x, w] + ([b] if b is not None else [])]
    y64 = _norm_ref64(leaves64[0], normalization, leaves64[1],
                      leaves64[2] if b is not None else None, m.eps, zero_centered)
    want64 = torch.autograd.grad(y64, leaves64, dy.double())
    dy64 = dy.double()
    xhat = _norm_ref64(x, normalization, torch.ones(k), torch.zeros(k), m.eps, False)
    gamma_max = float((w.double() + (1 if zero_centered else 0)).abs().max())
    # fp32 rounding error of the cancelling sums: over K per row (x), over the rows (params)
    x_terms = (dy64.abs() * (1 + xhat.abs())).sum(-1, keepdim=True) * gamma_max
    slack = {"x": 8 * FP32_U * x_terms.expand(rows, k),
             "weight": (rows + 8) * FP32_U * (dy64 * xhat).abs().sum(0),
             "bias": (rows + 8) * FP32_U * dy64.abs().sum(0)}
    for name, g, r in zip(["x", "weight", "bias"], got, want64):
        _assert_within_one_ulp(g, r, dtype, f"{normalization} {name} grad vs float64",
                               slack=slack[name])


# ================================================================================================
# activations
# ================================================================================================
def _act_ref(name, x):
    """The activations as formulas of torch ops, in whatever dtype ``x`` has."""
    if name in ("swiglu", "geglu"):
        a, b = x.chunk(2, dim=-1)
        return _act_ref("silu" if name == "swiglu" else "gelu", a) * b
    if name == "gelu":
        return 0.5 * x * (1 + torch.tanh((2 / torch.pi) ** 0.5 * (x + 0.044715 * x ** 3))) \
            if x.dtype == torch.float64 else F.gelu(x, approximate="tanh")
    return {"relu": lambda: torch.clamp_min(x, 0.0),
            "silu": lambda: x * torch.sigmoid(x) if x.dtype == torch.float64 else F.silu(x),
            "srelu": lambda: torch.clamp_min(x, 0.0) ** 2,
            "qgelu": lambda: x * torch.sigmoid(1.702 * x)}[name]()


def _act_input(name, dtype, seed=9):
    gated = ACTIVATIONS[name][1]
    return randn((32, 2 * 128 if gated else 128), seed=seed, scale=3.0, shift=0.0, dtype=dtype)


@pytest.mark.parametrize("name", list(ACTIVATIONS))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_activation_forward_fp32_rounded_once(dtype, name):
    fn, _ = ACTIVATIONS[name]
    x = _act_input(name, dtype)
    y = fn(x)
    assert y.dtype == dtype
    _assert_bits_equal(y, _act_ref(name, x.float()).to(dtype), f"{name} forward")
    # gelu and silu of a large negative x are far smaller than the fp32 terms they come from
    # (0.5 x and 1 + tanh(...) cancel): a few fp32 units of |x| (times the gate) absolute
    gate = x.double().chunk(2, dim=-1)[1].abs() if ACTIVATIONS[name][1] else 1.0
    first = x.double().chunk(2, dim=-1)[0] if ACTIVATIONS[name][1] else x.double()
    _assert_within_one_ulp(y, _act_ref(name, x.double()), dtype, f"{name} forward vs float64",
                           slack=16 * FP32_U * (1 + first.abs()) * gate)


@pytest.mark.parametrize("name", list(ACTIVATIONS))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_activation_backward_fp32_rounded_once(dtype, name):
    fn, _ = ACTIVATIONS[name]
    x = _act_input(name, dtype).requires_grad_(True)
    y = fn(x)
    g = randn(y.shape, seed=10, dtype=dtype)
    (dx,) = torch.autograd.grad(y, x, g)
    assert dx.dtype == dtype
    x32 = x.detach().float().requires_grad_(True)
    (want,) = torch.autograd.grad(_act_ref(name, x32), x32, g.float())
    _assert_bits_equal(dx, want.to(dtype), f"{name} backward")
    x64 = x.detach().double().requires_grad_(True)
    (want64,) = torch.autograd.grad(_act_ref(name, x64), x64, g.double())
    # the derivative's terms may cancel (qgelu', gelu' cross zero): their fp32 rounding error
    slack = 16 * FP32_U * g.double().abs().repeat(*[1] * (g.dim() - 1),
                                                  x.shape[-1] // g.shape[-1])
    slack = slack * (1 + x.detach().double().abs()) ** 2
    _assert_within_one_ulp(dx, want64, dtype, f"{name} backward vs float64", slack=slack)


def test_fp16_qgelu_rounds_once():
    """x * sigmoid(1.702 x) in fp16 op by op rounds three times; the activation rounds once,
    and that is a different result on this data (so the test above can tell them apart)."""
    fn, _ = ACTIVATIONS["qgelu"]
    x = _act_input("qgelu", torch.float16)
    once = _act_ref("qgelu", x.float()).to(torch.float16)
    _assert_bits_equal(fn(x), once, "qgelu")
    assert not torch.equal(_act_ref("qgelu", x), once)
