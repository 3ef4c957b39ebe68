"""The traced linear (lowprec/linear/traced.py): under torch.compile a Linear whose plan
traces is a graph of torch ops and GEMM calls, not one opaque ``lowprec::call``; its
forward and gradients are eager's bit for bit; every other call keeps the opaque op."""

from __future__ import annotations

import pytest
import torch
from helpers import GraphOps, cases, pairwise, plan_of

import lowprec
from lowprec.formats.block import graph as block_graph
from lowprec.formats.float8.graph import Delayed
from lowprec.formats.mxfp8 import graph as mxfp8_graph
from lowprec.kernels import use_kernels
from lowprec.linear import grad_split
from lowprec.recipe.recipes import (
    DelayedScaling,
    Float8BlockScaling,
    Float8CurrentScaling,
    Format,
    MXFP8BlockScaling,
    NVFP4BlockScaling,
)

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


pytestmark = pytest.mark.usefixtures("fresh_dynamo")


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


def _quick_pairs(axes: dict, inductor: dict) -> list:
    """``cases`` of the backends, ``axes`` and ``DEVICES``: on the CPU, under aot_eager the
    few holding every pair of the axes' values, under inductor the one case ``inductor``
    (its C++ kernels of each new graph take seconds to build on 2 cores, tens on an empty
    cache), the whole product with --slow; on CUDA all."""
    pairs = pairwise(axes)
    return cases({"backend": ["aot_eager", "inductor"], **axes, "device": DEVICES},
                 lambda backend, device, **case: device != "cpu" or (
                     pairs(**case) if backend == "aot_eager" else case == inductor))


@pytest.mark.parametrize("backend, fmt, bias, device", _quick_pairs(
    {"fmt": {"Format.HYBRID": Format.HYBRID, "Format.E4M3": Format.E4M3},
     "bias": [True, False]}, inductor={"fmt": Format.HYBRID, "bias": True}))
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


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bias", [True, False])
def test_fused_neighbours_keep_eager_rounding(device, bias):
    """bf16 under inductor: the op producing the Linear's input is fused into the quantize,
    and the ops consuming its output and its input gradient into the GEMM epilogues;
    inductor would pass fp32 values between them where eager rounds to bf16. The traced
    quantize rounds its input and makes its outputs from bf16 bits, so the result stays
    eager's. (One op on each side: a chain of the user's own bf16 ops fused by inductor
    rounds once where eager rounds after each.)"""
    recipe = Float8CurrentScaling()
    torch.manual_seed(0)
    m = lowprec.Linear(128, 96, bias=bias, name="l", params_dtype=torch.bfloat16, device=device)
    x = torch.randn(64, 128, device=device, dtype=torch.bfloat16)
    dy = torch.randn(64, 96, device=device, dtype=torch.bfloat16)

    def f(t):
        return m(t * 1.7) * 3

    want = _run(f, m, x, dy, recipe)
    got = _run(torch.compile(f, backend="inductor", fullgraph=True), m, x, dy, recipe)
    for w, g in zip(want, got):
        assert torch.equal(w, g)


@pytest.mark.parametrize("backend, two_d, fmt, bias, device", _quick_pairs(
    {"two_d": {"1x32": False, "32x32_weight": True},
     "fmt": {"Format.E4M3": Format.E4M3, "Format.HYBRID": Format.HYBRID},
     "bias": [True, False]}, inductor={"two_d": True, "fmt": Format.HYBRID, "bias": True}))
def test_mxfp8_traced_bit_identical(device, bias, fmt, backend, two_d):
    """MXFP8 traced: every operand's exact values made in the graph, multiplied in bf16 on
    CUDA (as ``exact_bf16``, a bias in cuBLAS's epilogue through one op the compiler keeps
    whole, ``traced_steps.addmm_op``) or in the fp32 emulation; a weight in 32x32 blocks
    too. Eager's bits, and no opaque call."""
    recipe = MXFP8BlockScaling(fp8_format=fmt, enable_2d_quantization=two_d)
    torch.manual_seed(0)
    m = lowprec.Linear(128, 96, bias=bias, name="l", params_dtype=_dtype(device), device=device)
    x = torch.randn(4, 48, 128, device=device, dtype=_dtype(device))
    x[0, 0, :32] *= 1e-30  # a block scaled far down, one far up
    x[1, 2, 32:64] *= 1e20
    dy = torch.randn(4, 48, 96, device=device, dtype=_dtype(device))
    want = _run(m, m, x, dy, recipe)
    ops = GraphOps()
    counted = ops if backend == "aot_eager" else backend
    got = _run(torch.compile(m, backend=counted, fullgraph=True), m, x, dy, recipe)
    for w, g in zip(want, got):
        assert torch.equal(w, g)
    if backend == "aot_eager":
        assert not any("lowprec.call" in t for t in ops.targets)
        assert plan_of(recipe, x, m.weight, m.bias) is not None
        assert (device == "cuda" and bias) == any("lowprec.addmm" in t for t in ops.targets)


