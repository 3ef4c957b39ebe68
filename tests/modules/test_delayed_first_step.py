"""A compiled delayed-scaling call on the kernel path (CUDA) stays the opaque op while a
slot it reads has no scale yet (``FirstScale.unseeded``), so that no traced graph seeds a
scale from the tensor's own amax (which would make every later step's cast wait for the
amax); once the notes clear it traces. The decision is taken on the CPU here, with the
kernel switch forced on (the route CUDA takes)."""

from __future__ import annotations

import pytest
import torch

import lowprec
from lowprec.modules import quantizers as module_quantizers
from lowprec.recipe.recipes import DelayedScaling


@pytest.fixture
def kernel_path(monkeypatch):
    monkeypatch.setattr(module_quantizers, "use_kernels", lambda t: True)


def _firsts(module):
    states = module._recipe_states
    return [f for mode in ("forward", "backward") for f in states[mode].delayed.firsts]


@pytest.mark.parametrize("make", [
    lambda: lowprec.Linear(64, 32, name="l"),
    lambda: lowprec.LayerNormMLP(64, 128, name="mlp")])
def test_opaque_until_every_read_slot_is_seeded(kernel_path, make):
    module = make()
    x = torch.randn(8, 64)
    with lowprec.autocast(recipe=DelayedScaling()):
        module.prepare_state(DelayedScaling())
        got = module.traced_quantizers(x, *[p for p in module.parameters() if p.dim() == 2])
        assert isinstance(got, str) and "first step" in got, got
        # seeded: every slot a GEMM reads (the output and grad_input slots, which nothing
        # reads, may stay without a scale)
        for f in _firsts(module):
            f.unseeded = False
        module._recipe_states["forward"].delayed.firsts[2].unseeded = True  # an output slot
        got = module.traced_quantizers(x, *[p for p in module.parameters() if p.dim() == 2])
        assert not isinstance(got, str), got
        # one read slot without a scale (the second GEMM's dY, say) keeps the call opaque
        _firsts(module)[-2].unseeded = True
        got = module.traced_quantizers(x, *[p for p in module.parameters() if p.dim() == 2])
        assert isinstance(got, str), got


def test_the_reference_path_traces_its_first_step():
    """Off the kernel path (the CPU reference, which takes the amax first anyway) a first
    step traces, seeding in the graph."""
    module = lowprec.Linear(64, 32, name="l")
    with lowprec.autocast(recipe=DelayedScaling()):
        module.prepare_state(DelayedScaling())
        got = module.traced_quantizers(torch.randn(8, 64), module.weight)
    assert not isinstance(got, str), got


@pytest.mark.parametrize("twice", [False, True], ids=["once", "twice"])
def test_the_next_step_traces_once_the_notes_clear(kernel_path, twice):
    """Compiled: the first step's graph holds the opaque op; once the notes clear (as the
    first update clears them on CUDA) the compiler traces the call, and every step equals
    eager's. A Linear called twice a step, opaque: each call's backward is a nested pass,
    which joins the outer one, so its backward state updates once, at the outer pass's
    end, and the first call's backward quantizes with the scale the pass began with."""
    from helpers import GraphOps
    from same_run import assert_same_step

    recipe = DelayedScaling(amax_history_len=3)
    torch.manual_seed(0)

    def make():
        layer = lowprec.Linear(64, 64 if twice else 32, name="l")
        return (torch.nn.Sequential(layer, layer) if twice else layer), layer
    eager, _ = make()
    model, layer = make()
    model.load_state_dict(eager.state_dict())
    ops = GraphOps()
    compiled = torch.compile(model, backend=ops, fullgraph=True)
    g = torch.Generator().manual_seed(1)
    for step in range(3):
        x = torch.randn(16, 64, generator=g) * 2.0 ** step
        dy = torch.randn(16, 64 if twice else 32, generator=g)
        assert_same_step(eager, compiled, model, recipe, x, dy, step)
        if step == 0:
            assert any(t.startswith("lowprec.call") for t in ops.steady())
            for f in _firsts(layer):  # the first update's note_seeded, on CUDA
                f.unseeded = False
    assert ops.steady() and not any(t.startswith("lowprec.call") for t in ops.steady())


@pytest.mark.parametrize("init", [False, True], ids=["state-from-call", "state-made"])
def test_opaque_calls_in_a_region_of_the_compiled_function_update_at_its_exit(kernel_path,
                                                                               init):
    """With ``lowprec.autocast`` inside the compiled function, its opaque calls (here a
    Linear called twice, its first step opaque) share one region at run time, which the
    traced region's exit updates: both calls cast with one scale and the step pushes one
    history row, eager's bits, whether the state was made before or by the first call."""
    from helpers import GraphOps
    from same_run import assert_same_run

    recipe = DelayedScaling(amax_history_len=3)
    torch.manual_seed(0)

    def make():
        layer = lowprec.Linear(64, 64, name="l")
        if init:
            lowprec.init_scaling_state(layer, recipe)
        return torch.nn.Sequential(layer, layer), layer

    def step(model):
        def run(x):
            with lowprec.autocast(recipe=recipe):
                return model(x)
        return run
    eager, _ = make()
    model, layer = make()
    model.load_state_dict(eager.state_dict())
    ops = GraphOps()
    compiled = torch.compile(step(model), backend=ops, fullgraph=True)
    g = torch.Generator().manual_seed(1)
    for n in range(3):
        x = torch.randn(16, 64, generator=g) * 2.0 ** n
        dy = torch.randn(16, 64, generator=g)
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        ya, yb = step(eager)(xa), compiled(xb)
        ya.backward(dy)
        yb.backward(dy)
        assert_same_run(eager, model, xa, xb, ya, yb)
        for p in (*eager.parameters(), *model.parameters()):
            p.grad = None
        if n == 0:
            assert "lowprec.exit_deferred.default" in ops.steady()
            for f in _firsts(layer):  # the first update's note_seeded, on CUDA
                f.unseeded = False
    assert not any(t.startswith("lowprec.call") for t in ops.steady())
