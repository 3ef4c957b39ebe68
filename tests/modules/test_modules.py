"""Linear, LayerNormLinear, LayerNormMLP and GroupedLinear under every recipe.

Expectations are computed independently of lowprec's GEMM code:

1. every GEMM the modules run is recorded (``lowprec.linear_fn.gemm`` wrapped) and its result is
   compared with a float64 product of its dequantized operands; module outputs and every
   gradient are tied to those GEMM results (bias and norm gradients through float64 re-derivations);
2. quantized vs unquantized fp32 module: SQNR above per-format thresholds;
3. backward modes ``high_precision`` / ``dequantized`` reproduce, bit for bit, a hand-written
   fp32 backward on the original / dequantized forward operands;
4. GroupedLinear equals one Linear per group, bit for bit;
5. what the default mode saves for backward (quantized, columnwise only, small);
6. errors; 7. behaviour outside autocast and with the identity recipe.
"""

from __future__ import annotations

import contextlib
import functools
import re
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

import lowprec
import lowprec.linear_fn
from lowprec import factories
from lowprec.formats.base import QuantizedTensor

# ================================================================================================
# helpers: recipes, sizes, modules, runs, SQNR, the GEMM recorder
# ================================================================================================
FP32_EPS = 2.0 ** -24  # unit roundoff of fp32 (round to nearest)

# ---- recipes ------------------------------------------------------------------------------
RECIPES = {
    "delayed": lambda **kw: lowprec.DelayedScaling(**kw),
    "current": lambda **kw: lowprec.Float8CurrentScaling(**kw),
    "block": lambda **kw: lowprec.Float8BlockScaling(**kw),
    "mxfp8": lambda **kw: lowprec.MXFP8BlockScaling(**kw),
    "nvfp4": lambda **kw: lowprec.NVFP4BlockScaling(**kw),
    "custom_mx_nv": lambda **kw: lowprec.CustomRecipe(
        qfactory=factories.mxfp8_fwd_nvfp4_bwd_factory, **kw),
}
RECIPE_NAMES = list(RECIPES)


def make_recipe(name: str, **kw):
    return RECIPES[name](**kw)


def expected_class(recipe_name: str, role: str, usage: str):
    """Quantized-tensor class of the representation a GEMM consumes: ``role`` is 'input',
    'weight' or 'grad', ``usage`` 'rowwise' or 'columnwise'."""
    if recipe_name == "custom_mx_nv":
        # mxfp8_fwd_nvfp4_bwd_factory: MXFP8 for the forward GEMM, NVFP4 for both backward
        # GEMMs (inputs/weights are MXFP8-rowwise / NVFP4-columnwise hybrids).
        nvfp4 = role == "grad" or usage == "columnwise"
        return lowprec.NVFP4Tensor if nvfp4 else lowprec.MXFP8Tensor
    return {"delayed": lowprec.Float8Tensor, "current": lowprec.Float8Tensor,
            "block": lowprec.Float8BlockwiseTensor, "mxfp8": lowprec.MXFP8Tensor,
            "nvfp4": lowprec.NVFP4Tensor}[recipe_name]


def effective_class(t, usage: str) -> type:
    """Class of the tensor that holds ``usage`` (a hybrid's sub-tensor, else the tensor's)."""
    if isinstance(t, lowprec.HybridQuantizedTensor):
        return type(t.sub_tensor(usage))
    return type(t)


# ---- sizes ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Dims:
    batch: int
    seq: int
    hidden: int
    ffn: int
    out: int
    m_splits: tuple

    @property
    def m(self) -> int:
        return self.batch * self.seq


# Float8BlockScaling needs M and K multiples of 128 (1x128 input/grad blocks, 128x128 weight
# blocks on both weight dims). The other formats need 32 (MXFP8) or 16 (NVFP4), so they run on
# smaller shapes to keep the CPU run short. In both, the MLP's fc1/fc2 weight shapes differ from
# each other and the group sizes differ, so every recorded GEMM is identified by its shapes.
BLOCK_DIMS = Dims(batch=2, seq=64, hidden=128, ffn=256, out=128, m_splits=(128, 256, 384))
SMALL_DIMS = Dims(batch=2, seq=32, hidden=64, ffn=128, out=96, m_splits=(32, 64, 96))


def dims_for(recipe_name: str | None) -> Dims:
    return BLOCK_DIMS if recipe_name == "block" else SMALL_DIMS


MODULE_NAMES = ["linear", "ln_linear", "mlp_gelu", "mlp_relu", "mlp_swiglu", "grouped"]


def mlp_act(kind: str) -> str:
    return kind[4:]


def make_module(kind: str, dims: Dims, dtype=torch.float32, seed: int = 0):
    torch.manual_seed(seed)
    if kind == "linear":
        m = lowprec.Linear(dims.hidden, dims.out, params_dtype=dtype, name="lin")
    elif kind == "ln_linear":
        m = lowprec.LayerNormLinear(dims.hidden, dims.out, params_dtype=dtype, name="lnlin")
    elif kind.startswith("mlp_"):
        act = mlp_act(kind)
        # swiglu also exercises RMSNorm (no norm bias).
        norm = "RMSNorm" if act == "swiglu" else "LayerNorm"
        m = lowprec.LayerNormMLP(dims.hidden, dims.ffn, activation=act, normalization=norm,
                                 params_dtype=dtype, name="mlp")
    elif kind == "grouped":
        m = lowprec.GroupedLinear(3, dims.hidden, dims.out, params_dtype=dtype, name="grp")
    else:
        raise ValueError(kind)
    # Non-trivial norm parameters so that their gradients are exercised.
    with torch.no_grad():
        for pname, p in m.named_parameters():
            if pname.startswith("layer_norm_"):
                p.copy_(torch.randn_like(p) * 0.2 + (1.0 if pname.endswith("weight") else 0.0))
    return m


