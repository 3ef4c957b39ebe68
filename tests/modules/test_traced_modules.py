"""LayerNormLinear and LayerNormMLP under torch.compile: the norm and the activation as one
op each around eager's computation (``lowprec.fused.graph``) and the linears traced
(``lowprec.linear.traced``), no opaque ``lowprec::call``; forward, input and parameter
gradients equal eager's bit for bit, on CUDA where eager fuses the producer into the
quantize kernel too. Calls the traced path does not take keep the opaque op."""

from __future__ import annotations

import pytest
import torch
from helpers import GraphOps, cases

import lowprec
from lowprec import fused
from lowprec.formats import Float8CurrentScalingQuantizer, NVFP4Quantizer
from lowprec.recipe.recipes import (
    DelayedScaling,
    Float8BlockScaling,
    Float8CurrentScaling,
    MXFP8BlockScaling,
    NVFP4BlockScaling,
)

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
RECIPES = {"current": Float8CurrentScaling(), "block": Float8BlockScaling(),
           "mxfp8": MXFP8BlockScaling(), "nvfp4": NVFP4BlockScaling(),
           "delayed": DelayedScaling(amax_history_len=2),
           "mxfp8_2d": MXFP8BlockScaling(enable_2d_quantization=True)}
# cuBLAS's 128x128-block GEMMs contract over multiples of 512
HIDDEN = FFN = 512


pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def _module(kind: str, device, dtype, bias: bool):
    kw = dict(params_dtype=dtype, device=device, bias=bias)
    if kind == "ln_linear":
        return lowprec.LayerNormLinear(HIDDEN, 512, name="n", **kw)
    if kind == "rms_linear_zc":
        return lowprec.LayerNormLinear(HIDDEN, 512, name="n", normalization="RMSNorm",
                                       zero_centered_gamma=True, **kw)
    if kind == "ln_linear_out":
        return lowprec.LayerNormLinear(HIDDEN, 512, name="n", return_layernorm_output=True,
                                       **kw)
    act = "gelu" if kind == "mlp_gelu" else "swiglu"
    norm = "LayerNorm" if kind == "mlp_gelu" else "RMSNorm"
    return lowprec.LayerNormMLP(HIDDEN, FFN, name="n", activation=act, normalization=norm,
                                **kw)


def _perturb(m: torch.nn.Module) -> None:
    """Norm parameters away from their 1/0 initialization, so they take part."""
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.startswith("layer_norm_"):
                p.add_((torch.randn(p.shape, generator=g) * 0.1).to(p.device, p.dtype))


def _run(fn, m, x, dy, recipe, steps=1):
    torch.manual_seed(5)  # NVFP4 draws dY's stochastic-rounding keys: the same ones each run
    outs = []
    for _ in range(steps):
        x = x.detach().clone().requires_grad_(True)
        for p in m.parameters():
            p.grad = None
        with lowprec.autocast(enabled=recipe is not None, recipe=recipe):
            y = fn(x)
        ys = y if isinstance(y, tuple) else (y,)
        torch.autograd.backward(ys, [dy] + [torch.ones_like(t) for t in ys[1:]])
        outs = [t.detach() for t in ys] + [x.grad] + [p.grad.clone() for p in m.parameters()]
    return outs


def _case(kind, recipe_name, device, bias, backend):
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    recipe = RECIPES[recipe_name]
    torch.manual_seed(0)
    a = _module(kind, device, dtype, bias)
    _perturb(a)
    b = _module(kind, device, dtype, bias)
    b.load_state_dict(a.state_dict())
    x = torch.randn(2, 128, HIDDEN, device=device, dtype=dtype) * 2 + 0.3
    n_out = 512
    dy = torch.randn(2, 128, n_out, device=device, dtype=dtype)
    ops = GraphOps()
    compiled = torch.compile(b, backend=ops if backend == "aot_eager" else backend,
                             fullgraph=True)
    # delayed scaling: the first call may be the opaque op (it makes the module's state,
    # or on CUDA seeds its scales), the next ones trace
    steps = 2 if recipe_name == "delayed" else 1
    want = _run(a, a, x, dy, recipe, steps)
    got = _run(compiled, b, x, dy, recipe, steps)
    return want, got, ops


