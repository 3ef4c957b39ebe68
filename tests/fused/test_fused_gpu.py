"""Fused norm/activation + quantize kernels (GPU only; skipped without CUDA and Triton).

* Bit-exactness: ``quantizer.quantize_fused(x, prologue)`` equals
  ``quantizer.quantize(apply_prologue(x, prologue))`` byte for byte (data, scales, recorded
  amaxes), for every fusable quantizer, prologue, input dtype and usage, on random data of
  odd and aligned shapes. ``apply_prologue`` is the same prologue written out by itself.
* The prologue against torch: the written-out norm/activation is within one unit in the
  last place of the dtype of ``F.layer_norm``/``F.rms_norm``/the reference activation (the
  row statistics are reduced in another order, and libdevice's tanh/exp may differ from
  CUDA's in the last bit, so bit equality with torch is not expected).
* The prologue against the reference paths (``lowprec.modules.norms``/``activations``) in
  bf16/fp16: both compute in fp32 and round once, so their fp32 values differ by a few fp32
  units at most and the rounded outputs differ in a tiny fraction of the elements (by one
  unit); a path that rounded an intermediate (``weight + 1`` in the weight's dtype, one
  rounding per op of an activation) would differ in a large fraction.
* Modules: LayerNormLinear and LayerNormMLP take the fused path on the GPU and agree with
  the unfused path (``lowprec.fused.unfused()``) to within 1% relative error in the output
  and every gradient; a flipped fp8 rounding here and there is all that differs, while
  E4M3 quantization noise itself is about 3%.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.nn.functional as F
from helpers import GPU_ONLY, randn

import lowprec
import lowprec.kernels
from lowprec import fused
from lowprec.formats.base import Quantizer
from lowprec.formats.block.quantizer import Float8BlockQuantizer
from lowprec.formats.float8.quantizer import Float8CurrentScalingQuantizer, Float8Quantizer
from lowprec.formats.mxfp8.quantizer import MXFP8Quantizer
from lowprec.fused.prologue import apply_prologue_with_amax, norm_stats
from lowprec.modules.activations import ACTIVATIONS

pytestmark = GPU_ONLY

E4 = torch.float8_e4m3fn
QUANTIZERS = {
    "current": lambda: Float8CurrentScalingQuantizer(E4),
    "current_e5m2_pow2": lambda: Float8CurrentScalingQuantizer(torch.float8_e5m2,
                                                               force_pow_2_scales=True),
    "delayed": lambda: Float8Quantizer(torch.tensor([0.37], device="cuda"),
                                       torch.full((1,), -1.0, device="cuda"), E4),
    "block1x128": lambda: Float8BlockQuantizer(E4, block_scaling_dim=1),
    "block128x128": lambda: Float8BlockQuantizer(E4, block_scaling_dim=2),
    "mxfp8": lambda: MXFP8Quantizer(E4),
    "mxfp8_2d": lambda: MXFP8Quantizer(E4, with_2d_quantization=True),
}
USAGES = {"both": (True, True), "row": (True, False), "col": (False, True)}
# (M, K) of the quantized output; odd ones only fit the per-tensor formats.
SHAPES = [(256, 384), (128, 256), (100, 96), (7, 40)]
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# one unit in the last place (fp32: a few units, the statistics are reduced in another order)
ULP = {torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10, torch.float32: 2.0 ** -17}


#: inputs drawn on the GPU, off zero-mean so that a norm's mean matters
ON_GPU = dict(shift=0.3, device="cuda")


def _norm_case(normalization, m, k, dtype, seed, want_amax):
    x = randn((m, k), dtype=dtype, seed=seed, scale=3.0, **ON_GPU)
    gamma = randn((k,), dtype=dtype, seed=seed + 1, scale=0.5, **ON_GPU)
    beta = (randn((k,), dtype=dtype, seed=seed + 2, **ON_GPU) if normalization == "LayerNorm"
            else None)
    rms = normalization == "RMSNorm"
    mean, rstd, amax = norm_stats(x, gamma, gamma if beta is None else beta, 1e-5, rms,
                                  want_amax)
    pro = fused.norm_prologue(normalization, None if rms else mean, rstd, gamma, beta,
                              amax if want_amax else None)
    return x, gamma, beta, pro


def _prologues(m, k, dtype, seed, want_amax):
    for norm in ("LayerNorm", "RMSNorm"):
        x, _, _, pro = _norm_case(norm, m, k, dtype, seed, want_amax)
        yield norm, x, pro
    for act in ACTIVATIONS:
        gated = ACTIVATIONS[act][1]
        yield act, randn((m, 2 * k if gated else k), dtype=dtype, seed=seed, scale=3.0, **ON_GPU), \
            fused.activation_prologue(act)


def _same(a, b, what):
    assert (a is None) == (b is None), what
    if a is None:
        return
    assert a.dtype == b.dtype and a.shape == b.shape, what
    if a.dtype.itemsize == 1:
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), what
    else:
        assert torch.equal(torch.isnan(a), torch.isnan(b)), what
        assert torch.equal(torch.nan_to_num(a).view(torch.int32),
                           torch.nan_to_num(b).view(torch.int32)), what


# Every prologue for bf16 with both usages; the other dtypes and usages with one norm and
# one gated activation (each combination is a kernel compilation of its own).
CASES = ([(k, torch.bfloat16, "both", None) for k in QUANTIZERS]
         + [(k, d, u, ("LayerNorm", "swiglu")) for k in QUANTIZERS for d in DTYPES
            for u in USAGES if (d, u) != (torch.bfloat16, "both")])


@pytest.mark.parametrize("kind,dtype,usage,only", CASES,
                         ids=[f"{c[0]}-{str(c[1])[6:]}-{c[2]}" for c in CASES])
def test_fused_matches_unfused_bitwise(kind, dtype, usage, only):
    checked = 0
    for i, (m, k) in enumerate(SHAPES):
        for name, x, pro in _prologues(m, k, dtype, seed=10 * i,
                                       want_amax=kind.startswith("current")):
            if only is not None and name not in only:
                continue
            qf = QUANTIZERS[kind]().set_usage(*USAGES[usage])
            qu = QUANTIZERS[kind]().set_usage(*USAGES[usage])
            y = fused.apply_prologue(x, pro)
            try:
                want = qu.quantize(y)
            except ValueError:
                with pytest.raises(ValueError):
                    qf.quantize_fused(x, pro)
                continue
            got = qf.quantize_fused(x, pro)
            assert type(got) is type(want) and tuple(got.shape) == tuple(want.shape)
            assert got.metadata() == want.metadata()
            for n, t in got.inner_tensors().items():
                _same(t, want.inner_tensors()[n], f"{kind} {name} {(m, k)} {n}")
            if hasattr(qf, "amax"):
                _same(qf.amax, qu.amax, f"{kind} {name} recorded amax")
            checked += 1
    # at least the two aligned shapes ran for every prologue
    assert checked >= 2 * (len(only) if only else 9)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
def test_norm_prologue_close_to_torch(normalization, dtype):
    for i, (m, k) in enumerate([(64, 4096), (33, 768), (5, 100)]):
        x, gamma, beta, pro = _norm_case(normalization, m, k, dtype, seed=i, want_amax=True)
        got = fused.apply_prologue(x, pro).float()
        if normalization == "LayerNorm":
            want = F.layer_norm(x, (k,), gamma, beta, 1e-5).float()
        else:
            want = F.rms_norm(x, (k,), gamma, 1e-5).float()
        torch.testing.assert_close(got, want, rtol=ULP[dtype], atol=1e-5)
        # the producer amax is exactly that of the written-out values
        amax = got.abs().max()
        assert pro.amax_bits.view(torch.float32).item() == amax.item()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("act", list(ACTIVATIONS))
def test_activation_prologue_close_to_torch(act, dtype):
    fn, gated = ACTIVATIONS[act]
    x = randn((96, 2 * 384 if gated else 384), dtype=dtype, seed=5, scale=3.0, **ON_GPU)
    x[0, :4] = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0])
    got = fused.apply_prologue(x, fused.activation_prologue(act)).float()
    want = fn(x).float()
    # the producer pass of current scaling writes the same values and their amax
    again, amax_bits = apply_prologue_with_amax(x, fused.activation_prologue(act))
    assert torch.equal(again.float().nan_to_num(), got.nan_to_num())
    if torch.isnan(got).any():  # any NaN bit pattern (they sort above Inf)
        assert amax_bits.item() > 0x7F800000
    else:
        assert amax_bits.item() == got.abs().max().view(torch.int32).item()
    assert torch.equal(torch.isnan(got), torch.isnan(want))
    ok = ~torch.isnan(want)
    torch.testing.assert_close(got[ok], want[ok], rtol=ULP[dtype], atol=1e-6)


LOW = (torch.bfloat16, torch.float16)
MANTISSA_BITS = {torch.bfloat16: 7, torch.float16: 10}
MIN_SUBNORMAL = {torch.bfloat16: 2.0 ** -133, torch.float16: 2.0 ** -24}
# fraction of elements whose rounding may flip between two fp32 computations of one value
FLIPS = 0.01


def _ulps_apart(got, want, dtype, what, fp32_terms=0.0):
    """got and want (same dtype) at most one unit of ``dtype`` apart, plus a few fp32 units
    of ``fp32_terms`` (the size of terms that cancel in their fp32 computation), and equal
    in all but FLIPS of the elements; NaN where the other is NaN."""
    assert got.dtype == want.dtype == dtype, what
    assert torch.equal(torch.isnan(got), torch.isnan(want)), what
    ok = ~torch.isnan(want)
    g, w = got[ok].double(), want[ok].double()
    _, e = torch.frexp(w.abs())
    spacing = torch.clamp_min(torch.ldexp(torch.ones_like(w), e - 1 - MANTISSA_BITS[dtype]),
                              MIN_SUBNORMAL[dtype])
    if isinstance(fp32_terms, torch.Tensor):
        fp32_terms = fp32_terms.expand(want.shape)[ok].double()
    bound = spacing + 64 * 2.0 ** -24 * fp32_terms
    assert bool(((g - w).abs() <= bound).all()), f"{what}: more than one unit apart"
    flipped = float((g != w).float().mean())
    assert flipped <= FLIPS, f"{what}: {flipped:.2%} of the elements differ"


@pytest.mark.parametrize("dtype", LOW, ids=str)
@pytest.mark.parametrize("act", list(ACTIVATIONS))
def test_activation_prologue_rounds_once_like_reference(act, dtype):
    fn, gated = ACTIVATIONS[act]
    x = randn((256, 2 * 512 if gated else 512), dtype=dtype, seed=6, **ON_GPU)
    got = fused.apply_prologue(x, fused.activation_prologue(act))
    # gelu of a negative x cancels 1 + tanh(...) in fp32: a last-bit difference of tanh is
    # then an error of a few fp32 units of |x| (times the gate), more than a unit of a small
    # fp16 result
    a, gate = x.double().chunk(2, dim=-1) if gated else (x.double(), 1.0)
    _ulps_apart(got, fn(x), dtype, act, fp32_terms=a.abs() * abs(gate))


@pytest.mark.parametrize("dtype", LOW, ids=str)
@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
def test_fused_norm_zero_centered_gamma_matches_reference(normalization, dtype, monkeypatch):
    """The fused norm with zero_centered_gamma forms weight + 1 in fp32, as the reference
    does (small weights: + 1 in bf16/fp16 would round off their low bits); its backward (the
    reference's fp32 backward from the kernel's statistics) accumulates the parameter
    gradients in fp32: the bias gradient of an all-ones gradient over M rows is M."""
    from lowprec.modules.norms import apply_norm
    m, k = 2048, 256
    x = randn((m, k), dtype=dtype, seed=7, scale=2.0, **ON_GPU)
    gen = torch.Generator(device="cuda").manual_seed(8)
    w = (torch.randn(k, generator=gen, device="cuda") * 0.05).to(dtype)  # gamma - 1
    b = (randn((k,), dtype=dtype, seed=9, scale=0.2, **ON_GPU) if normalization == "LayerNorm"
         else None)
    q = MXFP8Quantizer(E4)
    prologues = []
    orig = MXFP8Quantizer.quantize_fused
    monkeypatch.setattr(MXFP8Quantizer, "quantize_fused",
                        lambda self, t, pro: prologues.append(pro) or orig(self, t, pro))
    leaves = [t.detach().clone().requires_grad_(True) for t in (x, w, b) if t is not None]
    out = fused.norm_then_quantize(leaves[0], normalization, leaves[1],
                                   leaves[2] if b is not None else None, 1e-5, True, q,
                                   True, True)
    assert len(prologues) == 1
    ref_leaves = [t.detach().clone().requires_grad_(True) for t in leaves]
    want = apply_norm(ref_leaves[0], normalization, ref_leaves[1],
                      ref_leaves[2] if b is not None else None, 1e-5, True)
    # gamma * xhat + beta cancels where the output is near 0: a few fp32 units of the terms
    beta = 0.0 if b is None else b.double()
    terms = (want.detach().double() - beta).abs() + abs(beta)
    _ulps_apart(fused.apply_prologue(x, prologues[0]), want.detach(), dtype,
                f"{normalization} forward", fp32_terms=terms)

    ones = torch.ones(m, k, dtype=dtype, device="cuda")
    got = torch.autograd.grad(out, leaves, ones)
    ref = torch.autograd.grad(want, ref_leaves, ones)
    # dx cancels terms of the size of rstd * |gamma| * (1 + |xhat|); the parameter
    # gradients are sums of M terms of size up to |xhat| (about 5 at most here)
    terms = {"x": float(ref[0].abs().max()) + 4.0, "weight": 5.0 * m, "bias": float(m)}
    for name, g, r in zip(["x", "weight", "bias"], got, ref):
        _ulps_apart(g, r, dtype, f"{normalization} {name} grad", fp32_terms=terms[name])
    if b is not None:
        assert torch.equal(got[2], torch.full((k,), float(m), dtype=dtype, device="cuda"))


RECIPES = {name: functools.partial(lowprec.recipe.Recipe.from_name, name)
           for name in ("current", "delayed", "block", "mxfp8")}


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _run(module, x, recipe, dy):
    x = x.detach().clone().requires_grad_(True)
    for p in module.parameters():
        p.grad = None
    with lowprec.autocast(recipe=recipe):
        y = module(x)
    y.backward(dy)
    return [y, x.grad] + [p.grad for p in module.parameters()]


@pytest.mark.parametrize("recipe", list(RECIPES))
@pytest.mark.parametrize("module", ["ln_linear", "rms_linear", "mlp_gelu", "mlp_swiglu"])
def test_module_fused_path_matches_unfused(module, recipe, monkeypatch):
    torch.manual_seed(0)
    kw = dict(params_dtype=torch.bfloat16, device="cuda")
    if module.endswith("linear"):
        mod = lowprec.LayerNormLinear(256, 384, normalization="RMSNorm" if module == "rms_linear"
                                      else "LayerNorm", **kw)
        out = 384
    else:
        mod = lowprec.LayerNormMLP(256, 512, activation=module.split("_")[1], **kw)
        out = 256
    with torch.no_grad():
        for p in mod.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    x = torch.randn(2, 128, 256, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(2, 128, out, device="cuda", dtype=torch.bfloat16)
    calls = []
    orig = Quantizer.quantize_fused
    monkeypatch.setattr(Quantizer, "quantize_fused",
                        lambda self, *a: calls.append(type(self).__name__) or orig(self, *a))
    # separate copies: delayed scaling's state moves with every step
    got = _run(copy.deepcopy(mod), x, RECIPES[recipe](), dy)
    assert len(calls) == (1 if module.endswith("linear") else 2)
    with fused.unfused():
        want = _run(copy.deepcopy(mod), x, RECIPES[recipe](), dy)
    assert len(calls) == (1 if module.endswith("linear") else 2)
    for i, (a, b) in enumerate(zip(got, want)):
        assert _rel(a, b) < 0.01, (i, _rel(a, b))


def test_high_precision_mode_is_not_fused(monkeypatch):
    calls = []
    monkeypatch.setattr(Quantizer, "quantize_fused", lambda *a: calls.append(1))
    mod = lowprec.LayerNormLinear(128, 128, params_dtype=torch.bfloat16, device="cuda")
    x = torch.randn(64, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    with lowprec.autocast(recipe=lowprec.Float8CurrentScaling(backward_mode="high_precision")):
        mod(x).sum().backward()
    assert calls == []


@pytest.mark.parametrize("kind", ["current", "delayed", "mxfp8"])
def test_fused_torch_compile_fullgraph(kind):
    x = randn((128, 512), dtype=torch.bfloat16, seed=4, **ON_GPU)
    pro = fused.activation_prologue("swiglu")
    qe, qc = QUANTIZERS[kind](), QUANTIZERS[kind]()

    def run(q, t):
        qt = q.quantize_fused(t, pro)
        return tuple(getattr(qt, n) for n in type(qt)._inner if getattr(qt, n) is not None)

    torch._dynamo.reset()
    got = torch.compile(lambda t: run(qc, t), fullgraph=True)(x)
    want = run(qe, x)
    for a, b in zip(got, want):
        _same(a, b, kind)
