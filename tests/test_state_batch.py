"""Delayed-scaling states updated in batches (``lowprec.state_batch``): the same states as
one update per state, backward states updated when the backward pass ends (not when each
module's backward does), and the fallbacks. The batched kernel itself is checked against
the single-state kernel in ``test_state_gpu.py``; the batched amax all-reduce in
``tests/distributed``."""

from __future__ import annotations

import copy

import pytest
import torch

import lowprec
from lowprec import state_batch
from lowprec.recipe import DelayedScaling

DEVICES = ["cpu"] + (["cuda"] if lowprec.kernels.triton_available() else [])


def _model(device, seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        lowprec.Linear(64, 64, name="a", device=device), torch.nn.GELU(),
        lowprec.LayerNormLinear(64, 32, name="b", device=device), torch.nn.GELU(),
        lowprec.Linear(32, 16, name="c", device=device))


def _train(model, recipe, steps, device):
    gen = torch.Generator().manual_seed(5)
    outs = []
    for step in range(steps):
        x = (torch.randn(32, 64, generator=gen) * (1 + 3 * step)).to(device).requires_grad_(True)
        g = (torch.randn(32, 16, generator=gen) * 10.0 ** (step % 3)).to(device)
        with lowprec.autocast(recipe=recipe):
            y = model(x)
        y.backward(g)
        outs.append((y.detach(), x.grad))
    return outs