def _assert_same(want, got):
    assert len(want) == len(got)
    for i, (w, g) in enumerate(zip(want, got)):
        assert w.dtype == g.dtype and torch.equal(w, g), i


def _traced_graphs(ops: GraphOps) -> bool:
    """Whether the steady graphs hold no opaque op (delayed scaling too: on the CPU a
    module's state is made as the compiler traces its first call; on CUDA the first call
    is the opaque op while its slots have no scales, and the next one traces)."""
    return not any(t.startswith("lowprec.call.") for t in ops.steady())


@pytest.mark.parametrize("device, recipe_name, kind", cases(
    {"device": DEVICES, "recipe_name": ["current", "block", "mxfp8", "nvfp4"],
     "kind": ["ln_linear", "rms_linear_zc", "ln_linear_out", "mlp_gelu", "mlp_swiglu"]},
    # on the CPU, block and NVFP4 on one norm module and one MLP (their forms are the
    # Linear's; the norm and activation pieces are the recipe's to the others)
    lambda device, recipe_name, kind: device == "cuda" or recipe_name in ("current", "mxfp8")
    or kind in ("ln_linear", "mlp_swiglu")))
def test_traced_modules_bit_identical(kind, recipe_name, device):
    """aot_eager: the graph's ops are eager's; no opaque call (MXFP8 with a bias on CUDA
    keeps it, as for Linear)."""
    bias = not (device == "cuda" and recipe_name == "mxfp8")
    want, got, ops = _case(kind, recipe_name, device, bias, "aot_eager")
    _assert_same(want, got)
    assert not any("lowprec.call" in t for t in ops.targets)
    assert any("graph_norm" in t for t in ops.targets)
    if kind.startswith("mlp"):
        assert any("graph_activation" in t for t in ops.targets)


@pytest.mark.parametrize("device, recipe_name, kind", cases(
    {"device": DEVICES, "recipe_name": ["current", "block"], "kind": ["ln_linear", "mlp_swiglu"]},
    # on the CPU each recipe and each module once (inductor's C++ kernels of a new graph
    # take tens of seconds to build on 2 cores)
    lambda device, recipe_name, kind: device != "cpu"
    or (recipe_name, kind) in {("current", "mlp_swiglu"), ("block", "ln_linear")}))
def test_traced_modules_inductor_bit_identical(kind, recipe_name, device):
    """inductor: its fused kernels around the producer ops still hand on eager's bits."""
    want, got, _ = _case(kind, recipe_name, device, True, "inductor")
    _assert_same(want, got)


@pytest.mark.parametrize("kind", ["ln_linear", "mlp_gelu", "mlp_swiglu"])
@pytest.mark.parametrize("device", DEVICES)
def test_norm_modules_delayed_traced(kind, device):
    """Delayed scaling: each GEMM of LayerNormLinear and LayerNormMLP records into its slots
    of the module's states, as Linear's does (the states made as the first call is
    traced), and LayerNormMLP's backward state is updated once, after fc1's backward."""
    want, got, ops = _case(kind, "delayed", device, True, "aot_eager")
    _assert_same(want, got)
    assert _traced_graphs(ops) and any("graph_norm" in t for t in ops.targets)


def _delayed_states(m):
    states = m.__dict__["_recipe_states"]
    return [t.clone() for mode in ("forward", "backward") for t in
            (states[mode].delayed.scale, states[mode].delayed.amax_history,
             states[mode].delayed.amax_current)]


@pytest.mark.parametrize("frozen", [(), ("x",), ("x", "layer_norm_weight", "layer_norm_bias",
                                                  "fc1_weight", "fc1_bias")],
                         ids=["trained", "input_frozen", "fc1_frozen"])
