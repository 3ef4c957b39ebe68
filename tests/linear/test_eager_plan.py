"""Eager calls that run the traced plan (``lowprec.linear.eager_plan.eager_plan``): where every
form of a call's plan runs eagerly with eager's kernels (CUDA with Triton), an eager Linear
runs :class:`TracedLinear`, the Function a compiled call traces. Its results are the eager
Function's bit for bit (``eager_plans_off`` runs that one), and it keeps no more memory."""

from __future__ import annotations

import contextlib

import pytest
import torch

import lowprec
from lowprec import Float8CurrentScaling
from lowprec.kernels import triton_available
from lowprec.linear import eager_plan
from lowprec.recipe import factories

_KERNELS = torch.cuda.is_available() and triton_available()


def gpu(test):
    """A test of the kernels' eager forms."""
    return pytest.mark.gpu(pytest.mark.skipif(not _KERNELS,
                                              reason="needs a CUDA device with Triton")(test))



def _step(m, x, dy, recipe, **kw):
    for p in m.parameters():
        p.grad = None
    x = x.detach().clone().requires_grad_(x.requires_grad)
    with lowprec.autocast(recipe=recipe), torch.autocast("cuda", torch.bfloat16,
                                                         enabled=kw.get("amp", False)):
        y = m(x)
    name = type(y.grad_fn).__name__
    if y.requires_grad:
        y.backward(dy)
    grads = [x.grad] + [p.grad for p in m.parameters()]
    return name, [y] + grads


def _both(m, x, dy, recipe, **kw):
    planned_fn, planned = _step(m, x, dy, recipe, **kw)
    with eager_plan.eager_plans_off():
        eager_fn, eager = _step(m, x, dy, recipe, **kw)
    return planned_fn, planned, eager_fn, eager


def _same(a, b):
    assert len(a) == len(b)
    for i, (u, v) in enumerate(zip(a, b)):
        assert (u is None) == (v is None), i
        if u is not None:
            assert u.dtype == v.dtype and u.shape == v.shape, i
            assert torch.equal(u, v), (i, (u.float() - v.float()).abs().max())


