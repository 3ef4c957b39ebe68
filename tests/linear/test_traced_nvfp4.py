"""NVFP4 linears under torch.compile (lowprec/linear/traced.py): traced into the graph
(no opaque ``lowprec::call``), forward and gradients eager's bit for bit, stochastic
rounding included (the compiled step draws dY's keys from torch's generator as eager
does); shapes eager would pad or slice keep the opaque op."""

from __future__ import annotations

import pytest
import torch
from helpers import GPU_ONLY, GraphOps, plan_of

import lowprec
from lowprec.formats.nvfp4 import compiled as fp4
from lowprec.formats.nvfp4.draws import draw_key
from lowprec.formats.nvfp4.graph import FP4Blocks
from lowprec.linear import grad_split
from lowprec.recipe.recipes import NVFP4BlockScaling

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def _dtype(device):
    return torch.bfloat16 if device == "cuda" else torch.float32


def _stack(device, bias):
    """Two Linears with a ReLU between them (exact in any compiler): the lower layer's dY
    comes from the upper one's dgrad, so a wrong order of key draws between layers shows."""
    kw = dict(params_dtype=_dtype(device), device=device, bias=bias)
    return torch.nn.Sequential(lowprec.Linear(128, 96, name="a", **kw), torch.nn.ReLU(),
                               lowprec.Linear(96, 64, name="b", **kw))


def _run(fn, m, x, dy, recipe, seed):
    x = x.detach().clone().requires_grad_(True)
    for p in m.parameters():
        p.grad = None
    torch.manual_seed(seed)
    with lowprec.autocast(recipe=recipe):
        y = fn(x)
    y.backward(dy)
    return [y.detach(), x.grad] + [p.grad.clone() for p in m.parameters()]


def _inputs(device):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 48, 128, generator=g).to(device, _dtype(device))
    x[0, 0, :16] *= 1e-20  # one block scaled far down
    dy = torch.randn(4, 48, 64, generator=g).to(device, _dtype(device))
    return x, dy


RECIPES = {"default": NVFP4BlockScaling(),
           "no_rht_1d": NVFP4BlockScaling(disable_rht=True, disable_2d_quantization=True),
           "no_sr": NVFP4BlockScaling(disable_stochastic_rounding=True)}


def _cases():
    """(backend, recipe, bias, device): inductor on the CPU under the default recipe only
    (its C++ kernels take tens of seconds to build, the other recipes' pieces are the
    default's), with a bias; the other recipes each with or without one, the default
    (whose draws the test counts) both ways; the rest with --slow."""
    quick_aot = {("default", True), ("default", False), ("no_rht_1d", True), ("no_sr", False)}
    for backend in ("aot_eager", "inductor"):
        for recipe_name in RECIPES:
            for bias in (True, False):
                for device in DEVICES:
                    if backend == "inductor" and recipe_name != "default" and device == "cpu":
                        continue
                    slow = device == "cpu" and (
                        (backend == "inductor" and not bias)
                        or (backend == "aot_eager" and (recipe_name, bias) not in quick_aot))
                    yield pytest.param(backend, recipe_name, bias, device,
                                       id=f"{backend}-{recipe_name}-{bias}-{device}",
                                       marks=pytest.mark.slow if slow else ())


@pytest.mark.parametrize("backend, recipe_name, bias, device", list(_cases()))
def test_nvfp4_traced_bit_identical(device, bias, recipe_name, backend):
    recipe = RECIPES[recipe_name]
    torch.manual_seed(0)
    m = _stack(device, bias)
    x, dy = _inputs(device)
    want = _run(m, m, x, dy, recipe, seed=5)
    ops = GraphOps()
    compiled = torch.compile(m, backend=ops if backend == "aot_eager" else backend,
                             fullgraph=True)
    got = _run(compiled, m, x, dy, recipe, seed=5)
    for i, (w, g) in enumerate(zip(want, got)):
        assert w.dtype == g.dtype and torch.equal(w, g), i
    if backend == "aot_eager":
        assert not any("lowprec.call" in t for t in ops.targets)
        # a gradient's keys: their own op, or drawn inside its values' op (CUDA kernels)
        draws = sum("nvfp4_draw_keys" in t or "nvfp4_graph_values_drawn" in t
                    for t in ops.targets)
        assert draws == (0 if recipe.disable_stochastic_rounding else 2)
        # dY's draws are ordered by dY itself: no effect token (compile time) for them
        assert not any("draw_keys_ordered" in t for t in ops.targets)


def _forward_sr_recipe(device, hybrid_weight: bool):
    """Stochastic rounding on the input and weight too; ``hybrid_weight``: the weight's
    columnwise half only (an MXFP8/NVFP4 hybrid), which the traced form makes in the
    backward from the weight but must key in the forward, where eager draws it."""
    def sr():
        return lowprec.NVFP4Quantizer(stochastic_rounding=True)

    def factory(role):
        if role is None or role.tensor_type not in ("input", "weight", "grad_output"):
            return lowprec.IdentityQuantizer()
        if role.tensor_type == "weight" and hybrid_weight:
            return lowprec.HybridQuantizer(rowwise_quantizer=lowprec.MXFP8Quantizer(),
                                           columnwise_quantizer=sr())
        return sr()
    return lowprec.recipe.CustomRecipe(factory)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("hybrid_weight", [False, True])