@pytest.mark.parametrize("inside", [False, True], ids=["region_outside", "region_inside"])
def test_layernorm_mlp_delayed_states_over_steps(frozen, inside):
    """Four steps of LayerNormMLP under delayed scaling (history 3), eager against compiled
    with the autocast region around or inside the compiled call (where the first call,
    which makes the states, stays opaque and the next ones trace): outputs, gradients and
    both states (scales, histories, pending amaxes) bit for bit after every step, also where
    fc1 needs no gradient (fc2's backward then updates the backward state, as eager's
    callback does after the one GEMM backward that runs)."""
    recipe = DelayedScaling(amax_history_len=3)
    torch.manual_seed(0)
    a = _module("mlp_gelu", "cpu", torch.float32, True)
    _perturb(a)
    b = _module("mlp_gelu", "cpu", torch.float32, True)
    b.load_state_dict(a.state_dict())
    for m in (a, b):
        for name in frozen:
            if name != "x":
                getattr(m, name).requires_grad_(False)
    ops = GraphOps()
    if inside:
        def body(x):
            with lowprec.autocast(recipe=recipe):
                return b(x)
        compiled = torch.compile(body, backend=ops, fullgraph=True)
    else:
        compiled = torch.compile(b, backend=ops, fullgraph=True)
    for step in range(4):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(2, 64, HIDDEN, generator=g) * (1 + step)
        dy = torch.randn(2, 64, HIDDEN, generator=g)
        outs = []
        for fn, m, region in ((a, a, True), (compiled, b, not inside)):
            xi = x.clone().requires_grad_("x" not in frozen)
            for p in m.parameters():
                p.grad = None
            with lowprec.autocast(enabled=region, recipe=recipe):
                y = fn(xi)
            y.backward(dy)
            outs.append([y.detach(), xi.grad] + [p.grad for p in m.parameters()
                                                 if p.requires_grad] + _delayed_states(m))
        want, got = outs
        assert len(want) == len(got)
        for i, (w, g_) in enumerate(zip(want, got)):
            assert (w is None) == (g_ is None), (step, i)
            assert w is None or torch.equal(w, g_), (step, i)
    # with the region inside, the first call makes the states as an opaque call and the
    # next ones trace
    assert any("graph_norm" in t for t in ops.targets)
    assert inside or _traced_graphs(ops)


@pytest.mark.parametrize("amp", [False, True], ids=["fp32", "torch_autocast"])
@pytest.mark.parametrize("kind", ["ln_linear", "mlp_gelu"])
def test_no_recipe_traces_the_high_precision_path(kind, amp):
    """Outside autocast the call is the norm op and torch's linear ops: no opaque call,
    and the values eager's high-precision path gives (the fp32 GEMMs of the same
    operands; the bias gradient is the compiler's sum, as for ``Linear``). Under
    torch.autocast (bf16) as well, bit for bit there: the norm's output in bf16 and
    torch's linear cast as eager casts its operands."""
    want, got, ops = _case_plain(kind, amp)
    for w, g in zip(want, got):
        assert w.dtype == g.dtype
        if amp:
            assert torch.equal(g, w)
        else:
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    assert not any("lowprec.call" in t for t in ops.targets)
    assert any("graph_norm" in t for t in ops.targets)


def _case_plain(kind, amp=False):
    torch.manual_seed(0)
    m = _module(kind, "cpu", torch.float32, True)
    _perturb(m)
    x = torch.randn(4, 32, HIDDEN)
    dy = torch.randn(4, 32, 512)
    ops = GraphOps()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
        want = _run(m, m, x, dy, None)
        got = _run(torch.compile(m, backend=ops, fullgraph=True), m, x, dy, None)
    return want, got, ops


def test_producer_kernel_follows_eager_fusion(monkeypatch):
    """The traced norm and activation take eager's fused kernels' values exactly where
    eager fuses: kernels in use, ``lowprec.fused`` enabled, no torch.autocast, a recipe
    whose quantizers take a prologue (not NVFP4)."""
    from lowprec import kernels
    from lowprec.fused import graph
    x = torch.randn(16, 32)
    current = Float8CurrentScalingQuantizer(torch.float8_e4m3fn)
    assert not graph.producer_kernel(x, current, "default")  # no kernels on the CPU
    monkeypatch.setattr(graph, "use_kernels", lambda t: True)
    monkeypatch.setattr(kernels, "use_kernels", lambda t: True)
    assert graph.producer_kernel(x, current, "default")
    assert not graph.producer_kernel(x, NVFP4Quantizer(), "default")
    # high_precision saves the GEMM's input, which a fused producer never writes
    assert not graph.producer_kernel(x, current, "high_precision")
    with fused.unfused():
        assert not graph.producer_kernel(x, current, "default")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not graph.producer_kernel(x, current, "default")


