"""lowprec.ops: each op vs plain torch, Sequential vs LayerNormMLP, fused vs unfused,
quantized hand-over, usage preservation of quantized weights (train/eval loop), roles, errors."""

from __future__ import annotations

import copy
import functools
import io

import pytest
import torch
import torch.nn.functional as F
from helpers import randn, sqnr_db

import lowprec
import lowprec.linear.function
import lowprec.ops as ops
from lowprec.formats.base import QuantizedTensor
from lowprec.optim import QuantizedWeightOptimizer

E4M3 = torch.float8_e4m3fn

# test id -> Recipe.from_name name
RECIPES = {name: functools.partial(lowprec.recipe.Recipe.from_name, table_name)
           for name, table_name in (("delayed", "fp8_delayed"), ("current", "fp8_current"),
                                    ("block", "fp8_block"), ("mxfp8", "mxfp8"), ("nvfp4", "nvfp4"),
                                    ("hybrid", "mxfp8_fwd_nvfp4_bwd"))}
RECIPE_NAMES = list(RECIPES)


def dims(recipe_name):
    """(hidden, ffn, tokens): Float8BlockScaling needs multiples of 128 (1x128 and 128x128
    blocks; tokens are split into two GroupedLinear groups); 32 suffices for MXFP8 (and
    NVFP4's 16)."""
    return (128, 256, 256) if recipe_name == "block" else (64, 128, 64)




def fwd_bwd(module, x, dy, *extra, recipe=None, seed=7):
    """Forward (under autocast when a recipe is given) + backward; returns
    [y, dx, grad of each parameter in order]."""
    module.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_(True)
    torch.manual_seed(seed)  # NVFP4 stochastic rounding of gradients is repeatable
    with lowprec.autocast(enabled=recipe is not None, recipe=recipe):
        y = module(x, *extra)
    y.backward(dy)
    return [y.detach().clone(), x.grad.clone()] + [p.grad.clone() for p in module.parameters()]


def assert_all_equal(a, b):
    assert len(a) == len(b)
    for i, (u, v) in enumerate(zip(a, b)):
        assert torch.equal(u, v), f"entry {i}: max diff {(u.double() - v.double()).abs().max()}"


# fp32 GEMMs that run through differently laid out BLAS calls (reshaped / transposed operands)
# may accumulate in another order: agreement to a few fp32 ulps of the K-term sums.
GEMM_TOL = dict(rtol=1e-5, atol=1e-5)


# ---- each op vs plain torch, outside autocast -----------------------------------------------
def test_basic_linear_matches_torch():
    torch.manual_seed(0)
    op = ops.BasicLinear(48, 40)
    assert not hasattr(op, "bias") or op.__dict__.get("bias") is None
    x, dy = randn(3, 5, 48, seed=1), randn(3, 5, 40, seed=2)
    got = fwd_bwd(op, x, dy)
    xr = x.clone().requires_grad_(True)
    wr = op.weight.detach().clone().requires_grad_(True)
    yr = xr @ wr.t()
    yr.backward(dy)
    for g, r in zip(got, [yr.detach(), xr.grad, wr.grad]):
        torch.testing.assert_close(g, r, **GEMM_TOL)


def test_linear_matches_torch_and_lowprec_linear():
    torch.manual_seed(0)
    op = ops.Linear(64, 32)
    torch.manual_seed(0)
    ref_mod = lowprec.Linear(64, 32)
    # Same constructor order and init as lowprec.Linear (torch.nn.Linear's).
    assert torch.equal(op.weight, ref_mod.weight) and torch.equal(op.bias, ref_mod.bias)
    x, dy = randn(2, 16, 64, seed=1), randn(2, 16, 32, seed=2)
    got = fwd_bwd(op, x, dy)
    xr = x.clone().requires_grad_(True)
    wr = op.weight.detach().clone().requires_grad_(True)
    br = op.bias.detach().clone().requires_grad_(True)
    yr = F.linear(xr, wr, br)
    yr.backward(dy)
    for g, r in zip(got, [yr.detach(), xr.grad, wr.grad, br.grad]):
        torch.testing.assert_close(g, r, **GEMM_TOL)
    # BasicLinear + Bias run as quantized_linear(x, W, b): the computation of lowprec.Linear.
    for recipe in (None, lowprec.MXFP8BlockScaling()):
        assert_all_equal(fwd_bwd(op, x, dy, recipe=recipe), fwd_bwd(ref_mod, x, dy, recipe=recipe))


def test_bias_matches_torch():
    op = ops.Bias(16)
    assert torch.equal(op.bias, torch.zeros(16))  # zero-initialized
    with torch.no_grad():
        op.bias.copy_(randn(16, seed=3))
    x, dy = randn(4, 3, 16, seed=1), randn(4, 3, 16, seed=2)
    got = fwd_bwd(op, x, dy)
    assert torch.equal(got[0], x + op.bias.detach())  # one fp32 add: exact
    assert torch.equal(got[1], dy)
    # The bias gradient is a sum over 12 rows: summation order may differ by fp32 rounding.
    torch.testing.assert_close(got[2], dy.sum(dim=(0, 1)), rtol=1e-6, atol=1e-6)


