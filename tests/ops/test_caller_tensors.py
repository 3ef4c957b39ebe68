"""lowprec.ops.Sequential never modifies a quantized tensor the caller owns, yet still frees
the rowwise data of the quantized intermediates its own pieces made.

A pass-through op (``Quantize`` with nothing to do, or any ``Quantize`` outside autocast)
hands the caller's input to the following linear as is; that linear must treat it as the
caller's, not as an intermediate of the run. Expectations: the caller's tensor compared with
a clone taken before the run (every inner tensor, bit for bit), and the run compared with
the same ``ops.Linear`` called directly on its own copy of the input.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from helpers import randn

import lowprec
import lowprec.ops as ops
from lowprec.formats.base import QuantizedTensor

E4M3 = torch.float8_e4m3fn

# The caller's quantizer and the recipe the run uses, per format.
FORMATS = {
    "mxfp8": (lambda: lowprec.MXFP8Quantizer(E4M3), lowprec.MXFP8BlockScaling),
    "current": (lambda: lowprec.Float8CurrentScalingQuantizer(E4M3),
                 lowprec.Float8CurrentScaling),
}


def raw(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def assert_same_quantized(a: QuantizedTensor, b: QuantizedTensor, what: str) -> None:
    """Same usages and every inner tensor bit-identical."""
    assert type(a) is type(b) and a.metadata() == b.metadata(), what
    for name, ta in a.inner_tensors().items():
        tb = getattr(b, name)
        assert (ta is None) == (tb is None), f"{what}: {name} held by only one side"
        if ta is not None:
            assert torch.equal(raw(ta), raw(tb)), f"{what}: {name} differs"


def pass_through(autocast: bool):
    """Pieces before the linear that hand their input on unchanged: a Quantize with nothing
    to do under autocast (nested in a Sequential too), any Quantize outside autocast."""
    if autocast:
        return [ops.Quantize(forward=False, backward=False),
                ops.Sequential(ops.Quantize(forward=False, backward=False))]
    return [ops.Quantize(forward=True, backward=True)]


def run(module, qx, dy, recipe):
    """Forward under ``recipe`` (None: no autocast) and backward; (y, dx, dW, db)."""
    module.zero_grad(set_to_none=True)
    qx.grad = None
    region = lowprec.autocast(recipe=recipe) if recipe is not None else contextlib.nullcontext()
    with region:
        y = module(qx)
    y.backward(dy)
    lin = module if isinstance(module, ops.Linear) else module[-1]
    return y.detach(), qx.grad, lin.weight.grad, lin.bias.grad


@pytest.mark.parametrize("autocast", [True, False], ids=["autocast", "no_autocast"])
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_caller_quantized_input_is_left_alone(fmt, autocast):
    make_q, make_recipe = FORMATS[fmt]
    recipe = make_recipe() if autocast else None
    x, dy = randn(64, 64, seed=1), randn(64, 32, seed=2)
    torch.manual_seed(0)
    lin = ops.Linear(64, 32)
    for before in pass_through(autocast):
        seq = ops.Sequential(before, ops.Linear(64, 32))
        seq[-1].load_state_dict(lin.state_dict())
        qx = make_q().quantize(x).requires_grad_(True)
        assert qx.has_usage("rowwise") and qx.has_usage("columnwise")
        kept = qx.detach().clone()
        got = run(seq, qx, dy, recipe)
        # Forward and backward ran, and the caller's tensor is exactly what it was.
        assert_same_quantized(qx, kept, f"{fmt} {type(before).__name__}: caller's input")
        # The same linear on its own copy of the input (the first piece of its run, so never
        # an intermediate): the same numbers, bit for bit.
        ref = run(lin, kept.clone().requires_grad_(True), dy, recipe)
        for name, g, r in zip(("y", "dx", "dW", "db"), got, ref):
            assert g is not None and torch.equal(g, r), f"{fmt} {type(before).__name__}: {name}"
        # The input is still usable: a second step on it gives the same numbers again.
        again = run(seq, qx, dy, recipe)
        for name, g, r in zip(("y", "dx", "dW", "db"), again, ref):
            assert torch.equal(g, r), f"{fmt} second step {name}"


def test_caller_tensor_from_a_separate_quantize_op_is_left_alone():
    """Quantized by lowprec.ops.Quantize in a call of its own, the tensor is still the
    caller's when handed to a Sequential."""
    recipe = lowprec.MXFP8BlockScaling()
    with lowprec.autocast(recipe=recipe):
        qx = ops.Quantize()(randn(64, 64, seed=1))
    assert qx.has_usage("rowwise") and qx.has_usage("columnwise")
    kept = qx.clone()
    seq = ops.Sequential(ops.Quantize(forward=False, backward=False), ops.Linear(64, 32))
    with lowprec.autocast(recipe=recipe):
        y = seq(qx)
    y.sum().backward()
    assert seq[1].weight.grad is not None
    assert_same_quantized(qx, kept, "caller's input")


class _Recording(ops.Quantize):
    """A Quantize op that keeps what it returned, to look at after the run."""

    def op_forward(self, x, extra_inputs, ctx):
        self.out = super().op_forward(x, extra_inputs, ctx)
        return self.out


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_intermediate_made_by_the_run_is_still_released(fmt):
    """The memory behaviour is kept: a quantized tensor a piece of this run made loses its
    rowwise data once the linear's fprop ran (backward reads only its columnwise data), also
    when a pass-through op sits between its maker and the linear."""
    recipe = FORMATS[fmt][1]()
    # Before a non-linear op a Quantize quantizes rowwise only; the linear then derives the
    # columnwise data, which only per-tensor FP8 can (a transpose).
    betweens = [[]] + ([[ops.Quantize(forward=False, backward=False)]] if fmt == "current"
                       else [])
    for between in betweens:
        maker = _Recording()
        seq = ops.Sequential(maker, *between, ops.Linear(64, 32))
        x = randn(64, 64, seed=1).requires_grad_(True)
        with lowprec.autocast(recipe=recipe):
            y = seq(x)
        made = maker.out
        assert isinstance(made, QuantizedTensor)
        assert not made.has_usage("rowwise") and made.has_usage("columnwise")
        y.sum().backward()
        assert x.grad is not None and seq[-1].weight.grad is not None