def make_input(kind: str, dims: Dims, dtype=torch.float32, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    shape = (sum(dims.m_splits), dims.hidden) if kind == "grouped" else (dims.batch, dims.seq,
                                                                         dims.hidden)
    return torch.randn(shape, generator=g, dtype=torch.float32).to(dtype)


def run_module(module, kind: str, x, dims: Dims):
    return module(x, list(dims.m_splits)) if kind == "grouped" else module(x)


def make_upstream(shape, dtype=torch.float32, seed: int = 2):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float32).to(dtype)


@dataclass
class Run:
    x: torch.Tensor       # the input (detached)
    y: torch.Tensor       # the output
    dy: torch.Tensor      # the upstream gradient used
    grads: dict           # 'x' and every parameter name -> gradient


def forward_backward(module, kind, x, dims, dy=None, *, recipe=None, seed: int = 3) -> Run:
    """One forward + backward (under autocast when a recipe is given), grads cleared first."""
    module.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_(True)
    torch.manual_seed(seed)  # stochastic-rounding draws (NVFP4 gradients) are repeatable
    with lowprec.autocast(enabled=recipe is not None, recipe=recipe):
        y = run_module(module, kind, x, dims)
    if dy is None:
        dy = make_upstream(y.shape, y.dtype)
    y.backward(dy)
    grads = {"x": x.grad.clone()}
    for pname, p in module.named_parameters():
        grads[pname] = p.grad.clone()
    return Run(x.detach(), y.detach().clone(), dy, grads)


def sqnr_db(ref: torch.Tensor, test: torch.Tensor) -> float:
    ref, test = ref.detach().double(), test.detach().double()
    noise = (ref - test).pow(2).sum()
    if noise == 0:
        return float("inf")
    return float(10 * torch.log10(ref.pow(2).sum() / noise))


# ---- GEMM recorder ------------------------------------------------------------------------
def mat64(t: torch.Tensor, usage: str) -> torch.Tensor:
    """float64 values of mat(t, usage): the (M, K) matrix rowwise, its transpose (K, M)
    columnwise, from the dequantized representation of that usage for quantized tensors."""
    if isinstance(t, QuantizedTensor):
        v = t.dequantize(torch.float32, usage=usage).double()
    else:
        v = t.detach().double()
    m2 = v.reshape(-1, v.shape[-1])
    return m2 if usage == "rowwise" else m2.t()


def shape2d(shape) -> tuple:
    m = 1
    for s in shape[:-1]:
        m *= int(s)
    return (m, int(shape[-1]))


@dataclass
class GemmCall:
    a_cls: type            # class of the operand a (a hybrid: of the sub-tensor a_usage uses)
    a_usage: str
    a_shape: tuple         # nominal shape of operand a
    b_cls: type
    b_usage: str
    b_shape: tuple
    a64: torch.Tensor      # mat(a, a_usage) in float64, from the dequantized operand
    b64: torch.Tensor      # mat(b, b_usage) in float64
    a_deq: torch.Tensor    # a.dequantize(usage=a_usage) (nominal shape/dtype), or a itself
    b_deq: torch.Tensor
    bias: torch.Tensor | None
    out: torch.Tensor

    @property
    def key(self) -> tuple:
        """(a_usage, b_usage, 2-D shape of a, 2-D shape of b): identifies a GEMM of a test."""
        return (self.a_usage, self.b_usage, shape2d(self.a_shape), shape2d(self.b_shape))


def _deq(t, usage):
    if isinstance(t, QuantizedTensor):
        return t.dequantize(usage=usage)
    return t.detach().clone()


@contextlib.contextmanager
def record_gemms():
    """Record every GEMM lowprec.linear_fn runs (it calls ``gemm`` through its module globals).

    The operands are dequantized at call time: the forward frees the rowwise data of the
    tensors it saves right after the fprop GEMM, so they cannot be read afterwards.
    """
    calls: list[GemmCall] = []
    original = lowprec.linear_fn.gemm

    def wrapper(a, a_usage, b, b_usage, *, out_dtype, bias=None):
        rec = dict(a_cls=effective_class(a, a_usage), a_usage=a_usage, a_shape=tuple(a.shape),
                   b_cls=effective_class(b, b_usage), b_usage=b_usage, b_shape=tuple(b.shape),
                   a64=mat64(a, a_usage), b64=mat64(b, b_usage), a_deq=_deq(a, a_usage),
                   b_deq=_deq(b, b_usage), bias=None if bias is None else bias.detach().clone())
        out = original(a, a_usage, b, b_usage, out_dtype=out_dtype, bias=bias)
        calls.append(GemmCall(**rec, out=out.detach().clone()))
        return out

    lowprec.linear_fn.gemm = wrapper
    try:
        yield calls
    finally:
        lowprec.linear_fn.gemm = original


R, C = "rowwise", "columnwise"
E4M3 = torch.float8_e4m3fn


