"""Quantized parameters (quantized_model_init), their optimizer, eval steps and serialization.

Expectations are computed independently of the code under test wherever the library offers a
shortcut: weights are compared bit for bit against quantizers built here from the SPEC's
per-role rules (not the module's own recipe state), the first optimizer step against a plain
``torch.optim.AdamW`` on a plain tensor, and every copy / reload of a module against the
original module running the same steps beside it.
"""

from __future__ import annotations

import copy
import functools
import io
import pickle

import pytest
import torch
from torch import nn

import lowprec
from lowprec.formats import (
    Float8BlockQuantizer,
    Float8CurrentScalingQuantizer,
    Float8Quantizer,
    IdentityQuantizer,
    MXFP8Quantizer,
    NVFP4Quantizer,
    QuantizedTensor,
)
from lowprec.optim import QuantizedWeightOptimizer
from lowprec.recipe import factories
from lowprec.recipe.recipes import (
    CustomRecipe,
    DelayedScaling,
    Float8BlockScaling,
    Float8CurrentScaling,
    MXFP8BlockScaling,
    NVFP4BlockScaling,
    Recipe,
)

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2

RECIPES = {name: functools.partial(Recipe.from_name, name)
           for name in ("delayed", "current", "block", "mxfp8", "nvfp4")}
MODULE_KINDS = ["linear", "layernorm_mlp", "grouped_linear"]


def dim_for(recipe) -> int:
    """Smallest feature size every block of the recipe divides: 128x128 blocks for
    Float8BlockScaling weights; 32 covers MXFP8 (1x32) and NVFP4 (16x16)."""
    return 128 if isinstance(recipe, Float8BlockScaling) else 32


