"""Activation checkpointing (SPEC section 6): ``torch.utils.checkpoint``, reentrant or not,
and what calls it (Hugging Face gradient checkpointing, ``checkpoint_wrapper``, selective
checkpointing), recomputes every lowprec forward exactly as it ran, so outputs, gradients
and the delayed-scaling state are bit-identical to running without checkpointing.
``lowprec.checkpoint`` is an alias (``lowprec/memory/checkpointing.py``)."""

from __future__ import annotations

import contextlib
import copy
import functools
import gc
import warnings
import weakref

import pytest
import torch
import torch.utils.checkpoint as torch_checkpoint
from helpers import runs_in_backward
from same_run import RECIPES as SHARED_RECIPES
from same_run import assert_same_grads_and_states, assert_same_run, delayed_states

import lowprec
import lowprec.ops as ops
from lowprec import autocast
from lowprec.kernels import triton_available
from lowprec.linear import eager_plan
from lowprec.memory.checkpointing import current_frame
from lowprec.recipe.recipes import DelayedScaling, Float8CurrentScaling

D = 128  # every block divides it (128x128 FP8 blocks, MXFP8 32, NVFP4 16)


RECIPES = {k: SHARED_RECIPES[k] for k in ("current", "delayed", "block", "mxfp8", "nvfp4",
                                          "custom")}
#: for the variants: delayed scaling (state, frozen scales, amaxes once) and a stateless one
SOME = ["delayed", "current"]
REENTRANT = pytest.mark.parametrize("reentrant", [False, True],
                                    ids=["nonreentrant", "reentrant"])


class Block(torch.nn.Module):
    """Several modules, a norm and an activation between them."""

    def __init__(self) -> None:
        super().__init__()
        self.ln_lin = lowprec.LayerNormLinear(D, D, name="qkv")
        self.lin = lowprec.Linear(D, D, name="proj")
        self.mlp = lowprec.LayerNormMLP(D, 2 * D, activation="swiglu", name="mlp")

    def forward(self, x):
        h = x + self.lin(torch.nn.functional.gelu(self.ln_lin(x)))
        return h + self.mlp(h)


MODELS = {
    "linear": lambda: lowprec.Linear(D, D, name="l"),
    "layernorm_linear": lambda: lowprec.LayerNormLinear(D, D, name="l"),
    "layernorm_mlp": lambda: lowprec.LayerNormMLP(D, 2 * D, name="m"),
    "ops": lambda: ops.Sequential(ops.LayerNorm(D), ops.Linear(D, 2 * D), ops.GELU(),
                                  ops.Linear(2 * D, D)),
    "block": Block,
}


def _pair(model):
    torch.manual_seed(0)
    m = MODELS[model]()
    return m, copy.deepcopy(m)