_BLOCK_CPU_AXES = {"w_dim": [2, 1], "bias": [True, False],
                   "dtype": {"dtype0": torch.float32, "dtype1": torch.bfloat16}}
_BLOCK_CPU_PAIRS = pairwise(_BLOCK_CPU_AXES)


@pytest.mark.parametrize("backend, w_dim, bias, dtype", cases(
    {"backend": ["aot_eager", "inductor"], **_BLOCK_CPU_AXES},
    # every pair under aot_eager, one case under inductor (see _quick_pairs)
    lambda backend, **case: _BLOCK_CPU_PAIRS(**case) if backend == "aot_eager"
    else case == {"w_dim": 2, "bias": True, "dtype": torch.bfloat16}))
def test_block_traced_bit_identical_cpu(dtype, bias, w_dim, backend):
    """Block FP8 on the CPU: the reference's blocks in the graph and the fp32 emulation,
    as eager's CPU path; traced (no opaque call) for shapes that fill whole blocks."""
    recipe = Float8BlockScaling(w_block_scaling_dim=w_dim)
    torch.manual_seed(0)
    m = lowprec.Linear(256, 128, bias=bias, name="l", params_dtype=dtype)
    x = torch.randn(2, 128, 256, dtype=dtype)
    x[0, :3, :128] *= 1e-20  # blocks scaled far from the rest
    dy = torch.randn(2, 128, 128, dtype=dtype)
    want = _run(m, m, x, dy, recipe)
    ops = GraphOps()
    got = _run(torch.compile(m, backend=ops if backend == "aot_eager" else backend,
                             fullgraph=True), m, x, dy, recipe)
    for w, g in zip(want, got):
        assert torch.equal(w, g)
    if backend == "aot_eager":
        assert not any("lowprec.call" in t for t in ops.targets)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("recipe", [
    Float8CurrentScaling(), Float8BlockScaling(), MXFP8BlockScaling(),
    NVFP4BlockScaling(disable_stochastic_rounding=True),
    lowprec.CustomRecipe(qfactory=lambda role: lowprec.NVFP4Quantizer()),
    lowprec.CustomRecipe(qfactory=lambda role: lowprec.Float8BlockQuantizer(
        torch.float8_e4m3fn, block_scaling_dim=1))],
    ids=["current", "block", "mxfp8", "nvfp4", "nvfp4_1x16", "block_1x128"])
def test_quantized_weight_traced_bit_identical(device, recipe):
    """A weight that arrives quantized (``quantized_model_init`` here; FSDP2's quantized
    all-gather gives the same tensors) is read as it is in the graph: its codes and scales
    for fprop; for dgrad their transpose (per-tensor FP8, 128x128 blocks, NVFP4's 16x16
    tiles) or its columnwise ones (MXFP8's 1x32 blocks); forward and gradients are
    eager's."""
    dtype = _dtype(device)
    torch.manual_seed(0)
    with lowprec.quantized_model_init(recipe=recipe):
        # cuBLAS's 128x128-block GEMMs contract over multiples of 512
        m = lowprec.Linear(512, 512, name="l", params_dtype=dtype, device=device)
    x = torch.randn(2, 128, 512, dtype=dtype, device=device)
    assert plan_of(recipe, x, m.weight) is not None
    dy = torch.randn(2, 128, 512, dtype=dtype, device=device)
    want = _run(m, m, x, dy, recipe)
    ops = GraphOps()
    got = _run(torch.compile(m, backend=ops, fullgraph=True), m, x, dy, recipe)
    for w, g in zip(want, got):
        assert torch.equal(w, g)
    assert not any("lowprec.call" in t for t in ops.targets)