# ---- helpers -------------------------------------------------------------------------------
def raw(t: torch.Tensor) -> torch.Tensor:
    """Bytes of a tensor (NaN-safe, dtype-exact comparisons)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def assert_bits_equal(a: torch.Tensor, b: torch.Tensor, what: str = "") -> None:
    if isinstance(a, QuantizedTensor) or isinstance(b, QuantizedTensor):
        assert type(a) is type(b), f"{what}: {type(a).__name__} vs {type(b).__name__}"
        assert a.shape == b.shape and a.dtype == b.dtype, what
        assert a.metadata() == b.metadata(), f"{what}: {a.metadata()} vs {b.metadata()}"
        for name, ta in a.inner_tensors().items():
            tb = getattr(b, name)
            assert (ta is None) == (tb is None), f"{what}: {name} held by only one side"
            if isinstance(ta, QuantizedTensor):  # a hybrid's halves
                assert_bits_equal(ta, tb, f"{what}.{name}")
            elif ta is not None:
                assert ta.dtype == tb.dtype and ta.shape == tb.shape, f"{what}: {name}"
                assert torch.equal(raw(ta), raw(tb)), f"{what}: {name} differs"
        return
    assert a.dtype == b.dtype and a.shape == b.shape, what
    assert torch.equal(raw(a), raw(b)), f"{what}: values differ"


def expected_weight_quantizer(recipe, w_hp: torch.Tensor):
    """The weight quantizer the SPEC (section 4) gives each recipe, built here from scratch."""
    if isinstance(recipe, DelayedScaling):
        # quantized_model_init seeds the weight slot from the weight's own amax:
        # scale = fp8_max / amax / 2**margin in fp32 (margin 0), E4M3 for a forward tensor.
        scale = torch.tensor([448.0]) / w_hp.detach().abs().amax().reshape(1).to(torch.float32)
        return Float8Quantizer(scale, torch.zeros(1), E4M3)
    if isinstance(recipe, Float8CurrentScaling):
        return Float8CurrentScalingQuantizer(E4M3)
    if isinstance(recipe, Float8BlockScaling):
        return Float8BlockQuantizer(E4M3, block_scaling_dim=2, force_pow_2_scales=True)
    if isinstance(recipe, MXFP8BlockScaling):
        return MXFP8Quantizer(E4M3)
    if isinstance(recipe, NVFP4BlockScaling):
        return NVFP4Quantizer(with_2d_quantization=True)
    raise AssertionError(recipe)


def build(kind: str, d: int, name: str = "m"):
    if kind == "linear":
        return lowprec.Linear(d, d, name=name)
    if kind == "layernorm_mlp":
        return lowprec.LayerNormMLP(d, 2 * d, name=name)
    return lowprec.GroupedLinear(2, d, d, name=name)


def run(module, x):
    if isinstance(module, lowprec.GroupedLinear):
        return module(x, [x.shape[0] // 2, x.shape[0] - x.shape[0] // 2])
    return module(x)


def weight_names(module) -> list[str]:
    return module._weight_names()


class Stack(nn.Module):
    """Linear -> LayerNormMLP -> GroupedLinear, so every module kind shares one model."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.lin = lowprec.Linear(d, d, name="lin")
        self.mlp = lowprec.LayerNormMLP(d, d, name="mlp")
        self.grp = lowprec.GroupedLinear(2, d, d, name="grp")

    def forward(self, x):
        h = self.mlp(self.lin(x))
        return self.grp(h, [x.shape[0] // 2, x.shape[0] - x.shape[0] // 2])


def make_stack(recipe, d, seed, quantized=True):
    torch.manual_seed(seed)
    with lowprec.quantized_model_init(enabled=quantized, recipe=recipe):
        return Stack(d)


def quantized_weights(model):
    out = {}
    for mname, mod in model.named_modules():
        if isinstance(mod, lowprec.modules.base.LowprecModule):
            for pname in weight_names(mod):
                out[f"{mname}.{pname}"] = getattr(mod, pname)
    return out


def _hp_tensors(obj, numels, path, seen, found, depth=0):
    """Collect every plain floating tensor (>= 16 bit) with a weight's numel reachable from obj."""
    if id(obj) in seen or depth > 8:
        return
    seen.add(id(obj))
    if isinstance(obj, QuantizedTensor):
        for name, t in obj.inner_tensors().items():
            if (t is not None and t.is_floating_point() and t.element_size() >= 2
                    and t.numel() in numels):
                found.append(f"{path}.{name}")
        return
    if isinstance(obj, torch.Tensor):
        if obj.is_floating_point() and obj.element_size() >= 2 and obj.numel() in numels:
            found.append(path)
        return
    if isinstance(obj, dict):
        for k, v in obj.items():
            _hp_tensors(v, numels, f"{path}[{k!r}]", seen, found, depth + 1)
    elif isinstance(obj, (list, tuple, set)):
        for i, v in enumerate(obj):
            _hp_tensors(v, numels, f"{path}[{i}]", seen, found, depth + 1)
    elif type(obj).__module__.startswith("lowprec") and hasattr(obj, "__dict__"):
        # Modules, recipe states, quantizers: anything of ours may hide a cached copy.
        _hp_tensors(vars(obj), numels, path, seen, found, depth + 1)


def assert_no_hp_weight_copy(module) -> None:
    weights = [getattr(module, n) for n in weight_names(module)]
    numels = {w.numel() for w in weights}
    found: list[str] = []
    seen: set[int] = set()
    _hp_tensors(vars(module), numels, "vars", seen, found)
    for k, v in module.state_dict(keep_vars=True).items():
        _hp_tensors(v, numels, f"state_dict[{k!r}]", set(), found)
    for k, v in module.named_parameters():
        _hp_tensors(v, numels, f"param {k}", set(), found)
    for k, v in module.named_buffers():
        _hp_tensors(v, numels, f"buffer {k}", set(), found)
    assert not found, f"high-precision copies of a weight kept on the module: {found}"


# ---- 1. quantized_model_init ----------------------------------------------------------------
@pytest.mark.parametrize("kind", MODULE_KINDS)
@pytest.mark.parametrize("rname", list(RECIPES))
def test_quantized_model_init_weights(rname, kind):
    recipe = RECIPES[rname]()
    d = dim_for(recipe)
    torch.manual_seed(0)
    hp = build(kind, d)  # same seed, same init order: the high-precision weights to expect
    torch.manual_seed(0)
    with lowprec.quantized_model_init(recipe=recipe):
        module = build(kind, d)
    names = weight_names(module)
    assert len(names) == {"linear": 1, "layernorm_mlp": 2, "grouped_linear": 2}[kind]
    params = dict(module.named_parameters())
    for pname in names:
        w = getattr(module, pname)
        assert isinstance(w, QuantizedTensor), f"{pname} is {type(w).__name__}"
        assert isinstance(w, nn.Parameter) and pname in params and params[pname] is w
        assert w.requires_grad
        assert w.has_usage("rowwise") and w.has_usage("columnwise")
        w_hp = getattr(hp, pname)
        assert w.shape == w_hp.shape and w.dtype == w_hp.dtype
        expected_q = expected_weight_quantizer(recipe, w_hp)
        if isinstance(recipe, DelayedScaling):
            # Every weight slot is seeded from its own weight's amax, not the placeholder 1.
            assert_bits_equal(w.shared_scale, expected_q.scale,
                              f"{kind}.{pname} delayed-scaling scale")
        assert_bits_equal(w, expected_q.quantize(w_hp.detach()), f"{rname} {kind}.{pname}")
    # The other parameters are untouched plain tensors equal to the high-precision build.
    for pname, p in hp.named_parameters():
        if pname not in names:
            assert not isinstance(params[pname], QuantizedTensor)
            assert torch.equal(params[pname], p)
    assert_no_hp_weight_copy(module)

    # Still no high-precision copy (and both usages) after a training step's forward+backward.
    x = torch.randn(2 * d, d, requires_grad=True)
    with lowprec.autocast(recipe=recipe):
        y = run(module, x)
    y.square().sum().backward()
    for pname in names:
        w = getattr(module, pname)
        assert w.grad is not None and w.grad.shape == w.shape
        assert w.has_usage("rowwise") and w.has_usage("columnwise")
    assert_no_hp_weight_copy(module)


def test_hp_copy_detector_finds_planted_copies():
    """The check above must be able to fail: plant copies where a module could hide them."""
    assert_no_hp_weight_copy(_fresh_linear())
    plants = [
        lambda m: setattr(m, "_cache", m.weight.dequantize()),
        lambda m: m.register_buffer("w_hp", m.weight.dequantize().t().contiguous()),
        lambda m: setattr(m, "_stash", {"w": [m.weight.dequantize(torch.bfloat16)]}),
        lambda m: setattr(m._recipe_states["forward"].quantizers[1], "last", m.weight.dequantize()),
    ]
    for plant in plants:
        m = _fresh_linear()
        with lowprec.autocast(recipe=Float8CurrentScaling()):
            m(torch.randn(32, 32))
        plant(m)
        with pytest.raises(AssertionError, match="high-precision copies"):
            assert_no_hp_weight_copy(m)


def _fresh_linear():
    with lowprec.quantized_model_init(recipe=Float8CurrentScaling()):
        return lowprec.Linear(32, 32, name="m")


# ---- 2. QuantizedWeightOptimizer -------------------------------------------------------------
def regression_data(d, seed=1, n=None, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    n = n or 2 * d
    x = torch.randn(n, d, generator=g) * scale
    w_true = torch.randn(d, d, generator=g) / d ** 0.5
    return x, x @ w_true.T


def train_step(model, opt, recipe, x, y):
    opt.zero_grad()
    with lowprec.autocast(recipe=recipe):
        out = model(x)
    loss = (out - y).square().mean()
    loss.backward()
    opt.step()
    return loss.detach()


@pytest.mark.parametrize("rname", list(RECIPES))
def test_optimizer_trains_and_requantizes(rname):
    # Stochastic rounding (gradients only) off so the run is a pure function of the seed.
    recipe = (NVFP4BlockScaling(disable_stochastic_rounding=True) if rname == "nvfp4"
              else RECIPES[rname]())
    d = dim_for(recipe)
    model = make_stack(recipe, d, seed=0)
    x, y = regression_data(d)
    lr = 1e-2
    opt = QuantizedWeightOptimizer(model, torch.optim.AdamW, lr=lr)
    weights = quantized_weights(model)
    assert len(opt.master_weights()) == len(weights) == 5
    links = {id(p): (mod, i, master) for mod, i, p, master in opt._links}
    assert set(links) == {id(w) for w in weights.values()}
    for w in weights.values():  # masters start as the exact values of the quantized weights
        assert_bits_equal(links[id(w)][2].detach(), w.dequantize(torch.float32), "initial master")

    # Independent first step: plain AdamW on a plain copy of (dequantized weight, its gradient).
    opt.zero_grad()
    with lowprec.autocast(recipe=recipe):
        loss0 = (model(x) - y).square().mean()
    loss0.backward()
    refs = {}
    for key, w in weights.items():
        ref = w.detach().dequantize(torch.float32).clone().requires_grad_(True)
        ref.grad = w.grad.detach().to(torch.float32).clone()
        refs[key] = ref
    ref_opt = torch.optim.AdamW(list(refs.values()), lr=lr)
    ref_opt.step()
    opt.step()
    losses = [loss0.item()]
    for step in range(20):
        for key, w in weights.items():
            mod, i, master = links[id(w)]
            if step == 0:
                assert_bits_equal(master.detach(), refs[key].detach(), f"{key} master after step 1")
            assert w.has_usage("rowwise") and w.has_usage("columnwise"), key
            assert_bits_equal(w, mod.weight_quantizer(i).quantize(master.detach()),
                              f"{key} step {step}")
            if isinstance(recipe, DelayedScaling):
                # The weight slot's scale follows its own amax history: fp8_max / max(history).
                st = mod._recipe_states["forward"].delayed
                slot = 3 * i + 1
                expect_scale = torch.tensor([448.0]) / st.amax_history[:, slot].amax().reshape(1)
                assert_bits_equal(st.scale[slot:slot + 1], expect_scale, f"{key} delayed scale")
                indep = Float8Quantizer(expect_scale.clone(), torch.zeros(1), E4M3)
            else:
                indep = expected_weight_quantizer(recipe, master)
            assert_bits_equal(w, indep.quantize(master.detach()),
                              f"{key} step {step} (independent)")
        if step < 19:
            losses.append(train_step(model, opt, recipe, x, y).item())
    # The same model and data in high precision (plain weights, plain AdamW) as the yardstick.
    hp = make_stack(None, d, seed=0, quantized=False)
    hp_opt = torch.optim.AdamW(hp.parameters(), lr=lr)
    hp_losses = []
    for _ in range(20):
        hp_opt.zero_grad()
        loss = (hp(x) - y).square().mean()
        loss.backward()
        hp_opt.step()
        hp_losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses)))
    # High precision ends near 0.23x its first loss (measured); every format learns too.
    assert losses[-1] < 0.5 * losses[0], losses
    # Measured final-loss ratios to high precision: 8-bit formats ~1.0-1.05, NVFP4 ~1.25
    # (fp4 weights); 1.5 keeps margin for platform rounding, yet catches a broken update.
    assert losses[-1] < 1.5 * hp_losses[-1], (losses, hp_losses)


