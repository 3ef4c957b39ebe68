"""Delayed scaling's first training step runs eagerly under an autocast region entered around
compiled code (``lowprec.recipe.first_step``): the model compiles once, at the second step,
and every step equals eager's bit for bit."""

from __future__ import annotations

import copy

import pytest
import torch
import torch._dynamo.testing

import lowprec
from lowprec.recipe.recipes import DelayedScaling, Float8CurrentScaling

pytestmark = pytest.mark.usefixtures("fresh_dynamo", "eager_first_step")


def _delayed(n: int = 0) -> DelayedScaling:
    """A delayed recipe no other test's state was made under (a state made under an equal
    recipe that holds a scale counts as a first step taken)."""
    return DelayedScaling(amax_history_len=101 + n)


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _model(device="cpu"):
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    return torch.nn.Sequential(*[lowprec.Linear(64, 64, name=f"l{i}", params_dtype=dtype,
                                                device=device) for i in range(3)])


def _steps(recipe, n=3, *, inside=False, eval_first=False, device="cpu"):
    """``n`` training steps of a compiled model, then of an eager copy (the compiled model's
    region comes first in the thread), each step's output and gradients compared; returns
    the frames compiled after each step."""
    eager = _model(device)
    model = copy.deepcopy(eager)
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")

    def run(x):
        if inside:
            with lowprec.autocast(recipe=recipe):
                return model(x)
        return model(x)
    compiled = torch.compile(run, backend=counter, fullgraph=True)
    if eval_first:
        with lowprec.autocast(recipe=recipe), torch.no_grad():
            compiled(torch.randn(8, 64))
    def compiled_step(x):
        if inside:
            return compiled(x)
        with lowprec.autocast(recipe=recipe):
            return compiled(x)
    frames = []
    g = torch.Generator().manual_seed(1)
    for _ in range(n):
        x = torch.randn(8, 64, generator=g).to(device, next(model.parameters()).dtype)
        _same_step(compiled_step, model, eager, recipe, x)
        frames.append(counter.frame_count)
    return frames


def _same_step(compiled_step, model, eager, recipe, x):
    """A training step of the compiled model (``compiled_step``, which enters its own region
    where it needs one), then one of its eager copy under ``recipe``: the outputs and every
    gradient equal."""
    xa, xb = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    yb = compiled_step(xb)
    yb.sum().backward()
    with lowprec.autocast(recipe=recipe):
        ya = eager(xa)
    ya.sum().backward()
    assert torch.equal(ya, yb) and torch.equal(xa.grad, xb.grad)
    for a, b in zip(eager.parameters(), model.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad)


@pytest.mark.parametrize("device", DEVICES)
def test_first_step_eager_then_one_compile(device):
    """On CUDA a compiled first step would be the opaque op (its slots have no scales) and
    the second step a second compile."""
    assert _steps(_delayed(), device=device) == [0, 1, 1]


def test_a_later_model_compiles_its_first_step():
    """Once a slot made under an equal recipe holds a scale, a later model's first step
    compiles."""
    assert _steps(_delayed(), n=1) == [0]
    torch._dynamo.reset()
    assert _steps(_delayed(), n=1) == [1]


def test_regions_that_seed_nothing_run_eagerly_twice_at_most():
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(lambda t: (t * 2).sum(), backend=counter, fullgraph=True)
    frames = []
    for _ in range(3):
        with lowprec.autocast(recipe=_delayed(2)):
            compiled(torch.randn(4, requires_grad=True)).backward()
        frames.append(counter.frame_count)
    assert frames == [0, 0, 1]


@pytest.mark.parametrize("case", ["region_inside", "current"])
def test_where_the_first_step_compiles(case):
    """A region the compiler traces (entered inside the compiled function) and a recipe
    without state compile their first step."""
    recipe = Float8CurrentScaling() if case == "current" else _delayed()
    assert _steps(recipe, n=1, inside=case == "region_inside") == [1]


def test_an_evaluation_first_leaves_the_eager_step_to_training():
    """``with autocast(...), torch.no_grad():`` enters the region with gradients on: the
    evaluation runs eagerly, seeds nothing, and the training step after it runs eagerly
    too."""
    assert _steps(_delayed(), eval_first=True) == [0, 1, 1]


def test_an_error_in_the_first_step_leaves_the_compiler_on():
    model = _model()
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    with pytest.raises(RuntimeError, match="in the step"):
        with lowprec.autocast(recipe=_delayed()):
            compiled(torch.randn(8, 64, requires_grad=True))
            raise RuntimeError("an error in the step")
    assert counter.frame_count == 0
    torch.compile(lambda t: t * 2, backend=counter, fullgraph=True)(torch.randn(3))
    assert counter.frame_count == 1


def test_an_attached_recipe_around_compiled_layers():
    """``attach_recipe``'s hooks on a root that is not compiled, around layers compiled one
    by one: the first step eagerly, then one compile for every layer, eager's bits."""
    recipe = _delayed()
    eager = _model()
    model = copy.deepcopy(eager)
    lowprec.attach_recipe(model, recipe)
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    for i, layer in enumerate(model):
        model[i] = torch.compile(layer, backend=counter, fullgraph=True)
    frames = []
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        _same_step(model, model, eager, recipe, torch.randn(8, 64, generator=g))
        frames.append(counter.frame_count)
    assert frames == [0, 1, 1]