# ================================================================================================
# cached runs (each configuration is run once and shared by the tests that look at it)
# ================================================================================================
@functools.lru_cache(maxsize=None)
def quantized_run(kind: str, rname: str, backward_mode: str = "default"):
    """(module, Run, recorded GEMM calls) of one forward+backward under the recipe."""
    dims = dims_for(rname)
    module = make_module(kind, dims)
    x = make_input(kind, dims)
    recipe = make_recipe(rname, backward_mode=backward_mode)
    if rname == "delayed":
        # Delayed scaling quantizes the first step with scale 1; one step calibrates the scales
        # from the amax history, so the recorded step is a representative one.
        forward_backward(module, kind, x, dims, recipe=recipe)
    with record_gemms() as calls:
        run = forward_backward(module, kind, x, dims, recipe=recipe)
    return module, run, calls


@functools.lru_cache(maxsize=None)
def reference_run(kind: str, dims):
    """The unquantized fp32 module (same weights, same input and upstream gradient)."""
    module = make_module(kind, dims)
    return forward_backward(module, kind, make_input(kind, dims), dims)


# ================================================================================================
# expected GEMM list
# ================================================================================================
def _linear_gemms(m, k, n):
    """Keys of y(m, n) = x(m, k) W(n, k)^T: fprop row/row, dgrad row/col, wgrad col/col."""
    return {"fprop": (R, R, (m, k), (n, k)),
            "dgrad": (R, C, (m, n), (n, k)),
            "wgrad": (C, C, (m, n), (m, k))}


def expected_gemms(kind, dims):
    """{gemm name: {fprop/dgrad/wgrad: key}} in forward order."""
    if kind in ("linear", "ln_linear"):
        return {"main": _linear_gemms(dims.m, dims.hidden, dims.out)}
    if kind.startswith("mlp_"):
        f1 = 2 * dims.ffn if mlp_act(kind) in ("swiglu", "geglu") else dims.ffn
        return {"fc1": _linear_gemms(dims.m, dims.hidden, f1),
                "fc2": _linear_gemms(dims.m, dims.ffn, dims.hidden)}
    return {f"g{i}": _linear_gemms(mi, dims.hidden, dims.out) for i, mi in enumerate(dims.m_splits)}


def match_gemms(calls, kind, dims):
    """Check the recorded GEMM list and return {(gemm name, fprop/dgrad/wgrad): call}."""
    exp = expected_gemms(kind, dims)
    n = len(exp)
    fwd_keys = [g["fprop"] for g in exp.values()]
    bwd_keys = sorted(g[p] for g in exp.values() for p in ("dgrad", "wgrad"))
    assert [c.key for c in calls[:n]] == fwd_keys, "forward GEMMs (fprop row/row, in order)"
    assert sorted(c.key for c in calls[n:]) == bwd_keys, "backward GEMMs (dgrad row/col, wgrad col/col)"
    by_key = {c.key: c for c in calls}
    assert len(by_key) == len(calls), "test shapes must identify every GEMM"
    return {(name, p): by_key[key] for name, g in exp.items() for p, key in g.items()}


# ================================================================================================
# float64 re-derivations of the non-GEMM parts
# ================================================================================================
def act64(name, h):
    if name == "gelu":
        return 0.5 * h * (1 + torch.tanh((2 / torch.pi) ** 0.5 * (h + 0.044715 * h ** 3)))
    if name == "relu":
        return torch.relu(h)
    if name == "swiglu":
        a, b = h.chunk(2, dim=-1)
        return a * torch.sigmoid(a) * b
    raise ValueError(name)


def norm64(module, x64):
    """(norm output, [norm params as float64 leaves]) of LayerNorm/RMSNorm in float64."""
    w = module.layer_norm_weight.detach().double().requires_grad_(True)
    if module.normalization == "LayerNorm":
        b = module.layer_norm_bias.detach().double().requires_grad_(True)
        mu = x64.mean(-1, keepdim=True)
        var = (x64 - mu).pow(2).mean(-1, keepdim=True)
        return (x64 - mu) / torch.sqrt(var + module.eps) * w + b, [w, b]
    rms = torch.sqrt(x64.pow(2).mean(-1, keepdim=True) + module.eps)
    return x64 / rms * w, [w]


def assert_bounded(actual, ref64, bound, what):
    err = (actual.double() - ref64).abs()
    bad = err > bound
    assert not bool(bad.any()), (f"{what}: {int(bad.sum())} elements beyond the bound; worst "
                                 f"err/bound = {float((err / bound).max()):.3g}")


def check_gemm_fp64(call, what):
    """|out - A B^T - bias| <= (K+2) u (|A| |B|^T + |bias|) in float64."""
    ref = call.a64 @ call.b64.t()
    mag = call.a64.abs() @ call.b64.abs().t()
    if call.bias is not None:
        ref = ref + call.bias.double()
        mag = mag + call.bias.double().abs()
    assert float(mag.max()) > 0, f"{what}: degenerate operands"
    k = call.a64.shape[1]
    # Error bound of any fp32 summation order of K exact-in-fp64 products plus the bias add
    # (Higham, gamma_{K+1} <= (K+2) u for K u << 1); the operands are the exact fp32
    # dequantized values the GEMM consumed, so nothing else separates the two.
    assert_bounded(call.out, ref, (k + 2) * FP32_EPS * mag, what)