# ---- 3. eval steps between training steps --------------------------------------------------
def train_loop(recipe, d, with_eval: bool, steps: int = 4, eval_scale: float = 1.0):
    model = make_stack(recipe, d, seed=0)
    x, y = regression_data(d, seed=1)
    x_eval, _ = regression_data(d, seed=2, scale=eval_scale)
    opt = QuantizedWeightOptimizer(model, torch.optim.AdamW, lr=3e-3)
    torch.manual_seed(123)  # the stochastic-rounding draws of the gradients
    losses, evals = [], []
    for _ in range(steps):
        losses.append(train_step(model, opt, recipe, x, y))
        if with_eval:
            with torch.no_grad(), lowprec.autocast(recipe=recipe):
                evals.append(model(x_eval))
            for key, w in quantized_weights(model).items():
                assert w.has_usage("columnwise"), f"{key} lost its columnwise data in an eval step"
                assert w.has_usage("rowwise"), key
    return model, opt, losses, evals


@pytest.mark.parametrize("rname", list(RECIPES))
def test_eval_steps_do_not_change_training(rname):
    # Default NVFP4 keeps stochastic rounding on: the eval forward must not consume its draws.
    # The eval inputs are 8x larger than the training inputs, so an eval forward that leaked
    # into delayed-scaling amax histories would change the next training step's input scale.
    recipe = RECIPES[rname]()
    d = dim_for(recipe)
    m_a, opt_a, losses_a, evals = train_loop(recipe, d, with_eval=True, eval_scale=8.0)
    m_b, opt_b, losses_b, _ = train_loop(recipe, d, with_eval=False)
    assert len(evals) == 4 and all(torch.isfinite(e).all() for e in evals)
    for la, lb in zip(losses_a, losses_b):
        assert_bits_equal(la, lb, "training loss")
    for (ka, pa), (kb, pb) in zip(m_a.named_parameters(), m_b.named_parameters()):
        assert ka == kb
        assert_bits_equal(pa, pb, ka)
    for ma, mb in zip(opt_a.master_weights(), opt_b.master_weights()):
        assert_bits_equal(ma.detach(), mb.detach(), "master")
    if isinstance(recipe, DelayedScaling):
        for name in ("lin", "mlp", "grp"):
            for mode in ("forward", "backward"):
                sa = getattr(m_a, name)._recipe_states[mode].delayed
                sb = getattr(m_b, name)._recipe_states[mode].delayed
                assert_bits_equal(sa.scale, sb.scale, f"{name} {mode} scale")
                assert_bits_equal(sa.amax_history, sb.amax_history, f"{name} {mode} history")
    # And the last eval output is what a fresh eval forward on the final weights gives.
    with torch.no_grad(), lowprec.autocast(recipe=recipe):
        again = m_b(regression_data(d, seed=2, scale=8.0)[0])
    assert_bits_equal(evals[-1], again, "eval output")


