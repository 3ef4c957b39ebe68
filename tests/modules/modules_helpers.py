"""Shared helpers of the module tests (``test_modules.py``, ``test_module_backward.py``):
recipes, sizes, module builders, forward/backward runs, SQNR, and a recorder of every GEMM
the modules run with float64 checks of its result."""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass

import torch
from helpers import sqnr_db  # noqa: F401 - the module tests import it from here

import lowprec
import lowprec.linear.function
from lowprec.formats.base import QuantizedTensor
from lowprec.recipe.recipes import Recipe

# ================================================================================================
# helpers: recipes, sizes, modules, runs, SQNR, the GEMM recorder
# ================================================================================================
FP32_EPS = 2.0 ** -24  # unit roundoff of fp32 (round to nearest)

# ---- recipes ------------------------------------------------------------------------------
# test id -> Recipe.from_name name
RECIPES = {name: functools.partial(Recipe.from_name, table_name) for name, table_name in (
    ("delayed", "fp8_delayed"), ("current", "fp8_current"), ("block", "fp8_block"),
    ("mxfp8", "mxfp8"), ("nvfp4", "nvfp4"), ("custom_mx_nv", "mxfp8_fwd_nvfp4_bwd"))}
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
def spy_gemms(describe, make=dict):
    """Patch ``lowprec.linear.function.gemm`` (which the modules call through its module globals):
    each call appends ``make(rec)``, ``rec`` being ``describe(a, a_usage, b, b_usage, bias)``
    (a dict taken before the GEMM runs) plus ``out``. Yields the list.

    The operands must be described at call time: the forward frees the rowwise data of the
    tensors it saves right after the fprop GEMM, so they cannot be read afterwards.
    """
    calls = []
    original = lowprec.linear.function.gemm

    def wrapper(a, a_usage, b, b_usage, *, out_dtype, bias=None):
        rec = describe(a, a_usage, b, b_usage, bias)
        out = original(a, a_usage, b, b_usage, out_dtype=out_dtype, bias=bias)
        rec["out"] = out.detach().clone()
        calls.append(make(rec))
        return out

    lowprec.linear.function.gemm = wrapper
    try:
        yield calls
    finally:
        lowprec.linear.function.gemm = original


def _describe(a, a_usage, b, b_usage, bias) -> dict:
    return dict(a_cls=effective_class(a, a_usage), a_usage=a_usage, a_shape=tuple(a.shape),
                b_cls=effective_class(b, b_usage), b_usage=b_usage, b_shape=tuple(b.shape),
                a64=mat64(a, a_usage), b64=mat64(b, b_usage), a_deq=_deq(a, a_usage),
                b_deq=_deq(b, b_usage), bias=None if bias is None else bias.detach().clone())


def record_gemms():
    """Record every GEMM lowprec.linear.function runs as a :class:`GemmCall`."""
    return spy_gemms(_describe, lambda rec: GemmCall(**rec))


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
    assert sorted(c.key for c in calls[n:]) == bwd_keys, (
        "backward GEMMs (dgrad row/col, wgrad col/col)")
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