def check_sum_fp64(actual, terms32, what):
    """Bias gradient = column sum of fp32 terms: |err| <= M u sum|terms| (recursive sum bound)."""
    t = terms32.double().reshape(-1, terms32.shape[-1])
    assert_bounded(actual, t.sum(0), (t.shape[0] + 1) * FP32_EPS * t.abs().sum(0), what)


# ================================================================================================
# 1. every GEMM vs float64 of its dequantized operands; outputs and all gradients tied to them
# ================================================================================================
@pytest.mark.parametrize("rname", RECIPE_NAMES)
@pytest.mark.parametrize("kind", MODULE_NAMES)
def test_gemms_and_grads_match_fp64_of_dequantized_operands(kind, rname):
    dims = dims_for(rname)
    module, run, calls = quantized_run(kind, rname)
    g = match_gemms(calls, kind, dims)
    # (role of a, role of b) per GEMM: fprop X.W, dgrad dY.W, wgrad dY.X
    roles = {"fprop": ("input", "weight"), "dgrad": ("grad", "weight"), "wgrad": ("grad", "input")}

    for (name, p), c in g.items():
        want_a = expected_class(rname, roles[p][0], c.a_usage)
        want_b = expected_class(rname, roles[p][1], c.b_usage)
        assert issubclass(c.a_cls, want_a) and issubclass(c.b_cls, want_b), (
            f"{name}.{p}: operands {c.a_cls.__name__}, {c.b_cls.__name__}; expected "
            f"{want_a.__name__}, {want_b.__name__}")
        check_gemm_fp64(c, f"{kind}/{rname} {name}.{p}")

    grads, dy = run.grads, run.dy
    if kind in ("linear", "ln_linear"):
        fprop, dgrad, wgrad = g["main", "fprop"], g["main", "dgrad"], g["main", "wgrad"]
        assert torch.equal(run.y, fprop.out.reshape(run.y.shape))
        assert torch.equal(grads["weight"], wgrad.out)
        check_sum_fp64(grads["bias"], dy, "bias grad")
        if kind == "linear":
            assert torch.equal(grads["x"], dgrad.out.reshape(run.x.shape))
            dnorm = None
        else:
            dnorm = dgrad.out
    elif kind == "grouped":
        outs = [g[f"g{i}", "fprop"].out for i in range(3)]
        assert torch.equal(run.y, torch.cat(outs))
        assert torch.equal(grads["x"], torch.cat([g[f"g{i}", "dgrad"].out for i in range(3)]))
        for i, dyi in enumerate(torch.split(dy, list(dims.m_splits))):
            assert torch.equal(grads[f"weight{i}"], g[f"g{i}", "wgrad"].out)
            check_sum_fp64(grads[f"bias{i}"], dyi, f"bias{i} grad")
        dnorm = None
    else:  # LayerNormMLP
        assert torch.equal(run.y, g["fc2", "fprop"].out.reshape(run.y.shape))
        assert torch.equal(grads["fc1_weight"], g["fc1", "wgrad"].out)
        assert torch.equal(grads["fc2_weight"], g["fc2", "wgrad"].out)
        check_sum_fp64(grads["fc2_bias"], dy, "fc2_bias grad")
        # fc1's gradient: the activation's backward in float64 from the recorded fc1 output
        # (bias included) and the recorded fc2 dgrad.
        h1 = g["fc1", "fprop"].out.double().requires_grad_(True)
        da = g["fc2", "dgrad"].out.double()
        (dh1,) = torch.autograd.grad(act64(mlp_act(kind), h1), h1, da)
        # fp32 activation backward: a few roundings per element, each of at most the size of
        # the partial derivative times |da|, <= 1.2 |da| (1 + max|h1|) for gelu (|gelu'| <= 1.13),
        # relu and swiglu (|silu'| <= 1.1, |silu(a)| <= |a|); then a recursive sum over M rows.
        da_cols = torch.cat([da, da], -1) if mlp_act(kind) == "swiglu" else da
        scale = 1.2 * (1 + float(h1.detach().abs().max())) * da_cols.abs().sum(0)
        assert_bounded(grads["fc1_bias"], dh1.sum(0), (dims.m + 8) * FP32_EPS * scale,
                       "fc1_bias grad")
        dnorm = g["fc1", "dgrad"].out

    if dnorm is not None:
        # Norm backward in float64 from the recorded dgrad of the first GEMM.
        x64 = run.x.double().requires_grad_(True)
        y64, params = norm64(module, x64)
        refs = torch.autograd.grad(y64, [x64, *params], dnorm.double().reshape(y64.shape))
        names = ["x", "layer_norm_weight", "layer_norm_bias"][:len(refs)]
        for pname, ref in zip(names, refs):
            # fp32 norm forward+backward: elementwise ops plus reductions over K (x) or M rows
            # (params) in blocked order; observed <= 4.2 u max|ref| on these shapes, 32 u max|ref|
            # keeps 8x margin and is still ~3e4x below any quantization effect (>= 2^-4).
            bound = 32 * FP32_EPS * float(ref.abs().max()) * torch.ones_like(ref)
            assert_bounded(grads[pname], ref, bound, f"{pname} grad")


