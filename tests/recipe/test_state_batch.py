"""Delayed-scaling states updated in a batch (``lowprec.recipe.state_batch``), the forward
ones at the autocast region's exit and the backward ones at the backward pass's end: the
same states as one update per state. The batched kernel itself is checked against
the single-state kernel in ``test_state_gpu.py``; the batched amax all-reduce in
``tests/distributed``."""

from __future__ import annotations

import copy

import pytest
import torch

import lowprec
from lowprec.recipe import state_batch
from lowprec.recipe.recipes import DelayedScaling

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
    return [m.scaling_state() for m in model if isinstance(m, lowprec.modules.base.LowprecModule)]


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
                assert torch.equal(st.delayed.amax_current,
                                   torch.zeros_like(st.delayed.amax_current))


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
def test_a_module_called_twice_keeps_the_larger_backward_amax(algo):
    """A module called twice before one backward pushes one backward row a step, the max
    of both calls' amaxes (the second call's gradient, far larger): the same states as
    one update per state."""
    batched = _called_twice(algo)
    with state_batch.per_state_updates():
        alone = _called_twice(algo)
    for mode in ("forward", "backward"):
        for a, b in zip(batched[mode], alone[mode]):
            assert torch.equal(a, b), mode
    hist = batched["backward"][0]
    assert (hist[:2, 0] > 0).all() and (hist[2:, 0] == 0).all()  # one row a step
    assert torch.equal(hist[0, 0], hist[1, 0])  # each step's larger gradient amax: 1e4


def test_per_state_updates_restores_the_flag():
    with state_batch.per_state_updates():
        assert state_batch.BATCHED is False
    assert state_batch.BATCHED is True



def test_backward_states_update_at_the_end_of_the_backward_pass():
    """The last module's backward state still has its amax unpushed while the first
    module's backward runs; the pass's end pushes it."""
    recipe = DelayedScaling(amax_history_len=3)
    model = _model("cpu")
    last = model[4]
    seen = {}

    def during_backward(grad):
        seen["row0"] = last._recipe_states["backward"].delayed.amax_history[0].clone()
        return grad

    x = torch.randn(16, 64, requires_grad=True)
    with lowprec.autocast(recipe=recipe):
        h = model[1](model[0](x))
        h.register_hook(during_backward)
        y = model[4](model[3](model[2](h)))
    g = torch.randn(16, 16) * 100
    y.backward(g)
    assert seen["row0"][0] == 0
    assert last._recipe_states["backward"].delayed.amax_history[0, 0] == g.abs().max()


def test_a_copy_of_a_state_works_out_its_own_batch_key():
    recipe = DelayedScaling(amax_history_len=2)
    st = lowprec.recipe.state.DelayedScalingState(recipe, 2, [torch.float8_e4m3fn] * 2,
                                           torch.device("cpu"))
    assert state_batch._batch_key(st) is None  # a CPU state updates on the torch path
    assert "_batch_key" in st.__dict__ and "_batch_key" not in copy.deepcopy(st).__dict__