def _ref_activation(name, x):
    a, b = x.chunk(2, dim=-1)
    return {
        "gelu": lambda: F.gelu(x, approximate="tanh"),
        "relu": lambda: torch.relu(x),  # clamp_min's gradient at 0 would be 1, not 0
        "silu": lambda: F.silu(x),
        "srelu": lambda: torch.clamp_min(x, 0.0) ** 2,
        "qgelu": lambda: x * torch.sigmoid(1.702 * x),
        "swiglu": lambda: F.silu(a) * b,
        "geglu": lambda: F.gelu(a, approximate="tanh") * b,
    }[name]()


ACT_CLASSES = {"gelu": ops.GELU, "relu": ops.ReLU, "silu": ops.SiLU, "srelu": ops.SReLU,
               "qgelu": ops.QGELU, "swiglu": ops.SwiGLU, "geglu": ops.GEGLU}


def _bias_activation_and_reference(name, op, x, dy):
    """The fused Bias+activation step on (x, dy), and torch's fp32 autograd of the same
    formula: (outputs and grads, (reference output, reference x, reference bias))."""
    seq = ops.Sequential(ops.Bias(32, params_dtype=x.dtype), op)
    assert seq.fusion_plan() == [("BiasActivation", ("Bias", type(op).__name__))]
    with torch.no_grad():
        seq[0].bias.copy_(randn(32, seed=3))
    got = fwd_bwd(seq, x, dy)
    xr = x.detach().to(torch.float32, copy=True).requires_grad_(True)
    br = seq[0].bias.detach().float().requires_grad_(True)
    yr = _ref_activation(name, xr + br)
    yr.backward(dy.float())
    return got, (yr, xr, br)


@pytest.mark.parametrize("name", list(ACT_CLASSES))
def test_activation_matches_torch(name):
    op = ACT_CLASSES[name]()
    assert op.activation == name and ops.Activation(name).activation == name
    gated = name in ("swiglu", "geglu")
    x = randn(4, 3, 32, seed=1)
    dy = randn(4, 3, 16 if gated else 32, seed=2)
    got = fwd_bwd(op, x, dy)
    xr = x.clone().requires_grad_(True)
    yr = _ref_activation(name, xr)
    yr.backward(dy)
    # Same elementwise torch kernels (relu^2 and max(x,0)^2 agree exactly): bit-identical.
    assert torch.equal(got[0], yr.detach())
    assert torch.equal(got[1], xr.grad)

    # The fused bias+activation step (its own backward: dact recomputed, dbias summed).
    got, (yr, xr, br) = _bias_activation_and_reference(name, op, x, dy)
    assert torch.equal(got[0], yr.detach())
    assert torch.equal(got[1], xr.grad)  # same dact kernels on the same saved pre-activation
    torch.testing.assert_close(got[2], br.grad, rtol=1e-6, atol=1e-6)  # 12-row sum, any order


@pytest.mark.parametrize("norm", ["LayerNorm", "RMSNorm"])
def test_norm_matches_torch(norm):
    op = getattr(ops, norm)(32, eps=1e-5)
    with torch.no_grad():
        op.weight.copy_(1 + 0.2 * randn(32, seed=3))
        if norm == "LayerNorm":
            op.bias.copy_(0.2 * randn(32, seed=4))
    x, dy = randn(4, 3, 32, seed=1), randn(4, 3, 32, seed=2)
    got = fwd_bwd(op, x, dy)
    xr = x.clone().requires_grad_(True)
    params = [p.detach().clone().requires_grad_(True) for p in op.parameters()]
    if norm == "LayerNorm":
        yr = F.layer_norm(xr, (32,), params[0], params[1], 1e-5)
    else:
        yr = F.rms_norm(xr, (32,), params[0], 1e-5)
    yr.backward(dy)
    # The same torch norm kernels, forward and backward: bit-identical.
    assert_all_equal(got, [yr.detach(), xr.grad] + [p.grad for p in params])


# bf16/fp16: norms and activations computed in fp32, every result rounded once to its dtype.
# The expectations are torch's fp32 autograd of the same formulas on fp32 copies of the inputs.
LOW = [torch.bfloat16, torch.float16]


@pytest.mark.parametrize("dtype", LOW, ids=str)
@pytest.mark.parametrize("name", list(ACT_CLASSES))
def test_activation_low_precision_rounds_once(name, dtype):
    op = ACT_CLASSES[name]()
    gated = name in ("swiglu", "geglu")
    x = 3 * randn(64, 32, seed=1, dtype=dtype)
    dy = randn(64, 16 if gated else 32, seed=2, dtype=dtype)
    got = fwd_bwd(op, x, dy)
    xr = x.float().requires_grad_(True)
    yr = _ref_activation(name, xr)
    yr.backward(dy.float())
    assert_all_equal(got, [yr.detach().to(dtype), xr.grad.to(dtype)])

    # Bias + activation: the sum, the activation and dbias (a sum over rows of fp32 dact
    # values) in fp32, each output rounded once.
    got, (yr, xr, br) = _bias_activation_and_reference(name, op, x, dy)
    assert_all_equal(got, [yr.detach().to(dtype), xr.grad.to(dtype), br.grad.to(dtype)])


