"""Grouped modules under torch.compile: ``GroupedExperts``, torchtitan's experts and
``GroupedLinear`` trace eager's grouped paths (autograd Functions over custom ops, group
sizes never read on the host) into the graph, with no opaque ``lowprec::call``; forward and
gradients equal eager's bit for bit. Calls whose grouped GEMMs would read the sizes on
the host (one Linear a group) keep the opaque op and say why.

On the CPU each grouped path runs its torch forms; the tests open the path there by
declaring its device check true (eager and compiled alike), which is what a Hopper GPU
answers. On a Hopper GPU the same cases run through inductor, unpatched."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import GraphOps

import lowprec
from lowprec.compile.call import fallback_reasons
from lowprec.gemm import grouped_mm
from lowprec.linear import grouped_block_fp8, grouped_current, grouped_nvfp4
from lowprec.recipe import factories
from lowprec.recipe.recipes import (
    CustomRecipe,
    DelayedScaling,
    Float8BlockScaling,
    Float8CurrentScaling,
    MXFP8BlockScaling,
    NVFP4BlockScaling,
)

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

H, I, E, K, T = 256, 128, 4, 2, 96
#: recipe, and the device checks a Hopper GPU answers true for its grouped path
CASES = {
    "bf16": (None, {(grouped_mm, "plain_available"): lambda a, k, n: True}),
    "current": (Float8CurrentScaling(),
                {(grouped_current, "gemm_backend"): lambda *a: "triton"}),
    # a factory may read the roles' names: one quantizer set an expert is traced
    "custom_current": (CustomRecipe(qfactory=factories.fp8_current_scaling_factory),
                       {(grouped_current, "gemm_backend"): lambda *a: "triton"}),
    "mxfp8": (MXFP8BlockScaling(), {(grouped_mm, "plain_available"): lambda a, k, n: True}),
    "mxfp8_2d": (MXFP8BlockScaling(enable_2d_quantization=True),
                 {(grouped_mm, "plain_available"): lambda a, k, n: True}),
    # stochastic rounding: the compiled call draws the keys eager draws
    "nvfp4": (NVFP4BlockScaling(disable_rht=True),
              {(grouped_nvfp4, "runs_on"): lambda *a: True}),
    "block": (Float8BlockScaling(), {(grouped_block_fp8, "runs_on"): lambda *a: True}),
}
HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)


def _routing(device, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    w = torch.rand(T, K, generator=g).to(torch.bfloat16)
    return x.to(device), idx.to(device), w.to(device)


def _experts(device):
    torch.manual_seed(0)
    return lowprec.GroupedExperts(E, H, I, params_dtype=torch.bfloat16, name="experts",
                                  device=device)


def _step(call, mod, x, recipe):
    """(output, dX, the experts' gradients) of ``call(mod, x)`` under ``recipe``."""
    x = x.clone().requires_grad_(True)
    if recipe is None:
        y = call(mod, x)
    else:
        with lowprec.autocast(recipe=recipe):
            y = call(mod, x)
    y.float().square().sum().backward()
    grads = [p.grad.clone() for p in mod.parameters()]
    mod.zero_grad(set_to_none=True)
    return [y.detach(), x.grad, *grads]


def _compare(mod, x, recipe, call, backend):
    """Eager (``mod``) against compiled (fullgraph, a copy of ``mod``) bits over two steps,
    each seeded alike (stochastic rounding); the compiled graphs' ops."""
    ops = GraphOps()
    twin = copy.deepcopy(mod)
    compiled = torch.compile(call, backend=ops if backend == "graph_ops" else backend,
                             fullgraph=True)
    for step in range(2):
        torch.manual_seed(step)
        want = _step(call, mod, x, recipe)
        torch.manual_seed(step)
        got = _step(compiled, twin, x, recipe)
        for i, (a, b) in enumerate(zip(want, got)):
            assert torch.equal(a, b), (step, i)
        with torch.no_grad():  # the second step on other weights
            for p in (*mod.parameters(), *twin.parameters()):
                p.mul_(-1.5)
    return ops


def _patch(monkeypatch, checks):
    for (module, name), fn in checks.items():
        monkeypatch.setattr(module, name, fn)


def _patched_experts(case, monkeypatch):
    """The CPU experts compared compiled against eager under ``case``'s recipe, its
    grouped path opened; the graphs' ops."""
    recipe, checks = case
    _patch(monkeypatch, checks)
    mod = _experts("cpu")
    x, idx, w = _routing("cpu")
    return _compare(mod, x, recipe, lambda m, t: m(t, idx, w), "graph_ops")


@pytest.mark.parametrize("name", list(CASES))
def test_experts_trace_every_grouped_path(name, monkeypatch):
    ops = _patched_experts(CASES[name], monkeypatch)
    assert ops.targets and not any("lowprec.call" in t for t in ops.targets)


@pytest.mark.parametrize("recipe", [Float8CurrentScaling(), DelayedScaling(),
                                    NVFP4BlockScaling()], ids=["current", "delayed", "nvfp4"])
def test_experts_without_a_grouped_path_keep_the_opaque_op(recipe):
    """On the CPU (no grouped GEMM), under delayed scaling and NVFP4's transform (one
    Linear an expert on every device), the call stays one op and says why."""
    mod = _experts("cpu")
    x, idx, w = _routing("cpu")
    ops = _compare(mod, x, recipe, lambda m, t: m(t, idx, w), "graph_ops")
    assert any("lowprec.call" in t for t in ops.targets)
    assert any(r.startswith("GroupedExperts: ") for r in fallback_reasons())


def _titan_experts(device, dtype=torch.bfloat16):
    from lowprec.modules.experts import TorchtitanGroupedExperts

    torch.manual_seed(0)
    src = torch.nn.Module()
    for n, shape in (("w1", (E, I, H)), ("w2", (E, H, I)), ("w3", (E, I, H))):
        setattr(src, n, torch.nn.Parameter(
            torch.randn(shape, dtype=dtype, device=device) * 0.05))
    mod = TorchtitanGroupedExperts.from_experts(src, "experts")
    x = torch.randn(T, H, dtype=dtype, device=device)
    return mod, x, torch.tensor([30, 0, 50, 16], device=device)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_torchtitan_experts_trace(dtype, monkeypatch):
    """torchtitan's experts (fp32 parameters read in bf16, as its grouped-mm path)."""
    _patch(monkeypatch, CASES["current"][1])
    mod, x, sizes = _titan_experts("cpu", dtype)
    ops = _compare(mod, x, Float8CurrentScaling(), lambda m, t: m(t, sizes), "graph_ops")
    assert ops.targets and not any("lowprec.call" in t for t in ops.targets)


@pytest.mark.parametrize("sizes", [torch.tensor([30, 0, 50, 16]), [30, 0, 50, 16]],
                         ids=["tensor", "list"])
def test_grouped_linear_grouped_path_traces(sizes, monkeypatch):
    _patch(monkeypatch, CASES["current"][1])
    torch.manual_seed(0)
    mod = lowprec.GroupedLinear(E, H, I, bias=False, params_dtype=torch.bfloat16, name="g")
    x = torch.randn(T, H, dtype=torch.bfloat16)
    ops = _compare(mod, x, Float8CurrentScaling(), lambda m, t: m(t, sizes), "graph_ops")
    assert ops.targets and not any("lowprec.call" in t for t in ops.targets)


PER_GROUP = ["fp8_current", "fp8_block", "mxfp8", "nvfp4", "mxfp8_fwd_nvfp4_bwd",
             "fp8_row_mxfp8_col"]


# CI runs three recipes, one of them without biases; --slow every recipe both ways
_CI = {("fp8_current", True), ("mxfp8", False), ("fp8_row_mxfp8_col", True)}
PER_GROUP_CASES = [pytest.param(name, bias, marks=() if (name, bias) in _CI
                                else pytest.mark.slow)
                   for name in PER_GROUP for bias in (True, False)]


@pytest.mark.parametrize("name, bias", PER_GROUP_CASES)
def test_grouped_linear_per_group_traces(name, bias):
    """One Linear a group (biases, or no grouped path on this device), the sizes a list:
    each group a traced Linear, an empty group torch's linear; eager's bits."""
    recipe = lowprec.Recipe.from_name(name)
    if name == "nvfp4":  # stochastic rounding of dY only: the forward operands trace
        recipe = NVFP4BlockScaling()
    torch.manual_seed(0)
    mod = lowprec.GroupedLinear(E, H, I, bias=bias, params_dtype=torch.bfloat16, name="g")
    x = torch.randn(T, H, dtype=torch.bfloat16)
    ops = _compare(mod, x, recipe, lambda m, t: m(t, [32, 0, 48, 16]), "graph_ops")
    assert ops.targets and not any("lowprec.call" in t for t in ops.targets)


def test_grouped_linear_per_group_refusals():
    """Sizes in a tensor where each group runs its own Linear, and delayed scaling, keep
    the opaque op and say why; bad list sizes fail as eager's do."""
    torch.manual_seed(0)
    mod = lowprec.GroupedLinear(E, H, I, params_dtype=torch.bfloat16, name="g")
    x = torch.randn(T, H, dtype=torch.bfloat16)
    sizes = torch.tensor([30, 0, 50, 16])
    ops = _compare(mod, x, Float8CurrentScaling(), lambda m, t: m(t, sizes), "graph_ops")
    assert any("lowprec.call" in t for t in ops.targets)
    assert ("GroupedLinear: group sizes in a tensor: one Linear a group reads them on the host"
            in fallback_reasons())
    ops = _compare(mod, x, DelayedScaling(), lambda m, t: m(t, [30, 0, 50, 16]), "graph_ops")
    assert any("lowprec.call" in t for t in ops.targets)
    compiled = torch.compile(lambda m, t: m(t, [30, 0, 50, 17]), backend="aot_eager",
                             fullgraph=True)
    with pytest.raises(Exception, match="m_splits sum to 97 but the input has 96 rows"):
        with lowprec.autocast(recipe=Float8CurrentScaling()):
            compiled(mod, x)


@pytest.mark.skipif(not HOPPER, reason="the grouped GEMMs run on Hopper GPUs")
@pytest.mark.parametrize("name", list(CASES))
def test_gpu_experts_inductor_bit_identical(name):
    recipe, _ = CASES[name]
    mod = _experts("cuda")
    x, idx, w = _routing("cuda")
    _compare(mod, x, recipe, lambda m, t: m(t, idx, w), "inductor")
    ops = _compare(mod, x, recipe, lambda m, t: m(t, idx, w), "graph_ops")
    assert ops.targets and not any("lowprec.call" in t for t in ops.targets)


@pytest.mark.skipif(not HOPPER, reason="the grouped GEMMs run on Hopper GPUs")
@pytest.mark.parametrize("name", list(CASES))
def test_gpu_torchtitan_experts_inductor_bit_identical(name):
    """torchtitan's experts, ``silu(w1 x) * w3 x`` in eager's bits under inductor too."""
    mod, x, sizes = _titan_experts("cuda")
    _compare(mod, x, CASES[name][0], lambda m, t: m(t, sizes), "inductor")


def test_builtin_recipe_traces_one_quantizer_set(monkeypatch):
    """Under a built-in recipe the trace builds one quantizer set for all 2E GEMMs (its
    rule never reads a role's name): tracing time does not grow with the experts."""
    from lowprec.modules import quantizers

    built = []

    def counting(recipe, mode, roles):
        built.extend(roles)
        return stateless(recipe, mode, roles)
    stateless = quantizers.stateless_quantizers
    monkeypatch.setattr(quantizers, "stateless_quantizers", counting)
    _patch(monkeypatch, CASES["current"][1])
    mod = _experts("cpu")
    x, idx, w = _routing("cpu")
    _compare(mod, x, Float8CurrentScaling(), lambda m, t: m(t, idx, w), "graph_ops")
    # input, weight and dY of the first GEMM (dynamo may trace the frame more than once)
    assert built and {r.name for r in built} == {"experts.0.gate_up"}


def test_converted_experts_keep_their_roles():
    """``from_experts`` builds the roles as a constructor does: a compiled call never
    builds every expert's roles while dynamo traces it."""
    from lowprec.modules.experts import TorchtitanGroupedExperts

    src = torch.nn.Module()
    src.gate_up_proj = torch.nn.Parameter(torch.zeros(E, 2 * I, H))
    src.down_proj = torch.nn.Parameter(torch.zeros(E, H, I))
    src.act_fn = torch.nn.SiLU()
    assert "_role_lists" in lowprec.GroupedExperts.from_experts(src, "e").__dict__
    titan, _, _ = _titan_experts("cpu")
    assert "_role_lists" in titan.__dict__ and isinstance(titan, TorchtitanGroupedExperts)


def test_experts_with_a_gating_of_their_own_stay_opaque(monkeypatch):
    _patch(monkeypatch, CASES["current"][1])
    mod = _experts("cpu")
    mod.act_fn = torch.nn.functional.gelu
    x, idx, w = _routing("cpu")
    ops = _compare(mod, x, Float8CurrentScaling(), lambda m, t: m(t, idx, w), "graph_ops")
    assert any("lowprec.call" in t for t in ops.targets)
    assert any("gating of the model's own" in r for r in fallback_reasons())


def test_grouped_linear_without_a_recipe():
    """No recipe, one Linear a group: torch's linear, eager's values to fp32 rounding (the
    contract of a Linear without a recipe); quantized weights keep eager's call."""
    torch.manual_seed(0)
    mod = lowprec.GroupedLinear(E, H, I, name="g")
    x = torch.randn(T, H)
    sizes = [30, 0, 50, 16]
    ops = GraphOps()
    want = _step(lambda m, t: m(t, sizes), mod, x, None)
    got = _step(torch.compile(lambda m, t: m(t, sizes), backend=ops, fullgraph=True), mod,
                x, None)
    for a, b in zip(want, got):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert ops.targets and not any("lowprec.call" in t for t in ops.targets)
    with lowprec.quantized_model_init(recipe=Float8CurrentScaling()):
        quantized = lowprec.GroupedLinear(E, H, I, name="g")
    want = quantized(x, sizes)
    got = torch.compile(lambda m, t: m(t, sizes), backend="aot_eager")(quantized, x)
    assert torch.equal(want, got)
    assert any(r.startswith("GroupedLinear: no recipe, and an input or weight")
               for r in fallback_reasons())


@pytest.mark.parametrize("name", ["bf16", "current"])
def test_experts_trace_under_torch_autocast(name, monkeypatch):
    """fp32 experts and rows under torch.autocast (Hugging Face Trainer's bf16=True): the
    grouped paths run on the operands cast to bf16, in eager and in the graph alike."""
    recipe, checks = CASES[name]
    _patch(monkeypatch, checks)
    torch.manual_seed(0)
    mod = lowprec.GroupedExperts(E, H, I, name="experts")
    x, idx, w = _routing("cpu")

    def call(m, t):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return m(t, idx, w)
    ops = _compare(mod, x.float(), recipe, call, "graph_ops")
    assert ops.targets and not any("lowprec.call" in t for t in ops.targets)
