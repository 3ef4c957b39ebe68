"""Delayed-scaling backward states updated once per backward pass (``lowprec.recipe
.backward_pass``): one batched update of every module's state at the pass's end, in the
states' creation order; a module called several times before one backward pushes one
history row, the max of its calls' amaxes; a compiled backward joins through one op a
module and updates as eager does."""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch
from helpers import runs_in_backward
from same_run import assert_same_step

import lowprec
from lowprec.recipe import backward_pass
from lowprec.recipe.recipes import DelayedScaling

E5M2_MAX = 57344.0
#: on CUDA the end-of-pass update is the batched kernel, and the compiled Linears trace in
#: bf16
DEVICES = ["cpu"] + (["cuda"] if lowprec.kernels.triton_available() else [])


def _linears(n: int, seed: int = 0, device: str = "cpu"):
    torch.manual_seed(seed)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    return [lowprec.Linear(32, 32, name=f"l{i}", params_dtype=dtype, device=device)
            for i in range(n)]


def _backward_state(m):
    return m.scaling_state()["backward"]


@pytest.fixture
def updates(monkeypatch):
    """The lists of backward states each end-of-pass update was handed."""
    seen = []
    real = backward_pass.update_states

    def spy(states, group=None):
        seen.append(list(states))
        real(states, group)

    monkeypatch.setattr(backward_pass, "update_states", spy)
    return seen


@pytest.mark.parametrize("device", DEVICES)
def test_one_update_a_backward_pass_in_creation_order(updates, device):
    """Three modules, one backward pass: one update, handed all three backward states in
    the order they were made (the backward ran them last to first), each of which then
    holds dY's amax as its newest history row."""
    lins = _linears(3, device=device)
    recipe = DelayedScaling(amax_history_len=4)
    before = backward_pass.pending_passes()
    dtype = lins[0].weight.dtype
    x = torch.randn(16, 32, device=device, dtype=dtype, requires_grad=True)
    dys = {}
    with lowprec.autocast(recipe=recipe):
        h = x
        for lin in lins:
            h = lin(h)
            h.register_hook(lambda g, lin=lin: dys.__setitem__(lin, g.abs().max()))
    h.backward(torch.randn(16, 32, device=device, dtype=dtype))
    assert len(updates) == 1, updates
    serials = [s.serial for s in updates[0]]
    assert serials == sorted(serials) and len(serials) == 3
    states = [lin._kept_delayed()["backward"].delayed for lin in lins]
    assert updates[0] == states
    for lin in lins:
        st = _backward_state(lin)
        assert torch.equal(st["amax_history"][0, 0], dys[lin].float()), lin.name
        assert torch.equal(st["scale"][0].cpu(), torch.tensor(E5M2_MAX) / dys[lin].float().cpu())
    assert backward_pass.pending_passes() == before


def test_a_module_called_twice_pushes_one_row_with_the_larger_amax(updates):
    """A shared module called twice before one backward: one history row, the max of the
    two calls' dY amaxes, and one update."""
    (lin,) = _linears(1)
    recipe = DelayedScaling(amax_history_len=4)
    x = torch.randn(16, 32)
    a, b = torch.randn(16, 32), torch.randn(16, 32) * 5
    for step in range(2):
        with lowprec.autocast(recipe=recipe):
            y1, y2 = lin(x), lin(x * 2)
        ((y1 * a).sum() + (y2 * b).sum()).backward()
        hist = _backward_state(lin)["amax_history"]
        want = torch.maximum(a.abs().max(), b.abs().max())
        assert torch.equal(hist[0, 0], want), step
        assert torch.equal(hist[1, 0], want if step else torch.tensor(0.0)), step
    assert len(updates) == 2


@pytest.mark.parametrize("compiled", [False, True])
def test_each_backward_through_a_retained_graph_updates(updates, compiled):
    """A backward through a graph kept with ``retain_graph=True`` is a pass of its own: it
    pushes a row of its own. Compiled, the second backward raises autograd's in-place
    error (the graph saved the state's tensors, which the first backward wrote), never
    a silent second update from stale tensors."""
    (lin,) = _linears(1)
    # a fresh compile: a graph an earlier test compiled for Linear with another backend
    # (donated buffers) would refuse the second backward with another message
    torch._dynamo.reset()
    f = torch.compile(lin, backend="aot_eager", fullgraph=True) if compiled else lin
    with lowprec.autocast(recipe=DelayedScaling(amax_history_len=4)):
        y = f(torch.randn(8, 32))
    y.sum().backward(retain_graph=True)
    if compiled:
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            (2 * y).sum().backward()
        return
    (2 * y).sum().backward()
    hist = _backward_state(lin)["amax_history"]
    assert hist[0, 0] == 2.0 and hist[1, 0] == 1.0, hist[:3, 0]
    assert len(updates) == 2


