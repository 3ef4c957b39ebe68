"""Shared helpers for the module tests: recipes, sizes, module builders, a GEMM recorder, SQNR."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import pytest
import torch

import lowprec
import lowprec.linear_fn
from lowprec import factories
from lowprec.formats.base import QuantizedTensor

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
    a_held: tuple          # (rowwise, columnwise) held by a at call time
    b_held: tuple
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


def _held(t):
    if isinstance(t, QuantizedTensor):
        return (t.has_usage("rowwise"), t.has_usage("columnwise"))
    return (True, True)


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
                   b_cls=effective_class(b, b_usage),
                   b_usage=b_usage, b_shape=tuple(b.shape), a_held=_held(a), b_held=_held(b),
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


@pytest.fixture
def gemm_log():
    with record_gemms() as calls:
        yield calls
