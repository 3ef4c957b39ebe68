"""lowprec.ops under torch.compile (``lowprec.ops.traced``): a Sequential traces into the
graph (no opaque ``lowprec::call``) under every named recipe, fused and unfused, and its
outputs, input gradient and parameter gradients equal eager's bit for bit over two steps
(delayed scaling's second reads the first's scales, and its states match too). Calls the
traced form declines keep the opaque op, with eager's bits."""

from __future__ import annotations

import pytest
import torch
from helpers import GraphOps, cases, pairwise, randn

import lowprec
import lowprec.ops as ops
from lowprec.compile.call import fallback_reasons
from lowprec.recipe import Recipe

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
RECIPES = ["fp8_current", "fp8_delayed", "fp8_block", "mxfp8", "nvfp4", "mxfp8_fwd_nvfp4_bwd"]


def _block(hidden, ffn, device, dtype, fuse=True):
    """Every piece the traced form runs: norm -> linear (quantized hand-over), linear +
    bias + activation (fused dact + dbias), a BasicLinear with a separate Bias, bias +
    activation, linear + activation, linear + bias."""
    torch.manual_seed(0)
    kw = dict(params_dtype=dtype, device=device)
    seq = ops.Sequential(
        ops.RMSNorm(hidden, **kw),
        ops.Linear(hidden, ffn, **kw), ops.GELU(),
        ops.BasicLinear(ffn, 2 * hidden, **kw),
        ops.Bias(2 * hidden, **kw),
        ops.SwiGLU(),
        ops.BasicLinear(hidden, hidden, **kw), ops.SiLU(),
        ops.LayerNorm(hidden, **kw),
        ops.Linear(hidden, hidden, **kw),
        ops.Bias(hidden, **kw), ops.QGELU(),
        fuse=fuse)
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for name, p in seq.named_parameters():
            if "bias" in name or name.startswith(("0.", "8.")):  # biases and norm parameters
                p.add_((0.1 * torch.randn(p.shape, generator=g)).to(device, dtype))
    return seq


def _steps(fn, module, x, dy, recipe, steps=2):
    outs = []
    for step in range(steps):
        module.zero_grad(set_to_none=True)
        xi = x.detach().clone().requires_grad_(True)
        torch.manual_seed(7 + step)  # NVFP4 draws dY's stochastic-rounding keys
        with lowprec.autocast(enabled=recipe is not None, recipe=recipe):
            y = fn(xi)
        y.backward(dy)
        outs += [y.detach(), xi.grad] + [p.grad.clone() for p in module.parameters()]
    return outs


def _states(module):
    """Every delayed-scaling state tensor of the Sequential's linears."""
    out = []
    for m in module.modules():
        held = m.__dict__.get("_recipe_states")
        if held:
            for key in ("forward", "backward"):
                st = getattr(held.get(key), "delayed", None)
                if st is not None:
                    out += [st.scale, st.amax_history, st.amax_current]
    return out


def _assert_same(want, got):
    assert len(want) == len(got)
    for i, (w, g) in enumerate(zip(want, got)):
        assert w.dtype == g.dtype and torch.equal(w, g), i


def _compare(make, x, dy, recipe, backend="graph_ops"):
    a, b = make(), make()
    ops_ = GraphOps()
    compiled = torch.compile(b, backend=ops_ if backend == "graph_ops" else backend,
                             fullgraph=True)
    want = _steps(a, a, x, dy, recipe)
    got = _steps(compiled, b, x, dy, recipe)
    _assert_same(want, got)
    _assert_same(_states(a), _states(b))
    return ops_


def _dims(recipe_name, device):
    # 128x128 weight blocks: cuBLAS's block GEMM contracts over multiples of 512
    return (512, 512, 256) if (recipe_name, device) == ("fp8_block", "cuda") else (64, 128, 64)