def test_delayed_scaling_eval_forward_leaves_scaling_state_alone():
    """The library's choice (the SPEC is silent; see LowprecModule.gemm_quantizers): a forward
    with grad disabled does not push its amaxes into the delayed-scaling history, so the scales
    after an eval forward are those before it, even for a much larger input."""
    recipe = DelayedScaling()
    d = 32
    torch.manual_seed(0)
    with lowprec.quantized_model_init(recipe=recipe):
        m = lowprec.Linear(d, d, name="m")
    x = torch.randn(d, d)
    with lowprec.autocast(recipe=recipe):
        m(x.requires_grad_(True)).sum().backward()
    st = m._recipe_states["forward"].delayed
    scale, hist = st.scale.clone(), st.amax_history.clone()
    with torch.no_grad(), lowprec.autocast(recipe=recipe):
        m(100.0 * x.detach())
    assert_bits_equal(st.scale, scale, "forward scale")
    assert_bits_equal(st.amax_history, hist, "forward history")
    # A training forward with the same input does record it: the check above is not vacuous.
    with lowprec.autocast(recipe=recipe):
        m(100.0 * x.detach())
    assert st.amax_history[0, 0] == (100.0 * x.detach()).abs().amax()
    assert_bits_equal(st.scale[0:1],
                      torch.tensor([448.0]) / st.amax_history[:, 0].amax().reshape(1),
                      "input scale after a training forward")


