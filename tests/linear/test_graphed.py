"""Eager Linear calls replayed from CUDA graphs (``lowprec.autocast(cuda_graphs=True)``).

A replay must be the eager call bit for bit, step after step (weights updated in place in
between, so the graphs must read the parameters, not a copy), and must never hand out
a buffer that something still reads: a second forward before the first one's backward, or
an output still held at the next call, takes another graph (or runs eagerly). Calls the
graphs cannot serve run eagerly with a warning.

The bookkeeping (which buffers a capture takes, which graph a call takes, when one is
free, what a moved weight or a second backward does) runs on the CPU too, over a pretend
of the recording (``_PretendRecorder``: a "capture" runs the eager call, a "replay" runs it
again on the graph's own buffers and copies its results into the captured ones, so a
buffer shared or handed out and overwritten too early shows as wrong values); on a GPU
the same tests record real CUDA graphs.
"""

from __future__ import annotations

import contextlib
import copy
import warnings

import pytest
import torch
from helpers import GPU_ONLY, runs_in_backward

import lowprec
from lowprec.linear import graphed
from lowprec.recipe import factories as F

M, K, N = 200, 256, 384  # M off every block multiple: padded rows replay too


def GPU(test):
    for mark in GPU_ONLY:
        test = mark(test)
    return test


class _Recorded:
    def __init__(self, fn):
        self.replay = fn


class _PretendRecorder:
    """``graphed.RECORDER`` without CUDA: recording runs the call once (and gives back the
    random numbers it drew), and a replay runs it again (in the grad mode it was recorded
    in) and copies what it returns into what the recording returned: the graph's buffers,
    as a real replay writes them."""

    def __init__(self, device):
        pass

    def record(self, fn):
        grad = torch.is_grad_enabled()
        rng = torch.get_rng_state()
        first = fn()
        torch.set_rng_state(rng)  # a capture draws nothing: its replays do

        def replay():
            with torch.set_grad_enabled(grad):
                again = fn()
            pairs = zip(first, again) if isinstance(first, tuple) else [(first, again)]
            for into, out in pairs:
                if into is not None:
                    into.detach().copy_(out.detach())
        return _Recorded(replay), first

    def done(self):
        pass


@pytest.fixture(params=["cpu", "cuda"])
def device(request, monkeypatch):
    """"cpu": the pretend graphs; "cuda": real ones (skipped without CUDA and Triton)."""
    if request.param == "cuda":
        if not lowprec.kernels.triton_available():
            pytest.skip("needs a CUDA device and Triton")
    else:
        monkeypatch.setattr(graphed, "applies", lambda x: not torch.compiler.is_compiling())
        monkeypatch.setattr(graphed, "RECORDER", _PretendRecorder)
    graphed.counts.clear()
    return request.param


RECIPES = {
    "current": lambda: lowprec.recipe.Float8CurrentScaling(),
    "block": lambda: lowprec.recipe.Float8BlockScaling(),
    "mxfp8": lambda: lowprec.recipe.MXFP8BlockScaling(),
    "nvfp4": lambda: lowprec.recipe.NVFP4BlockScaling(),
    "mxfp8_fwd_nvfp4_bwd": lambda: lowprec.recipe.CustomRecipe(
        qfactory=F.mxfp8_fwd_nvfp4_bwd_factory),
    "fp8_block_hybrid": lambda: lowprec.recipe.CustomRecipe(qfactory=F.fp8_block_hybrid_factory),
}


class _Block(torch.nn.Module):
    """Three Linears, two reading one input (q/k-like: the shared quantize), bias on one."""

    def __init__(self, device="cuda"):
        super().__init__()
        kw = dict(params_dtype=torch.bfloat16, device=device)
        self.a = lowprec.Linear(K, N, bias=False, **kw)
        self.b = lowprec.Linear(K, N, bias=True, **kw)
        self.c = lowprec.Linear(N, K, bias=False, **kw)

    def forward(self, x):
        return self.c(torch.nn.functional.gelu(self.a(x)) * self.b(x))


