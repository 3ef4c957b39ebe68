"""A compiled Linear decided outside dynamo's interpretation (lowprec/linear/decided.py):
eager's bits, the very graphs of the plan decided in the trace, one decision for
same-shaped layers and equal recipes, and the decision in the trace where it does not
apply (symbolic sizes)."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest
import torch
from helpers import GraphOps, cases

import lowprec
from lowprec.formats import IdentityQuantizer
from lowprec.linear import decided, traced
from lowprec.modules import quantizers
from lowprec.recipe.recipes import (
    CustomRecipe,
    DelayedScaling,
    Float8BlockScaling,
    Float8CurrentScaling,
    MXFP8BlockScaling,
    NVFP4BlockScaling,
    recipe_of_value,
)

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
RECIPES = {"current": Float8CurrentScaling, "block": Float8BlockScaling,
           "mxfp8": MXFP8BlockScaling, "nvfp4": NVFP4BlockScaling}

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def _run(fn, m, x, dy, recipe, *, x_grad=True, amp=None):
    x = x.detach().clone().requires_grad_(x_grad)
    for p in m.parameters():
        p.grad = None
    torch.manual_seed(1)  # NVFP4's stochastic rounding draws from torch's generator
    with lowprec.autocast(recipe=recipe):
        if amp is None:
            y = fn(x)
        else:
            with torch.autocast(x.device.type, dtype=amp):
                y = fn(x)
    y.backward(dy.to(y.dtype))
    return [y.detach(), x.grad] + [p.grad.clone() for p in m.parameters()]


def _count_decided_calls(monkeypatch) -> list:
    """A list that each traced call of a decided Linear appends its decision to."""
    calls, call = [], decided.Decision.call

    def counted(self, *args):
        calls.append(self)
        return call(self, *args)
    monkeypatch.setattr(decided.Decision, "call", counted)
    return calls


def _dtype(device):
    return torch.bfloat16 if device == "cuda" else torch.float32


# (input shape, in, out, bias, params dtype (None: the device's), torch.autocast dtype)
CASES = {
    "3d-bias": ((3, 40, 128), 128, 96, True, None, None),
    "2d": ((64, 128), 128, 64, False, None, None),
    "padded": ((3, 7, 80), 80, 48, True, None, None),  # K, N and M in part blocks
    "amp": ((2, 32, 128), 128, 64, True, torch.float32, torch.bfloat16),
    # bf16 parameters: a parameter's values need no rounding in the graph (CUDA's default)
    "bf16": ((64, 128), 128, 64, False, torch.bfloat16, None),
}


def _each_case(flags, shift):
    """(recipe, flag) -> the one ``CASES`` entry a module test runs it with on the CPU
    without ``--slow``: every recipe with every flag, the entries in turn (so each runs;
    ``shift`` varies which recipe meets which between the tests). The Linear test runs
    every recipe on every entry."""
    pairs = itertools.product(RECIPES, flags)
    return {p: list(CASES)[(i + shift) % len(CASES)] for i, p in enumerate(pairs)}


def _case(case, name, device):
    """(recipe, input shape, in, out, bias, params dtype, torch.autocast dtype) of a case,
    torch's generator seeded for the module and operands made next."""
    shape, k, n, bias, dtype, amp = CASES[case]
    if name == "nvfp4" and device == "cuda" and not lowprec.kernels.triton_available():
        pytest.skip("NVFP4 traces on CUDA with its Triton kernels only")
    recipe = RECIPES[name]()
    torch.manual_seed(0)
    return recipe, shape, k, n, bias, dtype or _dtype(device), amp