def test_forward_stochastic_rounding_traces_bit_identical(device, hybrid_weight):
    """Input and weight stochastically rounded: the compiled step draws every key where
    eager does (both directions in the forward, layer by layer), so its bits are eager's."""
    recipe = _forward_sr_recipe(device, hybrid_weight)
    torch.manual_seed(0)
    m = _stack(device, True)
    x, dy = _inputs(device)
    want = _run(m, m, x, dy, recipe, seed=5)
    ops = GraphOps()
    got = _run(torch.compile(m, backend=ops, fullgraph=True), m, x, dy, recipe, seed=5)
    for i, (w, g) in enumerate(zip(want, got)):
        assert torch.equal(w, g), i
    assert not any("lowprec.call" in t for t in ops.targets)
    assert any("nvfp4_draw_keys_ordered" in t for t in ops.targets)  # the forward's


def _ordered_draws(gm) -> list:
    """The forward graph's ordered key draws (``with_effects`` nodes), in graph order."""
    return [n for n in gm.graph.nodes
            if "with_effects" in str(n.target) and "draw_keys_ordered" in str(n.args[1])]


def _data_ancestors(node) -> set:
    """The nodes ``node`` reads, directly or not, leaving out effect tokens (a
    ``with_effects`` node's first argument)."""
    def inputs(n):
        if "with_effects" in str(n.target):
            return [a for a in n.all_input_nodes if a is not n.args[0]]
        return n.all_input_nodes
    seen, todo = set(), inputs(node)
    while todo:
        n = todo.pop()
        if n not in seen:
            seen.add(n)
            todo += inputs(n)
    return seen


@pytest.mark.parametrize("module", ["linear", "layernorm_linear"])
@pytest.mark.parametrize("mode", ["default", "dequantized"])
@pytest.mark.parametrize("weight_row", ["mxfp8", "nvfp4_sr"])
def test_a_calls_forward_draws_follow_one_another_in_the_data(module, mode, weight_row):
    """The weight's forward keys are drawn after the input's, and a hybrid's columnwise
    half's after its rowwise half's, as eager draws them, through data: the effect token
    that orders the draws does not order inductor's kernels (on CUDA a LayerNormLinear's
    weight draw, whose anchor is ready first, ran before the input's, and the two
    columnwise operands swapped keys). So each draw reads what the forms before it
    made, which any scheduler respects."""
    def sr():
        return lowprec.NVFP4Quantizer(stochastic_rounding=True)

    def factory(role):
        if role is None or role.tensor_type not in ("input", "weight"):
            return lowprec.IdentityQuantizer()
        if role.tensor_type == "input":
            return lowprec.HybridQuantizer(rowwise_quantizer=sr(), columnwise_quantizer=sr())
        row = lowprec.MXFP8Quantizer() if weight_row == "mxfp8" else sr()
        return lowprec.HybridQuantizer(rowwise_quantizer=row, columnwise_quantizer=sr())
    recipe = lowprec.recipe.CustomRecipe(factory, backward_mode=mode)
    make = lowprec.Linear if module == "linear" else lowprec.LayerNormLinear
    m = make(64, 32, bias=False, params_dtype=torch.float32)
    graphs = []

    def backend(gm, example_inputs):
        from torch._dynamo.backends.common import aot_autograd

        def fw(g, _inputs):
            graphs.append(g)
            return g
        return aot_autograd(fw_compiler=fw, bw_compiler=lambda g, _: g)(gm, example_inputs)

    x = torch.randn(32, 64, requires_grad=True)
    torch.manual_seed(0)
    with lowprec.autocast(recipe=recipe):
        want = m(x)
    torch.manual_seed(0)
    with lowprec.autocast(recipe=recipe):
        got = torch.compile(m, backend=backend, fullgraph=True)(x)
    assert torch.equal(want, got)
    draws = _ordered_draws(graphs[0])
    # each operand's rowwise half, then (default mode) its columnwise half
    halves = 2 if mode == "default" else 1
    assert len(draws) == halves + (halves - 1 if weight_row == "mxfp8" else halves)
    for before, after in zip(draws, draws[1:]):
        assert before in _data_ancestors(after)


@pytest.mark.parametrize("device", DEVICES)
def test_stochastic_rounding_follows_the_seed(device):
    """The compiled step's draws come from torch's generator: another seed gives other
    gradients (through dY's stochastically rounded copies), the same seed the same."""
    recipe = NVFP4BlockScaling()
    torch.manual_seed(0)
    m = _stack(device, False)
    x, dy = _inputs(device)
    compiled = torch.compile(m, backend="aot_eager", fullgraph=True)
    a = _run(compiled, m, x, dy, recipe, seed=5)
    b = _run(compiled, m, x, dy, recipe, seed=6)
    c = _run(compiled, m, x, dy, recipe, seed=5)
    assert torch.equal(a[0], b[0])  # the forward draws nothing
    assert not torch.equal(a[1], b[1]) and not torch.equal(a[2], b[2])
    for u, v in zip(a, c):
        assert torch.equal(u, v)


