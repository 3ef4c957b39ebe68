"""One traced linear for every quantizer (lowprec/linear/traced.py): under torch.compile
a Linear, LayerNormLinear and LayerNormMLP trace into the graph (no opaque
``lowprec::call``) under every named recipe, the custom and hybrid ones, the identity
recipe and every backward mode, with eager's forward and gradients bit for bit."""

from __future__ import annotations

import pytest
import torch
from helpers import GraphOps, cases, train_layers

import lowprec
from lowprec.compile.call import fallback_reasons
from lowprec.formats import IdentityQuantizer
from lowprec.recipe import factories
from lowprec.recipe.recipes import (
    CustomRecipe,
    DelayedScaling,
    Float8BlockScaling,
    Float8CurrentScaling,
    MXFP8BlockScaling,
    NVFP4BlockScaling,
)

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])

RECIPES = {
    "current": lambda: Float8CurrentScaling(),
    "delayed": lambda: DelayedScaling(),
    "block": lambda: Float8BlockScaling(),
    "mxfp8": lambda: MXFP8BlockScaling(),
    "nvfp4": lambda: NVFP4BlockScaling(),
    "fp8_row_mxfp8_col": lambda: CustomRecipe(factories.fp8_row_mxfp8_col_factory),
    "mxfp8_fwd_nvfp4_bwd": lambda: CustomRecipe(factories.mxfp8_fwd_nvfp4_bwd_factory),
    "nvfp4_fp8_head": lambda: CustomRecipe(factories.NVFP4ExceptLayers(("l",))),
    "identity": lambda: CustomRecipe(lambda role: IdentityQuantizer()),
    "current_high_precision": lambda: Float8CurrentScaling(backward_mode="high_precision"),
    "current_dequantized": lambda: Float8CurrentScaling(backward_mode="dequantized"),
    "mxfp8_dequantized": lambda: MXFP8BlockScaling(backward_mode="dequantized"),
    "nvfp4_high_precision": lambda: NVFP4BlockScaling(backward_mode="high_precision"),
}

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def _step(fn, module, x, dy, recipe, seed):
    x = x.detach().clone().requires_grad_(True)
    for p in module.parameters():
        p.grad = None
    torch.manual_seed(seed)  # the same stochastic-rounding draws
    with lowprec.autocast(recipe=recipe):
        y = fn(x)
    y.backward(dy)
    return [y.detach(), x.grad] + [p.grad.clone() for p in module.parameters()]


def _sizes(device: str) -> tuple[int, int]:
    """(K, N): on CUDA large enough that cuBLAS's block-scaled GEMMs take every pair
    (128x128 weight blocks contracted over a multiple of 512)."""
    return (512, 512) if device == "cuda" else (256, 128)


def _module(kind: str, device: str, dtype):
    torch.manual_seed(0)
    k, n = _sizes(device)
    if kind == "linear":
        # with a bias, bf16 GEMMs of exact values take cuBLAS's epilogue on CUDA, which
        # a compiled graph may run apart: those calls stay opaque (see test below)
        return lowprec.Linear(k, n, bias=device == "cpu", name="l", params_dtype=dtype,
                              device=device)
    if kind == "layernorm_linear":
        return lowprec.LayerNormLinear(k, n, bias=False, name="l", params_dtype=dtype,
                                       device=device)
    return lowprec.LayerNormMLP(k, n, bias=False, name="l", params_dtype=dtype,
                                device=device)


#: the recipes LayerNormMLP runs on the CPU without --slow; LayerNormLinear runs the
#: others (Linear every recipe): each recipe on a Linear and on one norm module, the
#: delayed-scaling exception of LayerNormMLP and both halves of the hybrid among them
_MLP_QUICK = {"current", "delayed", "block", "mxfp8_fwd_nvfp4_bwd", "identity",
              "current_dequantized", "nvfp4_high_precision"}