@pytest.mark.parametrize("zero_centered", [False, True], ids=["gamma", "zero_centered"])
@pytest.mark.parametrize("dtype", LOW, ids=str)
@pytest.mark.parametrize("norm", ["LayerNorm", "RMSNorm"])
def test_norm_low_precision_rounds_once(norm, dtype, zero_centered):
    """zero_centered_gamma adds 1 to the weight in fp32; the parameter gradients are sums over
    the rows accumulated in fp32 (an all-ones gradient over 2048 rows sums to 2048, where a
    bf16 accumulator stops at 256 or 512)."""
    k, rows = 64, 2048
    op = getattr(ops, norm)(k, eps=1e-5, zero_centered_gamma=zero_centered, params_dtype=dtype)
    with torch.no_grad():
        op.weight.copy_(0.05 * randn(k, seed=3) + (0.0 if zero_centered else 1.0))
        if norm == "LayerNorm":
            op.bias.copy_(0.2 * randn(k, seed=4))
    x = 2 * randn(rows, k, seed=1, dtype=dtype)
    for dy in (randn(rows, k, seed=2, dtype=dtype), torch.ones(rows, k, dtype=dtype)):
        got = fwd_bwd(ops.Sequential(op), x, dy)
        xr = x.float().requires_grad_(True)
        params = [p.detach().float().requires_grad_(True) for p in op.parameters()]
        gamma = params[0] + 1 if zero_centered else params[0]
        if norm == "LayerNorm":
            yr = F.layer_norm(xr, (k,), gamma, params[1], 1e-5)
        else:
            yr = F.rms_norm(xr, (k,), gamma, 1e-5)
        yr.backward(dy.float())
        assert_all_equal(got, [t.to(dtype) for t in [yr.detach(), xr.grad]
                               + [p.grad for p in params]])
    if norm == "LayerNorm":
        assert torch.equal(got[3], torch.full((k,), float(rows), dtype=dtype))


def test_quantize_is_identity_outside_autocast():
    op = ops.Quantize(forward=True, backward=True)
    x, dy = randn(4, 32, seed=1), randn(4, 32, seed=2)
    y, dx = fwd_bwd(op, x, dy)
    assert type(y) is torch.Tensor and torch.equal(y, x) and torch.equal(dx, dy)


def test_grouped_linear_matches_torch_and_lowprec_grouped_linear():
    torch.manual_seed(0)
    op = ops.GroupedLinear(3, 64, 32)
    torch.manual_seed(0)
    ref_mod = lowprec.GroupedLinear(3, 64, 32)
    splits = [32, 0, 64]  # an empty group too
    x, dy = randn(96, 64, seed=1), randn(96, 32, seed=2)
    got = fwd_bwd(op, x, dy, splits)
    xr = x.clone().requires_grad_(True)
    ws = [getattr(op, f"weight{i}").detach().clone().requires_grad_(True) for i in range(3)]
    bs = [getattr(op, f"bias{i}").detach().clone().requires_grad_(True) for i in range(3)]
    yr = torch.cat([F.linear(xi, w, b) for xi, w, b in zip(torch.split(xr, splits), ws, bs)])
    yr.backward(dy)
    ref = [yr.detach(), xr.grad]
    for w, b in zip(ws, bs):
        ref += [w.grad, b.grad]
    ref_by_name = dict(zip(["y", "x"] + [f"{k}{i}" for i in range(3) for k in ("weight", "bias")],
                           ref))
    names = ["y", "x"] + [n for n, _ in op.named_parameters()]
    for n, g in zip(names, got):
        torch.testing.assert_close(g, ref_by_name[n], **GEMM_TOL)
    # The op is lowprec.GroupedLinear itself (same init, same GEMMs): bit-identical.
    for recipe in (None, lowprec.MXFP8BlockScaling()):
        assert_all_equal(fwd_bwd(op, x, dy, splits, recipe=recipe),
                         fwd_bwd(ref_mod, x, dy, splits, recipe=recipe))
    # In a Sequential, m_splits is the extra input.
    seq = ops.Sequential(op)
    assert_all_equal(fwd_bwd(seq, x, dy, splits), fwd_bwd(ref_mod, x, dy, splits))


# ---- Sequential vs LayerNormMLP ---------------------------------------------------------------
def build_pair(act="gelu", norm="LayerNorm", hidden=64, ffn=128, fuse=True):
    """A LayerNormMLP and the op Sequential with the same parameters."""
    torch.manual_seed(0)
    mlp = lowprec.LayerNormMLP(hidden, ffn, activation=act, normalization=norm, name="mlp")
    with torch.no_grad():
        mlp.layer_norm_weight.copy_(1 + 0.2 * randn(hidden, seed=11))
        if mlp.layer_norm_bias is not None:
            mlp.layer_norm_bias.copy_(0.2 * randn(hidden, seed=12))
    gated = act in ("swiglu", "geglu")
    seq = ops.Sequential(getattr(ops, norm)(hidden),
                         ops.Linear(hidden, 2 * ffn if gated else ffn, name="fc1"),
                         ops.Activation(act),
                         ops.Linear(ffn, hidden, name="fc2"), fuse=fuse)
    seq.load_state_dict({"0.weight": mlp.layer_norm_weight,
                         **({"0.bias": mlp.layer_norm_bias} if norm == "LayerNorm" else {}),
                         "1.weight": mlp.fc1_weight, "1.bias": mlp.fc1_bias,
                         "3.weight": mlp.fc2_weight, "3.bias": mlp.fc2_bias}, strict=False)
    return mlp, seq