def _decided_is_eager(m, x, dy, recipe, amp, monkeypatch, *, gemms=1, wrap=lambda fn: fn):
    """Compiles ``m`` (called through ``wrap``): its ``gemms`` decided calls give eager's
    bits. Returns (the graphs' ops, those of the calls decided in the trace)."""
    want = _run(wrap(m), m, x, dy, recipe, amp=amp)
    ops, interpreted = GraphOps(), GraphOps()
    calls = _count_decided_calls(monkeypatch)
    got = _run(wrap(torch.compile(m, backend=ops, fullgraph=True)), m, x, dy, recipe, amp=amp)
    assert len(calls) >= gemms  # decided outside the trace
    for w, g in zip(want, got):
        assert torch.equal(w, g)
    torch._dynamo.reset()
    monkeypatch.setattr(quantizers, "decided_linear", lambda *args: None)
    _run(wrap(torch.compile(m, backend=interpreted, fullgraph=True)), m, x, dy, recipe,
         amp=amp)
    return Counter(ops.targets), Counter(interpreted.targets)


#: (recipe, case) the Linear test runs on the CPU without --slow: every recipe with a
#: bias on 3-D input in partial blocks (each format's own block sizes), whole blocks in
#: the plain 2-D or autocast case, and the autocast and bf16-parameter cases (the dtypes'
#: handling) two recipes each
_LINEAR_QUICK = {(name, "padded") for name in RECIPES} | {
    ("current", "3d-bias"), ("current", "2d"), ("mxfp8", "2d"), ("block", "amp"),
    ("nvfp4", "amp"), ("current", "bf16"), ("block", "bf16")}


@pytest.mark.parametrize("name, case, device", cases(
    {"name": list(RECIPES), "case": list(CASES), "device": DEVICES},
    lambda name, case, device: device != "cpu" or (name, case) in _LINEAR_QUICK))
def test_decided_call_is_eager_bit_for_bit(device, case, name, monkeypatch):
    recipe, shape, k, n, bias, dtype, amp = _case(case, name, device)
    m = lowprec.Linear(k, n, bias=bias, name="l", params_dtype=dtype, device=device)
    x = torch.randn(shape, device=device, dtype=dtype)
    dy = torch.randn(*shape[:-1], n, device=device)
    ops, interpreted = _decided_is_eager(m, x, dy, recipe, amp, monkeypatch)
    # the graphs inductor receives are those of the plan decided in the trace
    assert ops == interpreted


@pytest.mark.parametrize("device", DEVICES)
def test_input_without_grad_and_evaluation(device):
    recipe = Float8CurrentScaling()
    m = lowprec.Linear(128, 64, name="l", params_dtype=_dtype(device), device=device)
    x = torch.randn(32, 128, device=device, dtype=_dtype(device))
    dy = torch.randn(32, 64, device=device)
    compiled = torch.compile(m, backend="aot_eager", fullgraph=True)
    want = _run(m, m, x, dy, recipe, x_grad=False)
    got = _run(compiled, m, x, dy, recipe, x_grad=False)
    assert got[1] is None
    for w, g in zip(want[2:], got[2:]):
        assert torch.equal(w, g)
    with torch.no_grad(), lowprec.autocast(recipe=recipe):
        assert torch.equal(m(x), compiled(x))


def test_same_shaped_layers_and_equal_recipes_share_one_decision():
    layers = torch.nn.Sequential(*(lowprec.Linear(64, 64, name=f"l{i}") for i in range(3)))
    x = torch.randn(16, 64, requires_grad=True)
    before, graphs = len(decided._NAMES), torch._dynamo.utils.counters["stats"]["unique_graphs"]
    compiled = torch.compile(layers, backend="aot_eager", fullgraph=True)
    for _ in range(2):  # an equal recipe object each step
        with lowprec.autocast(recipe=Float8CurrentScaling()):
            compiled(x).sum().backward()
    assert len(decided._NAMES) - before <= 1  # (none where this kind was decided before)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs == 1