def _steps(model, recipe, graphs: bool, steps: int = 4, lr: float = 0.05):
    """Outputs, input gradients and weights of ``steps`` SGD steps on fixed data."""
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(1)
    torch.manual_seed(7)  # stochastic rounding draws from torch's generator
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    out = []
    for _ in range(steps):
        x = torch.randn(M, K, device=device, dtype=torch.bfloat16, generator=gen)
        x.requires_grad_(True)
        dy = torch.randn(M, K, device=device, dtype=torch.bfloat16, generator=gen)
        with lowprec.autocast(recipe=recipe, cuda_graphs=graphs):
            y = model(x)
        y.backward(dy)
        out.append((y.detach().clone(), x.grad.clone(),
                    [p.grad.clone() for p in model.parameters()]))
        del y  # (an output held into the next step takes another graph: tested apart)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return out, [p.detach().clone() for p in model.parameters()]


def _assert_same(got, want, what):
    (steps_g, params_g), (steps_w, params_w) = got, want
    for i, ((yg, dxg, gg), (yw, dxw, gw)) in enumerate(zip(steps_g, steps_w)):
        assert torch.equal(yg, yw), f"{what}: step {i} output"
        assert torch.equal(dxg, dxw), f"{what}: step {i} input gradient"
        for j, (a, b) in enumerate(zip(gg, gw)):
            assert torch.equal(a, b), f"{what}: step {i} gradient of parameter {j}"
    for j, (a, b) in enumerate(zip(params_g, params_w)):
        assert torch.equal(a, b), f"{what}: parameter {j} after the steps"


@pytest.mark.parametrize("name", list(RECIPES))
def test_replays_are_eager_steps_bit_for_bit(name, device):
    torch.manual_seed(0)
    model = _Block(device)
    twin = copy.deepcopy(model)
    got = _steps(model, RECIPES[name](), graphs=True)
    # the first call of each Linear runs eagerly, the second captures, later ones replay
    # (a Linear whose input lies elsewhere on a later step captures once more, copying)
    assert 3 <= graphed.counts["captured"] <= 6, dict(graphed.counts)
    assert graphed.counts["replayed"] == 3 * 3, dict(graphed.counts)
    _assert_same(got, _steps(twin, RECIPES[name](), graphs=False), name)


def test_under_torch_autocast_with_fp32_weights(device):
    torch.manual_seed(0)
    lin = lowprec.Linear(K, N, params_dtype=torch.float32, device=device)
    twin = copy.deepcopy(lin)
    results = []
    for module, graphs in ((lin, True), (twin, False)):
        outs = []
        for step in range(3):
            gen = torch.Generator(device).manual_seed(step)
            x = torch.randn(M, K, device=device, generator=gen)
            with torch.autocast(device, dtype=torch.bfloat16), lowprec.autocast(
                    recipe=lowprec.recipe.Float8CurrentScaling(), cuda_graphs=graphs):
                y = module(x)
            y.float().square().sum().backward()
            outs.append((y.detach().clone(), module.weight.grad.clone()))
            module.weight.grad = None
        results.append(outs)
    assert graphed.counts["replayed"] == 2, dict(graphed.counts)  # the casts are captured
    for (yg, dwg), (yw, dww) in zip(*results):
        assert dwg.dtype == torch.float32
        assert torch.equal(yg, yw) and torch.equal(dwg, dww)


def test_second_forward_before_backward_takes_another_graph(device):
    torch.manual_seed(0)
    lin = lowprec.Linear(K, N, bias=False, params_dtype=torch.bfloat16, device=device)
    twin = copy.deepcopy(lin)
    recipe = lowprec.recipe.Float8CurrentScaling()
    xs = [torch.randn(M, K, device=device, dtype=torch.bfloat16, requires_grad=True)
          for _ in range(4)]
    with lowprec.autocast(recipe=recipe, cuda_graphs=True):
        lin(xs[0]).sum().backward()           # eager
        y1, y2 = lin(xs[1]), lin(xs[2])       # capture, then a second graph (the first waits)
        y3 = lin(xs[3])                       # both wait: eager
    assert graphed.counts["captured"] == 2, dict(graphed.counts)
    assert graphed.counts["eager (every graph of the kind is in use)"] == 1
    ys = [y1.detach().clone(), y2.detach().clone(), y3.detach().clone()]
    grads = []
    for y in (y3, y2, y1):
        lin.weight.grad = None
        y.float().square().sum().backward()
        grads.append(lin.weight.grad.clone())
    for i, (x, y) in enumerate(zip(xs[1:], ys)):
        xe = x.detach().clone().requires_grad_(True)
        twin.weight.grad = None
        with lowprec.autocast(recipe=recipe):
            ye = twin(xe)
        ye.float().square().sum().backward()
        assert torch.equal(y, ye), f"call {i + 1}: output"
        assert torch.equal(x.grad, xe.grad), f"call {i + 1}: input gradient"
        assert torch.equal(grads[2 - i], twin.weight.grad), f"call {i + 1}: weight gradient"


