"""The traced linear (lowprec/linear/traced.py): under torch.compile a Linear whose plan
traces is a graph of torch ops and GEMM calls, not one opaque ``lowprec::call``; its
forward and gradients are eager's bit for bit; every other call keeps the opaque op."""

from __future__ import annotations

import pytest
import torch

import lowprec
from lowprec.linear import traced
from lowprec.recipe import (
    DelayedScaling,
    Float8CurrentScaling,
    Format,
    MXFP8BlockScaling,
)

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


class _GraphOps:
    """A backend that records the ops of every graph dynamo hands it, then runs aot_eager."""

    def __init__(self) -> None:
        self.targets: list = []

    def __call__(self, gm, example_inputs):
        from torch._dynamo.backends.common import aot_autograd

        def record(g, _inputs):
            self.targets += [str(n.target) for n in g.graph.nodes if n.op == "call_function"]
            return g

        return aot_autograd(fw_compiler=record, bw_compiler=record)(gm, example_inputs)


def _run(fn, m, x, dy, recipe):
    x = x.detach().clone().requires_grad_(True)
    for p in m.parameters():
        p.grad = None
    with lowprec.autocast(recipe=recipe):
        y = fn(x)
    y.backward(dy)
    grads = [p.grad.clone() for p in m.parameters()]
    return [y.detach(), x.grad] + grads


def _dtype(device):
    return torch.bfloat16 if device == "cuda" else torch.float32


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("fmt", [Format.HYBRID, Format.E4M3])
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_traced_bit_identical(device, bias, fmt, backend):
    recipe = Float8CurrentScaling(fp8_format=fmt)
    torch.manual_seed(0)
    m = lowprec.Linear(128, 96, bias=bias, name="l", params_dtype=_dtype(device), device=device)
    x = torch.randn(3, 48, 128, device=device, dtype=_dtype(device))
    dy = torch.randn(3, 48, 96, device=device, dtype=_dtype(device))
    want = _run(m, m, x, dy, recipe)
    got = _run(torch.compile(m, backend=backend, fullgraph=True), m, x, dy, recipe)
    for w, g in zip(want, got):
        assert torch.equal(w, g)


def test_graph_has_no_opaque_call():
    """The compiled graph shows the quantize (amax, cast) and the GEMMs as ops."""
    ops = _GraphOps()
    m = lowprec.Linear(64, 32, name="l")
    compiled = torch.compile(m, backend=ops, fullgraph=True)
    x = torch.randn(16, 64, requires_grad=True)
    with lowprec.autocast(recipe=Float8CurrentScaling()):
        compiled(x).sum().backward()
    assert not any("lowprec.call" in t for t in ops.targets)
    assert any("amax" in t for t in ops.targets) and any("mm" in t for t in ops.targets)


@pytest.mark.parametrize("recipe", [DelayedScaling(), MXFP8BlockScaling(),
                                    Float8CurrentScaling(backward_mode="high_precision")],
                         ids=["delayed", "mxfp8", "hp_backward"])
def test_untraced_recipes_keep_the_opaque_call(recipe):
    ops = _GraphOps()
    m = lowprec.Linear(64, 32, name="l")
    compiled = torch.compile(m, backend=ops, fullgraph=True)
    with lowprec.autocast(recipe=recipe):
        compiled(torch.randn(16, 64, requires_grad=True)).sum().backward()
    assert any("lowprec.call" in t for t in ops.targets)


def test_plan_for():
    x, w = torch.randn(32, 64), torch.randn(16, 64)
    plan = traced.plan_for(Float8CurrentScaling(), x, w)
    assert plan.x.fp8_dtype == torch.float8_e4m3fn and plan.dy.fp8_dtype == torch.float8_e5m2
    assert not plan.cublas  # CPU: the fp32 emulation, as eager
    assert traced.plan_for(DelayedScaling(), x, w) is None
    assert traced.plan_for(Float8CurrentScaling(), x.double(), w.double()) is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_shapes_cublas_does_not_take_stay_opaque():
    """Eager runs another backend where cuBLAS needs multiples of 16 (or for E5M2 x E5M2):
    the traced plan declines, so compiled and eager still agree."""
    w = torch.randn(32, 64, device="cuda", dtype=torch.bfloat16)
    assert traced.plan_for(Float8CurrentScaling(), torch.randn(48, 64, device="cuda",
                                                                dtype=torch.bfloat16), w)
    assert traced.plan_for(Float8CurrentScaling(), torch.randn(24, 64, device="cuda",
                                                                dtype=torch.bfloat16), w) is None
    assert traced.plan_for(Float8CurrentScaling(fp8_format=Format.E5M2),
                           torch.randn(32, 64, device="cuda", dtype=torch.bfloat16), w) is None