# ================================================================================================
# 2. quantized vs unquantized fp32 module: SQNR per format
# ================================================================================================
# Thresholds sit ~2-3 dB under the values measured on these shapes and seeds (in brackets),
# which follow from the element formats: E4M3 keeps 3 mantissa bits (relative rounding error
# <= 2^-4, ~29 dB per quantized operand, ~28 dB for a product of two), E5M2 2 bits (~6 dB
# less), NVFP4's E2M1 1 bit with 16-element E4M3 block scales (~15-17 dB). Output SQNR depends
# on the forward format, gradient SQNR on the gradient format (and the forward noise they see).
# "mlp": the gradients cross two quantized GEMMs in each direction (~3-4 dB more noise).
# "mlp_relu": relu's step derivative turns forward noise into flipped gradient entries where a
# pre-activation changes sign: an O(1) error on a few percent of entries, hence ~10 dB lower.
FWD_FORMAT = {"delayed": "fp8", "current": "fp8", "block": "fp8", "mxfp8": "fp8",
              "nvfp4": "nvfp4", "custom_mx_nv": "fp8"}
GRAD_FORMAT = {"delayed": "e5m2", "current": "e5m2", "block": "e4m3", "mxfp8": "e4m3",
               "nvfp4": "nvfp4", "custom_mx_nv": "nvfp4"}
OUT_DB = {"fp8": {"single": 25.0,     # [28.3, 29.3]
                  "mlp": 22.0},       # [24.3, 25.9]
          "nvfp4": {"single": 14.0,   # [16.7]
                    "mlp": 10.5}}     # [12.7, 13.5]
GRAD_DB = {"e5m2": {"single": 22.0,     # [24.0, 25.5]
                    "mlp": 18.0,        # [20.1, 23.3]
                    "mlp_relu": 12.5},  # [14.9, 22.9]
           "e4m3": {"single": 25.5,     # [27.8, 29.0]
                    "mlp": 19.5,        # [21.9, 27.9]
                    "mlp_relu": 13.0},  # [15.4, 25.9]
           "nvfp4": {"single": 12.0,    # [14.3, 15.9]
                     "mlp": 6.0,        # [8.0, 15.4]
                     "mlp_relu": 4.5}}  # [6.8, 15.4]


def _group(kind):
    if kind == "mlp_relu":
        return "mlp_relu"
    return "mlp" if kind.startswith("mlp_") else "single"


@pytest.mark.parametrize("rname", RECIPE_NAMES)
@pytest.mark.parametrize("kind", MODULE_NAMES)
def test_sqnr_vs_unquantized(kind, rname):
    dims = dims_for(rname)
    _, run, _ = quantized_run(kind, rname)
    ref = reference_run(kind, dims)
    assert torch.equal(ref.x, run.x) and torch.equal(ref.dy, run.dy)
    group = _group(kind)
    out_min = OUT_DB[FWD_FORMAT[rname]]["mlp" if group != "single" else "single"]
    grad_min = GRAD_DB[GRAD_FORMAT[rname]][group]
    s = sqnr_db(ref.y, run.y)
    # The output must be quantized at all (identical to the fp32 module would be inf dB) ...
    assert s < 60, f"output SQNR {s:.1f} dB: autocast did not quantize"
    # ... and close to the fp32 module within the format's precision.
    assert s >= out_min, f"output SQNR {s:.1f} dB < {out_min}"
    assert set(ref.grads) == set(run.grads)
    for name in ref.grads:
        s = sqnr_db(ref.grads[name], run.grads[name])
        assert s >= grad_min, f"{name} grad SQNR {s:.1f} dB < {grad_min}"


# ================================================================================================
# 3. backward modes: high precision and dequantized backward, bit for bit
# ================================================================================================
def rowwise_forward_quantizers(rname):
    """Independently built (input, weight) quantizers of the recipe's forward, rowwise only."""
    if rname == "current":  # HYBRID: E4M3 forward
        qi, qw = lowprec.Float8CurrentScalingQuantizer(E4M3), lowprec.Float8CurrentScalingQuantizer(E4M3)
    elif rname == "mxfp8":
        qi, qw = lowprec.MXFP8Quantizer(E4M3), lowprec.MXFP8Quantizer(E4M3)
    elif rname == "nvfp4":  # inputs: RHT on the columnwise side only; weights: 16x16 blocks
        qi, qw = lowprec.NVFP4Quantizer(with_rht=True), lowprec.NVFP4Quantizer(with_2d_quantization=True)
    else:
        raise ValueError(rname)
    return [q.set_usage(rowwise=True, columnwise=False) for q in (qi, qw)]


def _act32(name, h):
    """The activations as Transformer Engine defines them (gelu: tanh approximation)."""
    if name == "gelu":
        return F.gelu(h, approximate="tanh")
    if name == "relu":
        return F.relu(h)
    a, b = h.chunk(2, dim=-1)
    return F.silu(a) * b


def _norm32(module, x):
    params = [module.layer_norm_weight.detach().clone().requires_grad_(True)]
    if module.normalization == "LayerNorm":
        params.append(module.layer_norm_bias.detach().clone().requires_grad_(True))
        out = F.layer_norm(x, (x.shape[-1],), params[0], params[1], module.eps)
    else:
        out = F.rms_norm(x, (x.shape[-1],), params[0], module.eps)
    return out, params