def test_an_input_changed_in_place_is_copied_again(device):
    """Graphs of one input shape share one input buffer, and one tensor read by several
    Linears in a row is copied in once: a tensor changed in place in between (its version
    moved) must be copied again."""
    torch.manual_seed(0)
    kw = dict(bias=False, params_dtype=torch.bfloat16, device=device)
    one, two = lowprec.Linear(K, N, **kw), lowprec.Linear(K, N, **kw)
    twins = copy.deepcopy(one), copy.deepcopy(two)
    recipe = lowprec.recipe.Float8CurrentScaling()
    for step in range(3):
        x = torch.randn(M, K, device=device, dtype=torch.bfloat16)
        got, want = [], []
        for modules, graphs, out in (((one, two), True, got), (twins, False, want)):
            xs = x.clone()
            with torch.no_grad(), lowprec.autocast(recipe=recipe, cuda_graphs=graphs):
                out.append(modules[0](xs))
                out.append(modules[1](xs))      # the same tensor: no copy
                xs.mul_(2)
                out.append(modules[1](xs))      # changed in place: copied again
        for i, (a, b) in enumerate(zip(got, want)):
            assert torch.equal(a, b), f"step {step}, call {i}"


def _lying_still(lin, twin, xs, dys):
    """Trains ``lin`` (graphed) and ``twin`` (eager) one call per (x, dY) pair, and checks
    each call's output and gradients bit for bit."""
    recipe = lowprec.recipe.Float8CurrentScaling()
    for i, (x, dy) in enumerate(zip(xs, dys)):
        got = []
        for module, graphs in ((lin, True), (twin, False)):
            x.grad = module.weight.grad = None
            with lowprec.autocast(recipe=recipe, cuda_graphs=graphs):
                y = module(x)
            y.backward(dy)
            got.append((y.detach().clone(), x.grad.clone(), module.weight.grad.clone()))
            del y
        for what, a, b in zip(("output", "input gradient", "weight gradient"), *got):
            assert torch.equal(a, b), f"call {i}: {what}"