@pytest.mark.parametrize("kind, recipe_name, device", cases(
    {"kind": ["linear", "layernorm_linear", "layernorm_mlp"], "recipe_name": list(RECIPES),
     "device": DEVICES},
    lambda kind, recipe_name, device: device != "cpu" or kind == "linear"
    or (recipe_name in _MLP_QUICK) == (kind == "layernorm_mlp")))
def test_every_recipe_traces_bit_identical(device, recipe_name, kind):
    recipe = RECIPES[recipe_name]()
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    m = _module(kind, device, dtype)
    k, n = _sizes(device)
    x = torch.randn(2, 128, k, device=device, dtype=dtype)
    dy = torch.randn(2, 128, k if kind == "layernorm_mlp" else n, device=device, dtype=dtype)
    want = [_step(m, m, x, dy, recipe, seed) for seed in (1, 2)]  # eager makes any state
    ops = GraphOps()
    compiled = torch.compile(m, backend=ops, fullgraph=True)
    got = [_step(compiled, m, x, dy, recipe, seed) for seed in (1, 2)]
    if recipe_name == "delayed":  # eager's two steps moved the state: compare afresh
        want = [_step(m, m, x, dy, recipe, 3)]
        got = [_step(compiled, m, x, dy, recipe, 3)]
    for w_step, g_step in zip(want, got):
        for w, g in zip(w_step, g_step):
            assert torch.equal(w, g)
    if not (kind == "layernorm_mlp" and recipe_name == "delayed"):
        assert not any("lowprec.call" in t for t in ops.targets), fallback_reasons()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("recipe_name", [
    # with --slow: per-tensor FP8, and the hybrid, whose halves run under inductor by
    # default in test_traced (MXFP8) and test_traced_nvfp4 (NVFP4); its C++ kernels take
    # about 30 s to build on an empty cache
    pytest.param("current", marks=pytest.mark.slow), "fp8_row_mxfp8_col",
    pytest.param("mxfp8_fwd_nvfp4_bwd", marks=pytest.mark.slow), "current_dequantized"])
def test_inductor_bit_identical(device, recipe_name):
    recipe = RECIPES[recipe_name]()
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    m = _module("linear", device, dtype)
    k, n = _sizes(device)
    x = torch.randn(2, 128, k, device=device, dtype=dtype)
    dy = torch.randn(2, 128, n, device=device, dtype=dtype)
    want = _step(m, m, x, dy, recipe, 1)
    got = _step(torch.compile(m, backend="inductor", fullgraph=True), m, x, dy, recipe, 1)
    for w, g in zip(want, got):
        assert torch.equal(w, g)


class _HeldFactory:
    """A ``CustomRecipe`` factory handing out ``Float8Quantizer``s over tensors it holds
    (static scales the user sets; amaxes recorded into them), one per tensor type."""

    def __init__(self, device):
        self.q = {t: lowprec.Float8Quantizer(torch.full((1,), s, device=device),
                                             torch.zeros(1, device=device), dt)
                  for t, s, dt in (("input", 8.0, torch.float8_e4m3fn),
                                   ("weight", 64.0, torch.float8_e4m3fn),
                                   ("grad_output", 2.0, torch.float8_e5m2))}

    def __call__(self, role):
        if role is None or role.tensor_type not in self.q:
            return IdentityQuantizer()
        return self.q[role.tensor_type]

    def amaxes(self):
        return [q.amax.clone() for q in self.q.values()]

    def reset(self):
        for q in self.q.values():
            q.amax.zero_()