def test_quantized_weight_under_torch_autocast():
    """An fp32 quantized weight under torch.autocast(bfloat16): read as it is (not cast),
    the output bf16 and the weight gradient fp32, as eager computes them."""
    recipe = Float8CurrentScaling()
    torch.manual_seed(0)
    with lowprec.quantized_model_init(recipe=recipe):
        m = lowprec.Linear(128, 96, name="l")
    assert m.weight.dtype == torch.float32
    _same_under_torch_autocast(m, "cpu", recipe)


def test_quantized_weight_of_another_form_keeps_the_opaque_call():
    """A quantized weight the plan's GEMMs do not read as it is (E5M2 codes under an E4M3
    recipe) is not traced; the opaque call then refuses quantized weights by name."""
    with lowprec.quantized_model_init(recipe=Float8CurrentScaling(fp8_format=Format.E5M2)):
        m = lowprec.Linear(64, 64, name="l")
    recipe = Float8CurrentScaling()
    x = torch.randn(16, 64)
    assert plan_of(recipe, x, m.weight) is None
    compiled = torch.compile(m, backend="aot_eager", fullgraph=True)
    with lowprec.autocast(recipe=recipe), pytest.raises(Exception, match="quantized_model_init"):
        compiled(x)


def test_graph_has_no_opaque_call():
    """The compiled graph shows the quantize (amax, cast) and the GEMMs as ops."""
    ops = GraphOps()
    m = lowprec.Linear(64, 32, name="l")
    compiled = torch.compile(m, backend=ops, fullgraph=True)
    x = torch.randn(16, 64, requires_grad=True)
    with lowprec.autocast(recipe=Float8CurrentScaling()):
        compiled(x).sum().backward()
    assert not any("lowprec.call" in t for t in ops.targets)
    assert any("amax" in t for t in ops.targets) and any("mm" in t for t in ops.targets)


@pytest.mark.parametrize("device", DEVICES)
def test_traced_under_torch_autocast(device):
    """fp32 parameters under torch.autocast(bfloat16), as AMP training scripts (and HF
    Trainer with bf16=True) run: still traced, still eager's bits, fp32 gradients."""
    recipe = Float8CurrentScaling()
    torch.manual_seed(0)
    m = lowprec.Linear(128, 96, name="l", device=device)
    _same_under_torch_autocast(m, device, recipe)


def _same_under_torch_autocast(m, device, recipe):
    """A (128 -> 96) fp32 Linear under torch.autocast(bfloat16), compiled and eager: the
    same bf16 output and fp32 gradients, and no opaque call in the graph."""
    x = torch.randn(64, 128, device=device)
    dy = torch.randn(64, 96, device=device, dtype=torch.bfloat16)
    ops = GraphOps()
    compiled = torch.compile(m, backend=ops, fullgraph=True)
    with torch.autocast(device, dtype=torch.bfloat16):
        want = _run(m, m, x, dy, recipe)
        got = _run(compiled, m, x, dy, recipe)
    assert want[0].dtype == torch.bfloat16 and want[2].dtype == torch.float32
    for w, g in zip(want, got):
        assert torch.equal(w, g)
    assert not any("lowprec.call" in t for t in ops.targets)


def _delayed_states(m):
    return {k: v.clone() for mode, sd in m.scaling_state().items() for k, v in
            ((f"{mode}.{n}", t) for n, t in sd.items())}


def _two_newest(history):
    """A callable amax algorithm: the larger of the two newest amaxes."""
    return history[:2].amax(0)


@pytest.mark.parametrize("backend, algo, bias, device", _quick_pairs(
    {"algo": ["max", "most_recent", "callable"], "bias": [True, False]},
    inductor={"algo": "callable", "bias": True}))