def test_inputs_that_lie_still_are_read_where_they_lie(device):
    """An input and a dY that lie at the same address call after call (as the caching
    allocator hands out a training step's tensors) are read there: nothing is copied in.
    New values in the same memory are read as they are."""
    torch.manual_seed(0)
    lin = lowprec.Linear(K, N, bias=False, params_dtype=torch.bfloat16, device=device)
    twin = copy.deepcopy(lin)
    x = torch.randn(M, K, device=device, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(M, N, device=device, dtype=torch.bfloat16)

    def refreshed(_):  # new values in the same memory
        with torch.no_grad():
            x.copy_(torch.randn_like(x))
            dy.copy_(torch.randn_like(dy))
        return x
    _lying_still(lin, twin, map(refreshed, range(4)), [dy] * 4)
    assert graphed.counts["captured"] == 1 and graphed.counts["replayed"] == 3, \
        dict(graphed.counts)
    assert graphed.counts["captured backward"] == 1, dict(graphed.counts)
    assert graphed.counts["copied in"] == 0, dict(graphed.counts)


def test_an_input_found_elsewhere_is_copied_from_then_on(device):
    """A graph reads its input where the capture found it; a later input elsewhere (the
    first one still alive, so surely elsewhere) takes a graph that copies, and so do the
    kind's later calls."""
    torch.manual_seed(0)
    lin = lowprec.Linear(K, N, bias=False, params_dtype=torch.bfloat16, device=device)
    twin = copy.deepcopy(lin)
    xs = [torch.randn(M, K, device=device, dtype=torch.bfloat16, requires_grad=True)
          for _ in range(5)]
    dy = torch.randn(M, N, device=device, dtype=torch.bfloat16)
    _lying_still(lin, twin, [xs[0], xs[0], xs[1], xs[2], xs[0]], [dy] * 5)
    assert graphed.counts["captured"] == 2 and graphed.counts["replayed"] == 4, \
        dict(graphed.counts)
    assert graphed.counts["copied in"] == 3, dict(graphed.counts)


@pytest.mark.parametrize("order,backward_graphs,copies", [
    # a dY elsewhere takes a second backward graph, over a shared buffer, and a dY back in
    # the first place the first graph
    ((0, 0, 1, 0, 2), 2, 2),
    # the first backward may find dY elsewhere than the steps after it: once dY is found
    # twice in a row at a new place, the first graph is recorded again to read it there
    ((0, 0, 1, 1, 1), 3, 1),
])
def test_backward_graphs_follow_where_dy_lies(order, backward_graphs, copies, device):
    """The first backward reads dY where it found it; later dYs are read where they lie
    or copied into a buffer, as the cases say."""
    torch.manual_seed(0)
    lin = lowprec.Linear(K, N, bias=False, params_dtype=torch.bfloat16, device=device)
    twin = copy.deepcopy(lin)
    x = torch.randn(M, K, device=device, dtype=torch.bfloat16, requires_grad=True)
    dys = [torch.randn(M, N, device=device, dtype=torch.bfloat16) for _ in range(3)]
    _lying_still(lin, twin, [x] * len(order), [dys[i] for i in order])
    assert graphed.counts["captured"] == 1, dict(graphed.counts)
    assert graphed.counts["captured backward"] == backward_graphs, dict(graphed.counts)
    assert graphed.counts["copied in"] == copies, dict(graphed.counts)


def test_a_saved_input_changed_in_place_raises_in_backward(device):
    """A high-precision backward reads the input itself; read where it lies, the replay
    keeps the caller's tensor, and a change in place before the backward raises, as
    autograd does for an eager call."""
    lin = lowprec.Linear(K, N, bias=False, params_dtype=torch.bfloat16, device=device)
    x = torch.randn(M, K, device=device, dtype=torch.bfloat16)
    recipe = lowprec.recipe.Float8CurrentScaling(backward_mode="high_precision")
    with lowprec.autocast(recipe=recipe, cuda_graphs=True):
        lin(x).float().sum().backward()
        y = lin(x)
    assert graphed.counts["replayed"] == 1, dict(graphed.counts)
    x.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.float().sum().backward()


def test_linears_reading_one_input_share_its_quantize(device):
    """a and b read one input: b's graph reads the quantize a's graph made (as eager
    calls share it), bit for bit as eager."""
    torch.manual_seed(0)
    model = _Block(device)
    twin = copy.deepcopy(model)
    recipe = lowprec.recipe.Float8CurrentScaling()
    _assert_same(_steps(model, recipe, graphs=True), _steps(twin, recipe, graphs=False),
                 "shared")
    assert graphed.counts["captured reading another's quantize"] >= 1, dict(graphed.counts)


def test_a_graph_reading_another_quantize_needs_it_made_from_its_input(device):
    """b's graph reads a's quantize only where a's last replay read b's input as it is
    now: b called on another tensor, or on a's input changed since, takes a graph of its
    own."""
    torch.manual_seed(0)
    kw = dict(bias=False, params_dtype=torch.bfloat16, device=device)
    a, b = lowprec.Linear(K, N, **kw), lowprec.Linear(K, N, **kw)
    twins = copy.deepcopy(a), copy.deepcopy(b)
    recipe = lowprec.recipe.Float8CurrentScaling()
    x = torch.randn(M, K, device=device, dtype=torch.bfloat16)
    other = torch.randn(M, K, device=device, dtype=torch.bfloat16)
    for step, change in enumerate((None, None, None, "other", "in place", None)):
        got, want = [], []
        for (one, two), graphs, out in (((a, b), True, got), (twins, False, want)):
            with torch.no_grad(), lowprec.autocast(recipe=recipe, cuda_graphs=graphs):
                out.append(one(x))
                if change == "other":
                    out.append(two(other))
                elif change == "in place":
                    x.mul_(2)
                    out.append(two(x))
                    x.div_(2)
                else:
                    out.append(two(x))
        for i, (g, w) in enumerate(zip(got, want)):
            assert torch.equal(g, w), f"step {step} ({change}): call {i}"
    assert graphed.counts["captured reading another's quantize"] >= 1, dict(graphed.counts)


@pytest.mark.parametrize("name", ["current", "block", "mxfp8"])
def test_a_quantize_read_by_a_pending_backward_is_not_overwritten(name, device):
    """While b's backward, which reads a's quantize (block's and MXFP8's columnwise forms
    kept for wgrad), is still to run, a's next call takes another graph rather than
    overwrite it. (The CPU's pretend replays write only a graph's outputs, so only the
    real graphs would show an overwrite.)"""
    torch.manual_seed(0)
    kw = dict(bias=False, params_dtype=torch.bfloat16, device=device)
    a, b = lowprec.Linear(K, N, **kw), lowprec.Linear(K, N, **kw)
    twins = copy.deepcopy(a), copy.deepcopy(b)
    recipe = RECIPES[name]()
    # whole blocks of rows: a padded input is not shared (eager's rule)
    xs = [torch.randn(256, K, device=device, dtype=torch.bfloat16) for _ in range(3)]
    grads = []
    for (one, two), graphs in (((a, b), True), (twins, False)):
        with lowprec.autocast(recipe=recipe, cuda_graphs=graphs):
            for x in xs[:2]:  # eager, then captured: b reads a's quantize
                ya, yb = one(x), two(x)
                (ya.float().sum() + yb.float().square().sum()).backward()
                del ya, yb
            ya, yb = one(xs[2]), two(xs[2])  # elsewhere: graphs that copy, b reading a's
            ya.float().sum().backward()  # b's backward still to run
            del ya  # (held, it alone would keep a's graph from being reused)
            one.weight.grad = None
            one(xs[0]).float().sum().backward()  # must not overwrite what b reads
        two.weight.grad = None
        yb.float().square().sum().backward()
        grads.append((one.weight.grad, two.weight.grad))
    assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1])
    assert graphed.counts["captured reading another's quantize"] == 2, dict(graphed.counts)
    # a's last call found its graph held by b's backward: it captured another
    assert graphed.counts["captured"] == 5, dict(graphed.counts)