@gpu
@pytest.mark.parametrize("shape", [(128, 256, 512), (100, 256, 384), (2, 48, 512, 256)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("mode", ["default", "high_precision", "dequantized"])
def test_linear_runs_the_plan_bit_for_bit(shape, bias, mode):
    *lead, k, n = shape
    gen = torch.Generator(device="cuda").manual_seed(sum(shape))
    m = lowprec.Linear(k, n, bias=bias, params_dtype=torch.bfloat16, device="cuda")
    x = torch.randn(*lead, k, device="cuda", generator=gen).to(torch.bfloat16)
    x.requires_grad_(True)
    dy = torch.randn(*lead, n, device="cuda", generator=gen).to(torch.bfloat16)
    recipe = Float8CurrentScaling(backward_mode=mode)
    planned_fn, planned, eager_fn, eager = _both(m, x, dy, recipe)
    assert planned_fn == "TracedLinearBackward" and eager_fn != planned_fn, (planned_fn,
                                                                             eager_fn)
    _same(planned, eager)


@gpu
def test_fp32_weights_under_torch_autocast():
    """torch.autocast casts the fp32 weight (its gradient stays fp32); the cast copy is no
    parameter, so the forward keeps its fp8 columnwise codes."""
    gen = torch.Generator(device="cuda").manual_seed(1)
    m = lowprec.Linear(256, 384, device="cuda")
    x = torch.randn(64, 256, device="cuda", generator=gen, requires_grad=True)
    dy = torch.randn(64, 384, device="cuda", generator=gen).to(torch.bfloat16)
    planned_fn, planned, _, eager = _both(m, x, dy, Float8CurrentScaling(), amp=True)
    assert planned_fn == "TracedLinearBackward"
    _same(planned, eager)


@gpu
def test_weight_only_and_input_only_gradients():
    gen = torch.Generator(device="cuda").manual_seed(2)
    m = lowprec.Linear(256, 256, bias=False, params_dtype=torch.bfloat16, device="cuda")
    x = torch.randn(32, 256, device="cuda", generator=gen).to(torch.bfloat16)
    dy = torch.randn(32, 256, device="cuda", generator=gen).to(torch.bfloat16)
    _, planned, _, eager = _both(m, x, dy, Float8CurrentScaling())  # no input gradient
    _same(planned, eager)
    m.weight.requires_grad_(False)
    _, planned, _, eager = _both(m, x.requires_grad_(True), dy, Float8CurrentScaling())
    _same(planned, eager)


@gpu
def test_evaluation_forward():
    gen = torch.Generator(device="cuda").manual_seed(3)
    m = lowprec.Linear(256, 128, params_dtype=torch.bfloat16, device="cuda")
    x = torch.randn(48, 256, device="cuda", generator=gen).to(torch.bfloat16)
    with torch.no_grad():
        with lowprec.autocast(recipe=Float8CurrentScaling()):
            y = m(x)
        with eager_plan.eager_plans_off(), lowprec.autocast(recipe=Float8CurrentScaling()):
            y0 = m(x)
    assert torch.equal(y, y0)


@pytest.mark.parametrize("recipe", [Float8CurrentScaling, lowprec.MXFP8BlockScaling,
                                    lowprec.Float8BlockScaling, lowprec.NVFP4BlockScaling])
@gpu
def test_stack_keeps_no_more_memory(recipe):
    """Peak memory of a stack's training step: no more than the eager Function's."""
    gen = torch.Generator(device="cuda").manual_seed(4)
    stack = torch.nn.Sequential(*[lowprec.Linear(1024, 1024, bias=False,
                                                 params_dtype=torch.bfloat16, device="cuda")
                                  for _ in range(4)])
    x = torch.randn(4096, 1024, device="cuda", generator=gen).to(torch.bfloat16)

    def peak():
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        with lowprec.autocast(recipe=recipe()):
            y = stack(x.requires_grad_(True))
        y.float().pow(2).mean().backward()
        for p in stack.parameters():
            p.grad = None
        x.grad = None
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base

    peak()
    planned = peak()
    with eager_plan.eager_plans_off():
        peak()
        eager = peak()
    assert planned <= eager * 1.02, (planned, eager)


@gpu
def test_linears_reading_one_input_share_its_quantize(monkeypatch):
    """q/k/v read one input: one quantize of it serves the three (``shared_input``), bit
    for bit as each would make it, as the eager Function shares it."""
    from lowprec.formats.float8 import graph as fp8_graph
    gen = torch.Generator(device="cuda").manual_seed(5)
    qkv = [lowprec.Linear(256, 384, bias=False, params_dtype=torch.bfloat16, device="cuda")
           for _ in range(3)]
    x = torch.randn(64, 256, device="cuda", generator=gen).to(torch.bfloat16)
    seen = []
    real = fp8_graph.Tensorwise._quantize

    def counted(self, t, row, col):
        seen.append(tuple(t.shape))
        return real(self, t, row, col)

    def step():
        xi = x.detach().clone().requires_grad_(True)
        with lowprec.autocast(recipe=Float8CurrentScaling()):
            ys = [m(xi) for m in qkv]
        sum(y.float().sum() for y in ys).backward()
        return ys + [xi.grad] + [m.weight.grad for m in qkv]

    planned = step()
    for m in qkv:
        m.weight.grad = None
    monkeypatch.setattr(fp8_graph.Tensorwise, "_quantize", counted)
    step()
    assert seen.count((64, 256)) == 1, seen  # x; the weights (384, 256), dY (64, 384)
    assert seen.count((64, 384)) == 3, seen
    for m in qkv:
        m.weight.grad = None
    with eager_plan.eager_plans_off():
        eager = step()
    _same(planned, eager)


#: recipes whose forms run eager calls with eager's kernels besides current scaling: MXFP8,
#: block FP8, NVFP4, and hybrids whose rowwise half does (``GraphOperand.eager``), a
#: hybrid gradient whose halves both launch eagerly included
RECIPES = {
    "fp8_block_hybrid": lambda mode: lowprec.CustomRecipe(
        qfactory=factories.fp8_block_hybrid_factory, backward_mode=mode),
    "fp8_row_mxfp8_col": lambda mode: lowprec.CustomRecipe(
        qfactory=factories.fp8_row_mxfp8_col_factory, backward_mode=mode),
    "mxfp8": lambda mode: lowprec.MXFP8BlockScaling(backward_mode=mode),
    "block": lambda mode: lowprec.Float8BlockScaling(backward_mode=mode),
    "nvfp4": lambda mode: lowprec.NVFP4BlockScaling(backward_mode=mode),
    "mxfp8_fwd_nvfp4_bwd": lambda mode: lowprec.CustomRecipe(
        qfactory=factories.mxfp8_fwd_nvfp4_bwd_factory, backward_mode=mode),
}


@gpu
@pytest.mark.parametrize("shape", [(256, 512, 512), (2, 128, 512, 1024)])
@pytest.mark.parametrize("mode", ["default", "high_precision", "dequantized"])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rname", list(RECIPES))
def test_kernel_recipes_run_the_plan_bit_for_bit(rname, bias, mode, shape):
    """Shapes whose GEMMs the traced table runs (cuBLAS's block-scale layout wants K/128 a
    multiple of 4); a bias in cuBLAS's epilogue on the exact bf16 GEMMs as well."""
    *lead, k, n = shape
    gen = torch.Generator(device="cuda").manual_seed(sum(shape) + len(rname))
    m = lowprec.Linear(k, n, bias=bias, params_dtype=torch.bfloat16, device="cuda")
    x = torch.randn(*lead, k, device="cuda", generator=gen).to(torch.bfloat16)
    x.requires_grad_(True)
    dy = torch.randn(*lead, n, device="cuda", generator=gen).to(torch.bfloat16)
    recipe = RECIPES[rname](mode)
    torch.manual_seed(0)  # NVFP4's stochastic rounding of dY draws the same keys in both
    planned_fn, planned = _step(m, x, dy, recipe)
    torch.manual_seed(0)
    with eager_plan.eager_plans_off():
        eager_fn, eager = _step(m, x, dy, recipe)
    assert planned_fn == "TracedLinearBackward" and eager_fn != planned_fn, (planned_fn,
                                                                             eager_fn)
    _same(planned, eager)


# ---- delayed scaling: the quantizes read and record into the module's own state ----------
def _delayed_module(kind: str, device: str, dtype):
    build = {"Linear": lambda: lowprec.Linear(128, 256, params_dtype=dtype, device=device),
             "LayerNormLinear": lambda: lowprec.LayerNormLinear(128, 256, params_dtype=dtype,
                                                                device=device),
             "LayerNormMLP": lambda: lowprec.LayerNormMLP(128, 256, params_dtype=dtype,
                                                          device=device)}[kind]
    torch.manual_seed(0)
    a, b = build(), build()
    b.load_state_dict(a.state_dict())
    return a, b


def _scaling_state(m) -> dict:
    return {f"{mode}.{name}": t.clone() for mode, sd in m.scaling_state().items()
            for name, t in sd.items()}


@gpu
@pytest.mark.parametrize("kind", ["Linear", "LayerNormLinear", "LayerNormMLP"])
def test_delayed_scaling_runs_the_plan_bit_for_bit(kind):
    """DelayedScaling, the default recipe: over training steps whose amaxes move the
    scales, each followed by an evaluation forward, the plan's outputs, gradients and the
    whole scaling state (histories, scales, recorded amaxes) equal the eager Function's.
    The backward state updates at the end of each module's backward (the module's
    callback, which counts a LayerNormMLP's two GEMMs)."""
    dtype, device = torch.bfloat16, "cuda"
    recipe = lowprec.DelayedScaling(amax_history_len=3, margin=1)
    planned_m, eager_m = _delayed_module(kind, device, dtype)
    gen = torch.Generator().manual_seed(1)
    for step in range(4):
        x = (torch.randn(64, 128, generator=gen) * 4.0 ** step).to(device, dtype)
        dy = (torch.randn(64, 256 if kind != "LayerNormMLP" else 128, generator=gen)
              / 2.0 ** step).to(device, dtype)
        runs = []
        for m, off in ((planned_m, False), (eager_m, True)):
            with eager_plan.eager_plans_off() if off else contextlib.nullcontext():
                fn, out = _step(m, x.requires_grad_(True), dy, recipe)
                with torch.no_grad(), lowprec.autocast(recipe=recipe):
                    out.append(m(x))
            runs.append((fn, out))
        (planned_fn, planned), (eager_fn, eager) = runs
        assert planned_fn == "TracedLinearBackward" or kind != "Linear", planned_fn
        assert eager_fn != "TracedLinearBackward", eager_fn
        _same(planned, eager)
        want, got = _scaling_state(eager_m), _scaling_state(planned_m)
        assert want.keys() == got.keys() and want
        for k in want:
            assert torch.equal(got[k], want[k]), (step, k)
    assert want["forward.scale"][0] != 1 and want["backward.scale"][0] != 1  # they moved


@gpu
def test_delayed_scaling_plan_holds_what_the_function_holds():
    """The forward keeps x's columnwise fp8 codes and the weight parameter itself (its
    columnwise codes are cast in backward with fprop's scale): an element a byte."""
    dtype, device = torch.bfloat16, "cuda"
    m = lowprec.Linear(128, 256, bias=False, params_dtype=dtype, device=device)
    x = torch.randn(64, 128, device=device, dtype=dtype, requires_grad=True)
    with lowprec.autocast(recipe=lowprec.DelayedScaling()):
        y = m(x)
    saved = [t for t in y.grad_fn.saved_tensors if t is not None]
    assert any(t is m.weight for t in saved)
    codes = [t for t in saved if t.dtype == torch.float8_e4m3fn]
    assert [tuple(t.shape) for t in codes] == [(128, 64)]
    rest = [t for t in saved if t is not m.weight and t.dtype != torch.float8_e4m3fn]
    assert rest and all(t.numel() <= 1 for t in rest)  # the scale and its reciprocal


@gpu
@pytest.mark.parametrize("shape", [(200, 512, 512), (256, 480, 512), (256, 512, 400),
                                   (2, 50, 512, 1024)])
@pytest.mark.parametrize("rname", ["mxfp8", "block", "nvfp4", "mxfp8_fwd_nvfp4_bwd"])
def test_padded_calls_run_the_plan_bit_for_bit(rname, shape, monkeypatch):
    """Token counts and feature sizes that are not whole blocks: the call pads them with
    zeros (``lowprec.linear.padding``) and runs the plan of the padded operands, with the
    eager Function's outputs and gradients (it pads the same zeros)."""
    *lead, k, n = shape
    runs = []
    real = eager_plan.run_plan
    monkeypatch.setattr(eager_plan, "run_plan", lambda *a: runs.append(1) or real(*a))
    gen = torch.Generator(device="cuda").manual_seed(sum(shape) + len(rname))
    m = lowprec.Linear(k, n, bias=False, params_dtype=torch.bfloat16, device="cuda")
    x = torch.randn(*lead, k, device="cuda", generator=gen).to(torch.bfloat16)
    x.requires_grad_(True)
    dy = torch.randn(*lead, n, device="cuda", generator=gen).to(torch.bfloat16)
    recipe = RECIPES[rname]("default")
    torch.manual_seed(0)
    _, planned = _step(m, x, dy, recipe)
    assert runs == [1]
    torch.manual_seed(0)
    with eager_plan.eager_plans_off():
        _, eager = _step(m, x, dy, recipe)
    assert runs == [1]
    _same(planned, eager)