def _cases():
    # unfused (each op on its own) under two recipes: its pieces are the fused run's parts;
    # NVFP4 and MXFP8 alone on the CPU run with --slow (mxfp8_fwd_nvfp4_bwd's forward is
    # MXFP8's and its backward NVFP4's, and test_compiled_call traces both formats' ops
    # model under torch.autocast), and so does delayed scaling unfused (its states per op:
    # test_lone_linear_op_traced)
    for device in DEVICES:
        for recipe_name in RECIPES:
            for fuse in (True, False):
                if fuse or recipe_name in ("fp8_current", "fp8_delayed") or device == "cuda":
                    slow = device == "cpu" and (recipe_name in ("nvfp4", "mxfp8") or (
                        recipe_name, fuse) == ("fp8_delayed", False))
                    yield pytest.param(device, recipe_name, fuse,
                                       marks=pytest.mark.slow if slow else ())


@pytest.mark.parametrize("device,recipe_name,fuse", list(_cases()))
def test_sequential_traced_bit_identical(recipe_name, fuse, device):
    hidden, ffn, tokens = _dims(recipe_name, device)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    x = randn(2, tokens // 2, hidden, seed=1).to(device, dtype)
    dy = randn(2, tokens // 2, hidden, seed=2).to(device, dtype)
    recipe = Recipe.from_name(recipe_name)
    got = _compare(lambda: _block(hidden, ffn, device, dtype, fuse), x, dy, recipe)
    # the graphs the steps settle on (delayed scaling's first step on CUDA is opaque while
    # its slots have no scales)
    assert not any(t.startswith("lowprec.call.") for t in got.steady())
    assert any("graph_bias_activation" in t for t in got.targets) == fuse


# (MXFP8 with --slow: inductor's C++ kernels of each new graph take tens of seconds to
# build on 2 cores; MXFP8's Linear runs under inductor in test_traced)
@pytest.mark.parametrize("recipe_name", ["fp8_current",
                                         pytest.param("mxfp8", marks=pytest.mark.slow)])
def test_sequential_inductor_bit_identical(recipe_name):
    x, dy = randn(2, 32, 64, seed=1), randn(2, 32, 64, seed=2)
    _compare(lambda: _block(64, 128, "cpu", torch.float32), x, dy,
             Recipe.from_name(recipe_name), backend="inductor")


@pytest.mark.parametrize("recipe_name", ["fp8_current", "fp8_delayed"])
def test_lone_linear_op_traced(recipe_name):
    """An op called on its own (not in a Sequential) traces as its one piece."""
    def make():
        torch.manual_seed(0)
        return ops.Linear(64, 96)
    x, dy = randn(4, 16, 64, seed=1), randn(4, 16, 96, seed=2)
    got = _compare(make, x, dy, Recipe.from_name(recipe_name))
    assert not any(t.startswith("lowprec.call.") for t in got.targets)


def test_torch_autocast_traced_bit_identical():
    """fp32 ops under torch.autocast(bf16): the linears cast their operands, the norm writes
    bf16, the bias + activation steps keep eager's dtypes."""
    x, dy = randn(2, 32, 64, seed=1), randn(2, 32, 64, seed=2).bfloat16()

    def make():
        return _block(64, 128, "cpu", torch.float32)

    a, b = make(), make()
    ops_ = GraphOps()
    inner = torch.compile(b, backend=ops_, fullgraph=True)

    def under(m):
        def call(t):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return m(t)
        return call

    recipe = Recipe.from_name("fp8_current")
    _assert_same(_steps(under(a), a, x, dy, recipe), _steps(under(inner), b, x, dy, recipe))
    assert not any(t.startswith("lowprec.call.") for t in ops_.targets)


@pytest.mark.parametrize("recipe_name", ["fp8_current", "fp8_delayed"])
def test_grouped_linear_op_between_traced_pieces(recipe_name):
    """A GroupedLinear op in a Sequential, the pieces around it traced: traced itself (one
    Linear a group, its sizes a list) under current scaling, its own opaque call under
    delayed scaling; eager's bits (delayed scaling's states too)."""
    def make():
        torch.manual_seed(0)
        return ops.Sequential(ops.Linear(64, 64), ops.GELU(), ops.GroupedLinear(2, 64, 64),
                              ops.Linear(64, 64))

    x, dy = randn(64, 64, seed=1), randn(64, 64, seed=2)
    recipe = Recipe.from_name(recipe_name)
    a, b = make(), make()
    ops_ = GraphOps()
    compiled = torch.compile(b, backend=ops_, fullgraph=True)
    want = _steps(lambda t: a(t, [32, 32]), a, x, dy, recipe)
    got = _steps(lambda t: compiled(t, [32, 32]), b, x, dy, recipe)
    _assert_same(want, got)
    _assert_same(_states(a), _states(b))
    # one compiled graph: under delayed scaling the grouped op is the one opaque call of
    # its forward
    calls = [t for t in ops_.targets if t.startswith("lowprec.call.")]
    assert calls == (["lowprec.call.default"] if recipe_name == "fp8_delayed" else [])
    assert any("graph_bias_activation" in t for t in ops_.targets)


def _quantize_role_e5m2(role):
    """Current scaling, E5M2 for the Quantize op's roles and E4M3 for the linears' forward:
    a linear reading the op's quantized tensor shows which quantizer made it."""
    from lowprec.formats import Float8CurrentScalingQuantizer
    mine = role is not None and role.module_type == "quantize"
    fwd = role is not None and not role.is_gradient
    return Float8CurrentScalingQuantizer(
        torch.float8_e4m3fn if fwd and not mine else torch.float8_e5m2)


_HAND_OVERS = {
    # a Quantize op between two linears: its input for the next, its dY for the previous
    "between": lambda: [ops.BasicLinear(64, 64), ops.Quantize(forward=True, backward=True),
                        ops.Linear(64, 64), ops.GELU()],
    "first": lambda: [ops.Quantize(forward=True), ops.Linear(64, 64)],
    "after_norm": lambda: [ops.RMSNorm(64), ops.Quantize(forward=True), ops.Linear(64, 64),
                           ops.SiLU(), ops.BasicLinear(64, 64), ops.Quantize(False, True)],
}


_HAND_OVER_PAIRS = pairwise({"recipe_name": ["fp8_current", "own_roles"],
                             "case": list(_HAND_OVERS), "fuse": [True, False]})


@pytest.mark.parametrize("recipe_name, case, fuse", cases(
    {"recipe_name": ["fp8_current", "mxfp8", "own_roles"], "case": list(_HAND_OVERS),
     "fuse": {"fused": True, "unfused": False}},
    # MXFP8 (blocks whose hand-over needs whole blocks) in its fullest case on the CPU;
    # the other two every pair of recipe, case and fusing
    lambda recipe_name, case, fuse: (case, fuse) == ("after_norm", True)
    if recipe_name == "mxfp8" else _HAND_OVER_PAIRS(recipe_name=recipe_name, case=case,
                                                    fuse=fuse)))
def test_quantize_op_handing_a_linear_its_operand_traces(recipe_name, case, fuse):
    """A Quantize op that quantizes a linear's input (forward) or dY (backward): the
    linear next to it reads the op's quantized tensor as eager does (its quantizer, not
    the linear's: ``own_roles`` gives the op E5M2 where the linears' forward is E4M3), no
    opaque call, eager's bits over two steps."""
    def make():
        torch.manual_seed(0)
        return ops.Sequential(*_HAND_OVERS[case](), fuse=fuse)

    x, dy = randn(2, 32, 64, seed=1), randn(2, 32, 64, seed=2)
    recipe = (lowprec.CustomRecipe(qfactory=_quantize_role_e5m2) if recipe_name == "own_roles"
              else Recipe.from_name(recipe_name))
    got = _compare(make, x, dy, recipe)
    assert not any(t.startswith("lowprec.call.") for t in got.targets)
    if recipe_name == "own_roles":  # the op's quantizer decides what its linear reads
        m = make()
        with torch.no_grad():
            outs = []
            for r in (recipe, Recipe.from_name("fp8_current")):  # E4M3 for the op there
                with lowprec.autocast(recipe=r):
                    outs.append(m(x))
        assert not torch.equal(*outs)


_DECLINED = {
    "before_activation": (lambda: [ops.Quantize(forward=True), ops.GELU(),
                                   ops.Linear(64, 64)], "fp8_current", "not a linear's input"),
    "after_bias": (lambda: [ops.Linear(64, 64), ops.Quantize(False, True),
                            ops.Linear(64, 64)], "fp8_current", "not a linear's dY"),
    "delayed": (lambda: [ops.Quantize(forward=True), ops.Linear(64, 64)], "fp8_delayed",
                "delayed scaling"),
    "high_precision": (lambda: [ops.Quantize(forward=True), ops.Linear(64, 64)],
                       "fp8_current_hp", "backward_mode"),
}


@pytest.mark.parametrize("case", list(_DECLINED))
def test_quantize_op_whose_tensor_only_eager_hands_on_keeps_the_opaque_call(case):
    """Where the op's quantized tensor goes elsewhere than a linear's GEMM (an activation,
    a dY the bias gradient also reads), or the op keeps state, or the backward
    mode keeps the high-precision input: the whole run is the opaque op, eager's bits, the
    reason logged."""
    parts, recipe_name, reason = _DECLINED[case]

    def make():
        torch.manual_seed(0)
        return ops.Sequential(*parts())

    x, dy = randn(64, 64, seed=1), randn(64, 64, seed=2)
    recipe = (lowprec.Float8CurrentScaling(backward_mode="high_precision")
              if recipe_name == "fp8_current_hp" else Recipe.from_name(recipe_name))
    a, b = make(), make()
    ops_ = GraphOps()
    compiled = torch.compile(b, backend=ops_, fullgraph=True)
    _assert_same(_steps(a, a, x, dy, recipe), _steps(compiled, b, x, dy, recipe))
    assert any(t.startswith("lowprec.call.") for t in ops_.targets)
    assert any(reason in r for r in fallback_reasons()), fallback_reasons()


@pytest.mark.parametrize("amp", [False, True], ids=["fp32", "torch_autocast"])
@pytest.mark.parametrize("fuse", [True, False], ids=["fused", "unfused"])
def test_outside_autocast_traces_the_high_precision_path(fuse, amp):
    """No recipe: torch's linear for each linear, the ops' graph forms around them (a
    Quantize op the identity); no opaque call, eager's values (the fp32 GEMMs of the same
    operands; bias gradients of torch's linear are the compiler's sums). Under
    torch.autocast (bf16) too, bit for bit there."""
    def make():
        torch.manual_seed(0)
        return ops.Sequential(ops.LayerNorm(64), ops.Linear(64, 128), ops.GELU(),
                              ops.Quantize(forward=True, backward=True),
                              ops.BasicLinear(128, 64), ops.Bias(64), ops.SiLU(), fuse=fuse)

    x, dy = randn(2, 16, 64, seed=1), randn(2, 16, 64, seed=2)
    a, b = make(), make()
    ops_ = GraphOps()
    compiled = torch.compile(b, backend=ops_, fullgraph=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
        want, got = _steps(a, a, x, dy, None), _steps(compiled, b, x, dy, None)
    for i, (w, g) in enumerate(zip(want, got)):
        assert w.dtype == g.dtype, i
        if amp:  # torch's linear casting as eager's high-precision path: the same bits
            assert torch.equal(w, g), i
        else:
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    assert not any(t.startswith("lowprec.call.") for t in ops_.targets)
    assert any("graph_norm" in t for t in ops_.targets)