def test_a_pass_that_raises_leaves_its_states_to_the_next():
    """A backward that raises before its end runs no update: its states stay pending with
    their amaxes, and the next pass that joins them pushes the max of both."""
    (lin,) = _linears(1)
    recipe = DelayedScaling(amax_history_len=4)

    def fail(g):
        raise ValueError("stop")

    with lowprec.autocast(recipe=recipe):
        x = torch.randn(8, 32, requires_grad=True)
        x.register_hook(fail)
        y = lin(x)
    with pytest.raises(ValueError, match="stop"):
        (3 * y).sum().backward()
    state = lin._kept_delayed()["backward"].delayed
    assert state.pending and state.amax_history[0, 0] == 0
    with lowprec.autocast(recipe=recipe):
        y = lin(torch.randn(8, 32))
    y.sum().backward()
    assert state.amax_history[0, 0] == 3.0 and state.amax_history[1, 0] == 0
    assert not state.pending


def test_outside_a_pass_a_state_updates_at_once():
    """Joined outside the autograd engine (a backward function called by hand), a state
    updates as it joins."""
    (lin,) = _linears(1)
    with lowprec.autocast(recipe=DelayedScaling(amax_history_len=2)):
        lin(torch.randn(8, 32))
    state = lin._kept_delayed()["backward"].delayed
    state.amax_current.fill_(3.0)
    before = backward_pass.pending_passes()
    backward_pass.join(state)
    assert not state.pending and state.amax_history[0, 0] == 3.0
    assert backward_pass.pending_passes() == before


@pytest.mark.parametrize("backend, device", [("aot_eager", "cpu"), ("inductor", "cpu")]
                         + [("inductor", "cuda")] * ("cuda" in DEVICES))
def test_compiled_backward_joins_the_pass_as_eager(updates, backend, device):
    """A compiled model's backward states update in one end-of-pass update, as eager's,
    with eager's bits over steps whose amaxes move the scales."""
    recipe = DelayedScaling(amax_history_len=3)
    eager = torch.nn.Sequential(*_linears(2, device=device))
    model = torch.nn.Sequential(*_linears(2, device=device))
    dtype = model[0].weight.dtype
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    g = torch.Generator().manual_seed(3)
    for step in range(3):
        x = (torch.randn(16, 32, generator=g) * 3.0 ** step).to(device, dtype)
        dy = (torch.randn(16, 32, generator=g) / 2.0 ** step).to(device, dtype)
        assert_same_step(eager, compiled, model, recipe, x, dy, step)  # states too
    # one update a backward pass, eager's and compiled's alike, of both modules' states
    assert len(updates) == 6 and all(len(u) == 2 for u in updates), updates


@pytest.mark.parametrize("nested_for_outer", [True, False], ids=["for-running", "own-pass"])
def test_a_nested_pass_run_for_the_outer_one_joins_it(updates, nested_for_outer):
    """A backward that runs ``autograd.grad`` over a graph of its own (an opaque compiled
    call's) inside ``for_running``: the states joining in that nested pass update with the
    outer pass's, once, at its end; without it the nested pass updates them at its own
    end, before the outer pass goes on."""
    a, b = _linears(2)
    recipe = DelayedScaling(amax_history_len=3)
    x = torch.randn(8, 32)
    with lowprec.autocast(recipe=recipe):
        inner_in = torch.randn(8, 32, requires_grad=True)
        inner_out = b(inner_in)  # a graph the outer backward runs by hand

    def outer_backward(g):
        with backward_pass.for_running() if nested_for_outer else nullcontext():
            torch.autograd.grad(inner_out, inner_in, g)
        seen_inside.append(len(updates))
        return g

    seen_inside = []
    with lowprec.autocast(recipe=recipe):
        y = runs_in_backward(a(x.requires_grad_()), outer_backward)
    y.sum().backward()
    state_a, state_b = (m._kept_delayed()["backward"].delayed for m in (a, b))
    if nested_for_outer:
        # nothing updated inside; one update at the outer end, with both states
        assert seen_inside == [0] and [len(u) for u in updates] == [2]
        assert updates[0] == [state_b, state_a]  # creation order: b ran first
    else:
        assert seen_inside == [1] and [len(u) for u in updates] == [1, 1]
    assert not state_a.pending and not state_b.pending