def manual_backward(kind, module, run, g, dims, operand):
    """fp32 gradients of the module written out by hand, with each GEMM's backward operands
    ``operand(t, 'input'|'weight')`` of the forward tensor t (original or dequantized).

    dgrad = dY @ W, wgrad = dY^T @ X, bias grad = column sum: the products the spec defines
    for high-precision backward GEMMs. Returns (grads, {gemm name: (gemm input, weight)}).
    """
    dy, x = run.dy, run.x
    lin = lambda dy2, X2, W: (dy2 @ W, dy2.t() @ X2, dy2.sum(0))  # noqa: E731
    if kind == "linear":
        dx, dw, db = lin(dy.reshape(-1, dims.out), operand(x, "input").reshape(-1, dims.hidden),
                         operand(module.weight, "weight"))
        return {"x": dx.reshape(x.shape), "weight": dw, "bias": db}, {"main": (x, module.weight)}
    if kind == "grouped":
        grads, fwd_in, dxs = {}, {}, []
        for i, (xi, dyi) in enumerate(zip(torch.split(x, list(dims.m_splits)),
                                          torch.split(dy, list(dims.m_splits)))):
            w = getattr(module, f"weight{i}")
            dxi, grads[f"weight{i}"], grads[f"bias{i}"] = lin(dyi, operand(xi, "input"),
                                                              operand(w, "weight"))
            dxs.append(dxi)
            fwd_in[f"g{i}"] = (xi, w)
        grads["x"] = torch.cat(dxs)
        return grads, fwd_in

    xl = x.clone().requires_grad_(True)
    ln, norm_params = _norm32(module, xl)
    norm_names = ["layer_norm_weight", "layer_norm_bias"][:len(norm_params)]
    if kind == "ln_linear":
        dln, dw, db = lin(dy.reshape(-1, dims.out), operand(ln.detach(), "input").reshape(-1, dims.hidden),
                          operand(module.weight, "weight"))
        grads = {"weight": dw, "bias": db}
        fwd_in = {"main": (ln.detach(), module.weight)}
    else:  # LayerNormMLP; fc1's output is taken from the run (quantized forward)
        f1 = module.fc1_weight.shape[0]
        h1 = g["fc1", "fprop"].out.reshape(*x.shape[:-1], f1).requires_grad_(True)
        a = _act32(mlp_act(kind), h1)
        da, dw2, db2 = lin(dy.reshape(-1, dims.hidden),
                           operand(a.detach(), "input").reshape(-1, dims.ffn),
                           operand(module.fc2_weight, "weight"))
        (dh1,) = torch.autograd.grad(a, h1, da.reshape(a.shape))
        dln, dw1, db1 = lin(dh1.reshape(-1, f1), operand(ln.detach(), "input").reshape(-1, dims.hidden),
                            operand(module.fc1_weight, "weight"))
        grads = {"fc1_weight": dw1, "fc1_bias": db1, "fc2_weight": dw2, "fc2_bias": db2}
        fwd_in = {"fc1": (ln.detach(), module.fc1_weight), "fc2": (a.detach(), module.fc2_weight)}
    dnorm = torch.autograd.grad(ln, [xl, *norm_params], dln.reshape(ln.shape))
    grads.update(zip(["x", *norm_names], dnorm))
    return grads, fwd_in


BWD_RECIPES = ["current", "mxfp8", "nvfp4"]
BWD_KINDS = ["linear", "ln_linear", "mlp_gelu", "mlp_swiglu", "grouped"]


@pytest.mark.parametrize("mode", ["high_precision", "dequantized"])
@pytest.mark.parametrize("rname", BWD_RECIPES)
@pytest.mark.parametrize("kind", BWD_KINDS)
def test_backward_modes_bit_exact(kind, rname, mode):
    dims = dims_for(rname)
    module, run, calls = quantized_run(kind, rname, mode)
    g = match_gemms(calls, kind, dims)
    qi, qw = rowwise_forward_quantizers(rname)
    qdq = lambda q, t: q.quantize(t.detach()).dequantize()  # noqa: E731
    if mode == "high_precision":
        operand = lambda t, role: t.detach()  # noqa: E731
    else:
        operand = lambda t, role: qdq(qi if role == "input" else qw, t)  # noqa: E731
    expected, fwd_in = manual_backward(kind, module, run, g, dims, operand)

    for (name, p), c in g.items():
        if p == "fprop":
            # The forward is quantized in every mode: exactly the independent rowwise quantization.
            gin, w = fwd_in[name]
            assert issubclass(c.a_cls, QuantizedTensor) and issubclass(c.b_cls, QuantizedTensor)
            assert torch.equal(c.a_deq, qdq(qi, gin).reshape(c.a_deq.shape)), f"{name} fprop input"
            assert torch.equal(c.b_deq, qdq(qw, w)), f"{name} fprop weight"
        else:
            assert not issubclass(c.a_cls, QuantizedTensor), f"{name}.{p}: quantized gradient"
            assert not issubclass(c.b_cls, QuantizedTensor), f"{name}.{p}: quantized operand"
    assert set(expected) == set(run.grads)
    for name, ref in expected.items():
        assert torch.equal(run.grads[name], ref), f"{mode} {name} grad differs from the manual backward"

    if mode == "high_precision" and not kind.startswith("mlp_"):
        # Without a quantized activation in between, the gradients are those of the
        # unquantized module given the same upstream gradient, bit for bit.
        ref = reference_run(kind, dims)
        assert torch.equal(ref.dy, run.dy)
        assert sqnr_db(ref.y, run.y) < 60, "the forward must still be quantized"
        for name, t in ref.grads.items():
            assert torch.equal(run.grads[name], t), f"{name} grad differs from the unquantized module"


