"""A compiled Linear decided outside dynamo's interpretation (lowprec/linear/decided.py)
and run as two graph ops (lowprec/linear/graph_linear.py): eager's bits, the quantize and
GEMM ops in the graph inductor receives, one decision for same-shaped layers and equal
recipes, and the traced path where it does not apply."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from helpers import GraphOps

import lowprec
from lowprec.linear import decided
from lowprec.modules import quantizers
from lowprec.recipe.recipes import (
    Float8BlockScaling,
    Float8CurrentScaling,
    MXFP8BlockScaling,
    NVFP4BlockScaling,
)

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
RECIPES = {"current": Float8CurrentScaling, "block": Float8BlockScaling,
           "mxfp8": MXFP8BlockScaling, "nvfp4": NVFP4BlockScaling}
FORWARD, BACKWARD = "lowprec.linear_forward.default", "lowprec.linear_backward.default"

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


class Recorder:
    """A backend that keeps the op targets of the graphs dynamo hands it (their subgraphs
    included), run as aot_eager."""

    def __init__(self) -> None:
        self.targets: list = []

    def __call__(self, gm, example_inputs):
        from functorch.compile import make_boxed_func
        from torch._dynamo.backends.common import aot_autograd
        for g in gm.modules():  # the autograd Function's forward and backward subgraphs too
            if isinstance(g, torch.fx.GraphModule):
                self.targets += [str(n.target) for n in g.graph.nodes if n.op == "call_function"]
        return aot_autograd(fw_compiler=lambda g, _: make_boxed_func(g))(gm, example_inputs)


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


def _dtype(device):
    return torch.bfloat16 if device == "cuda" else torch.float32


# (input shape, in, out, bias, params dtype (None: the device's), torch.autocast dtype)
CASES = {
    "3d-bias": ((3, 40, 128), 128, 96, True, None, None),
    "2d": ((64, 128), 128, 64, False, None, None),
    "padded": ((3, 7, 80), 80, 48, True, None, None),  # K, N and M in part blocks
    "amp": ((2, 32, 128), 128, 64, True, torch.float32, torch.bfloat16),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("name", list(RECIPES))
def test_decided_call_is_eager_bit_for_bit(device, case, name, monkeypatch):
    shape, k, n, bias, dtype, amp = CASES[case]
    if name == "nvfp4" and device == "cuda" and not lowprec.kernels.triton_available():
        pytest.skip("NVFP4 traces on CUDA with its Triton kernels only")
    recipe = RECIPES[name]()
    torch.manual_seed(0)
    dtype = dtype or _dtype(device)
    m = lowprec.Linear(k, n, bias=bias, name="l", params_dtype=dtype, device=device)
    x = torch.randn(shape, device=device, dtype=dtype)
    dy = torch.randn(*shape[:-1], n, device=device)
    want = _run(m, m, x, dy, recipe, amp=amp)
    seen = Recorder()
    got = _run(torch.compile(m, backend=seen, fullgraph=True), m, x, dy, recipe, amp=amp)
    assert FORWARD in seen.targets, seen.targets
    for w, g in zip(want, got):
        assert torch.equal(w, g)
    # the graph inductor receives: the ops decomposed, into the very ops of the call's
    # plan traced by dynamo
    ops, traced = GraphOps(), GraphOps()
    got = _run(torch.compile(m, backend=ops, fullgraph=True), m, x, dy, recipe, amp=amp)
    for w, g in zip(want, got):
        assert torch.equal(w, g)
    torch._dynamo.reset()
    monkeypatch.setattr(quantizers, "decided_linear", lambda *args: None)
    _run(torch.compile(m, backend=traced, fullgraph=True), m, x, dy, recipe, amp=amp)
    assert FORWARD not in ops.targets and BACKWARD not in ops.targets
    assert _compute(ops.targets) == _compute(traced.targets)


def _compute(targets) -> Counter:
    # views and aliases aside: the Function keeps its own 2-D view of the input where the
    # op may not return one, and AOT aliases some of an op's outputs
    return Counter(t for t in targets if t not in ("aten.view.default", "aten.alias.default"))


@pytest.mark.parametrize("device", DEVICES)
def test_input_without_grad_and_evaluation(device):
    recipe = Float8CurrentScaling()
    m = lowprec.Linear(128, 64, name="l", params_dtype=_dtype(device), device=device)
    x = torch.randn(32, 128, device=device, dtype=_dtype(device))
    dy = torch.randn(32, 64, device=device)
    compiled = torch.compile(m, backend=Recorder(), fullgraph=True)
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
    assert len(decided._NAMES) - before == 1
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs == 1


def test_symbolic_shapes_trace_as_before():
    """Symbolic sizes cannot be a decision's key: the call traces its plan in the graph."""
    recipe = Float8CurrentScaling()
    m = lowprec.Linear(64, 32, name="l")
    x, dy = torch.randn(24, 64), torch.randn(24, 32)
    want = _run(m, m, x, dy, recipe)
    seen = Recorder()
    got = _run(torch.compile(m, backend=seen, fullgraph=True, dynamic=True), m, x, dy, recipe)
    assert FORWARD not in seen.targets and seen.targets
    for w, g in zip(want, got):
        assert torch.equal(w, g)


def test_recipe_value_keys():
    a, b = Float8CurrentScaling(), Float8CurrentScaling()
    c = Float8CurrentScaling(use_power_2_scales=True)
    assert a._lowprec_value == b._lowprec_value != c._lowprec_value
    assert a._lowprec_key != b._lowprec_key