def test_symbolic_shapes_trace_as_before(monkeypatch):
    """Symbolic sizes cannot be a decision's key: the call traces its plan in the graph."""
    recipe = Float8CurrentScaling()
    m = lowprec.Linear(64, 32, name="l")
    x, dy = torch.randn(24, 64), torch.randn(24, 32)
    want = _run(m, m, x, dy, recipe)
    calls = _count_decided_calls(monkeypatch)
    got = _run(torch.compile(m, backend="aot_eager", fullgraph=True, dynamic=True), m, x, dy,
               recipe)
    assert not calls
    for w, g in zip(want, got):
        assert torch.equal(w, g)


def test_recipe_value_keys():
    a, b = Float8CurrentScaling(), Float8CurrentScaling()
    c = Float8CurrentScaling(use_power_2_scales=True)
    assert a._lowprec_value == b._lowprec_value != c._lowprec_value
    assert a._lowprec_key != b._lowprec_key
    assert recipe_of_value(b._lowprec_value) == b
    # a CustomRecipe names only itself (its factory is not kept alive)
    d, e = (CustomRecipe(qfactory=lambda role: IdentityQuantizer()) for _ in range(2))
    assert d._lowprec_value < 0 and d._lowprec_value != e._lowprec_value
    with pytest.raises(RuntimeError, match="value key"):
        recipe_of_value(d._lowprec_value)


def test_decided_call_is_one_node_of_dynamos_graph():
    """Dynamo does not interpret a decided Linear's Python: each call is one node of the
    graph it hands AOT autograd, which traces the node's quantizes and GEMMs."""
    layers = torch.nn.Sequential(*(lowprec.Linear(64, 64, name=f"l{i}") for i in range(3)))
    x = torch.randn(16, 64, requires_grad=True)
    dynamo_graphs, ops = [], GraphOps()

    def backend(gm, example_inputs):
        dynamo_graphs.append(gm)
        return ops(gm, example_inputs)
    with lowprec.autocast(recipe=Float8CurrentScaling()):
        torch.compile(layers, backend=backend, fullgraph=True)(x).sum().backward()
    (gm,) = dynamo_graphs
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert targets.count(decided._linear_node) == 3
    assert not [t for t in targets if "lowprec" in str(t)]  # no quantize or GEMM op
    assert any("lowprec" in str(t) for t in ops.targets)  # AOT autograd traced them


@pytest.mark.parametrize("name", ["current", "block"])
@pytest.mark.parametrize("case", ["2d", "amp", "padded"])
def test_decided_call_holds_a_parameter_weight(case, name, monkeypatch):
    """A parameter weight's columnwise copy is cast in backward from the parameter, not
    saved from forward: AOT autograd hands the node's Python a functional tensor, which
    is not an ``nn.Parameter``, so the decision tells the Function what the type said.
    Casts (torch.autocast) and padding make a temporary weight, which is not held."""
    shape, k, n, bias, dtype, amp = CASES[case]
    m = lowprec.Linear(k, n, bias=bias, name="l", params_dtype=dtype or torch.float32)
    x = torch.randn(shape, dtype=dtype or torch.float32)
    dy = torch.randn(*shape[:-1], n)
    held, forward = [], traced.TracedLinear.forward

    def spy(ctx, x, weight, bias, plan, grad_enabled, weight_held, *rest):
        held.append(weight_held)
        return forward(ctx, x, weight, bias, plan, grad_enabled, weight_held, *rest)
    monkeypatch.setattr(traced.TracedLinear, "forward", staticmethod(spy))
    calls = _count_decided_calls(monkeypatch)
    _run(torch.compile(m, backend="aot_eager", fullgraph=True), m, x, dy, RECIPES[name](),
         amp=amp)
    assert calls and held
    expected = amp is None and not calls[0].plan.padding
    assert set(held) == {expected}
    # per-tensor FP8 pads nothing, 128x128 blocks pad these weights
    assert expected == (name == "current" and case != "amp")