# ================================================================================================
# 4. GroupedLinear == one Linear per group, bit for bit
# ================================================================================================
@pytest.mark.parametrize("rname", RECIPE_NAMES)
def test_grouped_equals_per_group_linears(rname):
    dims = dims_for(rname)
    splits = list(dims.m_splits)  # multiples of the format's block (128 for block FP8)
    grouped = make_module("grouped", dims)
    lins = []
    for i in range(3):
        lin = lowprec.Linear(dims.hidden, dims.out, name="grp")
        with torch.no_grad():
            lin.weight.copy_(getattr(grouped, f"weight{i}"))
            lin.bias.copy_(getattr(grouped, f"bias{i}"))
        lins.append(lin)
    recipe = make_recipe(rname)
    # Two steps: delayed scaling's second step uses scales updated from each group's own amaxes.
    for step in range(2):
        x = make_input("grouped", dims, seed=10 + step)
        dy = make_upstream((sum(splits), dims.out), seed=20 + step)
        run = forward_backward(grouped, "grouped", x, dims, dy, recipe=recipe, seed=30 + step)

        for lin in lins:
            lin.zero_grad(set_to_none=True)
        xl = x.clone().requires_grad_(True)
        # Same seed and the same graph shape (split -> Linears in group order -> cat), so the
        # backward runs the groups in the same order and stochastic rounding draws the same
        # numbers for the same group.
        torch.manual_seed(30 + step)
        with lowprec.autocast(recipe=recipe):
            y = torch.cat([lin(xi) for lin, xi in zip(lins, torch.split(xl, splits))])
        y.backward(dy)

        assert torch.equal(run.y, y.detach()), f"step {step}: forward"
        assert torch.equal(run.grads["x"], xl.grad), f"step {step}: input grad"
        for i, lin in enumerate(lins):
            assert torch.equal(run.grads[f"weight{i}"], lin.weight.grad), f"step {step}: weight{i}"
            assert torch.equal(run.grads[f"bias{i}"], lin.bias.grad), f"step {step}: bias{i}"


# ================================================================================================
# 5. what the default backward mode saves
# ================================================================================================
def _nbytes(t):
    """Bytes actually held: the inner tensors of a quantized tensor (recursively for hybrids)."""
    if isinstance(t, QuantizedTensor):
        return sum(_nbytes(v) for v in t.inner_tensors().values() if v is not None)
    return t.nbytes


# Saved bytes / bf16 bytes of (input + weight). FP8 data is 1 byte vs 2; the scales add at most
# 4 B per 128 elements (1x128 fp32 block scales: +1.6%) or 1 B per 32 (MXFP8 E8M0: +1.6%):
# <= 0.52. NVFP4: 0.5 B of data + 1 B E4M3 scale per 16 elements (0.5625 / 2 = 0.281): <= 0.29.
# The custom recipe saves NVFP4 columnwise data (its hybrids' backward side).
SAVED_RATIO = {"delayed": 0.52, "current": 0.52, "block": 0.52, "mxfp8": 0.52, "nvfp4": 0.29,
               "custom_mx_nv": 0.29}


@pytest.mark.parametrize("needs", ["both", "input_only", "weight_only"])
@pytest.mark.parametrize("rname", RECIPE_NAMES)
def test_default_mode_saves_only_columnwise_quantized(rname, needs):
    dims = dims_for(rname)
    lin = make_module("linear", dims, dtype=torch.bfloat16)
    x = make_input("linear", dims, dtype=torch.bfloat16)
    need_dx = needs in ("both", "input_only")
    need_dw = needs in ("both", "weight_only")
    x.requires_grad_(need_dx)
    lin.weight.requires_grad_(need_dw)
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with lowprec.autocast(recipe=make_recipe(rname)):
            y = lin(x)
    big = {x.numel(), lin.weight.numel()}
    quantized = [t for t in saved if isinstance(t, QuantizedTensor)]
    for t in saved:
        if not isinstance(t, QuantizedTensor):
            assert not (t.is_floating_point() and t.numel() in big), (
                f"a plain {t.dtype} tensor of shape {tuple(t.shape)} was saved for backward")
    # dgrad needs the weight, wgrad the input: exactly those, as columnwise quantized tensors.
    want = sorted(([tuple(lin.weight.shape)] if need_dx else []) + ([tuple(x.shape)] if need_dw else []))
    assert sorted(tuple(t.shape) for t in quantized) == want
    for t in quantized:
        role = "weight" if tuple(t.shape) == tuple(lin.weight.shape) else "input"
        assert issubclass(effective_class(t, "columnwise"), expected_class(rname, role, "columnwise"))
        assert t.has_usage("columnwise") and not t.has_usage("rowwise"), repr(t)
    hp_bytes = 2 * (x.numel() + lin.weight.numel())  # bf16 input + weight
    ratio = sum(_nbytes(t) for t in saved) / hp_bytes
    assert ratio <= SAVED_RATIO[rname], f"saved {ratio:.3f} of the bf16 input+weight bytes"
    y.float().sum().backward()  # the saved tensors are enough for the backward
    assert (x.grad is not None) == need_dx and (lin.weight.grad is not None) == need_dw


# ================================================================================================
# 6. errors
# ================================================================================================
def _weight_none_factory(role):
    if role is not None and role.tensor_type == "weight":
        return None
    return lowprec.MXFP8Quantizer()