def test_accumulation_whose_second_micro_batch_drops_the_graph(device):
    """The first micro-batch of each step finds its input where the capture did (the same
    tensor), so its replay hands out a gradient that ``.grad`` takes over; the second's
    input lies elsewhere, so the graph is dropped while that ``.grad`` still views its
    buffer: the accumulated gradients stay eager's."""
    torch.manual_seed(0)
    lin = lowprec.Linear(K, N, bias=True, params_dtype=torch.bfloat16, device=device)
    twin = copy.deepcopy(lin)
    recipe = lowprec.recipe.Float8CurrentScaling()
    first = torch.empty(M, K, device=device, dtype=torch.bfloat16)
    for step in range(3):
        first.normal_()
        second = torch.randn(M, K, device=device, dtype=torch.bfloat16)
        # step 0 calls twice on ``first`` (eager, then the capture, where it lies)
        micro = (first, first) if step == 0 else (first, second)
        grads = []
        for module, graphs in ((lin, True), (twin, False)):
            module.zero_grad(set_to_none=True)
            for x in micro:
                with lowprec.autocast(recipe=recipe, cuda_graphs=graphs):
                    y = module(x)
                y.float().square().sum().backward()
                del y
            torch.randn(4 * M, K, device=device)  # memory asked for again
            grads.append((module.weight.grad.clone(), module.bias.grad.clone()))
        assert torch.equal(grads[0][0], grads[1][0]), f"step {step}: weight"
        assert torch.equal(grads[0][1], grads[1][1]), f"step {step}: bias"
    # captured on ``first``, dropped at step 1's second micro-batch, captured again
    assert graphed.counts["captured"] == 2, dict(graphed.counts)


def test_held_output_is_never_overwritten(device):
    lin = lowprec.Linear(K, N, bias=False, params_dtype=torch.bfloat16, device=device)
    recipe = lowprec.recipe.Float8CurrentScaling()
    with torch.no_grad(), lowprec.autocast(recipe=recipe, cuda_graphs=True):
        lin(torch.randn(M, K, device=device, dtype=torch.bfloat16))
        held = lin(torch.randn(M, K, device=device, dtype=torch.bfloat16))[:10]  # a view
        kept = held.clone()
        for _ in range(3):
            lin(torch.randn(M, K, device=device, dtype=torch.bfloat16))
    assert torch.equal(held, kept)