# ---- 4. pickle / deepcopy / torch.save of whole modules -------------------------------------
def _pickle(m):
    return pickle.loads(pickle.dumps(m))


def _deepcopy(m):
    return copy.deepcopy(m)


def _torch_save(m):
    buf = io.BytesIO()
    torch.save(m, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


COPIERS = {"pickle": _pickle, "deepcopy": _deepcopy, "torch_save": _torch_save}
SER_RECIPES = {**RECIPES, "custom_nvfp4": lambda: CustomRecipe(qfactory=factories.nvfp4_factory)}


def fwd_bwd(model, recipe, x, seed):
    torch.manual_seed(seed)  # stochastic rounding of NVFP4 gradients
    x = x.clone().requires_grad_(True)
    with lowprec.autocast(recipe=recipe):
        y = model(x)
    y.square().mean().backward()
    return y.detach(), x.grad


# A fresh module with plain weights holds no state at all; the other three cases do.
@pytest.mark.parametrize("when,quantized", [("fresh", True), ("after_fwd_bwd", True),
                                            ("after_fwd_bwd", False)],
                         ids=["fresh-qinit", "after_fwd_bwd-qinit", "after_fwd_bwd-plain"])
@pytest.mark.parametrize("how", list(COPIERS))
@pytest.mark.parametrize("rname", list(SER_RECIPES))
def test_module_copies(rname, how, when, quantized):
    recipe = SER_RECIPES[rname]()
    d = dim_for(recipe)
    init_recipe = recipe if quantized else None
    model = make_stack(init_recipe, d, seed=0, quantized=quantized)
    x = torch.randn(2 * d, d)
    if when == "after_fwd_bwd":
        fwd_bwd(model, recipe, x, seed=5)
    clone = COPIERS[how](model)
    assert clone is not model
    for (k, p), (k2, p2) in zip(model.named_parameters(), clone.named_parameters()):
        assert k == k2 and p2 is not p and type(p2) is type(p)
        assert p2.requires_grad == p.requires_grad
        assert_bits_equal(p, p2, f"{how} {k}")
    # Run both side by side: same outputs and input grads bit for bit, twice (the second step
    # sees the state the first one left behind, e.g. delayed-scaling histories).
    for p in (*model.parameters(), *clone.parameters()):
        p.grad = None  # pickle does not carry .grad; compare the gradients of the steps below
    for step in range(2):
        y_a, gx_a = fwd_bwd(model, recipe, x, seed=10 + step)
        y_b, gx_b = fwd_bwd(clone, recipe, x, seed=10 + step)
        assert_bits_equal(y_a, y_b, f"{how} output, step {step}")
        assert_bits_equal(gx_a, gx_b, f"{how} input grad, step {step}")
    for (k, p), (_, p2) in zip(model.named_parameters(), clone.named_parameters()):
        assert_bits_equal(p.grad, p2.grad, f"{how} grad {k}")
    if isinstance(recipe, DelayedScaling):
        for name in ("lin", "mlp", "grp"):
            for mode in ("forward", "backward"):
                rs = getattr(model, name)._recipe_states[mode]
                rs2 = getattr(clone, name)._recipe_states[mode]
                # The copy's state is its own, equal to the original's after the same steps ...
                assert rs.delayed.scale.data_ptr() != rs2.delayed.scale.data_ptr()
                assert_bits_equal(rs.delayed.amax_history, rs2.delayed.amax_history,
                                  f"{how} {name} {mode} history")
                # ... and its quantizers still quantize with the scales its state computes.
                for i, q in enumerate(rs2.quantizers):
                    assert_bits_equal(q.scale, rs2.delayed.scale[i:i + 1],
                                      f"{how} {name} {mode} quantizer {i} scale vs state")


@pytest.mark.parametrize("how", list(COPIERS))
@pytest.mark.parametrize("rname", ["current", "nvfp4"])
def test_module_copies_keep_quantized_weights_as_parameters(rname, how):
    """A copied module's quantized weights must still be nn.Parameters, as in the original:
    user code checks isinstance(p, nn.Parameter), and load_state_dict(assign=True) refuses to
    assign into a slot whose current value is not one."""
    recipe = RECIPES[rname]()
    model = make_stack(recipe, dim_for(recipe), seed=0)
    for k, w in quantized_weights(model).items():
        assert isinstance(w, nn.Parameter), f"original {k}"
    clone = COPIERS[how](model)
    for k, w in quantized_weights(clone).items():
        assert isinstance(w, QuantizedTensor)
        assert isinstance(w, nn.Parameter), (
            f"{how}: {k} came back as {type(w).__name__}, not a Parameter")
    result = clone.load_state_dict(model.state_dict(), assign=True)
    assert not result.missing_keys and not result.unexpected_keys
    for (k, p), (_, p2) in zip(model.named_parameters(), clone.named_parameters()):
        assert_bits_equal(p, p2, f"{how} assign {k}")


@pytest.mark.parametrize("rname", list(RECIPES))
def test_state_dict_round_trip_weights_only(rname):
    recipe = RECIPES[rname]()
    d = dim_for(recipe)
    model = make_stack(recipe, d, seed=0)
    x = torch.randn(2 * d, d)
    fwd_bwd(model, recipe, x, seed=1)
    fwd_bwd(model, recipe, x, seed=2)  # delayed scaling: a non-trivial amax history
    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)
    buf.seek(0)
    sd = torch.load(buf, weights_only=True)
    fresh = make_stack(recipe, d, seed=99)
    y_model, _ = fwd_bwd(model, recipe, x, seed=3)
    y_fresh, _ = fwd_bwd(fresh, recipe, x, seed=3)
    assert not torch.equal(y_model, y_fresh)  # sanity: the load below has work to do

    # Rebuild both from scratch so the comparison starts from the saved state.
    model = make_stack(recipe, d, seed=0)
    fwd_bwd(model, recipe, x, seed=1)
    fwd_bwd(model, recipe, x, seed=2)
    fresh = make_stack(recipe, d, seed=99)
    result = fresh.load_state_dict(sd)
    assert not result.missing_keys and not result.unexpected_keys
    for (k, p), (_, p2) in zip(model.named_parameters(), fresh.named_parameters()):
        assert type(p2) is type(p) and isinstance(p2, nn.Parameter), k
        assert_bits_equal(p, p2, f"loaded {k}")
    for step in range(2):
        y_a, gx_a = fwd_bwd(model, recipe, x, seed=3 + step)
        y_b, gx_b = fwd_bwd(fresh, recipe, x, seed=3 + step)
        assert_bits_equal(y_a, y_b, f"output after load, step {step}")
        assert_bits_equal(gx_a, gx_b, f"input grad after load, step {step}")


