"""The groups a compiled call makes recipe state for as it is traced
(``lowprec.modules.scaling.prepare_group``): a model's modules, as ``convert_model`` and
``attach_recipe`` group them, and no other model's."""

from __future__ import annotations

import copy
import pickle

import torch
import torch._dynamo.testing
from helpers import train_layers
from torch import nn

import lowprec
from lowprec.modules.scaling import GROUP_ATTR
from lowprec.recipe import CustomRecipe, DelayedScaling


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return lowprec.convert_model(nn.Sequential(nn.Linear(32, 64), nn.ReLU(),
                                               nn.Linear(64, 32)))


def _group(m: nn.Module) -> int | None:
    return m.__dict__.get(GROUP_ATTR)


def _holds(m: nn.Module, recipe) -> bool:
    held = m.__dict__["_recipe_states"]["forward"]
    return held is not None and held.recipe is recipe


def test_convert_model_groups_a_models_modules_and_no_other():
    a, b = _model(0), _model(1)
    assert _group(a[0]) == _group(a[2]) != _group(b[0]) == _group(b[2])
    loose = lowprec.Linear(32, 32), lowprec.Linear(32, 32)
    assert _group(loose[0]) is None and _group(loose[1]) is None
    attached = lowprec.attach_recipe(nn.Sequential(*loose), DelayedScaling())
    assert _group(attached[0]) == _group(attached[1])
    built = nn.Sequential(lowprec.Linear(32, 32), lowprec.Linear(32, 32))
    lowprec.init_scaling_state(built, DelayedScaling())
    assert _group(built[0]) == _group(built[1]) != _group(attached[0])


def test_modules_built_directly_share_code_grouped_or_not():
    """Layers of lowprec modules built directly (Transformer Engine's way) and compiled one
    by one under delayed scaling: one frame for all, whether ``init_scaling_state`` grouped
    them or not (the modules never grouped count as one group)."""
    recipe = DelayedScaling()

    def frames(group: bool) -> int:
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = nn.Sequential(*[lowprec.Linear(32, 32, name=f"l{i}") for i in range(3)])
        if group:
            lowprec.init_scaling_state(model, recipe)
        counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
        train_layers([torch.compile(m, backend=counter) for m in model], recipe,
                     torch.randn(8, 32, requires_grad=True))
        return counter.frame_count

    assert frames(group=False) == 1
    assert frames(group=True) == 1


def test_tracing_one_module_makes_its_models_state_only():
    """The first layer's trace makes delayed scaling's state for every layer of its model
    (so the next layer's guards pass), and for no module of another model."""
    a, b = _model(0), _model(1)
    recipe = DelayedScaling()
    compiled = torch.compile(a[0], backend="aot_eager", fullgraph=True)
    with lowprec.autocast(recipe=recipe):
        compiled(torch.randn(8, 32)).sum().backward()
    assert _holds(a[0], recipe) and _holds(a[2], recipe)  # a[2] never ran
    assert not _holds(b[0], recipe) and not _holds(b[2], recipe)


def test_factory_reading_names_is_asked_outside_the_trace_once_per_role():
    """A name-reading CustomRecipe: every role of the model is asked for once, by name,
    when the first layer is traced; the compiled calls read the quantizers it gave."""
    asked = []

    def factory(role):
        asked.append(None if role is None else (role.name, role.tensor_type))
        return lowprec.Float8CurrentScalingQuantizer(
            torch.float8_e5m2 if role is not None and role.is_gradient else torch.float8_e4m3fn)

    recipe = CustomRecipe(qfactory=factory)
    a = _model(0)
    layers = [torch.compile(a[i], backend="aot_eager", fullgraph=True) for i in (0, 2)]
    for _ in range(2):
        with lowprec.autocast(recipe=recipe):
            layers[1](torch.relu(layers[0](torch.randn(8, 32)))).sum().backward()
    # both modules' roles, once (the boundary slots have no role), made as the first layer
    # was traced: the second layer's trace and the second step ask nothing
    want = [(name, t) for name in ("0", "2") for t in ("input", "weight", "grad_output")]
    assert [r for r in asked if r is not None] == want, asked


def test_groups_survive_copies():
    a = _model(0)
    for c in (copy.deepcopy(a), pickle.loads(pickle.dumps(a))):
        assert _group(c[0]) == _group(c[2]) == _group(a[0])