def test_delayed_traced_bit_identical(device, bias, algo, backend):
    """Delayed scaling traced: the quantizes read the module's scales and record their
    amaxes into its state in place, the backward state joins the backward pass's update,
    which runs at its end (the forward state at the region's exit, as eager). Over steps
    whose amaxes move the scales, outputs, gradients and the whole state equal eager's bit
    for bit. The steps trace (no ``lowprec::call``); on the CPU the first too (the
    module's state is made as the compiler traces it), on CUDA from the second (the first
    is the opaque op while its slots have no scales). A callable algorithm runs in the
    update, as eager runs it."""
    recipe = DelayedScaling(amax_history_len=3, margin=1,
                            amax_compute_algo=_two_newest if algo == "callable" else algo)
    dtype = _dtype(device)
    torch.manual_seed(0)
    a = lowprec.Linear(128, 96, bias=bias, name="l", params_dtype=dtype, device=device)
    b = lowprec.Linear(128, 96, bias=bias, name="l", params_dtype=dtype, device=device)
    b.load_state_dict(a.state_dict())
    ops = GraphOps()
    compiled = torch.compile(b, backend=ops if backend == "aot_eager" else backend,
                             fullgraph=True)
    g = torch.Generator().manual_seed(1)
    for step in range(4):
        x = (torch.randn(64, 128, generator=g) * 4.0 ** step).to(device, dtype)
        dy = (torch.randn(64, 96, generator=g) / 2.0 ** step).to(device, dtype)
        want = _run(a, a, x, dy, recipe)
        got = _run(compiled, b, x, dy, recipe)
        for w, t in zip(want, got):
            assert torch.equal(w, t), step
        sa, sb = _delayed_states(a), _delayed_states(b)
        assert sa.keys() == sb.keys() and sa
        for k in sa:
            assert torch.equal(sa[k], sb[k]), (step, k)
    assert sa["forward.scale"][0] != 1 and sa["backward.scale"][0] != 1  # the scales moved
    if backend == "aot_eager":
        graphs = " ".join(ops.steady())
        # the traced quantizes (the scale in use plain torch ops the compiler fuses); the
        # backward graph only joins its state to the pass's update, which runs outside it
        assert "lowprec.call" not in graphs and "aten.where" in graphs
        assert "lowprec.join_backward" in graphs and "delayed_update" not in graphs
        assert plan_of(recipe, x, b.weight) is not None


@pytest.mark.parametrize("module", ["linear", "mlp"])
def test_delayed_evaluation_traces_and_leaves_the_state(module):
    """An evaluation forward (gradients off) under delayed scaling traces: it casts with
    the states' scales and records nothing, so its outputs are eager's bit for bit and
    both states (scales, histories, pending amaxes) are left as eager leaves them, also
    before any training step (the trace makes the states)."""
    recipe = DelayedScaling(amax_history_len=4)

    def make():
        torch.manual_seed(0)
        if module == "linear":
            return lowprec.Linear(64, 32, name="l")
        return lowprec.LayerNormMLP(64, 128, name="m")

    def states(m):
        held = m.__dict__["_recipe_states"]
        return [t.clone() for mode in ("forward", "backward") for t in
                (held[mode].delayed.scale, held[mode].delayed.amax_history,
                 held[mode].delayed.amax_current)]

    a, b = make(), make()
    x0 = torch.randn(16, 64) * 3
    for m in (a, b):  # one training step each: the states exist and have moved
        with lowprec.autocast(recipe=recipe):
            m(x0).sum().backward()
    ops = GraphOps()
    compiled = torch.compile(b, backend=ops, fullgraph=True)
    for step in range(2):
        x = torch.randn(16, 64) * (2 + step)
        with torch.no_grad():
            with lowprec.autocast(recipe=recipe):
                want = a(x)
            with lowprec.autocast(recipe=recipe):
                got = compiled(x)
        assert torch.equal(want, got)
        for s_a, s_b in zip(states(a), states(b)):
            assert torch.equal(s_a, s_b)
    assert ops.targets and not any("lowprec.call" in t for t in ops.targets)
    # before any training step the trace makes the states (as eager's first call does),
    # and traces: scale 1, nothing recorded, both states left as eager leaves them
    fresh, fresh_ref = make(), make()
    ops = GraphOps()
    with torch.no_grad(), lowprec.autocast(recipe=recipe):
        got = torch.compile(fresh, backend=ops, fullgraph=True)(x0)
        want = fresh_ref(x0)
    assert ops.targets and not any("lowprec.call" in t for t in ops.targets)
    assert torch.equal(want, got)
    for s_a, s_b in zip(states(fresh_ref), states(fresh), strict=True):
        assert torch.equal(s_a, s_b)


class _OwnMXFP8(lowprec.MXFP8Quantizer):
    """A user's quantizer that quantizes its own way: it has no traced form."""

    def _quantize_2d(self, x2d):
        return super()._quantize_2d(x2d)


