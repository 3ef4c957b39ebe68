"""Bit-for-bit comparison of two runs of the same model (shared by the tests that compare
a way of running against eager: checkpointing, torch.compile)."""

from __future__ import annotations

import torch

import lowprec
from lowprec.recipe.recipes import CustomRecipe, Recipe


def nvfp4_factory(role):
    from lowprec.recipe.factories import nvfp4_factory as factory
    return factory(role)


def hybrid_factory(role):
    """MXFP8 forward, NVFP4 backward: a hybrid per direction."""
    from lowprec.recipe.factories import mxfp8_fwd_nvfp4_bwd_factory
    return mxfp8_fwd_nvfp4_bwd_factory(role)


#: A fresh recipe per call, for each kind the bit-for-bit tests run.
RECIPES = {
    "current": lambda: Recipe.from_name("fp8_current"),
    "delayed": lambda: Recipe.from_name("fp8_delayed", amax_history_len=4),
    "block": lambda: Recipe.from_name("fp8_block"),
    "mxfp8": lambda: Recipe.from_name("mxfp8"),
    "nvfp4": lambda: Recipe.from_name("nvfp4"),  # RHT, stochastic rounding, 2D weights
    "custom": lambda: CustomRecipe(qfactory=nvfp4_factory),
    "hybrid": lambda: CustomRecipe(qfactory=hybrid_factory),
}


def delayed_states(m) -> dict:
    """Every lowprec module's delayed-scaling state dicts, by (module name, mode)."""
    return {(name, mode): sd for name, mod in m.named_modules()
            if isinstance(mod, lowprec.modules.base.LowprecModule)
            for mode, sd in mod.scaling_state().items()}


def assert_same_run(a, b, xa, xb, ya, yb) -> None:
    """Outputs, input and parameter gradients and delayed-scaling states all equal."""
    assert torch.equal(ya, yb)
    assert torch.equal(xa.grad, xb.grad)
    assert_same_grads_and_states(a, b)


def assert_same_step(eager, compiled, model, recipe, x, dy, what="") -> None:
    """One step of ``eager`` and of ``compiled`` (which runs ``model``) under ``recipe`` on
    ``x`` and ``dy``: outputs, parameter gradients and delayed-scaling states all equal;
    the gradients are cleared after."""
    ys = []
    for m in (eager, compiled):
        with lowprec.autocast(recipe=recipe):
            ys.append(m(x))
        ys[-1].backward(dy)
    assert torch.equal(ys[0], ys[1]), what
    assert_same_grads_and_states(eager, model)
    for p in (*eager.parameters(), *model.parameters()):
        p.grad = None


def assert_same_grads_and_states(a, b) -> None:
    """Parameter gradients and delayed-scaling states of two models all equal."""
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(p.grad, q.grad), n
    sa, sb = delayed_states(a), delayed_states(b)
    assert sa.keys() == sb.keys()
    for key in sa:
        for k in sa[key]:
            assert torch.equal(sa[key][k], sb[key][k]), (key, k)