class _OwnMXFP8(lowprec.MXFP8Quantizer):
    """A user's quantizer that quantizes its own way: it has no traced form."""

    def _quantize_2d(self, x2d):
        return super()._quantize_2d(x2d)


@pytest.mark.parametrize("kind", ["ln_linear", "mlp_gelu"])
def test_quantizers_without_a_form_keep_the_opaque_call(kind):
    ops = GraphOps()
    m = _module(kind, "cpu", torch.float32, True)
    compiled = torch.compile(m, backend=ops, fullgraph=True)
    with lowprec.autocast(recipe=lowprec.CustomRecipe(qfactory=lambda role: _OwnMXFP8())):
        compiled(torch.randn(64, HIDDEN, requires_grad=True)).sum().backward()
    assert any("lowprec.call" in t for t in ops.targets)
    assert not any("graph_norm" in t for t in ops.targets)


@pytest.mark.parametrize("kind", ["ln_linear", "mlp_gelu"])
def test_mxfp8_2d_weights_trace_bit_identical(kind):
    want, got, ops = _case(kind, "mxfp8_2d", "cpu", True, "aot_eager")
    _assert_same(want, got)
    assert ops.targets and not any("lowprec.call" in t for t in ops.targets)


#: the CPU's quick cases (the rest with --slow): per-tensor and delayed scaling each on
#: every module, each way of entering torch.autocast with each of them and on every
#: module (every pair of the three axes); MXFP8 both ways on the SwiGLU MLP
_AUTOCAST_QUICK = {(False, "current", "ln_linear"), (True, "delayed", "ln_linear"),
                   (True, "current", "ln_linear_out"), (False, "delayed", "ln_linear_out"),
                   (False, "current", "mlp_gelu"), (True, "delayed", "mlp_gelu"),
                   (True, "current", "mlp_swiglu"), (False, "delayed", "mlp_swiglu"),
                   (False, "mxfp8", "mlp_swiglu"), (True, "mxfp8", "mlp_swiglu")}


@pytest.mark.parametrize("inside, recipe_name, kind", cases(
    {"inside": {"autocast_outside": False, "autocast_inside": True},
     "recipe_name": ["current", "mxfp8", "delayed"],
     "kind": ["ln_linear", "ln_linear_out", "mlp_gelu", "mlp_swiglu"]},
    lambda inside, recipe_name, kind: (inside, recipe_name, kind) in _AUTOCAST_QUICK))
def test_torch_autocast_traced_bit_identical(kind, recipe_name, inside):
    """fp32 modules under torch.autocast(bf16), entered around or inside the compiled
    call: the norm's output in bf16 (eager's one rounding of its fp32 math), the linears'
    operands cast to bf16, gradients in fp32; traced (no opaque call) and eager's bits,
    two steps (delayed scaling's second reads the first's scales)."""
    recipe = RECIPES[recipe_name]
    torch.manual_seed(0)
    a = _module(kind, "cpu", torch.float32, True)
    _perturb(a)
    b = _module(kind, "cpu", torch.float32, True)
    b.load_state_dict(a.state_dict())
    x = torch.randn(2, 64, HIDDEN) * 2 + 0.3
    dy = torch.randn(2, 64, 512, dtype=torch.bfloat16)

    def under_autocast(m):
        def call(t):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return m(t)
        return call

    ops = GraphOps()
    if inside:
        compiled = torch.compile(under_autocast(b), backend=ops, fullgraph=True)
    else:
        inner = torch.compile(b, backend=ops, fullgraph=True)
        compiled = under_autocast(inner)
    want = _run(under_autocast(a), a, x, dy, recipe, 2)
    got = _run(compiled, b, x, dy, recipe, 2)
    _assert_same(want, got)
    assert want[0].dtype == torch.bfloat16 and want[-1].dtype == torch.float32
    assert any("graph_norm" in t for t in ops.targets)
    assert recipe_name == "delayed" or _traced_graphs(ops)