# ---- 5. CustomRecipe pickling ---------------------------------------------------------------
def test_custom_recipe_with_module_level_factory_pickles():
    recipe = CustomRecipe(qfactory=factories.nvfp4_factory)
    back = pickle.loads(pickle.dumps(recipe))
    assert back == recipe and back.qfactory is factories.nvfp4_factory
    mixed = CustomRecipe(qfactory=factories.NVFP4ExceptLayers(fp8_layers=("head",)))
    back = pickle.loads(pickle.dumps(mixed))
    assert isinstance(back.qfactory, factories.NVFP4ExceptLayers)
    assert back.qfactory.fp8_layers == ("head",)


def test_custom_recipe_with_lambda_does_not_pickle():
    # Documented in CustomRecipe's docstring: a closure or lambda does not pickle.
    recipe = CustomRecipe(qfactory=lambda role: factories.nvfp4_factory(role))
    with pytest.raises((pickle.PicklingError, AttributeError, TypeError)):
        pickle.dumps(recipe)


# ---- 6. NVFP4ExceptLayers -------------------------------------------------------------------
def test_nvfp4_except_layers_picks_fp8_for_named_layers():
    d = 32
    recipe = CustomRecipe(qfactory=factories.NVFP4ExceptLayers(fp8_layers=("head",)))
    torch.manual_seed(0)
    body, head = lowprec.Linear(d, d, name="body"), lowprec.Linear(d, d, name="head")
    x = torch.randn(d, d)
    torch.manual_seed(7)
    xb = x.clone().requires_grad_(True)
    with lowprec.autocast(recipe=recipe):
        h = body(xb)
        y = head(h)
    y.square().sum().backward()

    fb, bb = body._recipe_states["forward"].quantizers, body._recipe_states["backward"].quantizers
    assert [type(q) for q in fb] == [NVFP4Quantizer, NVFP4Quantizer, IdentityQuantizer]
    assert fb[0].with_rht and not fb[0].with_2d_quantization and not fb[0].stochastic_rounding
    assert fb[1].with_2d_quantization and not fb[1].with_rht
    assert [type(q) for q in bb] == [NVFP4Quantizer, IdentityQuantizer]
    assert bb[0].with_rht and bb[0].stochastic_rounding

    fh, bh = head._recipe_states["forward"].quantizers, head._recipe_states["backward"].quantizers
    assert [type(q) for q in fh] == [Float8CurrentScalingQuantizer] * 2 + [IdentityQuantizer]
    assert fh[0].fp8_dtype == E4M3 and fh[1].fp8_dtype == E4M3
    assert [type(q) for q in bh] == [Float8CurrentScalingQuantizer, IdentityQuantizer]
    assert bh[0].fp8_dtype == E5M2

    # Numerically: body is the built-in NVFP4 recipe, head the built-in FP8 current scaling.
    body2, head2 = copy.deepcopy(body), copy.deepcopy(head)
    for p in (*body2.parameters(), *head2.parameters()):
        p.grad = None
    torch.manual_seed(7)
    xb2 = x.clone().requires_grad_(True)
    with lowprec.autocast(recipe=NVFP4BlockScaling()):
        h2 = body2(xb2)
    h2d = h2.detach().requires_grad_(True)
    with lowprec.autocast(recipe=Float8CurrentScaling()):
        y2 = head2(h2d)
    assert_bits_equal(h, h2, "body output")
    assert_bits_equal(y, y2, "head output")
    y2.square().sum().backward()
    assert_bits_equal(head.weight.grad, head2.weight.grad, "head wgrad")
    h2.backward(h2d.grad)
    assert_bits_equal(body.weight.grad, body2.weight.grad, "body wgrad")
    assert_bits_equal(xb.grad, xb2.grad, "input grad")