def _inputs(shape=(2, D // 2, D)):
    xa = torch.randn(*shape, requires_grad=True)
    return xa, xa.detach().clone().requires_grad_(True)


def torch_ck(reentrant: bool, **kwargs):
    """``torch.utils.checkpoint.checkpoint`` as a (function, input) -> output callable."""
    return lambda fn, t: torch_checkpoint.checkpoint(fn, t, use_reentrant=reentrant, **kwargs)


def _step(m, x, recipe, seed, ck=None, autocast_inside=False, fn=None):
    """One forward and backward of ``fn`` (default: ``m``), checkpointed by ``ck`` unless
    None, with ``lowprec.autocast`` around the checkpoint or inside the function."""
    fn = fn or m

    def body(t):
        if autocast_inside:
            with autocast(recipe=recipe):
                return fn(t)
        return fn(t)

    torch.manual_seed(seed)  # NVFP4's stochastic rounding draws from the default generator
    with autocast(recipe=recipe) if not autocast_inside else contextlib.nullcontext():
        y = body(x) if ck is None else ck(body, x)
    y.backward(torch.randn(y.shape, generator=torch.Generator().manual_seed(seed)).to(y))
    return y.detach()


def _compare(rname, model, ck, autocast_inside=False, steps=2):
    recipe = RECIPES[rname]()
    a, b = _pair(model)
    xa, xb = _inputs()
    for step in range(steps):
        ya = _step(a, xa, recipe, 10 + step, None, autocast_inside)
        yb = _step(b, xb, recipe, 10 + step, ck, autocast_inside)
        assert_same_run(a, b, xa, xb, ya, yb)


# ---- torch.utils.checkpoint itself -----------------------------------------------------------
@REENTRANT
@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("rname", list(RECIPES))
def test_torch_checkpoint_bit_identical(rname, model, reentrant):
    _compare(rname, model, torch_ck(reentrant))


@REENTRANT
@pytest.mark.parametrize("rname", list(RECIPES))
def test_torch_checkpoint_with_autocast_inside_bit_identical(rname, reentrant):
    _compare(rname, "block", torch_ck(reentrant), autocast_inside=True)


@REENTRANT
def test_lowprec_checkpoint_is_torch_checkpoint(reentrant):
    _compare("delayed", "block",
             lambda fn, t: lowprec.checkpoint(fn, t, use_reentrant=reentrant))
    with warnings.catch_warnings():  # non-reentrant by default, so torch does not warn
        warnings.simplefilter("error")
        _compare("current", "linear", lowprec.checkpoint, steps=1)


def test_lowprec_checkpoint_bad_arguments():
    with pytest.raises(TypeError, match="use_reentrant"):
        lowprec.checkpoint(lambda t: t, torch.randn(2, requires_grad=True), use_reentrant=None)


def test_delayed_scaling_amaxes_recorded_once_and_scales_of_the_forward_used():
    """Three steps whose inputs grow: the recompute must use the scales the forward used
    (the region's exit moves them before backward) and record nothing."""
    recipe = DelayedScaling(amax_history_len=4, amax_compute_algo="most_recent")
    for reentrant in (False, True):
        a, b = _pair("layernorm_mlp")
        for step in range(3):
            xa = (torch.randn(D, D) * 4 ** step).requires_grad_(True)
            xb = xa.detach().clone().requires_grad_(True)
            ya = _step(a, xa, recipe, step)
            yb = _step(b, xb, recipe, step, torch_ck(reentrant))
            assert_same_run(a, b, xa, xb, ya, yb)


def test_full_recompute_without_early_stop():
    with torch_checkpoint.set_checkpoint_early_stop(False):
        _compare("delayed", "block", torch_ck(False))


@REENTRANT
@pytest.mark.parametrize("rname", ["current", "block"])
def test_recompute_takes_the_forward_thread_settings(rname, reentrant):
    """The slicing mode (``lowprec.linear.grad_split``) set around the forward alone: the
    recompute, in the backward outside that block, runs with the forward's mode (the same
    saved tensors, which torch checks) and gives the unsliced run's results."""
    recipe = RECIPES[rname]()
    a, b = _pair("block")
    xa, xb = _inputs()
    torch.manual_seed(0)
    with lowprec.linear.unsliced(), autocast(recipe=recipe):
        ya = a(xa)
    ya.backward(torch.ones_like(ya))
    with lowprec.linear.unsliced(), autocast(recipe=recipe):
        yb = torch_ck(reentrant)(b, xb)
    yb.backward(torch.ones_like(yb))  # outside unsliced(): the recompute restores it
    assert_same_run(a, b, xa, xb, ya.detach(), yb.detach())


# ---- on the GPU, where eager calls run the traced plan -----------------------------------------
_KERNELS = torch.cuda.is_available() and triton_available()


@pytest.mark.gpu
@pytest.mark.skipif(not _KERNELS, reason="needs a CUDA device with Triton")
@REENTRANT
@pytest.mark.parametrize("model", ["linear", "block"])
@pytest.mark.parametrize("rname", [*RECIPES, "hybrid"])
def test_torch_checkpoint_bit_identical_on_the_plan(rname, model, reentrant, monkeypatch):
    """bf16 on CUDA with the kernels: the checkpointed calls and their recomputes run the
    traced plan as the plain calls do (``eager_plan.run_plan``; where the plan has no GEMM for
    the call, the eager Function: block FP8 at K=128), shared inputs included, and give the
    same outputs, gradients and delayed-scaling states over steps."""
    runs = []
    real = eager_plan.run_plan
    monkeypatch.setattr(eager_plan, "run_plan", lambda *a: runs.append(1) or real(*a))
    recipe = {**RECIPES, **SHARED_RECIPES}[rname]()
    a, b = _pair(model)
    a, b = a.to("cuda", torch.bfloat16), b.to("cuda", torch.bfloat16)
    xa = torch.randn(2, D // 2, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    xb = xa.detach().clone().requires_grad_(True)
    for step in range(3):
        for m in (a, b):
            m.zero_grad(set_to_none=True)
        xa.grad = xb.grad = None
        before = len(runs)
        ya = _step(a, xa, recipe, 10 + step)
        plain = len(runs) - before
        yb = _step(b, xb, recipe, 10 + step, torch_ck(reentrant))
        assert_same_run(a, b, xa, xb, ya, yb)
        # the checkpointed step's calls and their recomputes take the plan where plain does
        assert len(runs) - before - plain == 2 * plain, (plain, len(runs) - before - plain)
    assert rname == "block" or runs


# ---- several calls of one module -------------------------------------------------------------
def _fresh_grads(*models) -> None:
    # A reentrant checkpoint's backward adds its parameters' gradients into .grad itself, so
    # a parameter used in several checkpoints sums its gradient in another order than one
    # backward does onto an existing .grad (torch's, with or without lowprec): these tests
    # start each step without gradients.
    for m in models:
        m.zero_grad(set_to_none=True)


@REENTRANT
@pytest.mark.parametrize("rname", SOME)
def test_module_called_in_several_checkpoints_of_one_graph(rname, reentrant):
    """Weight tying: one Linear in two checkpoints, and twice inside one of them."""
    recipe = RECIPES[rname]()
    a, b = _pair("linear")

    def twice(m):
        return lambda t: m(torch.nn.functional.gelu(m(t)))

    def run(m, x, ck):
        x.grad = None
        with autocast(recipe=recipe):
            h = m(x) if ck is None else ck(m, x)
            y = twice(m)(h) if ck is None else ck(twice(m), h)
        y.backward(torch.ones_like(y))
        return y.detach()

    _two_steps(a, b, run, reentrant)


def _two_steps(a, b, run, reentrant) -> None:
    """Two steps of ``run(model, x, checkpoint or None)``, plain against checkpointed."""
    xa, xb = _inputs()
    for _ in range(2):
        _fresh_grads(a, b)
        assert_same_run(a, b, xa, xb, run(a, xa, None), run(b, xb, torch_ck(reentrant)))


@REENTRANT
def test_module_under_two_recipes_in_one_graph(reentrant):
    """The recompute of each call takes its own call's recipe, not the module's last one."""
    delayed, mxfp8 = RECIPES["delayed"](), RECIPES["mxfp8"]()
    a, b = _pair("block")

    def run(m, x, ck):
        x.grad = None
        with autocast(recipe=delayed):
            h = m(x) if ck is None else ck(m, x)
        with autocast(recipe=mxfp8):
            y = m(h) if ck is None else ck(m, h)
        y.backward(torch.ones_like(y))
        return y.detach()

    _two_steps(a, b, run, reentrant)


@REENTRANT
def test_interleaved_gradient_accumulation(reentrant):
    """Two micro-batches' forwards (each region moves the delayed scales on), then their
    backwards: each recompute uses its own forward's scales."""
    recipe = RECIPES["delayed"]()
    a, b = _pair("block")
    inputs = [_inputs((D, D)) for _ in range(2)]

    def run(m, xs, ck):
        ys = []
        for i, x in enumerate(xs):
            with autocast(recipe=recipe):
                ys.append(m(x * (1 + 3 * i)) if ck is None else ck(m, x * (1 + 3 * i)))
        for y in ys:
            y.backward(torch.ones_like(y))
        return torch.cat([y.detach() for y in ys])

    for _ in range(2):
        xas, xbs = [xa for xa, _ in inputs], [xb for _, xb in inputs]
        ya, yb = run(a, xas, None), run(b, xbs, torch_ck(reentrant))
        for xa, xb in inputs:
            assert torch.equal(xa.grad, xb.grad)
        assert_same_run(a, b, xas[0], xbs[0], ya, yb)


@REENTRANT
def test_backward_twice_through_one_graph(reentrant):
    """retain_graph: each backward recomputes (replaying from the first call again), and the
    delayed backward state is updated once per call, as without checkpointing."""
    recipe = RECIPES["delayed"]()
    a, b = _pair("block")
    xa, xb = _inputs()

    def run(m, x, ck):
        with autocast(recipe=recipe):
            y = m(x) if ck is None else ck(m, x)
        y.backward(torch.ones_like(y), retain_graph=True)
        y.backward(torch.ones_like(y) * 3)
        return y.detach()

    for _ in range(2):
        assert_same_run(a, b, xa, xb, run(a, xa, None), run(b, xb, torch_ck(reentrant)))


@pytest.mark.parametrize("inner_reentrant", [False, True], ids=["inner_nonre", "inner_re"])
@REENTRANT
def test_nested_checkpoints_bit_identical(reentrant, inner_reentrant):
    """A checkpointed function that checkpoints part of itself: the inner original forward
    runs again during the outer recompute and records what the outer replays."""
    recipe = RECIPES["delayed"]()
    a, b = _pair("block")

    def outer(t):
        h = t + b.lin(torch.nn.functional.gelu(b.ln_lin(t)))
        return torch_checkpoint.checkpoint(lambda u: u + b.mlp(u), h,
                                           use_reentrant=inner_reentrant)

    xa, xb = _inputs((D, D))
    for step in range(2):
        ya = _step(a, xa, recipe, step)
        yb = _step(b, xb, recipe, step, torch_ck(reentrant), fn=outer)
        assert_same_run(a, b, xa, xb, ya, yb)


# ---- evaluation, lifetime, errors ------------------------------------------------------------
@REENTRANT
def test_checkpoint_under_no_grad_is_an_evaluation(reentrant):
    """Gradients off: nothing will be recomputed, so no frame is made and the delayed state
    does not move (as Hugging Face runs a model in train mode under no_grad)."""
    recipe = RECIPES["delayed"]()
    m, _ = _pair("layernorm_mlp")
    x = torch.randn(D, D)
    _step(m, x.clone().requires_grad_(True), recipe, 0)
    before = copy.deepcopy(delayed_states(m))
    frames = []

    def fn(t):
        frames.append(current_frame())
        return m(t)

    with torch.no_grad(), autocast(recipe=recipe):
        expected = m(x * 50)
        y = torch_checkpoint.checkpoint(fn, x * 50, use_reentrant=reentrant)
    assert torch.equal(y, expected) and frames == [None]
    after = delayed_states(m)
    for key in before:
        for k in before[key]:
            assert torch.equal(before[key][k], after[key][k]), (key, k)


@REENTRANT
def test_a_frame_lives_as_long_as_the_graph(reentrant):
    m, _ = _pair("linear")
    refs = []

    def fn(t):
        frame = current_frame()
        if frame is not None and not frame.replaying:
            refs.append(weakref.ref(frame))
        return m(t)

    x = torch.randn(D, D, requires_grad=True)
    with autocast(recipe=RECIPES["delayed"]()):
        fn(x).sum().backward()
        assert refs == []  # no checkpoint, no frame
        y = torch_checkpoint.checkpoint(fn, x, use_reentrant=reentrant)
    gc.collect()
    assert refs[0]() is not None  # held by the graph until its backward
    y.sum().backward()
    del y
    gc.collect()
    assert refs[0]() is None


def test_modules_outside_autocast_checkpoint_as_usual():
    a, b = _pair("block")
    x = torch.randn(D, D, requires_grad=True)
    for reentrant in (False, True):
        ya, yb = a(x), torch_checkpoint.checkpoint(b, x, use_reentrant=reentrant)
        assert torch.equal(ya, yb)
        yb.sum().backward()


@REENTRANT
def test_recompute_calling_other_modules_raises(reentrant):
    recipe = Float8CurrentScaling()
    m1, m2 = lowprec.Linear(D, D), lowprec.Linear(D, D)
    calls = []

    def fn(t):
        calls.append(None)
        return (m1 if len(calls) == 1 else m2)(t)

    x = torch.randn(D, D, requires_grad=True)
    with autocast(recipe=recipe):
        y = torch_checkpoint.checkpoint(fn, x, use_reentrant=reentrant)
    with pytest.raises(RuntimeError, match="same lowprec modules in the same order"):
        y.sum().backward()


def test_module_run_in_backward_outside_a_checkpoint_raises():
    """What lowprec cannot replay (a forward run inside a backward pass by anything but a
    checkpoint) is refused rather than silently high precision."""
    m = lowprec.Linear(D, D, name="l")

    x = torch.randn(D, D, requires_grad=True)
    with autocast(recipe=Float8CurrentScaling()):
        y = runs_in_backward(m(x), m)
    with pytest.raises(RuntimeError, match="run during backward by something other than"):
        y.sum().backward()


# ---- what calls torch.utils.checkpoint -------------------------------------------------------
@pytest.mark.parametrize("use_reentrant", [False, True, None], ids=["nonreentrant", "reentrant",
                                                                     "hf_default"])
@pytest.mark.parametrize("rname", SOME)
def test_hugging_face_gradient_checkpointing(rname, use_reentrant):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(hidden_size=D, intermediate_size=2 * D,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=256)
    torch.manual_seed(0)
    a = lowprec.convert_model(transformers.LlamaForCausalLM(config))
    b = copy.deepcopy(a)
    kwargs = None if use_reentrant is None else {"use_reentrant": use_reentrant}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # renamed activation_checkpointing_*
        b.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    assert isinstance(b.model.layers[0].self_attn.q_proj, lowprec.Linear)
    recipe = RECIPES[rname]()
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))
    for step in range(2):
        losses = []
        for m in (a, b):
            torch.manual_seed(step)
            with autocast(recipe=recipe):
                loss = m(input_ids=ids, labels=ids).loss
            loss.backward()
            losses.append(loss.detach())
        assert torch.equal(*losses)
        assert_same_grads_and_states(a, b)


@pytest.mark.parametrize("impl", ["REENTRANT", "NO_REENTRANT"])
@pytest.mark.parametrize("rname", SOME)
def test_checkpoint_wrapper(rname, impl):
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        checkpoint_wrapper,
    )

    recipe = RECIPES[rname]()
    a, b = _pair("block")
    wrapped = checkpoint_wrapper(b, checkpoint_impl=getattr(CheckpointImpl, impl))
    xa, xb = _inputs()
    for step in range(2):
        ya = _step(a, xa, recipe, step)
        yb = _step(wrapped, xb, recipe, step)
        assert_same_run(a, b, xa, xb, ya, yb)


def _save_matmuls(ctx, op, *args, **kwargs):
    """A selective-checkpointing policy: keep the matmuls, recompute the rest."""
    if op in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default,
              torch.ops.aten.bmm.default):
        return torch_checkpoint.CheckpointPolicy.MUST_SAVE
    return torch_checkpoint.CheckpointPolicy.PREFER_RECOMPUTE


@pytest.mark.parametrize("rname", [*SOME, "nvfp4"])
def test_selective_checkpointing(rname):
    context_fn = functools.partial(torch_checkpoint.create_selective_checkpoint_contexts,
                                   _save_matmuls)
    _compare(rname, "block", torch_ck(False, context_fn=context_fn))