def test_quantizers_without_a_form_keep_the_opaque_call():
    ops = GraphOps()
    m = lowprec.Linear(64, 32, name="l")
    compiled = torch.compile(m, backend=ops, fullgraph=True)
    recipe = lowprec.CustomRecipe(qfactory=lambda role: _OwnMXFP8())
    with lowprec.autocast(recipe=recipe):
        compiled(torch.randn(16, 64, requires_grad=True)).sum().backward()
    assert any("lowprec.call" in t for t in ops.targets)


def test_plan_for():
    x, w = torch.randn(32, 64), torch.randn(16, 64)
    plan = plan_of(Float8CurrentScaling(), x, w)
    assert plan.x.fp8_dtype == torch.float8_e4m3fn and plan.dy.fp8_dtype == torch.float8_e5m2
    assert plan.routes == ("emulated",) * 3  # CPU: the fp32 emulation, as eager
    assert isinstance(plan_of(DelayedScaling(), x, w).x, Delayed)
    assert plan_of(Float8CurrentScaling(), x.double(), w.double()) is None
    # fp16 keeps the opaque call (the traced quantize restores bf16 rounding only)
    assert plan_of(Float8CurrentScaling(), x.half(), w.half()) is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_shapes_cublas_does_not_take_run_eagers_next_backend():
    """Eager runs another backend where cuBLAS needs multiples of 16 (wgrad contracts over
    the token count) or for E5M2 x E5M2: the traced plan routes those GEMMs as eager does
    (the bf16 GEMM of the exact values), and compiled and eager agree bit for bit."""
    cases = [(Float8CurrentScaling(), 48, ("cublas_fp8",) * 3),
             (Float8CurrentScaling(), 24, ("cublas_fp8", "cublas_fp8", "exact_bf16")),
             (Float8CurrentScaling(fp8_format=Format.E5M2), 32, ("exact_bf16",) * 3)]
    for recipe, m, routes in cases:
        torch.manual_seed(0)
        lin = lowprec.Linear(64, 32, bias=False, name="l", params_dtype=torch.bfloat16,
                             device="cuda")
        x = torch.randn(m, 64, device="cuda", dtype=torch.bfloat16)
        assert plan_of(recipe, x.requires_grad_(), lin.weight).routes == routes
        dy = torch.randn(m, 32, device="cuda", dtype=torch.bfloat16)
        want = _run(lin, lin, x, dy, recipe)
        got = _run(torch.compile(lin, backend="inductor", fullgraph=True), lin, x, dy, recipe)
        for a, b in zip(want, got):
            assert torch.equal(a, b)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_block_pairs_cublas_does_not_take_trace_bit_identical():
    """Hidden 768 (a 110M Llama) under Float8BlockScaling: fprop and dgrad contract over
    K/128 = 3 and 6 blocks of the 128x128 weight, which cuBLAS's block GEMM does not take,
    so eager multiplies the exact bf16 values; the compiled linear traces the same GEMMs
    (no opaque call) and matches eager, and the eager Function, bit for bit."""
    recipe = Float8BlockScaling()
    torch.manual_seed(0)
    lin = lowprec.Linear(384, 768, bias=False, name="l", params_dtype=torch.bfloat16,
                         device="cuda")
    x = torch.randn(256, 384, device="cuda", dtype=torch.bfloat16)
    assert plan_of(recipe, x.requires_grad_(), lin.weight).routes == (
        "exact_bf16", "exact_bf16", "cublas_fp8_block")
    dy = torch.randn(256, 768, device="cuda", dtype=torch.bfloat16)
    want = _run(lin, lin, x, dy, recipe)
    with lowprec.linear.eager_plans_off():
        function = _run(lin, lin, x, dy, recipe)
    ops = GraphOps()
    got = _run(torch.compile(lin, backend=ops, fullgraph=True), lin, x, dy, recipe)
    assert ops.targets and not any("lowprec.call" in t for t in ops.targets)
    torch._dynamo.reset()
    inductor = _run(torch.compile(lin, backend="inductor", fullgraph=True), lin, x, dy, recipe)
    for a, b, c, d in zip(want, function, got, inductor):
        assert torch.equal(a, b) and torch.equal(a, c) and torch.equal(a, d)