# ---- high-precision values into quantized parameters (load_state_dict, copy_) -------------------
def _mx_factory(role):
    return MXFP8Quantizer(E4M3)


def _hybrid_factory(role):
    from lowprec import HybridQuantizer
    return HybridQuantizer(rowwise_quantizer=Float8CurrentScalingQuantizer(E4M3),
                           columnwise_quantizer=MXFP8Quantizer(E4M3))


HP_RECIPES = dict(RECIPES, custom=lambda: CustomRecipe(qfactory=_mx_factory),
                  hybrid=lambda: CustomRecipe(qfactory=_hybrid_factory))


def _quantized_pair(rname, kind):
    recipe = HP_RECIPES[rname]()
    d = dim_for(recipe)
    mods = []
    for _ in range(2):
        torch.manual_seed(0)
        with lowprec.quantized_model_init(recipe=recipe):
            mods.append(build(kind, d))
    torch.manual_seed(1)
    plain = build(kind, d)
    return mods[0], mods[1], plain


def _expect_requantized(module, ref_module, hp_values):
    """Each quantized weight of ``module`` equals ``ref_module``'s weight quantizer for the same
    values (under delayed scaling, seeded from them before training) applied to them directly
    (every usage the parameter holds)."""
    for i, pname in enumerate(weight_names(module)):
        p = getattr(module, pname)
        assert isinstance(p, QuantizedTensor) and isinstance(p, nn.Parameter), pname
        values = hp_values[pname].to(p.dtype)
        q = ref_module.weight_quantizer(i, p.device, values=values, copied=True)
        with q.usages(rowwise=p.has_usage("rowwise"), columnwise=p.has_usage("columnwise")):
            expected = q.quantize(values)
        assert_bits_equal(p, expected, pname)
    s1, s2 = module.scaling_state(), ref_module.scaling_state()
    assert s1.keys() == s2.keys()
    for mode in s1:
        for k in s1[mode]:
            assert torch.equal(s1[mode][k], s2[mode][k]), (mode, k)


@pytest.mark.parametrize("src_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kind", MODULE_KINDS)
@pytest.mark.parametrize("rname", list(HP_RECIPES))
def test_load_high_precision_state_dict_requantizes(rname, kind, src_dtype):
    m, ref, plain = _quantized_pair(rname, kind)
    sd = {k: (v.to(src_dtype) if v.is_floating_point() else v)
          for k, v in plain.state_dict().items() if not k.endswith("_extra_state")}
    weights = [id(getattr(m, n)) for n in weight_names(m)]
    m.load_state_dict(sd, strict=False)
    assert weights == [id(getattr(m, n)) for n in weight_names(m)]  # in place
    _expect_requantized(m, ref, sd)
    for name, p in m.named_parameters():
        if name not in weight_names(m):
            assert torch.equal(p, sd[name].to(p.dtype)), name


@pytest.mark.parametrize("rname", list(HP_RECIPES))
def test_param_copy_of_high_precision_values_requantizes(rname):
    m, ref, plain = _quantized_pair(rname, "layernorm_mlp")
    hp = {n: getattr(plain, n).detach() * 1.5 for n in weight_names(m)}
    with torch.no_grad():
        for n in weight_names(m):
            getattr(m, n).copy_(hp[n])
    _expect_requantized(m, ref, hp)


@pytest.mark.parametrize("how", ["deepcopy", "pickle", "torch_save", "to"])
def test_copies_requantize_into_their_own_module(how):
    m, _, plain = _quantized_pair("delayed", "linear")
    before = m.weight.dequantize().clone()
    state_before = copy.deepcopy(m.scaling_state())
    c = {"deepcopy": _deepcopy, "pickle": _pickle, "torch_save": _torch_save,
         "to": lambda mod: mod.to(torch.float32)}[how](m)
    with torch.no_grad():
        c.weight.copy_(plain.weight * 3)
    if how != "to":  # .to() on the module keeps it the same module
        assert torch.equal(m.weight.dequantize(), before)
        assert torch.equal(m.scaling_state()["forward"]["amax_current"],
                           state_before["forward"]["amax_current"])
    assert torch.equal(c.scaling_state()["forward"]["amax_current"][1],
                       (plain.weight * 3).abs().max())
    assert not torch.equal(c.weight.dequantize(), before)