@pytest.mark.parametrize("device", DEVICES)
def test_draw_keys_draws_as_eager(device):
    torch.manual_seed(3)
    want = torch.stack([draw_key(None, device), draw_key(None, device)])
    torch.manual_seed(3)
    got = fp4.draw_keys(torch.empty(1, device=device), 2)
    assert got.shape == (2, 2) and got.dtype == torch.int64 and torch.equal(got, want)


def test_an_evaluation_forward_makes_only_rowwise_values(monkeypatch):
    """Under no_grad the traced forward quantizes x and the weight only in the direction
    fprop reads (as eager's plan does), with eager's output."""
    recipe = NVFP4BlockScaling()
    torch.manual_seed(0)
    m = _stack("cpu", True)
    x, _ = _inputs("cpu")
    with lowprec.autocast(recipe=recipe), torch.no_grad():
        want = m(x)
    directions = []
    reference = fp4.reference_values

    def recording(t, rowwise, **kw):
        directions.append(rowwise)
        return reference(t, rowwise, **kw)

    monkeypatch.setattr(fp4, "reference_values", recording)
    with lowprec.autocast(recipe=recipe), torch.no_grad():
        got = torch.compile(m, backend="aot_eager", fullgraph=True)(x)
    assert torch.equal(want, got)
    assert directions and all(directions)


def test_plan_and_what_stays_opaque():
    recipe = NVFP4BlockScaling()
    w = torch.randn(32, 64, requires_grad=True)  # a weight gradient: eager pads M for wgrad
    plan = plan_of(recipe, torch.randn(48, 64), w)
    assert plan.x == FP4Blocks(rht=True) and plan.w == FP4Blocks(two_d=True)
    assert plan.dy == FP4Blocks(rht=True, sr=True) and plan.routes == ("emulated",) * 3
    # operands that are not whole 16-blocks (M here) have no plan of their own: the linear
    # pads them first (``lowprec.linear.padding``)
    assert plan_of(recipe, torch.randn(40, 64), w) is None
    assert plan_of(recipe, torch.randn(48, 64), torch.randn(24, 64)) is None
    with grad_split.sliced():  # eager's sliced path (a call needing both gradients)
        assert plan_of(recipe, torch.randn(48, 64, requires_grad=True), w) is None


def test_padded_call_traces_bit_identical():
    """40 tokens: the compiled linear pads M to whole 16-blocks (zero rows) and traces,
    with eager's outputs and gradients."""
    recipe = NVFP4BlockScaling()
    m = lowprec.Linear(64, 32, name="l")
    x = torch.randn(40, 64)
    dy = torch.randn(40, 32)
    ops = GraphOps()
    runs = []
    for fn in (m, torch.compile(m, backend=ops, fullgraph=True)):
        m.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_(True)
        torch.manual_seed(0)  # the stochastic rounding of dY
        with lowprec.autocast(recipe=recipe):
            y = fn(xi)
        y.backward(dy)
        runs.append((y.detach(), xi.grad, m.weight.grad, m.bias.grad))
    for want, got in zip(*runs):
        assert torch.equal(want, got)
    assert not any("lowprec.call" in t for t in ops.targets)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rowwise", [True, False])
def test_reference_values_are_the_emulations_operands(device, rowwise):
    """``compiled.reference_values`` is what eager's fp32 emulation multiplies: the
    quantizer's tensor dequantized (the RHT undone), for the same key."""
    from lowprec import NVFP4Quantizer
    x = torch.randn(64, 48, device=device) * 3
    q = NVFP4Quantizer(with_rht=True, stochastic_rounding=True)
    q.set_usage(rowwise=rowwise, columnwise=not rowwise)
    torch.manual_seed(7)
    want = q.quantize(x).dequantize(usage="rowwise" if rowwise else "columnwise")
    torch.manual_seed(7)
    key = draw_key(None, device)
    got = fp4.reference_values(x, rowwise, rht=True, two_d=False, key=key)
    assert torch.equal(got if rowwise else got.t(), want.float())


@GPU_ONLY[0]
@GPU_ONLY[1]
def test_reduce_overhead_steps_match_eager():
    """CUDA graphs (``mode="reduce-overhead"``) take the NVFP4 step whole and replay it
    with eager's bits, new keys drawn at every replay."""
    recipe = NVFP4BlockScaling()
    torch.manual_seed(0)
    m = _stack("cuda", False)
    x, dy = _inputs("cuda")
    compiled = torch.compile(m, mode="reduce-overhead", fullgraph=True)
    for seed in (11, 12, 13, 11):
        want = _run(m, m, x, dy, recipe, seed)
        got = _run(compiled, m, x, dy, recipe, seed)
        for i, (w, g) in enumerate(zip(want, got)):
            assert torch.equal(w, g), (seed, i)