def test_backward_twice_raises(device):
    lin = lowprec.Linear(K, N, bias=False, params_dtype=torch.bfloat16, device=device)
    with lowprec.autocast(recipe=lowprec.recipe.Float8CurrentScaling(), cuda_graphs=True):
        for _ in range(2):
            y = lin(torch.randn(M, K, device=device, dtype=torch.bfloat16))
    y.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward ran twice"):
        y.sum().backward()


def test_delayed_scaling_is_graphed(device):
    """Delayed scaling replays too: the graphs cast with the states' scales and record the
    amaxes into them, the replayed backward joins each backward state to the pass's
    update, and over steps that move the scales the outputs, gradients, weights and
    states are eager's."""
    torch.manual_seed(0)
    model = _Block(device)
    twin = copy.deepcopy(model)
    recipe = lowprec.recipe.DelayedScaling(amax_history_len=3)
    got = _steps(model, recipe, graphs=True, steps=5)
    assert graphed.counts["captured"] > 0 and graphed.counts["replayed"] > 0, \
        dict(graphed.counts)
    _assert_same(got, _steps(twin, recipe, graphs=False, steps=5), "delayed")
    for a, b in zip(model.modules(), twin.modules()):
        if isinstance(a, lowprec.Linear):
            for mode in ("forward", "backward"):
                for name, t in a.scaling_state()[mode].items():
                    assert torch.equal(t, b.scaling_state()[mode][name]), (mode, name)
            # the backward state moved in every step (each replay joined its pass)
            assert (a.scaling_state()["backward"]["amax_history"][:3, 0] > 0).all()


def test_a_forward_that_saves_its_input_never_shares_a_buffer(device):
    """A high-precision backward saves the input itself: two such Linears of one input
    layout, reading different tensors, must not share an input buffer (the second copy
    would become the first one's saved input). They read their inputs where they lie, and
    once those move, each copies into a buffer of its own."""
    torch.manual_seed(0)
    kw = dict(bias=False, params_dtype=torch.bfloat16, device=device)
    pair = lowprec.Linear(K, N, **kw), lowprec.Linear(K, N, **kw)
    twins = copy.deepcopy(pair[0]), copy.deepcopy(pair[1])
    recipe = lowprec.recipe.Float8CurrentScaling(backward_mode="high_precision")
    for step in range(3):
        xs = [torch.randn(M, K, device=device, dtype=torch.bfloat16) for _ in range(2)]
        grads = []
        for (one, two), graphs in ((pair, True), (twins, False)):
            one.weight.grad = two.weight.grad = None
            with lowprec.autocast(recipe=recipe, cuda_graphs=graphs):
                y = one(xs[0]).float() + two(xs[1]).float()
            y.square().sum().backward()
            grads.append((one.weight.grad, two.weight.grad))
        assert torch.equal(grads[0][0], grads[1][0]), f"step {step}: first weight gradient"
        assert torch.equal(grads[0][1], grads[1][1]), f"step {step}: second weight gradient"
    assert graphed.counts["replayed"] == 4, dict(graphed.counts)


def _train_call(module, x, graphs: bool):
    with lowprec.autocast(recipe=lowprec.recipe.Float8CurrentScaling(), cuda_graphs=graphs):
        y = module(x)
    module.weight.grad = None
    y.float().square().sum().backward()
    return y.detach().clone(), module.weight.grad.clone()


def test_a_moved_weight_is_captured_again_then_refused(device):
    torch.manual_seed(0)
    lin = lowprec.Linear(K, N, bias=False, params_dtype=torch.bfloat16, device=device)
    twin = copy.deepcopy(lin)
    graphed._WARNED.clear()
    x = torch.randn(M, K, device=device, dtype=torch.bfloat16)
    for step, move in enumerate((False, False, True, False, True, False)):
        if move:  # new storage, same values (a reload, or FSDP's resharding)
            for m in (lin, twin):
                m.weight.data = m.weight.data.clone()
        if step == 4:
            with pytest.warns(UserWarning, match="storage moves"):
                got = _train_call(lin, x, True)
        else:
            got = _train_call(lin, x, True)
        want = _train_call(twin, x, False)
        assert all(torch.equal(a, b) for a, b in zip(got, want)), f"step {step}"
    assert graphed.counts["captured"] == 2, dict(graphed.counts)