def _delayed_steps(fn, model, recipe, steps, *, region_inside=False, amp=None):
    """Parameters and delayed-scaling states after ``steps`` SGD steps of ``fn``."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    device = next(model.parameters()).device
    torch.manual_seed(3)
    for step in range(steps):
        x = torch.randn(2, 8, 64, device=device) * (step + 1)

        def run(x):
            if amp is None:
                return fn(x)
            with torch.autocast(device.type, dtype=amp):
                return fn(x)
        if region_inside:
            y = run(x)
        else:
            with lowprec.autocast(recipe=recipe):
                y = run(x)
        y.float().pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
    states = [t for m in model for mode in ("forward", "backward")
              for t in (m._recipe_states[mode].delayed.scale,
                        m._recipe_states[mode].delayed.amax_history)]
    return [p.detach().clone() for p in model.parameters()] + [s.clone() for s in states]


def _delayed_model(kind, device):
    """(model, the delayed-scaling GEMMs it runs, the modules that decide them)."""
    from lowprec.modules import layernorm_linear, layernorm_mlp
    from lowprec.modules import linear as linear_module
    if kind == "linear":
        return torch.nn.Sequential(lowprec.Linear(64, 64, name="a", device=device),
                                   lowprec.Linear(64, 32, name="b", device=device)), 2, \
            [linear_module]
    if kind == "twice":  # one Linear called twice: its second call's backward runs first
        shared = lowprec.Linear(64, 64, name="a", device=device)
        return torch.nn.Sequential(shared, shared), 2, [linear_module]
    return torch.nn.Sequential(
        lowprec.LayerNormLinear(64, 64, name="a", device=device, normalization="RMSNorm"),
        lowprec.LayerNormMLP(64, 128, name="b", device=device, activation="swiglu")), 3, \
        [layernorm_linear, layernorm_mlp]


#: (kind, region inside, torch.autocast) the CPU runs without ``--slow``: every pair of
#: two of the three axes
_DELAYED_QUICK = {("linear", False, False), ("linear", True, True), ("twice", False, True),
                  ("twice", True, False), ("layernorm", False, False),
                  ("layernorm", True, True)}


@pytest.mark.parametrize("amp, region_inside, kind, device", cases(
    {"amp": {"fp32": None, "amp": torch.bfloat16},
     "region_inside": {"region-outside": False, "region-inside": True},
     "kind": ["linear", "twice", "layernorm"], "device": DEVICES},
    lambda amp, region_inside, kind, device: device != "cpu"
    or (kind, region_inside, amp is not None) in _DELAYED_QUICK))
def test_delayed_call_is_one_node_and_eager_bit_for_bit(region_inside, amp, kind, device,
                                                        monkeypatch):
    """A compiled delayed-scaling GEMM (a Linear's, twice for a Linear called twice,
    LayerNormLinear's, both of LayerNormMLP's) is one node of dynamo's graph over its
    module's states' tensors: over
    steps that move the scales, parameters and states equal eager's, with the autocast
    region around the compiled call (recorded through the module's handle) or inside it
    (its exit's update traced), and AOT autograd records the interpreted calls' graphs."""
    import copy

    recipe = DelayedScaling(amax_history_len=4)
    torch.manual_seed(0)
    model, gemms, deciders = _delayed_model(kind, device)
    if kind == "twice" and region_inside:
        # the state made before the first call, as docs/recipes.md asks of a module called
        # more than once a step with the region inside the compiled function
        lowprec.init_scaling_state(model, recipe)
    start = copy.deepcopy(model)
    want = _delayed_steps(model, model, recipe, 4, amp=amp)

    def compiled(fresh, backend):
        if not region_inside:
            return torch.compile(fresh, backend=backend, fullgraph=True)

        def region(x):
            with lowprec.autocast(recipe=recipe):
                return fresh(x)
        return torch.compile(region, backend=backend, fullgraph=True)

    dynamo_graphs, ops = [], GraphOps()

    def backend(gm, example_inputs):
        dynamo_graphs.append(gm)
        return ops(gm, example_inputs)
    fresh = copy.deepcopy(start)
    got = _delayed_steps(compiled(fresh, backend), fresh, recipe, 4,
                         region_inside=region_inside, amp=amp)
    for w, g in zip(want, got):
        assert torch.equal(w, g)
    # (a first call before the states exist stays opaque, and makes them)
    targets = [n.target for n in dynamo_graphs[-1].graph.nodes if n.op == "call_function"]
    assert targets.count(decided._delayed_node) == gemms
    # the same graphs as the call interpreted by dynamo
    torch._dynamo.reset()
    interpreted = GraphOps()
    for module in deciders:
        monkeypatch.setattr(module, "decided_delayed_linear", lambda *args: None)
    fresh = copy.deepcopy(start)
    _delayed_steps(compiled(fresh, interpreted), fresh, recipe, 4, region_inside=region_inside,
                   amp=amp)
    assert Counter(ops.targets) == Counter(interpreted.targets)


@pytest.mark.parametrize("region_inside", [False, True], ids=["region-outside",
                                                              "region-inside"])
def test_interpreted_delayed_call_traces_with_the_update_kernel(region_inside, monkeypatch):
    """Where no decided node runs a delayed-scaling call (dynamic shapes), dynamo interprets
    the Function and speculates its backward (which joins the state to the backward pass's
    update, a host-side op), and with the region inside traces the region exit's update of
    the forward states. That update, which launches its kernel on CUDA, asks nothing dynamo
    cannot answer (a tensor's contiguity) and writes no global: under torch.autocast a
    failed speculation is retried and leaves autocast's state changed. Here CUDA's update
    choice on CPU tensors, in the trace only (the backend stops once it has the graph)."""
    from lowprec.modules import linear as linear_module
    from lowprec.recipe import state
    recipe = DelayedScaling(amax_history_len=4)
    model = torch.nn.Sequential(lowprec.Linear(64, 64, name="a"), lowprec.Linear(64, 32, name="b"))
    lowprec.init_scaling_state(model, recipe)
    monkeypatch.setattr(linear_module, "decided_delayed_linear", lambda *args: None)
    monkeypatch.setattr(state, "use_kernels", lambda t: torch.compiler.is_compiling())
    graphs = []

    class Traced(Exception):
        pass

    def backend(gm, example_inputs):
        graphs.append(gm)
        raise Traced

    def region(x):
        with lowprec.autocast(recipe=recipe):
            return model(x)
    compiled = torch.compile(region if region_inside else model, backend=backend,
                             fullgraph=True)
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(
            torch._dynamo.exc.BackendCompilerFailed):
        if region_inside:
            compiled(torch.randn(2, 8, 64))
        else:
            with lowprec.autocast(recipe=recipe):
                compiled(torch.randn(2, 8, 64))
    (gm,) = graphs
    targets = [str(n.target) for n in gm.graph.nodes]
    assert sum("autograd_function_apply" in t for t in targets) == 2
    assert not any("lowprec.call" in t for t in targets)


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_delayed_non_finite_input_is_nan_as_eager(bad):
    """A compiled delayed-scaling Linear casts with the state's scale before its amax is
    known; an input holding Inf or NaN still gives NaN everywhere in the output and the
    weight gradient, as eager's (whose codes are NaN), and records the same amaxes. TE's start
    (scale 1, no seeding) so that no cast waits for an amax."""
    import copy
    recipe = DelayedScaling(amax_history_len=4, first_scale="one")
    torch.manual_seed(0)
    model = lowprec.Linear(64, 32, name="a")
    lowprec.init_scaling_state(model, recipe)
    compiled_model = copy.deepcopy(model)
    compiled = torch.compile(compiled_model, backend="aot_eager", fullgraph=True)
    x = torch.randn(16, 64)
    x[3, 5] = bad
    got = []
    for fn, m in ((model, model), (compiled, compiled_model)):
        xi = x.clone().requires_grad_()
        with lowprec.autocast(recipe=recipe):
            y = fn(xi)
        y.sum().backward()
        got.append((y, xi.grad, m.weight.grad))
    (y, dx, dw), (cy, cdx, cdw) = got
    # y and dW read the input's NaN scale; dX does not read the input
    assert torch.isnan(y).all() and torch.isnan(cy).all()
    assert torch.isnan(dw).all() and torch.isnan(cdw).all()
    assert torch.equal(dx, cdx)
    eager_state, compiled_state = model.scaling_state(), compiled_model.scaling_state()
    for mode, state in eager_state.states.items():
        for name, t in state.items():
            if isinstance(t, torch.Tensor):
                assert torch.equal(t.nan_to_num(), compiled_state.states[mode][name].nan_to_num())


_LN_LINEAR_QUICK = _each_case([False, True], 0)


@pytest.mark.parametrize("name, case, ln_out, device", cases(
    {"name": list(RECIPES), "case": list(CASES), "ln_out": {"y": False, "y-and-ln": True},
     "device": DEVICES},
    lambda name, case, ln_out, device: device != "cpu"
    or _LN_LINEAR_QUICK[name, ln_out] == case))
def test_decided_layernorm_linear_is_eager_bit_for_bit(device, case, name, ln_out,
                                                       monkeypatch):
    """A compiled LayerNormLinear's GEMM is decided from its input's metadata before the
    norm is traced, and is one node: eager's bits (the norm output too), and where the
    call decided in the trace has a plan, its graphs."""
    recipe, shape, k, n, bias, dtype, amp = _case(case, name, device)
    m = lowprec.LayerNormLinear(k, n, bias=bias, name="l", params_dtype=dtype, device=device,
                                normalization="RMSNorm", return_layernorm_output=ln_out)
    x = torch.randn(shape, device=device, dtype=dtype)
    dy = torch.randn(*shape[:-1], n, device=device)

    def first(fn):
        return lambda x: fn(x)[0] if ln_out else fn(x)
    ops, interpreted = _decided_is_eager(m, x, dy, recipe, amp, monkeypatch, wrap=first)
    if "lowprec.call.default" not in interpreted:  # the trace's own plan traced too
        assert ops == interpreted
    if ln_out:
        with lowprec.autocast(recipe=recipe), torch.no_grad():
            assert torch.equal(m(x)[1], torch.compile(m, backend="aot_eager")(x)[1])


_LN_MLP_QUICK = _each_case(["gelu", "swiglu"], 2)


@pytest.mark.parametrize("name, case, activation, device", cases(
    {"name": list(RECIPES), "case": list(CASES), "activation": ["gelu", "swiglu"],
     "device": DEVICES},
    lambda name, case, activation, device: device != "cpu"
    or _LN_MLP_QUICK[name, activation] == case))
def test_decided_layernorm_mlp_is_eager_bit_for_bit(device, case, name, activation,
                                                    monkeypatch):
    """A compiled LayerNormMLP's two GEMMs are decided before its norm is traced, fc2's
    from a stand-in of its input, and are one node each: eager's bits, and where the call
    decided in the trace has a plan, its graphs."""
    recipe, shape, k, n, bias, dtype, amp = _case(case, name, device)
    m = lowprec.LayerNormMLP(k, n, bias=bias, name="l", params_dtype=dtype, device=device,
                             normalization="RMSNorm", activation=activation)
    x = torch.randn(shape, device=device, dtype=dtype)
    dy = torch.randn(*shape[:-1], k, device=device)
    ops, interpreted = _decided_is_eager(m, x, dy, recipe, amp, monkeypatch, gemms=2)
    if "lowprec.call.default" not in interpreted:  # the trace's own plans traced too
        assert ops == interpreted
