"""The NaN/Inf check names the first layer, role and step where a non-finite value met a
quantizer."""

from __future__ import annotations

import pytest
import torch
from debug_helpers import batches, make_model, train

import lowprec
from lowprec.debug import NonFiniteError, Recorder
from lowprec.debug.finite import NonFiniteEvent


def _poison_fc2_input(model, at_call: int) -> None:
    """A NaN in fc2's input on its ``at_call``-th forward (fc1's stays finite)."""
    calls = [0]

    def hook(module, args):
        calls[0] += 1
        if calls[0] - 1 == at_call:
            x = args[0].clone()
            x[3, 7] = float("nan")
            return (x,)
        return None

    model[2].register_forward_pre_hook(hook)


def test_raise_names_the_layer_role_and_step():
    model = make_model()
    _poison_fc2_input(model, at_call=2)
    rec = Recorder(model, every=1, check_finite="raise")
    with pytest.raises(NonFiniteError, match=r"step 2 in layer 'fc2'.*role 'input'") as info:
        train(model, lowprec.MXFP8BlockScaling(), batches(4), rec)
    # raised by rec.step() at the end of step 2, after the step's rows were written
    assert info.value.event == NonFiniteEvent(2, "fc2", "input", "input", "2")
    assert rec.nonfinite == [info.value.event]
    assert rec.step_index == 3
    step2 = {(r["layer"], r["role"], r["direction"]): r for r in rec.rows if r["step"] == 2}
    assert len(step2) == 10  # the whole step: forward and backward
    assert [step2["fc2", "input", d]["nonfinite"] for d in ("rowwise", "columnwise")] == [1, 1]
    assert step2["fc1", "input", "rowwise"]["nonfinite"] == 0
    # the NaN spread into the backward (fc1 quantized its dY after fc2's input): not
    # the first event of the step, so not the one reported
    assert step2["fc1", "grad_output", "columnwise"]["nonfinite"] > 0
    assert all(r["nonfinite"] == 0 for r in rec.rows if r["step"] < 2)
    rec.close()
    assert rec.nonfinite == [info.value.event]


def test_warn_on_check_only_steps():
    """Recorded every 100 steps, checked every step: the NaN of step 2 is found at step 2."""
    model = make_model()
    _poison_fc2_input(model, at_call=2)
    rec = Recorder(model, every=100, check_every=1, check_finite="warn")
    with pytest.warns(RuntimeWarning, match=r"first NaN/Inf of step 2 in layer 'fc2'"):
        train(model, lowprec.Float8CurrentScaling(), batches(3), rec)
    rec.close()
    assert rec.nonfinite == [NonFiniteEvent(2, "fc2", "input", "input", "2")]
    assert {r["step"] for r in rec.rows} == {0}


def test_quantized_values_alone_non_finite():
    """A NaN delayed scale: the input is finite, its quantized values are not."""
    model = make_model()
    recipe = lowprec.DelayedScaling()
    x = batches(1)[0]
    with lowprec.autocast(recipe=recipe):  # creates the states
        model(x)
    model[0]._recipe_states["forward"].delayed.scale.fill_(float("nan"))
    rec = Recorder(model, every=1, check_finite="warn")
    with pytest.warns(RuntimeWarning, match=r"layer 'fc1'.*role 'input'.*rowwise quantized"):
        with lowprec.autocast(recipe=recipe):
            model(x)
        rec.close()  # the step ends: its check is read back
    assert rec.nonfinite[0].where == "rowwise"


def test_no_check():
    model = make_model()
    _poison_fc2_input(model, at_call=0)
    rec = Recorder(model, every=1, check_finite=False)
    train(model, lowprec.MXFP8BlockScaling(), batches(1), rec)
    rec.close()
    assert rec.nonfinite == []
    nan_rows = [r for r in rec.rows if r["nonfinite"]]
    assert nan_rows and all(r["layer"] == "fc2" or r["role"] == "grad_output"
                            for r in nan_rows)
    assert all(torch.isnan(torch.tensor(r["sqnr_db"])) for r in nan_rows)