@pytest.mark.parametrize("mode", ["default", "unsliced", "high_precision"])
def test_weight_moved_between_forward_and_backward(device, mode):
    """After the weight moves (FSDP frees and gathers it again), a backward that reads
    only what its forward made (a quantized weight) gives eager's gradients, and one that
    reads the weight itself (a high-precision backward saves it; the default one may make
    the weight's columnwise copy from it, and the traced plan that CUDA runs eagerly
    quantizes it again) raises rather than read the old storage: never a silently wrong
    gradient."""
    torch.manual_seed(0)
    lin = lowprec.Linear(K, N, bias=False, params_dtype=torch.bfloat16, device=device)
    twin = copy.deepcopy(lin)
    x = torch.randn(M, K, device=device, dtype=torch.bfloat16, requires_grad=True)
    recipe = lowprec.recipe.Float8CurrentScaling(
        backward_mode="high_precision" if mode == "high_precision" else "default")
    # unsliced: the forward quantizes the weight's columnwise copy too (nothing reads the
    # weight in backward)
    slicing = lowprec.linear.unsliced() if mode == "unsliced" else contextlib.nullcontext()
    with slicing, lowprec.autocast(recipe=recipe, cuda_graphs=True):
        lin(x)
        y = lin(x)
    assert graphed.counts["replayed"] == 1
    lin.weight.data = lin.weight.data.clone()
    try:
        y.float().square().sum().backward()
    except RuntimeError as err:
        assert "move to other storage" in str(err)
        # CUDA runs current scaling's traced plan eagerly, whose backward quantizes the
        # weight again from the weight itself; the eager Function (CPU) keeps the copies
        assert mode != "unsliced" or device == "cuda", (
            "a backward that reads only its forward's copies raised")
        return
    assert mode != "high_precision", "a high-precision backward reads the moved weight"
    xe = x.detach().clone().requires_grad_(True)
    with slicing, lowprec.autocast(recipe=recipe):
        ye = twin(xe)
    ye.float().square().sum().backward()
    assert torch.equal(x.grad, xe.grad) and torch.equal(lin.weight.grad, twin.weight.grad)


def test_attach_recipe_carries_the_flag(device):
    """A model with an attached recipe (the Hugging Face Trainer's way) replays its Linears
    under ``attach_recipe(..., cuda_graphs=True)``, bit for bit as without."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        lowprec.Linear(K, N, params_dtype=torch.bfloat16, device=device), torch.nn.GELU(),
        lowprec.Linear(N, K, params_dtype=torch.bfloat16, device=device))
    twin = copy.deepcopy(model)
    lowprec.attach_recipe(model, lowprec.recipe.Float8CurrentScaling(), cuda_graphs=True)
    lowprec.attach_recipe(twin, lowprec.recipe.Float8CurrentScaling())
    for step in range(3):
        x = torch.randn(M, K, device=device, dtype=torch.bfloat16)
        outs = []
        for m in (model, twin):
            m.zero_grad(set_to_none=True)
            y = m(x)
            y.float().square().sum().backward()
            outs.append((y.detach().clone(), [p.grad for p in m.parameters()]))
        (yg, gg), (yw, gw) = outs
        assert torch.equal(yg, yw), f"step {step}: output"
        assert all(torch.equal(a, b) for a, b in zip(gg, gw)), f"step {step}: gradients"
    # (each Linear captures once more where its input lies elsewhere on a later step)
    assert 2 <= graphed.counts["captured"] <= 4 and graphed.counts["replayed"] == 4, \
        dict(graphed.counts)


def test_gradient_accumulation_and_interleaved_evaluation(device):
    """Two micro-batches a step accumulate into ``.grad`` (autograd adds the graph's
    gradient buffer into it, never keeps the buffer), and an evaluation under ``no_grad``
    between steps (a kind of its own) leaves training as eager's."""
    torch.manual_seed(0)
    model = _Block(device)
    twin = copy.deepcopy(model)
    recipe = lowprec.recipe.Float8CurrentScaling()
    gen = torch.Generator(device=device).manual_seed(3)
    for step in range(3):
        xs = [torch.randn(M, K, device=device, dtype=torch.bfloat16, generator=gen)
              for _ in range(3)]
        results = []
        for m, graphs in ((model, True), (twin, False)):
            m.zero_grad(set_to_none=True)
            for x in xs[:2]:
                with lowprec.autocast(recipe=recipe, cuda_graphs=graphs):
                    y = m(x)
                y.float().square().sum().backward()
                del y  # (held into the next call, it would take a second graph)
            with torch.no_grad(), lowprec.autocast(recipe=recipe, cuda_graphs=graphs):
                evaluated = m(xs[2]).clone()
            results.append((evaluated, [p.grad.clone() for p in m.parameters()]))
        (eg, gg), (ew, gw) = results
        assert torch.equal(eg, ew), f"step {step}: evaluation"
        assert all(torch.equal(a, b) for a, b in zip(gg, gw)), f"step {step}: gradients"
    # 3 Linears x 2 kinds, each captured once more where its input lies elsewhere
    assert 6 <= graphed.counts["captured"] <= 12, dict(graphed.counts)