def _amaxes(device):
    """fp32 amaxes over the whole range: random bit patterns (positive, finite), subnormals,
    and the special values."""
    g = torch.Generator().manual_seed(0)
    bits = torch.randint(0, 0x7F800000, (1 << 16,), generator=g, dtype=torch.int32)
    special = torch.tensor([0.0, 1e-45, 1e-40, 1.0, 448.0, 3.4e38, float("inf"), float("nan")])
    return torch.cat([bits.view(torch.float32), special]).to(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("eps", [0.0, 1e-12])
def test_compiled_scale_rule_is_the_reference(device, pow2, eps):
    """``scale_from_amax`` (its quotient in fp64, rounded once) is the fp32 rule computed with
    an IEEE fp32 division (eager, CPU), bit for bit, also compiled by inductor (whose fp32
    division is not correctly rounded on the GPU); so is the traced decode scale."""
    from lowprec.formats.casting import floor_pow2, scale_from_amax
    from lowprec.formats.graph import decode_scale

    amax = _amaxes(device)
    a = amax.cpu()
    clamped = torch.clamp_min(a, eps) if eps > 0 else a
    want = torch.full_like(a, 448.0) / clamped
    want = torch.where(clamped == 0, torch.ones_like(want), want)
    want = torch.where(torch.isinf(want), torch.full_like(want, torch.finfo(torch.float32).max),
                       want)
    want = floor_pow2(want) if pow2 else want
    want = torch.where(torch.isfinite(a), want, torch.full_like(want, float("nan")))
    eager = scale_from_amax(amax, 448.0, eps=eps, pow2=pow2)
    compiled = torch.compile(lambda t: scale_from_amax(t, 448.0, eps=eps, pow2=pow2),
                             fullgraph=True)(amax)
    for got in (eager, compiled):
        assert torch.equal(got.cpu().view(torch.int32), want.view(torch.int32))
    if pow2 or eps:
        return
    finite = eager[torch.isfinite(eager) & (eager > 0)][:8]
    dec = torch.compile(lambda s: torch.stack([decode_scale(v).reshape(()) for v in s]))(finite)
    assert torch.equal(dec, torch.reciprocal(finite))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (cuBLAS block FP8)")
@pytest.mark.parametrize("shape", [(256, 512, 1024), (4096, 512, 4096)],
                         ids=["whole", "sliced_backward"])
@pytest.mark.parametrize("w_dim", [2, 1])
def test_block_traced_bit_identical_cuda(shape, w_dim, monkeypatch):
    """Block FP8 traced on cuBLAS; the larger shape slices dY in eager (grad_split, its
    default floor lowered to this shape's 16 MiB copies), and so in the traced backward."""
    monkeypatch.setattr(grad_split, "AUTO_MIN_COPY_BYTES", grad_split.MIN_COPY_BYTES)
    m, k, n = shape
    recipe = Float8BlockScaling(w_block_scaling_dim=w_dim)
    torch.manual_seed(0)
    lin = lowprec.Linear(k, n, name="l", params_dtype=torch.bfloat16, device="cuda")
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    # the plan of a training call (eager slices a backward that needs both gradients)
    xg = x.detach().requires_grad_()
    assert plan_of(recipe, xg, lin.weight) is not None
    if shape[0] == 4096:
        assert plan_of(recipe, xg, lin.weight).split is not None
    assert plan_of(recipe, xg, lin.weight).x.kernel == use_kernels(x)
    ops = GraphOps()
    want = _run(lin, lin, x, dy, recipe)
    got = _run(torch.compile(lin, fullgraph=True), lin, x, dy, recipe)
    for w, g in zip(want, got):
        assert torch.equal(w, g)
    with lowprec.autocast(recipe=recipe):
        torch.compile(lin, backend=ops, fullgraph=True)(x.requires_grad_()).sum().backward()
    assert not any("lowprec.call" in t for t in ops.targets)


#: (recipe, graph module, launcher name, where its rowwise and columnwise flags sit)
_ONE_PASS = {"block": (Float8BlockScaling, block_graph, "fp8_block_quantize", 4),
             "mxfp8": (MXFP8BlockScaling, mxfp8_graph, "mxfp8_quantize", 2)}


@pytest.mark.skipif(not (torch.cuda.is_available() and use_kernels(torch.empty(1))),
                    reason="needs CUDA and Triton (block FP8 / MXFP8 kernels)")
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("fmt", sorted(_ONE_PASS))
def test_linears_reading_one_input_quantize_it_once(fmt, backend, monkeypatch):
    """q/k/v-like Linears on one input: a graph quantizes that input once for all three,
    both directions in one pass whose columnwise blocks the backward keeps (eager's Gluon
    quantize, merged by the compiler's common-subexpression pass), with eager's bits."""
    recipe_cls, graph, name, at = _ONE_PASS[fmt]
    calls = []
    launcher = getattr(graph, name)

    def counted(x, *args):
        calls.append((tuple(x.shape), args[at], args[at + 1]))
        return launcher(x, *args)
    monkeypatch.setattr(graph, name, counted)
    recipe = recipe_cls()
    torch.manual_seed(0)
    lins = torch.nn.ModuleList(
        lowprec.Linear(512, 512, bias=False, name=f"l{i}", params_dtype=torch.bfloat16,
                       device="cuda") for i in range(3))

    def block(x):
        return lins[0](x) * lins[1](x) + lins[2](x)
    x = torch.randn(256, 512, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(256, 512, device="cuda", dtype=torch.bfloat16)
    want = _run(block, lins, x, dy, recipe)
    calls.clear()
    got = _run(torch.compile(block, backend=backend, fullgraph=True), lins, x, dy, recipe)
    for w, g in zip(want, got):
        assert torch.equal(w, g)
    # the input once (both directions), then each dY once (both directions)
    assert calls == [((256, 512), True, True)] * 4


@pytest.mark.parametrize("partition", ["default", "min_cut"])
@pytest.mark.parametrize("first_scale", ["one", "current"])
def test_delayed_backward_keeps_the_forwards_scales(partition, first_scale):
    """A compiled delayed-scaling Linear's backward recasts x and W with the scales its
    forward cast with, never with the state's: the region's update moves the state between
    the forward and the backward. Under either partitioner AOT autograd may use (the
    default one, which moves to backward what no forward output needs, and the min-cut one
    inductor uses, which recomputes cheap ops from saved inputs), over steps whose amaxes
    move the scales, outputs and gradients equal eager's bit for bit."""
    from torch._functorch import partitioners

    backend = GraphOps({"default": partitioners.default_partition,
                        "min_cut": partitioners.min_cut_rematerialization_partition}[partition])
    recipe = DelayedScaling(amax_history_len=2, first_scale=first_scale)
    torch.manual_seed(0)
    a = lowprec.Linear(64, 32, name="l")
    b = lowprec.Linear(64, 32, name="l")
    b.load_state_dict(a.state_dict())
    compiled = torch.compile(b, backend=backend, fullgraph=True)
    g = torch.Generator().manual_seed(2)
    for step in range(4):
        x = torch.randn(16, 64, generator=g) * 8.0 ** step
        dy = torch.randn(16, 32, generator=g)
        for w, t in zip(_run(a, a, x, dy, recipe), _run(compiled, b, x, dy, recipe)):
            assert torch.equal(w, t), step
    assert a.scaling_state()["forward"]["scale"][0] != 1  # the scales moved


def test_delayed_kept_scales_are_each_the_start_of_its_own_copy():
    """The scales a traced delayed-scaling forward keeps for its backward are each element
    0 of a copy of its own: the compiler may make the backward's decode scale in the
    copy's place, and cuBLAS refuses a scale pointer at an offset of 4 bytes into a buffer
    (CUBLAS_STATUS_NOT_SUPPORTED, which a shared copy of both scales met on "1b")."""
    from lowprec.linear.traced_delayed import delayed_forward

    recipe = DelayedScaling(amax_history_len=2)
    x, w = torch.randn(16, 64), torch.randn(32, 64)
    plan = plan_of(recipe, x, w)
    assert plan is not None and plan.delayed
    scale = torch.tensor([2.0, 4.0, 1.0])
    (_, x_keep), (_, w_keep) = delayed_forward(plan, x, w, (scale, torch.zeros(3), None, 0,
                                                            False))
    kept = [x_keep[1], w_keep[1]]
    assert [k.storage_offset() for k in kept] == [0, 0]
    assert kept[0].untyped_storage().data_ptr() != kept[1].untyped_storage().data_ptr()
    assert [k.item() for k in kept] == [2.0, 4.0]  # the scales the forward cast with