@pytest.mark.parametrize("device", DEVICES)
def test_factory_held_float8_quantizers_trace(device):
    """A factory's own ``Float8Quantizer``s trace (no opaque call): the compiled step casts
    with the scales they hold at each call (graph inputs: a changed scale takes effect
    without a recompile) and records the same amaxes as eager, bit for bit."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    m = _module("linear", device, dtype)
    k, n = _sizes(device)
    x = torch.randn(2, 128, k, device=device, dtype=dtype)
    dy = torch.randn(2, 128, n, device=device, dtype=dtype)
    held = _HeldFactory(device)
    recipe = CustomRecipe(held)
    ops, compiles = GraphOps(), [0]

    def backend(gm, inputs):
        compiles[0] += 1
        return ops(gm, inputs)
    compiled = torch.compile(m, backend=backend, fullgraph=True)
    for scale in (8.0, 0.5):
        held.q["input"].scale.fill_(scale)
        held.reset()
        want = _step(m, m, x, dy, recipe, 1)
        want_amax = held.amaxes()
        held.reset()
        got = _step(compiled, m, x, dy, recipe, 1)
        for w, g in zip(want + want_amax, got + held.amaxes()):
            assert torch.equal(w, g)
        assert all(float(a) > 0 for a in want_amax)
    assert not any("lowprec.call" in t for t in ops.targets), fallback_reasons()
    assert compiles == [1]  # one graph for both scales: the scale is read when it runs


def test_layers_share_compiled_code_under_a_custom_recipe():
    """Same-shaped layers whose quantizers agree share one compiled code, whatever their
    names: tracing reads the quantizers' settings, not the roles' names."""
    from torch._dynamo.utils import counters

    recipe = CustomRecipe(factories.fp8_row_mxfp8_col_factory)
    layers = [lowprec.Linear(64, 64, name=f"layers.{i}.proj") for i in range(4)]
    for layer in layers:
        layer.compile(backend="aot_eager", fullgraph=True)
    counters.clear()
    train_layers(layers, recipe, torch.randn(32, 64, requires_grad=True))
    assert counters["stats"]["unique_graphs"] == 1


@pytest.mark.parametrize("device", DEVICES)
def test_compiles_once_when_triton_was_never_asked(device, monkeypatch):
    """The first trace may be the process's first question about Triton (whether kernels
    run): its answer is a constant to dynamo, not a guard on the cached flag that the
    question sets, which recompiled every model on its second call."""
    from torch._dynamo.utils import counters

    import lowprec.kernels
    monkeypatch.setattr(lowprec.kernels, "_triton_found", None)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    m = lowprec.Linear(128, 128, params_dtype=dtype, device=device)
    m.compile(backend="aot_eager", fullgraph=True)
    counters.clear()
    x = torch.randn(32, 128, device=device, dtype=dtype, requires_grad=True)
    for _ in range(2):
        with lowprec.autocast(recipe=Float8CurrentScaling()):
            y = m(x)
        y.float().sum().backward()
    assert counters["stats"]["unique_graphs"] == 1


@pytest.mark.parametrize("device,dtype", [("cpu", torch.float32)] + (
    [("cuda", torch.bfloat16), ("cuda", torch.float32)] if torch.cuda.is_available() else []))
def test_bias_epilogue_traces(device, dtype):
    """MXFP8's bf16 GEMM with a bias traces: on CUDA with a bf16 output eager's cuBLAS
    epilogue is one op the compiler keeps whole (``lowprec::addmm``); with an fp32 output
    the GEMM writes fp32 and eager's epilogue kernel adds the bias; elsewhere the fp32
    emulation's bias add."""
    recipe = MXFP8BlockScaling()
    torch.manual_seed(0)
    m = lowprec.Linear(256, 128, name="l", params_dtype=dtype, device=device)
    x = torch.randn(64, 256, device=device, dtype=dtype)
    dy = torch.randn(64, 128, device=device, dtype=dtype)
    want = _step(m, m, x, dy, recipe, 1)
    ops = GraphOps()
    got = _step(torch.compile(m, backend=ops, fullgraph=True), m, x, dy, recipe, 1)
    for w, g in zip(want, got):
        assert torch.equal(w, g)
    assert not any("lowprec.call" in t for t in ops.targets)
    assert any("lowprec.addmm" in t for t in ops.targets) == (dtype == torch.bfloat16)