@pytest.mark.parametrize("rname,k,block", [("mxfp8", 48, 32), ("nvfp4", 24, 16), ("block", 64, 128)])
def test_unaligned_shape_raises_value_error_naming_shape(rname, k, block):
    lin = lowprec.Linear(k, 64)
    x = torch.randn(2, 64, k)
    with pytest.raises(ValueError) as exc:
        with lowprec.autocast(recipe=make_recipe(rname)):
            lin(x)
    msg = str(exc.value)
    # The input (2, 64, K) or the weight (64, K) is the first tensor that does not fit.
    assert re.search(rf"\(2, 64, {k}\)|\(64, {k}\)", msg), msg
    assert str(block) in msg, msg


def test_per_tensor_fp8_accepts_any_shape():
    # Control for the test above: per-tensor scaling has no block, K=48 works and is accurate.
    torch.manual_seed(0)
    lin = lowprec.Linear(48, 40)
    x = torch.randn(3, 5, 48)
    with lowprec.autocast(recipe=lowprec.Float8CurrentScaling()):
        y = lin(x)
    assert sqnr_db(F.linear(x, lin.weight, lin.bias), y.detach()) > 25  # E4M3: ~28-29 dB


@pytest.mark.parametrize("kind", ["linear", "grouped"])
@pytest.mark.parametrize("quantized", [False, True])
def test_input_dtype_mismatch_raises_type_error(kind, quantized):
    module = make_module(kind, SMALL_DIMS)  # fp32 weights
    x = make_input(kind, SMALL_DIMS, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="dtype"):
        with lowprec.autocast(enabled=quantized, recipe=lowprec.MXFP8BlockScaling()):
            if kind == "grouped":
                module(x, list(SMALL_DIMS.m_splits))
            else:
                module(x)


def test_custom_factory_returning_none_names_the_role():
    lin = lowprec.Linear(64, 64, name="my_layer")
    with pytest.raises(ValueError) as exc:
        with lowprec.autocast(recipe=lowprec.CustomRecipe(qfactory=_weight_none_factory)):
            lin(torch.randn(32, 64))
    msg = str(exc.value)
    assert "weight" in msg and "my_layer" in msg, msg


@pytest.mark.parametrize("mode", ["high_precision", "dequantized", "unquant", "dequant"])
def test_delayed_scaling_rejects_non_default_backward_mode(mode, monkeypatch):
    monkeypatch.delenv("LOWPREC_BACKWARD_MODE", raising=False)
    with pytest.raises(ValueError, match="backward_mode"):
        lowprec.DelayedScaling(backward_mode=mode)
    # The same mode from the environment variable is rejected too.
    monkeypatch.setenv("LOWPREC_BACKWARD_MODE", mode)
    with pytest.raises(ValueError):
        lowprec.DelayedScaling()
    assert lowprec.Float8CurrentScaling().backward_mode in ("high_precision", "dequantized")


# ================================================================================================
# 7. outside autocast: high precision; the identity recipe is no quantization
# ================================================================================================
@contextlib.contextmanager
def _nested_disabled():
    with lowprec.autocast(recipe=lowprec.NVFP4BlockScaling()):
        with lowprec.autocast(enabled=False):
            yield


@pytest.mark.parametrize("region", ["none", "disabled", "disabled_inside_enabled"])
def test_linear_outside_autocast_is_torch_linear(region):
    dims = SMALL_DIMS
    lin = make_module("linear", dims)
    x = make_input("linear", dims).requires_grad_(True)
    ctx = {"none": contextlib.nullcontext,
           "disabled": lambda: lowprec.autocast(enabled=False, recipe=lowprec.MXFP8BlockScaling()),
           "disabled_inside_enabled": _nested_disabled}[region]
    with ctx():
        y = lin(x)
    dy = make_upstream(y.shape)
    y.backward(dy)
    xb = x.detach().clone().requires_grad_(True)
    w = lin.weight.detach().clone().requires_grad_(True)
    b = lin.bias.detach().clone().requires_grad_(True)
    yb = F.linear(xb, w, b)
    yb.backward(dy)
    # lowprec runs addmm, F.linear may sum in another order: both are fp32 GEMMs over K = 64
    # (forward/dgrad) or M = 64 (wgrad, bias) terms of size ~1, so they may differ by a few
    # fp32 ulps (~1e-7 of values up to ~10): 1e-6 relative and absolute covers that, while any
    # quantization (>= 2^-4 relative error) is far outside.
    for got, want in ((y, yb), (x.grad, xb.grad), (lin.weight.grad, w.grad), (lin.bias.grad, b.grad)):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def _identity_factory(role):
    return lowprec.IdentityQuantizer()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", MODULE_NAMES)
def test_identity_recipe_is_bit_identical_to_no_autocast(kind, dtype):
    dims = SMALL_DIMS
    module = make_module(kind, dims, dtype=dtype)
    x = make_input(kind, dims, dtype=dtype)
    plain = forward_backward(module, kind, x, dims)
    ident = forward_backward(module, kind, x, dims, plain.dy,
                             recipe=lowprec.CustomRecipe(qfactory=_identity_factory))
    assert plain.y.dtype == dtype and ident.y.dtype == dtype
    assert torch.equal(plain.y, ident.y)
    assert set(plain.grads) == set(ident.grads)
    for name, t in plain.grads.items():
        assert torch.equal(t, ident.grads[name]), name