def test_copy_into_quantized_tensor_without_a_module():
    # a tensor re-quantizes with the quantizer that made it; one loaded from a file has none
    q = MXFP8Quantizer(E4M3)
    qt, values = q.quantize(torch.randn(32, 32)), torch.randn(32, 32)
    assert torch.equal(qt.copy_(values).dequantize(), q.quantize(values).dequantize())
    buf = io.BytesIO()
    torch.save(qt, buf)
    buf.seek(0)
    with pytest.raises(TypeError, match="update_quantized"):
        torch.load(buf, weights_only=False).copy_(values)
    m, _, _ = _quantized_pair("mxfp8", "linear")
    with pytest.raises(ValueError, match="shapes must match"):
        with torch.no_grad():
            m.weight.copy_(torch.randn(1, 32))
    # the state dict's detached tensors carry no module: pickling one does not pickle the model
    assert not hasattr(m.state_dict()["weight"], "_lowprec_requantize")


@pytest.mark.parametrize("rname", ["delayed", "mxfp8", "nvfp4"])
def test_load_state_dict_assign_quantizes_high_precision_weights(rname):
    m, ref, plain = _quantized_pair(rname, "linear")
    sd = plain.state_dict()
    m.load_state_dict(sd, assign=True)
    assert isinstance(m.weight, QuantizedTensor) and isinstance(m.weight, nn.Parameter)
    assert not isinstance(sd["weight"], QuantizedTensor)  # the caller's dict is left as it was
    _expect_requantized(m, ref, sd)
    with torch.no_grad():  # and the assigned weight is linked like the others
        m.weight.copy_(sd["weight"] * 2)


# ---- module conversions, plain optimizers ------------------------------------------------------
@pytest.mark.parametrize("convert", ["float", "bfloat16", "half", "to_dtype", "cpu", "to_device"])
def test_module_conversions_keep_quantized_weights_and_their_attributes(convert):
    with lowprec.quantized_model_init(recipe=Float8CurrentScaling()):
        m = lowprec.Linear(64, 32, params_dtype=torch.bfloat16)
    m.weight.tp_mark = ("column", 0)
    before = m.weight.dequantize(torch.float32)
    {"float": lambda: m.float(), "bfloat16": lambda: m.bfloat16(), "half": lambda: m.half(),
     "to_dtype": lambda: m.to(torch.float32), "cpu": lambda: m.cpu(),
     "to_device": lambda: m.to("cpu")}[convert]()
    w = m.weight
    assert isinstance(w, QuantizedTensor) and isinstance(w, nn.Parameter)
    assert w.tp_mark == ("column", 0)
    want = {"float": torch.float32, "half": torch.float16, "to_dtype": torch.float32}
    assert w.dtype == want.get(convert, torch.bfloat16)
    assert torch.equal(w.dequantize(torch.float32), before)  # lossless: same codes and scales
    # still linked to its module: a high-precision copy re-quantizes
    hp = torch.randn(32, 64)
    with torch.no_grad():
        w.copy_(hp)
    q = Float8CurrentScalingQuantizer(E4M3)
    assert torch.equal(w.dequantize(torch.float32),
                       q.quantize(hp.to(w.dtype)).dequantize(torch.float32))


def test_plain_optimizer_on_quantized_weights_names_the_wrapper():
    with lowprec.quantized_model_init(recipe=Float8CurrentScaling()):
        m = lowprec.Linear(64, 32, params_dtype=torch.bfloat16)
    with lowprec.autocast(recipe=Float8CurrentScaling()):
        m(torch.randn(4, 64, dtype=torch.bfloat16)).float().sum().backward()
    opt = torch.optim.AdamW(m.parameters())
    with pytest.raises(NotImplementedError, match=r"lowprec\.optim\.QuantizedWeightOptimizer"):
        opt.step()


def test_optim_is_reachable_from_the_package():
    assert lowprec.optim.QuantizedWeightOptimizer is QuantizedWeightOptimizer


@pytest.mark.parametrize("kind", ["linear", "layernorm_mlp", "ops"])
def test_module_pickles_after_running_under_a_lambda_recipe(kind):
    make = {"linear": lambda: lowprec.Linear(64, 64),
            "layernorm_mlp": lambda: lowprec.LayerNormMLP(64, 128),
            "ops": lambda: lowprec.ops.Sequential(lowprec.ops.BasicLinear(64, 64))}[kind]
    torch.manual_seed(0)
    m = make()
    recipe = CustomRecipe(qfactory=lambda role: factories.mxfp8_factory(role))
    x = torch.randn(32, 64)
    with lowprec.autocast(recipe=recipe):
        m(x).sum().backward()
    for back in (pickle.loads(pickle.dumps(m)), copy.deepcopy(m)):
        with lowprec.autocast(recipe=recipe):
            assert torch.equal(back(x), m(x))