def two_steps(module, x, dy, recipe):
    # Two steps: delayed scaling's second step quantizes with the scales the first produced.
    return fwd_bwd(module, x, dy, recipe=recipe, seed=7) + fwd_bwd(module, x, dy, recipe=recipe,
                                                                   seed=8)


@pytest.mark.parametrize("recipe_name", [None] + RECIPE_NAMES)
def test_sequential_matches_layernorm_mlp(recipe_name):
    """The op path does LayerNormMLP's computation (bias in the GEMM, same quantizers, same
    gradient quantization order): forward and every gradient bit-identical."""
    hidden, ffn, tokens = dims(recipe_name)
    mlp, seq = build_pair(hidden=hidden, ffn=ffn)
    assert seq.fusion_plan() == [("LayerNorm", ("LayerNorm",)),
                                 ("LinearBiasActivation", ("Linear", "Bias", "Activation")),
                                 ("LinearBias", ("Linear", "Bias"))]
    x, dy = randn(2, tokens // 2, hidden, seed=1), randn(2, tokens // 2, hidden, seed=2)
    recipe = RECIPES[recipe_name]() if recipe_name else None
    assert_all_equal(two_steps(seq, x, dy, recipe), two_steps(mlp, x, dy, recipe))


@pytest.mark.parametrize("recipe_name,act,norm,mode", [
    ("mxfp8", "swiglu", "RMSNorm", "default"),
    ("nvfp4", "geglu", "LayerNorm", "default"),
    ("hybrid", "srelu", "RMSNorm", "default"),
    ("mxfp8", "gelu", "LayerNorm", "high_precision"),
    ("nvfp4", "gelu", "LayerNorm", "dequantized"),
])
def test_sequential_matches_layernorm_mlp_variants(recipe_name, act, norm, mode):
    """Gated activations, RMSNorm and the other backward modes: still bit-identical."""
    hidden, ffn, tokens = dims(recipe_name)
    mlp, seq = build_pair(act, norm, hidden, ffn)
    x, dy = randn(tokens, hidden, seed=1), randn(tokens, hidden, seed=2)
    recipe = RECIPES[recipe_name](backward_mode=mode)
    assert_all_equal(fwd_bwd(seq, x, dy, recipe=recipe), fwd_bwd(mlp, x, dy, recipe=recipe))


# ---- fused vs unfused -------------------------------------------------------------------------
def build_block(hidden, ffn, dtype=torch.float32, fuse=True):
    """Exercises every fusion and hand-over: norm -> linear (quantized hand-over), linear+bias+
    act (forward fusion, fused dact+dbias, quantized grad hand-over), act -> linear, a
    BasicLinear without bias and with a separate Bias op, bias+act, and a GroupedLinear."""
    torch.manual_seed(0)
    seq = ops.Sequential(
        ops.RMSNorm(hidden, params_dtype=dtype),
        ops.Linear(hidden, ffn, params_dtype=dtype), ops.GELU(),
        ops.BasicLinear(ffn, 2 * hidden, params_dtype=dtype),
        ops.Bias(2 * hidden, params_dtype=dtype),
        ops.SwiGLU(),
        ops.BasicLinear(hidden, hidden, params_dtype=dtype), ops.SiLU(),
        ops.Linear(hidden, hidden, params_dtype=dtype),
        ops.GroupedLinear(2, hidden, hidden, params_dtype=dtype),
        ops.Bias(hidden, params_dtype=dtype), ops.QGELU(),
        fuse=fuse)
    with torch.no_grad():
        for m in seq:
            if isinstance(m, ops.Bias):
                m.bias.copy_(0.1 * torch.randn(m.size).to(dtype))
    unfused = copy.deepcopy(seq)
    unfused.fuse = False
    return seq, unfused


def test_fusion_plan():
    seq, unfused = build_block(64, 128)
    assert seq.fusion_plan() == [
        ("RMSNorm", ("RMSNorm",)),
        ("LinearBiasActivation", ("Linear", "Bias", "GELU")),
        ("LinearBiasActivation", ("BasicLinear", "Bias", "SwiGLU")),
        ("LinearActivation", ("BasicLinear", "SiLU")),
        ("LinearBias", ("Linear", "Bias")),
        ("GroupedLinear", ("GroupedLinear",)),
        ("BiasActivation", ("Bias", "QGELU")),
    ]
    assert [name for name, _ in unfused.fusion_plan()] == [
        "RMSNorm", "Linear", "Bias", "GELU", "BasicLinear", "Bias", "SwiGLU", "BasicLinear",
        "SiLU", "Linear", "Bias", "GroupedLinear", "Bias", "QGELU"]


@pytest.mark.parametrize("recipe_name", RECIPE_NAMES)
def test_fused_equals_unfused_quantized(recipe_name):
    """Under a quantizing recipe the GEMM runs in fp32 and adds the bias in fp32 before the
    one rounding to fp32: the fused bias is the unfused add, and the quantized hand-overs
    quantize the same values with the same quantizers. Bit-identical."""
    hidden, ffn, tokens = dims(recipe_name)
    seq, unfused = build_block(hidden, ffn)
    splits = [tokens // 2, tokens // 2]
    x, dy = randn(tokens, hidden, seed=1), randn(tokens, hidden, seed=2)
    recipe = RECIPES[recipe_name]()
    assert_all_equal(fwd_bwd(seq, x, dy, splits, recipe=recipe),
                     fwd_bwd(unfused, x, dy, splits, recipe=recipe))


def test_fused_equals_unfused_high_precision():
    x, dy = randn(64, 64, seed=1), randn(64, 64, seed=2)
    seq, unfused = build_block(64, 128)
    got, ref = fwd_bwd(seq, x, dy, [32, 32]), fwd_bwd(unfused, x, dy, [32, 32])
    for g, r in zip(got, ref):
        # addmm (bias inside the GEMM) vs mm then add: fp32 rounding of the same sums.
        torch.testing.assert_close(g, r, **GEMM_TOL)
    seq, unfused = build_block(64, 128, dtype=torch.bfloat16)
    got = fwd_bwd(seq, x.bfloat16(), dy.bfloat16(), [32, 32])
    ref = fwd_bwd(unfused, x.bfloat16(), dy.bfloat16(), [32, 32])
    for g, r in zip(got, ref):
        # In bf16 the fused bias is rounded once, the unfused add twice: the paths differ by
        # bf16 roundings (2^-9 relative, ~54 dB) that propagate through 6 layers; 30 dB
        # leaves that margin and still fails on any real mismatch (a wrong op is ~0 dB).
        assert sqnr_db(r.float(), g.float()) > 30


# ---- quantized hand-over ---------------------------------------------------------------------
@pytest.fixture
def operand_log(monkeypatch):
    """Records the input x each quantized-linear forward receives (and whether it arrived
    quantized)."""
    seen = []
    function = lowprec.linear.function.EagerLinearFunction
    original = function.forward

    def spy(ctx, x, *args):
        seen.append((x, isinstance(x, QuantizedTensor)))
        return original(ctx, x, *args)

    monkeypatch.setattr(function, "forward", staticmethod(spy))
    return seen


@pytest.mark.parametrize("mode", ["default", "dequantized", "high_precision"])
def test_norm_and_activation_hand_over_quantized_input(operand_log, mode):
    _, seq = build_pair(hidden=64, ffn=128)
    x = randn(64, 64, seed=1).requires_grad_(True)
    with lowprec.autocast(recipe=lowprec.MXFP8BlockScaling(backward_mode=mode)):
        y = seq(x)
    # the linears' inputs: the norm's and the activation's outputs, quantized by them with
    # the linear's input quantizer
    inputs = operand_log
    assert len(inputs) == 2
    if mode == "high_precision":
        # That mode saves the original input for backward: no quantized hand-over.
        assert not any(q for _, q in inputs)
    else:
        for t, q in inputs:
            assert q and isinstance(t, lowprec.MXFP8Tensor)
            # default: the wgrad keeps only the columnwise data, the rowwise data is freed once
            # the fprop GEMM ran; dequantized mode keeps (only) the rowwise data it saves.
            assert t.has_usage("rowwise") == (mode == "dequantized")
            assert t.has_usage("columnwise") == (mode == "default")
    y.sum().backward()
    assert x.grad is not None and seq[1].weight.grad is not None


def test_hand_over_skips_usages_not_needed():
    """A frozen linear needs no wgrad: the handed-over input is rowwise only."""
    _, seq = build_pair(hidden=64, ffn=128)
    seq[3].weight.requires_grad_(False)
    captured = []
    original = lowprec.linear.function.quantize_operand

    def spy(quantizer, t, **kw):
        if isinstance(t, QuantizedTensor) and t.shape[-1] == 128:
            captured.append((t.has_usage("rowwise"), t.has_usage("columnwise")))
        return original(quantizer, t, **kw)

    lowprec.linear.function.quantize_operand = spy
    try:
        with lowprec.autocast(recipe=lowprec.MXFP8BlockScaling()):
            y = seq(randn(64, 64, seed=1).requires_grad_(True))
    finally:
        lowprec.linear.function.quantize_operand = original
    assert captured == [(True, False)]
    y.sum().backward()
    assert seq[1].weight.grad is not None and seq[3].weight.grad is None


# ---- Quantize op -----------------------------------------------------------------------------
def _mx(t):
    return lowprec.MXFP8Quantizer(E4M3).quantize(t)


def test_quantize_op_alone():
    x, dy = randn(64, 64, seed=1), randn(64, 64, seed=2)
    op = ops.Quantize(forward=True, backward=True, name="q")
    xr = x.clone().requires_grad_(True)
    with lowprec.autocast(recipe=lowprec.MXFP8BlockScaling()):
        y = op(xr)
    assert isinstance(y, lowprec.MXFP8Tensor) and y.has_usage("rowwise") and y.has_usage(
        "columnwise")
    ref = _mx(x)
    assert torch.equal(y.dequantize(), ref.dequantize())
    assert torch.equal(y.dequantize(usage="columnwise"), ref.dequantize(usage="columnwise"))
    y.backward(dy)
    # On its own, the quantized gradient's values go back.
    assert torch.equal(xr.grad, _mx(dy).dequantize())


def _custom(table):
    """A CustomRecipe factory: table[(module_type, tensor_type)] or identity."""
    return lowprec.CustomRecipe(qfactory=_TableFactory(table))


class _TableFactory:
    def __init__(self, table):
        self.table, self.seen = table, []

    def __call__(self, role):
        self.seen.append(role)
        if role is None:
            return lowprec.IdentityQuantizer()
        make = self.table.get((role.module_type, role.tensor_type))
        return make() if make else lowprec.IdentityQuantizer()


def test_quantize_op_feeds_linear_its_format():
    """Quantize before a linear: the linear consumes the Quantize role's tensor (MXFP8) even
    though its own input role is high precision; after it, the gradient the linear gets is
    the Quantize op's backward quantization."""
    recipe = _custom({("quantize", "input"): lambda: lowprec.MXFP8Quantizer(E4M3),
                      ("quantize", "grad_output"): lambda: lowprec.MXFP8Quantizer(E4M3)})
    torch.manual_seed(0)
    seq = ops.Sequential(ops.Quantize(), ops.BasicLinear(64, 64), ops.Quantize(False, True))
    x, dy = randn(64, 64, seed=1), randn(64, 64, seed=2)
    y, dx, dw = fwd_bwd(seq, x, dy, recipe=recipe)
    w = seq[1].weight.detach()
    xq, dyq = _mx(x), _mx(dy)
    # Expected in fp64 from the dequantized operands; the emulated GEMM runs in fp32.
    torch.testing.assert_close(y, (xq.dequantize().double() @ w.double().t()).float(), **GEMM_TOL)
    # dgrad: the linear consumed dy's MXFP8 rowwise data; wgrad: dy's and x's columnwise data.
    torch.testing.assert_close(dx, (dyq.dequantize().double() @ w.double()).float(), **GEMM_TOL)
    dw_ref = dyq.dequantize(usage="columnwise").double().t() @ xq.dequantize(
        usage="columnwise").double()
    torch.testing.assert_close(dw, dw_ref.float(), **GEMM_TOL)
    # And not the unquantized values (the test can tell the difference).
    assert not torch.allclose(dw, (dy.double().t() @ x.double()).float(), **GEMM_TOL)


def test_quantize_op_before_high_precision_op():
    """Before an op that computes in high precision the Quantize output is read as its
    (rowwise) values: ReLU(Quantize(x)) == relu(dequant(mx(x)))."""
    seq = ops.Sequential(ops.Quantize(), ops.ReLU())
    x = randn(32, 64, seed=1)
    with lowprec.autocast(recipe=lowprec.MXFP8BlockScaling()):
        y = seq(x.requires_grad_(True))
    assert torch.equal(y, torch.relu(_mx(x.detach()).dequantize()))
    y.sum().backward()
    assert torch.equal(x.grad, (x.detach() > 0).float() * (_mx(x.detach()).dequantize() > 0))


# ---- quantized weights: usages are never dropped ----------------------------------------------
def test_eval_forward_keeps_weight_usages():
    with lowprec.quantized_model_init(recipe=lowprec.MXFP8BlockScaling()):
        torch.manual_seed(0)
        lin = ops.Linear(64, 64)
        grp = ops.GroupedLinear(2, 64, 64)
    weights = [lin.weight, grp.weight0, grp.weight1]
    for w in weights:
        assert isinstance(w, lowprec.MXFP8Tensor) and w.has_usage("rowwise") and w.has_usage(
            "columnwise")
    x = randn(64, 64, seed=1)
    with torch.no_grad(), lowprec.autocast(recipe=lowprec.MXFP8BlockScaling()):
        lin(x)
        grp(x, [32, 32])
    assert [lin.weight, grp.weight0, grp.weight1] == weights  # same objects
    for w in weights:
        assert w.has_usage("rowwise") and w.has_usage("columnwise")
    # and the next training step runs its dgrad on the columnwise data that was kept
    with lowprec.autocast(recipe=lowprec.MXFP8BlockScaling()):
        (lin(x.requires_grad_(True)).sum() + grp(x, [32, 32]).sum()).backward()
    assert x.grad is not None and lin.weight.grad is not None


def _train_eval_loop(recipe_name, with_eval):
    hidden, ffn, tokens = dims(recipe_name)
    recipe = RECIPES[recipe_name]()
    torch.manual_seed(0)
    with lowprec.quantized_model_init(recipe=recipe):
        model = ops.Sequential(ops.LayerNorm(hidden), ops.Linear(hidden, ffn), ops.GELU(),
                               ops.GroupedLinear(2, ffn, hidden))
    opt = QuantizedWeightOptimizer(model, torch.optim.Adam, lr=1e-2)
    splits = [tokens // 2, tokens // 2]
    data = [randn(tokens, hidden, seed=100 + s) for s in range(2)]
    eval_x = randn(tokens, hidden, seed=200)
    losses = []
    for step, x in enumerate(data):
        torch.manual_seed(1000 + step)  # stochastic rounding draws of this step
        opt.zero_grad()
        with lowprec.autocast(recipe=recipe):
            y = model(x, splits)
        loss = y.float().pow(2).mean()
        loss.backward()
        opt.step()
        losses.append(loss.detach())
        if with_eval:
            with torch.no_grad(), lowprec.autocast(recipe=recipe):
                eval_y = model(eval_x, splits)
            assert torch.isfinite(eval_y).all()
            for name, p in model.named_parameters():
                if isinstance(p, QuantizedTensor):
                    assert p.has_usage("rowwise") and p.has_usage("columnwise"), name
    return losses, model, opt


def _raw(t):
    """Bytes-level view of a quantized tensor's buffers (fp8 viewed as uint8)."""
    out = []
    for name, inner in t.inner_tensors().items():
        if isinstance(inner, QuantizedTensor):
            out += _raw(inner)
        elif inner is not None:
            out.append(inner.view(torch.uint8) if inner.dtype.itemsize == 1 else inner)
    return out


@pytest.mark.parametrize("recipe_name", RECIPE_NAMES)
def test_train_eval_alternation_is_bit_identical(recipe_name):
    """Train steps interleaved with torch.no_grad() eval steps, quantized weights: losses,
    quantized weights (every buffer), masters and other parameters equal the loop without
    the eval steps, bit for bit."""
    la, ma, oa = _train_eval_loop(recipe_name, True)
    lb, mb, ob = _train_eval_loop(recipe_name, False)
    assert_all_equal(la, lb)
    n_quantized = 0
    for (name, p), (_, q) in zip(ma.named_parameters(), mb.named_parameters()):
        if isinstance(p, QuantizedTensor):
            n_quantized += 1
            assert_all_equal(_raw(p), _raw(q))
        else:
            assert torch.equal(p, q), name
    assert n_quantized == 3  # Linear.weight, GroupedLinear.weight0/1
    assert_all_equal(oa.master_weights(), ob.master_weights())


# ---- roles ------------------------------------------------------------------------------------
def test_roles():
    R = lowprec.QuantizerRole
    lin = ops.Linear(32, 32, name="fc")
    assert lin.get_quantizer_roles(fwd=True) == [R("linear", "input", "fc"),
                                                 R("linear", "weight", "fc"), None]
    assert lin.get_quantizer_roles(fwd=False) == [R("linear", "grad_output", "fc"), None]
    assert ops.BasicLinear(32, 32, name="b").get_quantizer_roles(fwd=False, num_quantizers=2) == [
        R("linear", "grad_output", "b"), None]
    grp = ops.GroupedLinear(2, 32, 32, name="g")
    assert grp.get_quantizer_roles(fwd=True) == [R("grouped_linear", "input", "g"),
                                                 R("grouped_linear", "weight", "g"), None] * 2
    q = ops.Quantize(name="q")
    assert q.get_quantizer_roles(fwd=True) == [R("quantize", "input", "q")]
    assert q.get_quantizer_roles(fwd=False) == [R("quantize", "grad_output", "q")]
    for op in (ops.Bias(4), ops.GELU(), ops.LayerNorm(4), ops.RMSNorm(4)):
        assert op.get_quantizer_roles(fwd=True) == [] == op.get_quantizer_roles(fwd=False)
    with pytest.raises(ValueError, match="quantizer slots"):
        lin.get_quantizer_roles(fwd=True, num_quantizers=2)
    seq = ops.Sequential(ops.LayerNorm(32), lin, ops.GELU(), q, grp)
    assert seq.get_quantizer_roles(fwd=True) == (lin.get_quantizer_roles(fwd=True)
                                                 + q.get_quantizer_roles(fwd=True)
                                                 + grp.get_quantizer_roles(fwd=True))


def test_recipe_sees_every_declared_role():
    """The qfactory is asked for exactly the roles the ops declare (forward and backward)."""
    factory = _TableFactory({})
    recipe = lowprec.CustomRecipe(qfactory=factory)
    seq = ops.Sequential(ops.LayerNorm(32), ops.Linear(32, 32, name="fc1"), ops.GELU(),
                         ops.Quantize(name="q"), ops.GroupedLinear(2, 32, 32, name="g"))
    with lowprec.autocast(recipe=recipe):
        y = seq(randn(32, 32, seed=1).requires_grad_(True), [16, 16])
    y.sum().backward()
    declared = seq.get_quantizer_roles(fwd=True) + seq.get_quantizer_roles(fwd=False)
    assert sorted(map(repr, factory.seen)) == sorted(map(repr, declared))


# ---- errors -------------------------------------------------------------------------------
def test_errors():
    with pytest.raises(ValueError, match="not supported.*gelu"):
        ops.Activation("gleu")
    grp = ops.GroupedLinear(2, 16, 16)
    x = randn(32, 16, seed=1)
    with pytest.raises(ValueError, match="m_splits sum to 30 but the input has 32 rows"):
        grp(x, [10, 20])
    with pytest.raises(ValueError, match="must have 2 non-negative sizes"):
        grp(x, [32])
    seq = ops.Sequential(ops.Linear(16, 16), grp)
    with pytest.raises(ValueError, match="m_splits sum"):
        seq(x, [16, 8])
    with pytest.raises(ValueError, match="expected 1 extra input"):
        seq(x)
    with pytest.raises(ValueError, match="expected 0 extra input"):
        ops.Sequential(ops.GELU())(x, [32])
    with pytest.raises(TypeError, match="lowprec ops"):
        ops.Sequential(torch.nn.Linear(4, 4))
    with pytest.raises(ValueError, match="even last dimension"):
        ops.SwiGLU()(randn(4, 5, seed=1))
    with pytest.raises(ValueError, match="Bias of size 8"):
        ops.Bias(8)(x)
    with pytest.raises(ValueError, match="features"):
        ops.Linear(8, 8)(x)


# ---- state: pickling, extra state ---------------------------------------------------------------
def test_save_load_after_training_step():
    """torch.save of a whole Sequential after forward/backward; delayed-scaling state travels
    as extra state and the reloaded copy computes the same next step."""
    recipe = lowprec.DelayedScaling(amax_history_len=4)
    _, seq = build_pair(hidden=64, ffn=128)
    x, dy = randn(64, 64, seed=1), randn(64, 64, seed=2)
    fwd_bwd(seq, x, dy, recipe=recipe)
    buf = io.BytesIO()
    torch.save(seq, buf)
    buf.seek(0)
    clone = torch.load(buf, weights_only=False)
    _, fresh = build_pair(hidden=64, ffn=128)
    fresh.load_state_dict(seq.state_dict())
    ref = fwd_bwd(seq, x, dy, recipe=recipe)
    assert_all_equal(fwd_bwd(clone, x, dy, recipe=recipe), ref)
    assert_all_equal(fwd_bwd(fresh, x, dy, recipe=recipe), ref)
    # the scales really moved away from the first step's 1.0, so the state mattered
    assert not torch.equal(seq[1]._recipe_states["forward"].delayed.scale, torch.ones(3))


@pytest.mark.parametrize("first", ["quantize_off", "quantize_forward_only"])
@pytest.mark.parametrize("recipe_name", ["mxfp8", "current"])
def test_caller_quantized_input_passed_through_is_never_modified(first, recipe_name):
    """An op before the linear that passes the caller's quantized input through unchanged:
    the linear must not drop the rowwise data of a tensor the run did not make."""
    recipe = {"mxfp8": lowprec.MXFP8BlockScaling(), "current": lowprec.Float8CurrentScaling()}
    q = {"mxfp8": lowprec.MXFP8Quantizer(E4M3),
         "current": lowprec.Float8CurrentScalingQuantizer(E4M3)}[recipe_name]
    qx = q.quantize(randn(64, 64, seed=1))
    before = {n: (None if t is None else t.clone()) for n, t in qx.inner_tensors().items()}
    op = (ops.Quantize(forward=False, backward=False) if first == "quantize_off"
          else ops.Quantize(forward=True, backward=False))
    torch.manual_seed(0)
    seq = ops.Sequential(op, ops.Linear(64, 32))
    with lowprec.autocast(recipe=recipe[recipe_name]):
        y = seq(qx)
    y.sum().backward()
    assert seq[1].weight.grad is not None
    for name, t in qx.inner_tensors().items():
        assert (t is None) == (before[name] is None), name
        if t is not None:
            assert torch.equal(t.view(torch.uint8) if t.element_size() == 1 else t,
                               before[name].view(torch.uint8) if t.element_size() == 1
                               else before[name]), name
    # the same linear on the caller's tensor directly gives the same weight gradient
    ref = ops.Sequential(ops.Linear(64, 32))
    ref.load_state_dict({"0." + k[2:]: v for k, v in seq.state_dict().items()
                         if k.startswith("1.")})
    with lowprec.autocast(recipe=recipe[recipe_name]):
        ref(qx).sum().backward()
    assert torch.equal(ref[0].weight.grad, seq[1].weight.grad)


@pytest.mark.parametrize("recipe_name", [None, "current", "mxfp8"])
def test_linear_op_casts_an_input_of_another_dtype_to_its_weights(recipe_name):
    """As Transformer Engine's fusible ops do: an fp32 input to bf16 weights is cast to bf16
    (the result is the bf16 input's bit for bit), and its gradient comes back in fp32."""
    recipe = RECIPES[recipe_name]() if recipe_name else None
    op = ops.Sequential(ops.Linear(128, 64, bias=True, params_dtype=torch.bfloat16))
    x32 = randn(32, 128, seed=1)
    dy = randn(32, 64, seed=2).to(torch.bfloat16)
    got = fwd_bwd(op, x32, dy, recipe=recipe)
    want = fwd_bwd(op, x32.to(torch.bfloat16), dy, recipe=recipe)
    assert got[0].dtype == torch.bfloat16 and torch.equal(got[0], want[0])
    assert got[1].dtype == torch.float32 and torch.equal(got[1], want[1].float())
    assert_all_equal(got[2:], want[2:])


def test_linear_op_takes_a_quantized_input_of_another_nominal_dtype():
    """A quantized input's nominal dtype is cast to the weights' (lossless: the same codes),
    as TE's fusible ops take it."""
    op = ops.Sequential(ops.Linear(128, 64, params_dtype=torch.bfloat16))
    x = randn(32, 128, seed=3)
    q = lowprec.Float8CurrentScalingQuantizer(E4M3)
    xq = q.quantize(x)  # nominal fp32
    with lowprec.autocast(recipe=RECIPES["current"]()):
        got = op(xq)
        want = op(xq.to(torch.bfloat16))  # the same codes, nominally bf16
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)
