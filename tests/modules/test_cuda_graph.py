"""A whole Linear training step captured in a CUDA graph and replayed (GPU only).

Users take the host out of small steps by capturing them (``torch.cuda.graph`` around
forward and backward, as Transformer Engine users do with ``make_graphed_callables``). A
replay runs only the kernels recorded at capture, so anything a step decides on the host
from the data, or any state it keeps on the host, would come out wrong, silently. Each
recipe's replays are therefore compared with the same steps run eagerly on a twin module:
bit for bit where the quantization is deterministic, and for NVFP4's stochastic rounding,
by checking that the draws move on from one replay to the next (a frozen key would round
every step the same way: biased) while each replay stays as close to the float64 product
as an eager step.
"""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import GPU_ONLY
from modules_helpers import make_recipe, sqnr_db

import lowprec
import lowprec.kernels

pytestmark = [
    *GPU_ONLY,
    pytest.mark.usefixtures("no_kernel_loads_in_capture"),  # tests/conftest.py
]

M, K, N = 256, 384, 512
DETERMINISTIC = ["current", "delayed", "block", "mxfp8"]


def _step(module, recipe, x, dy):
    module.weight.grad = None
    x.grad = None
    with lowprec.autocast(recipe=recipe):
        y = module(x)
    y.backward(dy)
    return y


def _data(seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, generator=gen)
    dy = torch.randn(M, N, device="cuda", dtype=torch.bfloat16, generator=gen)
    return x, dy


def _captured(recipe_name):
    """(module, eager twin, twin's recipe, graph, static x, static dy, static y): the
    module's step captured after two eager warm-up steps on a side stream, as
    ``torch.cuda.graph`` asks, and the twin warmed up on the same data."""
    torch.manual_seed(0)
    mod = lowprec.Linear(K, N, bias=False, params_dtype=torch.bfloat16, device="cuda")
    twin = copy.deepcopy(mod)
    recipe, twin_recipe = make_recipe(recipe_name), make_recipe(recipe_name)
    x_static = torch.empty(M, K, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy_static = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for seed in (1, 2):
            x, dy = _data(seed)
            with torch.no_grad():
                x_static.copy_(x)
                dy_static.copy_(dy)
            _step(mod, recipe, x_static, dy_static)
            _step(twin, twin_recipe, x.clone().requires_grad_(True), dy)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y_static = _step(mod, recipe, x_static, dy_static)
    return mod, twin, twin_recipe, graph, x_static, dy_static, y_static


def _replay(graph, x_static, dy_static, x, dy):
    with torch.no_grad():
        x_static.copy_(x)
        dy_static.copy_(dy)
    graph.replay()
    torch.cuda.synchronize()


@pytest.mark.parametrize("recipe_name", DETERMINISTIC)
def test_replays_match_eager_steps(recipe_name):
    mod, twin, twin_recipe, graph, xs, dys, ys = _captured(recipe_name)
    for seed in (3, 4, 5):  # several replays: state kept across steps (delayed) must move on
        x, dy = _data(seed)
        _replay(graph, xs, dys, x, dy)
        xe = x.clone().requires_grad_(True)
        ye = _step(twin, twin_recipe, xe, dy)
        assert torch.equal(ys, ye), f"{recipe_name}: forward output, replay of seed {seed}"
        assert torch.equal(xs.grad, xe.grad), f"{recipe_name}: dgrad, replay of seed {seed}"
        assert torch.equal(mod.weight.grad, twin.weight.grad), \
            f"{recipe_name}: wgrad, replay of seed {seed}"


def test_delayed_scaling_state_advances_in_replays():
    """The amax history and scales are updated by the replays themselves (device-side
    state), not frozen at their capture-time values."""
    mod, _, _, graph, xs, dys, _ = _captured("delayed")
    states = [s.delayed for s in mod._recipe_states.values() if s is not None]
    assert len(states) == 2, "expected forward and backward delayed-scaling states"
    before = [(s.amax_history.clone(), s.scale.clone()) for s in states]
    x, dy = _data(6)
    _replay(graph, xs, dys, x * 1000.0, dy * 1000.0)  # larger amaxes must enter the histories
    for (hist, scale), s in zip(before, states):
        assert not torch.equal(hist, s.amax_history)
        assert not torch.equal(scale, s.scale)
        assert s.amax_history.max() >= 1000.0


def test_nvfp4_stochastic_rounding_draws_advance():
    mod, _, _, graph, xs, dys, ys = _captured("nvfp4")
    x, dy = _data(3)
    _replay(graph, xs, dys, x, dy)
    first = (ys.clone(), xs.grad.clone(), mod.weight.grad.clone())
    _replay(graph, xs, dys, x, dy)
    second = (ys, xs.grad, mod.weight.grad)
    # the forward of the default NVFP4 recipe rounds to nearest: same bits each replay; the
    # backward's stochastic rounding must draw anew
    assert torch.equal(first[0], second[0])
    assert not torch.equal(first[2], second[2]), "wgrad identical in two replays: SR frozen"
    # each replay is still a faithful step: SQNR against the float64 gradient. 4-bit codes
    # with 16-element blocks keep about 15-20 dB per operand; two quantized operands and
    # the stochastic rounding leave above 10 dB, where a broken replay (stale or garbage
    # operands) falls near or below 0 dB
    w64 = mod.weight.detach().double()
    dw64 = dy.double().t() @ x.double()
    dx64 = dy.double() @ w64
    for got in (first, second):
        assert sqnr_db(dw64, got[2].double()) > 10.0
        assert sqnr_db(dx64, got[1].double()) > 10.0


class _UnderAutocast(torch.nn.Module):
    """``module`` run under ``lowprec.autocast(recipe)``: what ``make_graphed_callables``
    captures (the recipe context must be inside the captured forward)."""

    def __init__(self, module, recipe):
        super().__init__()
        self.module, self.recipe = module, recipe

    def forward(self, x):
        with lowprec.autocast(recipe=self.recipe):
            return self.module(x)


@pytest.mark.parametrize("recipe_name", ["current", "block", "mxfp8"])
def test_make_graphed_callables(recipe_name):
    """``torch.cuda.make_graphed_callables`` captures forward and backward apart (as
    Transformer Engine's does); its warm-up runs the backward on uninitialized gradients,
    which a stateless recipe forgets (delayed scaling would record their amaxes: capture
    whole steps instead, or reset the history after graphing)."""
    torch.manual_seed(0)
    mod = lowprec.Linear(K, N, bias=False, params_dtype=torch.bfloat16, device="cuda")
    twin = copy.deepcopy(mod)
    recipe = make_recipe(recipe_name)
    sample = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    graphed = torch.cuda.make_graphed_callables(_UnderAutocast(mod, recipe), (sample,))
    for seed in (3, 4):
        x, dy = _data(seed)
        mod.weight.grad = None
        xg = x.clone().requires_grad_(True)
        y = graphed(xg)
        y.backward(dy)
        xe = x.clone().requires_grad_(True)
        ye = _step(twin, make_recipe(recipe_name), xe, dy)
        torch.cuda.synchronize()
        assert torch.equal(y, ye), f"{recipe_name}: forward output, seed {seed}"
        assert torch.equal(xg.grad, xe.grad), f"{recipe_name}: dgrad, seed {seed}"
        assert torch.equal(mod.weight.grad, twin.weight.grad), f"{recipe_name}: wgrad, seed {seed}"