def _states(model):
    return [m.get_extra_state() for m in model if isinstance(m, lowprec.modules.base.LowprecModule)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("algo", ["max", "most_recent"])
def test_batched_updates_match_one_update_per_state(device, algo):
    recipe = DelayedScaling(amax_history_len=4, margin=1, amax_compute_algo=algo)
    batched, alone = _model(device), _model(device)
    out_b = _train(batched, recipe, 5, device)
    with state_batch.per_state_updates():
        out_a = _train(alone, recipe, 5, device)
    for (yb, gb), (ya, ga) in zip(out_b, out_a):
        assert torch.equal(yb, ya) and torch.equal(gb, ga)
    moved = 0
    for sb, sa in zip(_states(batched), _states(alone)):
        for mode in ("forward", "backward"):
            for name in ("scale", "amax_history"):
                assert torch.equal(sb[mode][name], sa[mode][name]), (mode, name)
            moved += int((sb[mode]["scale"] != 1).sum())
    assert moved > 0  # the states really moved
    for m in batched:
        if isinstance(m, lowprec.modules.base.LowprecModule):
            for st in m._recipe_states.values():
                assert not st.delayed.pending
                assert torch.equal(st.delayed.amax_current, torch.zeros_like(st.delayed.amax_current))


def test_backward_states_update_when_the_backward_pass_ends():
    recipe = DelayedScaling(amax_history_len=3)
    model = _model("cpu")
    last, first = model[4], model[0]
    seen = {}

    def during_backward(grad):
        # runs after the last module's backward, before the first module's: the last
        # module's backward amax is recorded but has not entered its history yet
        st = last._recipe_states["backward"].delayed
        seen["pending"] = st.pending
        seen["row0"] = st.amax_history[0].clone()
        seen["current"] = st.amax_current.clone()
        return grad

    x = torch.randn(16, 64, requires_grad=True)
    with lowprec.autocast(recipe=recipe):
        h = model[1](model[0](x))
        h.register_hook(during_backward)
        y = model[4](model[3](model[2](h)))
    g = torch.randn(16, 16) * 100
    y.backward(g)
    assert seen["pending"] and torch.equal(seen["row0"], torch.zeros(2))
    assert seen["current"][0] == g.abs().max()
    for m in (last, first):
        st = m._recipe_states["backward"].delayed
        assert not st.pending and st.amax_history[0][0] > 0
    assert last._recipe_states["backward"].delayed.amax_history[0][0] == g.abs().max()
    assert not state_batch._QUEUES


def test_outside_a_backward_pass_the_update_runs_at_once():
    recipe = DelayedScaling(amax_history_len=2)
    st = lowprec.state.DelayedScalingState(recipe, 2, [torch.float8_e5m2] * 2, torch.device("cpu"))
    st.amax_current.copy_(torch.tensor([4.0, 0.0]))
    state_batch.defer_backward_update(st)
    assert not st.pending and not state_batch._QUEUES
    assert st.amax_history[0].tolist() == [4.0, 0.0]
    assert st.scale.tolist() == [57344.0 / 4.0, 1.0]


def _called_twice(algo):
    """A module called twice before one backward, the second call's gradient far larger:
    (forward and backward states after two steps)."""
    recipe = DelayedScaling(amax_history_len=4, amax_compute_algo=algo)
    torch.manual_seed(0)
    lin = lowprec.Linear(16, 16, bias=False)
    for _ in range(2):
        x = torch.randn(4, 16, requires_grad=True)
        with lowprec.autocast(recipe=recipe):
            y = lin(lin(x) * 1e-3)
        (y * 1e4).sum().backward()
    return {mode: (st.delayed.amax_history.clone(), st.delayed.scale.clone())
            for mode, st in lin._recipe_states.items()}


@pytest.mark.parametrize("algo", ["max", "most_recent"])
def test_a_module_called_twice_keeps_every_backward_amax(algo):
    """Each call's backward amax enters the history (the later call's backward records
    over the earlier's amax): the same states as one update per call."""
    batched = _called_twice(algo)
    with state_batch.per_state_updates():
        alone = _called_twice(algo)
    for mode in ("forward", "backward"):
        for a, b in zip(batched[mode], alone[mode]):
            assert torch.equal(a, b), mode
    hist = batched["backward"][0]
    assert (hist[:4, 0] > 0).all()  # two backward rows a step, both steps
    assert hist[:, 0].max() > 100 * hist[:, 0].min()  # the large gradient is among them


def test_a_forward_without_backward_does_not_hold_batching_back():
    """A forward whose graph is dropped unused closes its call: later backward passes
    still queue the state instead of updating it at once."""
    recipe = DelayedScaling(amax_history_len=2)
    lin = lowprec.Linear(16, 16)
    with lowprec.autocast(recipe=recipe):
        lin(torch.randn(4, 16, requires_grad=True))  # graph dropped here
    st = lin._recipe_states["backward"].delayed
    assert st._open_backwards == 0
    seen = {}
    x = torch.randn(4, 16, requires_grad=True)
    with lowprec.autocast(recipe=recipe):
        y = lin(x)

    def hook(grad):
        seen["pending"] = st.pending
        return grad
    x.register_hook(hook)
    y.sum().backward()
    assert seen["pending"] is True and not st.pending


def test_per_state_updates_restores_the_flag():
    with state_batch.per_state_updates():
        assert state_batch.BATCHED is False
    assert state_batch.BATCHED is True


class _Fails(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("backward failed on purpose")


def test_a_failed_backward_pass_leaves_its_queue_to_no_other_pass():
    """The states of a pass that raised stay out of the history; the next pass updates
    only its own states (each once), as one update per state would after the failure."""
    recipe = DelayedScaling(amax_history_len=3)

    def run():
        torch.manual_seed(0)
        a, b, c = (lowprec.Linear(8, 8) for _ in range(3))
        x = torch.randn(4, 8, requires_grad=True)
        with lowprec.autocast(recipe=recipe):
            y = c(_Fails.apply(b(a(x))))
        with pytest.raises(RuntimeError, match="on purpose"):
            y.sum().backward()
        hist_c = c._recipe_states["backward"].delayed.amax_history.clone()
        with lowprec.autocast(recipe=recipe):
            y = c(b(a(x)))
        y.sum().backward()
        return hist_c, [m._recipe_states["backward"].delayed.amax_history.clone() for m in (a, b, c)]

    stale_c, batched = run()
    assert torch.equal(stale_c, torch.zeros_like(stale_c))  # queued, not yet updated
    assert not state_batch._QUEUES
    with state_batch.per_state_updates():
        _, alone = run()
    for h in batched[:2]:  # a and b: one row, from the pass that completed
        assert (h[0, 0] > 0) and torch.equal(h[1:], torch.zeros_like(h[1:]))
    assert torch.equal(batched[2][0], alone[2][0])  # c: the completed pass's amax on top


def test_a_copy_of_a_state_has_no_open_calls():
    recipe = DelayedScaling(amax_history_len=2)
    lin = lowprec.Linear(8, 8)
    x = torch.randn(2, 8, requires_grad=True)
    with lowprec.autocast(recipe=recipe):
        y = lin(x)  # its backward is still to run
    st = lin._recipe_states["backward"].delayed
    assert st._open_backwards == 1
    twin = copy.deepcopy(lin)
    assert twin._recipe_states["backward"].delayed._open_backwards == 0
    y.sum().backward()
    assert st._open_backwards == 0