def test_a_forward_whose_graph_is_dropped_frees_its_graph(device):
    """A forward whose output is dropped without a backward (a discarded loss) frees its
    graph for the next call once its autograd graph is gone."""
    lin = lowprec.Linear(K, N, bias=False, params_dtype=torch.bfloat16, device=device)
    x = torch.randn(M, K, device=device, dtype=torch.bfloat16, requires_grad=True)
    with lowprec.autocast(recipe=lowprec.recipe.Float8CurrentScaling(), cuda_graphs=True):
        for _ in range(4):
            y = lin(x)
            del y
    assert graphed.counts["captured"] == 1 and graphed.counts["replayed"] == 3, \
        dict(graphed.counts)


def test_flag_must_be_a_bool():
    with pytest.raises(TypeError, match="cuda_graphs must be a bool, got 1"):
        with lowprec.autocast(cuda_graphs=1):
            pass
    with pytest.raises(TypeError, match="cuda_graphs must be a bool"):
        lowprec.attach_recipe(torch.nn.Linear(4, 4), lowprec.recipe.Float8CurrentScaling(),
                              cuda_graphs="yes")


def test_cpu_calls_run_eagerly_without_a_warning():
    lin = lowprec.Linear(64, 32, params_dtype=torch.bfloat16)
    twin = copy.deepcopy(lin)
    x = torch.randn(16, 64, dtype=torch.bfloat16)
    graphed.counts.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with lowprec.autocast(recipe=lowprec.recipe.Float8CurrentScaling(), cuda_graphs=True):
            y = lin(x)
    with lowprec.autocast(recipe=lowprec.recipe.Float8CurrentScaling()):
        ye = twin(x)
    assert torch.equal(y, ye) and not graphed.counts


@pytest.mark.parametrize("case, reason", [
    ("cache", "cache_weights"),
    ("output", "output or grad_input quantizer"),
    ("nonleaf", "not a leaf"),
    ("hooks", "saved-tensor hooks"),
    ("inference", "inference mode"),
    ("backward", "inside a backward pass"),
])
def test_refusal_names_the_reason(case, reason):
    q = lowprec.linear.LinearQuantizers(input=None, weight=None)
    x, w = torch.randn(4, 8), torch.randn(6, 8, requires_grad=True)
    cache = False
    if case == "cache":
        cache = True
    elif case == "output":
        q.output = object()
    elif case == "nonleaf":
        w = w * 2
    if case == "hooks":
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
            got = graphed.refusal(x, w, None, q, cache)
    elif case == "inference":
        with torch.inference_mode():
            got = graphed.refusal(x, w, None, q, cache)
    elif case == "backward":
        seen = []

        def probe(g):
            seen.append(graphed.refusal(x, w, None, q, cache))
            return g

        runs_in_backward(torch.ones(2, requires_grad=True), probe).sum().backward()
        got = seen[0]
    else:
        got = graphed.refusal(x, w, None, q, cache)
    assert got is not None and reason in got
    assert graphed.refusal(x, torch.randn(6, 8, requires_grad=True), None,
                           lowprec.linear.LinearQuantizers(input=None, weight=None),
                           False) is None
