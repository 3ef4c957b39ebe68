"""The eager linear's plan (lowprec/linear/plan.py): decided once per kind of call, reused
by later calls, and decided anew for another shape, grad mode or slicing mode."""

from __future__ import annotations

import torch

import lowprec
from lowprec.linear import grad_split
from lowprec.linear import plan as plan_mod
from lowprec.recipe.recipes import Float8BlockScaling, Float8CurrentScaling


def _decisions(monkeypatch):
    calls = []
    real = plan_mod._decide

    def spy(*args, **kwargs):
        calls.append(args[1].shape)
        return real(*args, **kwargs)

    monkeypatch.setattr(plan_mod, "_decide", spy)
    return calls


def test_plan_is_decided_once_per_kind_of_call(monkeypatch):
    calls = _decisions(monkeypatch)
    m = lowprec.Linear(128, 64, name="l")
    x = torch.randn(32, 128, requires_grad=True)
    with lowprec.autocast(recipe=Float8CurrentScaling()):
        for _ in range(3):
            m(x).sum().backward()
        assert len(calls) == 1
        m(torch.randn(48, 128)).sum().backward()  # another token count
        assert len(calls) == 2
        with torch.no_grad():  # no gradients: another plan (no columnwise copies)
            m(x)
        assert len(calls) == 3
        with grad_split.unsliced():
            m(x).sum().backward()
        assert len(calls) == 4


def test_plan_holds_the_decisions():
    m = lowprec.Linear(128, 128, name="l")
    with lowprec.autocast(recipe=Float8BlockScaling()):
        qs, mode, _ = m.gemm_quantizers(torch.device("cpu"))
    q = qs[0]
    x, w = torch.randn(200, 128), m.weight
    p = plan_mod.plan_for(q, x, w, mode, True, True, False)
    assert p.pad == 56  # 1x128 columnwise blocks run along M: 200 -> 256 rows
    assert p.x_columnwise and p.w_columnwise and p.w_two_steps
    assert p.w_in_backward  # a parameter: saved as it is, its columnwise copy made in backward
    assert plan_mod.plan_for(q, x, w, mode, True, True, False) is p
    copy = plan_mod.plan_for(q, x, w.detach().clone(), mode, True, True, False)
    assert copy.w_two_steps and not copy.w_in_backward  # a temporary: its copy is made now
    eval_plan = plan_mod.plan_for(q, x, w, mode, False, False, False)
    assert eval_plan.pad == 0 and not eval_plan.x_columnwise and not eval_plan.w_columnwise
    with grad_split.unsliced():
        assert not plan_mod.plan_for(q, x, w, mode, True, True, False).w_two_steps


def test_copies_of_quantizers_decide_their_own_plans():
    """A pickled or deep-copied LinearQuantizers starts without plans: the prepared quantizes
    of the original's plans hold the original's quantizers."""
    import copy
    import pickle

    from lowprec import Float8CurrentScalingQuantizer
    from lowprec.linear.function import LinearQuantizers, quantized_linear
    q = LinearQuantizers(Float8CurrentScalingQuantizer(), Float8CurrentScalingQuantizer(),
                         grad_output=Float8CurrentScalingQuantizer())
    x = torch.randn(4, 32, requires_grad=True)
    w = torch.randn(16, 32, requires_grad=True)
    quantized_linear(x, w, quantizers=q).sum().backward()
    assert q.plans
    for clone in (pickle.loads(pickle.dumps(q)), copy.deepcopy(q)):
        assert clone.plans == {} and clone.input is not q.input
        y = quantized_linear(x, w, quantizers=clone)
        assert torch.equal(y, quantized_linear(x, w, quantizers=q))
        assert clone.plans and all(plan is not q.plans[k] for k, plan in clone.plans.items())
