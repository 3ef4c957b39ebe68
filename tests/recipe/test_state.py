"""Roles, recipe state (built-in per-role choices, CustomRecipe factories), delayed-scaling
history math and checkpoint resume (``test_delayed_scaling.py``).

Expectations are written out from SPEC sections 2 and 4: role lists literally, per-role
quantizer settings literally, the delayed-scaling recurrence by an independent python-float
model, and bit-identity claims against a second independent run.
"""

from __future__ import annotations

import collections
import copy
import dataclasses

import pytest
import torch

import lowprec
from lowprec import (
    Float8BlockQuantizer,
    Float8CurrentScalingQuantizer,
    Float8Quantizer,
    IdentityQuantizer,
    MXFP8Quantizer,
    NVFP4Quantizer,
    QuantizerRole,
    autocast,
)
from lowprec.recipe import state_batch
from lowprec.recipe.factories import (
    fp8_block_scaling_factory,
    fp8_current_scaling_factory,
    mxfp8_factory,
    nvfp4_factory,
)
from lowprec.recipe.recipes import (
    CustomRecipe,
    DelayedScaling,
    Float8BlockScaling,
    Float8CurrentScaling,
    Format,
    MXFP8BlockScaling,
    NVFP4BlockScaling,
)
from lowprec.recipe.state import DelayedScalingState, RecipeState

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    monkeypatch.delenv("LOWPREC_BACKWARD_MODE", raising=False)


def R(module_type, tensor_type, name):
    return QuantizerRole(module_type, tensor_type, name)


# =============================================================================================
# (a) roles each module emits
# =============================================================================================
def _modules(**kw):
    return {
        "Linear": lowprec.Linear(32, 32, name="proj", **kw),
        "LayerNormLinear": lowprec.LayerNormLinear(32, 32, name="proj", **kw),
    }


@pytest.mark.parametrize("kind", ["Linear", "LayerNormLinear"])
def test_linear_roles(kind):
    m = _modules()[kind]
    assert m.get_quantizer_roles(fwd=True, num_quantizers=3) == [
        R("linear", "input", "proj"), R("linear", "weight", "proj"), None]
    assert m.get_quantizer_roles(fwd=False, num_quantizers=2) == [
        R("linear", "grad_output", "proj"), None]


@pytest.mark.parametrize("kind", ["Linear", "LayerNormLinear"])
def test_linear_boundary_roles(kind):
    out_role, gin_role = R("attn", "input", "next"), R("attn", "grad_output", "prev")
    m = _modules(output_quantizer_role=out_role, grad_input_quantizer_role=gin_role)[kind]
    assert m.get_quantizer_roles(fwd=True, num_quantizers=3) == [
        R("linear", "input", "proj"), R("linear", "weight", "proj"), out_role]
    assert m.get_quantizer_roles(fwd=False, num_quantizers=2) == [
        R("linear", "grad_output", "proj"), gin_role]


def test_unnamed_module_has_empty_name():
    m = lowprec.Linear(16, 16)
    assert m.get_quantizer_roles(fwd=True) == [R("linear", "input", ""), R("linear", "weight", ""),
                                               None]


@pytest.mark.parametrize("num_gemms", [1, 3])
def test_grouped_linear_roles(num_gemms):
    m = lowprec.GroupedLinear(num_gemms, 32, 32, name="experts")
    fwd = m.get_quantizer_roles(fwd=True, num_quantizers=3 * num_gemms)
    bwd = m.get_quantizer_roles(fwd=False, num_quantizers=2 * num_gemms)
    assert fwd == [R("grouped_linear", "input", "experts"),
                   R("grouped_linear", "weight", "experts"), None] * num_gemms
    assert bwd == [R("grouped_linear", "grad_output", "experts"), None] * num_gemms


def test_grouped_linear_boundary_roles():
    # Every group's output and grad-input leave the module, so every group gets the boundary role.
    out_role, gin_role = R("x", "input", "next"), R("x", "grad_output", "prev")
    m = lowprec.GroupedLinear(2, 32, 32, name="experts", output_quantizer_role=out_role,
                              grad_input_quantizer_role=gin_role)
    assert m.get_quantizer_roles(fwd=True) == [
        R("grouped_linear", "input", "experts"), R("grouped_linear", "weight", "experts"),
        out_role] * 2
    assert m.get_quantizer_roles(fwd=False) == [
        R("grouped_linear", "grad_output", "experts"), gin_role] * 2


def test_layernorm_mlp_roles():
    m = lowprec.LayerNormMLP(32, 64, name="mlp")
    assert m.get_quantizer_roles(fwd=True, num_quantizers=6) == [
        R("linear", "input", "mlp.fc1"), R("linear", "weight", "mlp.fc1"), None,
        R("linear", "input", "mlp.fc2"), R("linear", "weight", "mlp.fc2"), None]
    assert m.get_quantizer_roles(fwd=False, num_quantizers=4) == [
        R("linear", "grad_output", "mlp.fc1"), None, R("linear", "grad_output", "mlp.fc2"), None]


def test_layernorm_mlp_boundary_roles():
    # Only fc2's output and fc1's grad-input cross the module boundary; the inner ones stay None.
    out_role, gin_role = R("x", "input", "next"), R("x", "grad_output", "prev")
    m = lowprec.LayerNormMLP(32, 64, name="mlp", output_quantizer_role=out_role,
                             grad_input_quantizer_role=gin_role)
    fwd = m.get_quantizer_roles(fwd=True)
    bwd = m.get_quantizer_roles(fwd=False)
    assert fwd[2] is None and fwd[5] == out_role
    assert bwd[1] == gin_role and bwd[3] is None
    assert (fwd[3] == R("linear", "input", "mlp.fc2")
            and bwd[2] == R("linear", "grad_output", "mlp.fc2"))


@pytest.mark.parametrize("make,fwd_n,bwd_n", [
    (lambda: lowprec.Linear(16, 16), 3, 2),
    (lambda: lowprec.LayerNormLinear(16, 16), 3, 2),
    (lambda: lowprec.LayerNormMLP(16, 32), 6, 4),
    (lambda: lowprec.GroupedLinear(4, 16, 16), 12, 8),
])
def test_wrong_num_quantizers_raises(make, fwd_n, bwd_n):
    m = make()
    assert len(m.get_quantizer_roles(fwd=True, num_quantizers=fwd_n)) == fwd_n
    assert len(m.get_quantizer_roles(fwd=False, num_quantizers=bwd_n)) == bwd_n
    for bad in (fwd_n - 1, fwd_n + 1, bwd_n):
        with pytest.raises(ValueError):
            m.get_quantizer_roles(fwd=True, num_quantizers=bad)
    for bad in (bwd_n - 1, bwd_n + 1, fwd_n):
        with pytest.raises(ValueError):
            m.get_quantizer_roles(fwd=False, num_quantizers=bad)


def test_quantizer_role_is_frozen_and_hashable():
    r = R("linear", "input", "a")
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.name = "b"
    assert {r: 1}[R("linear", "input", "a")] == 1
    assert QuantizerRole() == R("", "", "")
    assert r.is_forward and not r.is_gradient
    assert R("linear", "grad_output", "a").is_gradient


# =============================================================================================
# (b) built-in per-role choices
# =============================================================================================
OUT_ROLE, GIN_ROLE = R("linear", "input", "next"), R("linear", "grad_output", "prev")
LIN = lowprec.Linear(32, 32, name="p")
LIN_B = lowprec.Linear(32, 32, name="p", output_quantizer_role=OUT_ROLE,
                       grad_input_quantizer_role=GIN_ROLE)


def states(recipe, module=LIN):
    f = RecipeState.create(recipe, "forward", module.get_quantizer_roles(fwd=True))
    b = RecipeState.create(recipe, "backward", module.get_quantizer_roles(fwd=False))
    return f.quantizers, b.quantizers


def nvfp4_flags(q):
    assert type(q) is NVFP4Quantizer
    return (q.with_rht, q.with_2d_quantization, q.stochastic_rounding)


def test_nvfp4_builtin_roles():
    (qi, qw, qo), (qg, qgi) = states(NVFP4BlockScaling())
    # (with_rht, with_2d_quantization, stochastic_rounding)
    assert nvfp4_flags(qi) == (True, False, False)
    assert nvfp4_flags(qw) == (False, True, False)
    assert nvfp4_flags(qg) == (True, False, True)
    assert qi.generator is None and qg.generator is None  # default generator: manual_seed repeats


@pytest.mark.parametrize("kw,inp,wgt,grad", [
    (dict(disable_rht=True), (False, False, False), (False, True, False), (False, False, True)),
    (dict(disable_stochastic_rounding=True), (True, False, False), (False, True, False),
     (True, False, False)),
    (dict(disable_2d_quantization=True), (True, False, False), (False, False, False),
     (True, False, True)),
])
def test_nvfp4_builtin_switches(kw, inp, wgt, grad):
    (qi, qw, _), (qg, _) = states(NVFP4BlockScaling(**kw))
    assert nvfp4_flags(qi) == inp and nvfp4_flags(qw) == wgt and nvfp4_flags(qg) == grad


@pytest.mark.parametrize("fmt,fwd,bwd", [(Format.HYBRID, E4M3, E5M2), (Format.E4M3, E4M3, E4M3),
                                         (Format.E5M2, E5M2, E5M2)])
@pytest.mark.parametrize("pow2", [False, True])
def test_current_scaling_builtin_roles(fmt, fwd, bwd, pow2):
    (qi, qw, qo), (qg, qgi) = states(Float8CurrentScaling(fp8_format=fmt, use_power_2_scales=pow2),
                                     LIN_B)
    for q, dt in ((qi, fwd), (qw, fwd), (qo, fwd), (qg, bwd), (qgi, bwd)):
        assert type(q) is Float8CurrentScalingQuantizer
        assert q.fp8_dtype == dt
        assert q.force_pow_2_scales is pow2


def test_current_scaling_unset_boundary_slots_follow_direction():
    # An unset boundary slot (None role) in the backward state is a gradient slot.
    (_, _, qo), (_, qgi) = states(Float8CurrentScaling())
    assert qo.fp8_dtype == E4M3 and qgi.fp8_dtype == E5M2


def test_block_scaling_builtin_roles():
    (qi, qw, qo), (qg, qgi) = states(Float8BlockScaling(), LIN_B)
    expect = {id(qi): 1, id(qw): 2, id(qo): 1, id(qg): 1, id(qgi): 1}
    for q in (qi, qw, qo, qg, qgi):
        assert type(q) is Float8BlockQuantizer
        assert q.block_scaling_dim == expect[id(q)]
        assert q.fp8_dtype == E4M3
        assert q.force_pow_2_scales is True


def test_block_scaling_builtin_custom_dims_and_hybrid():
    r = Float8BlockScaling(fp8_format=Format.HYBRID, x_block_scaling_dim=2, w_block_scaling_dim=1,
                           grad_block_scaling_dim=2)
    (qi, qw, _), (qg, _) = states(r)
    assert (qi.block_scaling_dim, qw.block_scaling_dim, qg.block_scaling_dim) == (2, 1, 2)
    assert (qi.fp8_dtype, qw.fp8_dtype, qg.fp8_dtype) == (E4M3, E4M3, E5M2)


@pytest.mark.parametrize("two_d", [False, True])
def test_mxfp8_builtin_roles(two_d):
    (qi, qw, qo), (qg, qgi) = states(MXFP8BlockScaling(enable_2d_quantization=two_d), LIN_B)
    for q in (qi, qw, qo, qg, qgi):
        assert type(q) is MXFP8Quantizer and q.fp8_dtype == E4M3  # E4M3 for every role
    assert qw.with_2d_quantization is two_d
    assert not any(q.with_2d_quantization for q in (qi, qo, qg, qgi))


def test_delayed_builtin_roles_share_state():
    f = RecipeState.create(DelayedScaling(), "forward", LIN.get_quantizer_roles(fwd=True))
    b = RecipeState.create(DelayedScaling(), "backward", LIN.get_quantizer_roles(fwd=False))
    assert [type(q) for q in f.quantizers + b.quantizers] == [Float8Quantizer] * 5
    assert [q.fp8_dtype for q in f.quantizers] == [E4M3] * 3
    assert [q.fp8_dtype for q in b.quantizers] == [E5M2] * 2
    # Each quantizer's scale is a view of its slot in the state: an update is seen by the quantizer.
    f.delayed.scale.copy_(torch.tensor([2.0, 3.0, 4.0]))
    assert [float(q.scale) for q in f.quantizers] == [2.0, 3.0, 4.0]


@pytest.mark.parametrize("recipe", [Float8CurrentScaling(), Float8BlockScaling(),
                                    MXFP8BlockScaling(), NVFP4BlockScaling(),
                                    CustomRecipe(mxfp8_factory)])
def test_one_object_per_slot_with_both_usages(recipe):
    qf, qb = states(recipe, LIN_B)
    qs = qf + qb
    assert len({id(q) for q in qs}) == len(qs)
    assert all(q.rowwise_usage and q.columnwise_usage for q in qs)


def test_create_rejects_bad_mode_and_recipe():
    roles = LIN.get_quantizer_roles(fwd=True)
    with pytest.raises(ValueError):
        RecipeState.create(MXFP8BlockScaling(), "fwd", roles)
    with pytest.raises(TypeError):
        RecipeState.create("mxfp8", "forward", roles)


# =============================================================================================
# (c) CustomRecipe factory protocol
# =============================================================================================
class Recorder:
    """A factory that records every role it is asked for."""

    def __init__(self, inner=mxfp8_factory):
        self.calls, self.inner = [], inner

    def __call__(self, role):
        self.calls.append(role)
        return self.inner(role)


@pytest.mark.parametrize("mode,fwd", [("forward", True), ("backward", False)])
def test_factory_called_once_per_slot(mode, fwd):
    rec = Recorder()
    roles = LIN_B.get_quantizer_roles(fwd=fwd) + LIN.get_quantizer_roles(fwd=fwd)  # incl. None
    st = RecipeState.create(CustomRecipe(rec), mode, roles)
    assert rec.calls == roles
    assert len(st.quantizers) == len(roles)


@pytest.mark.parametrize("make,x,args", [
    (lambda: lowprec.Linear(32, 32, name="l"), (32, 32), ()),
    (lambda: lowprec.LayerNormMLP(32, 64, name="mlp"), (2, 16, 32), ()),
    (lambda: lowprec.GroupedLinear(2, 32, 32, name="g"), (64, 32), ([32, 32],)),
])
def test_factory_called_once_per_module_slot(make, x, args):
    torch.manual_seed(0)
    m = make()
    rec = Recorder()
    recipe = CustomRecipe(rec)
    expected = m.get_quantizer_roles(fwd=True) + m.get_quantizer_roles(fwd=False)
    for _ in range(2):  # the second step reuses the state: no new calls
        xx = torch.randn(x, requires_grad=True)
        with autocast(recipe=recipe):
            y = m(xx, *args)
        y.sum().backward()
    assert collections.Counter(rec.calls) == collections.Counter(expected)
    assert None in rec.calls  # unset boundary slots are asked for too


def _none_for(target):
    def factory(role):
        return None if role == target else mxfp8_factory(role)
    return factory


def test_factory_returning_none_names_role():
    target = R("linear", "weight", "special_layer")
    roles = [R("linear", "input", "special_layer"), target, None]
    with pytest.raises(ValueError) as err:
        RecipeState.create(CustomRecipe(_none_for(target)), "forward", roles)
    msg = str(err.value)
    assert "weight" in msg and "special_layer" in msg and "IdentityQuantizer" in msg


def test_factory_returning_none_for_unset_boundary_raises():
    roles = [R("linear", "grad_output", "l"), None]
    with pytest.raises(ValueError):
        RecipeState.create(CustomRecipe(_none_for(None)), "backward", roles)


def test_factory_returning_none_raises_in_module():
    m = lowprec.Linear(32, 32, name="special_layer")
    recipe = CustomRecipe(_none_for(R("linear", "grad_output", "special_layer")))
    with pytest.raises(ValueError) as err:
        with autocast(recipe=recipe):
            m(torch.randn(4, 32))
    assert "grad_output" in str(err.value) and "special_layer" in str(err.value)


@pytest.mark.parametrize("bad", ["fp8", torch.float8_e4m3fn, MXFP8Quantizer])
def test_factory_returning_non_quantizer_names_role(bad):
    target = R("linear", "input", "odd_layer")

    def factory(role):
        return bad if role == target else mxfp8_factory(role)

    with pytest.raises(TypeError) as err:
        RecipeState.create(CustomRecipe(factory), "forward",
                           [target, R("linear", "weight", "x"), None])
    assert "input" in str(err.value) and "odd_layer" in str(err.value)


# =============================================================================================
# (d) mirror factories are bit-identical to the built-in recipes
# =============================================================================================
MIRRORS = {
    "current": (Float8CurrentScaling, fp8_current_scaling_factory),
    "block": (Float8BlockScaling, fp8_block_scaling_factory),
    "mxfp8": (MXFP8BlockScaling, mxfp8_factory),
    "nvfp4": (NVFP4BlockScaling, nvfp4_factory),
}

# Shapes: every blocked dim (M per GEMM, K, N) is a multiple of 128, so all formats fit.
H = 128


def _spread(t: torch.Tensor) -> torch.Tensor:
    """Scale rows and columns by powers of two in [2^-8, 2^8]: magnitudes then differ between
    blocks, so the block shape (1x128 vs 128x128, 1x32 vs 32x32, rowwise vs columnwise) changes
    the quantized values. Without it pow2-scaled FP8 of an i.i.d. tensor hardly depends on the
    block shape and a mirror with the wrong block layout could go unnoticed."""
    t2 = t.reshape(-1, t.shape[-1])
    rows = torch.exp2(torch.randint(-8, 9, (t2.shape[0], 1)).float())
    cols = torch.exp2(torch.randint(-8, 9, (1, t2.shape[1])).float())
    return (t2 * rows * cols).reshape(t.shape)


def _build(kind):
    torch.manual_seed(1)
    if kind == "Linear":
        m, x, args = lowprec.Linear(H, H, name="lin"), torch.randn(2, 64, H), ()
    elif kind == "LayerNormMLP":
        m, x, args = lowprec.LayerNormMLP(H, H, name="mlp"), torch.randn(2, 64, H), ()
        with torch.no_grad():  # non-trivial norm parameters so their gradients are exercised
            m.layer_norm_weight.uniform_(0.5, 1.5)
            m.layer_norm_bias.uniform_(-0.5, 0.5)
    else:
        m, x, args = lowprec.GroupedLinear(2, H, H, name="grp"), torch.randn(2 * H, H), ([H, H],)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if p.dim() == 2:
                p.copy_(_spread(p))
    x = _spread(x)
    g = _spread(torch.randn(*x.shape[:-1], H))
    return m, x, args, g


def _run(module, x, args, g, recipe, seed=1234):
    m = copy.deepcopy(module)
    xx = x.clone().requires_grad_(True)
    torch.manual_seed(seed)  # stochastic rounding (NVFP4 grads) draws from the default generator
    with autocast(enabled=recipe is not None, recipe=recipe):
        y = m(*(xx, *args))
    y.backward(g)
    grads = {"input": xx.grad}
    grads.update({n: p.grad for n, p in m.named_parameters()})
    assert all(v is not None for v in grads.values())
    return y.detach(), grads


@pytest.mark.parametrize("kind", ["Linear", "LayerNormMLP", "GroupedLinear"])
@pytest.mark.parametrize("fmt", sorted(MIRRORS))
def test_mirror_factory_bit_identical(kind, fmt):
    builtin, factory = MIRRORS[fmt]
    module, x, args, g = _build(kind)
    y_ref, g_ref = _run(module, x, args, g, builtin())
    y_cus, g_cus = _run(module, x, args, g, CustomRecipe(factory))
    assert torch.equal(y_cus, y_ref)
    assert g_cus.keys() == g_ref.keys()
    for name in g_ref:
        assert torch.equal(g_cus[name], g_ref[name]), name
    # Not vacuous: the recipe really quantized the forward and the backward.
    y_hp, g_hp = _run(module, x, args, g, None)
    assert not torch.equal(y_ref, y_hp)
    wname = ("weight" if kind == "Linear"
             else ("fc1_weight" if kind == "LayerNormMLP" else "weight0"))
    assert not torch.equal(g_ref[wname], g_hp[wname])
    assert not torch.equal(g_ref["input"], g_hp["input"])


@pytest.mark.parametrize("mode", ["high_precision", "dequantized"])
@pytest.mark.parametrize("fmt", ["current", "nvfp4"])
def test_mirror_factory_bit_identical_other_backward_modes(fmt, mode):
    builtin, factory = MIRRORS[fmt]
    module, x, args, g = _build("LayerNormMLP")
    y_ref, g_ref = _run(module, x, args, g, builtin(backward_mode=mode))
    y_cus, g_cus = _run(module, x, args, g, CustomRecipe(factory, backward_mode=mode))
    assert torch.equal(y_cus, y_ref)
    for name in g_ref:
        assert torch.equal(g_cus[name], g_ref[name]), name


def test_nvfp4_mirror_needs_same_seed():
    # The re-seeding above matters: without it stochastic rounding makes the gradients differ,
    # so the bit-identity test really compares two independent draws of the same numbers.
    module, x, args, g = _build("Linear")
    _, g1 = _run(module, x, args, g, NVFP4BlockScaling(), seed=1)
    _, g2 = _run(module, x, args, g, CustomRecipe(nvfp4_factory), seed=2)
    assert not torch.equal(g1["weight"], g2["weight"])


def _identity_factory(role):
    return IdentityQuantizer()


@pytest.mark.parametrize("kind", ["Linear", "LayerNormMLP", "GroupedLinear"])
def test_identity_factory_bit_identical_to_no_quantization(kind):
    # SPEC 4: returning IdentityQuantizer() keeps a tensor in high precision, exactly.
    module, x, args, g = _build(kind)
    y_hp, g_hp = _run(module, x, args, g, None)
    y_id, g_id = _run(module, x, args, g, CustomRecipe(_identity_factory))
    assert torch.equal(y_id, y_hp)
    for name in g_hp:
        assert torch.equal(g_id[name], g_hp[name]), name


def test_shared_quantizer_factory_matches_per_slot_factory():
    # One quantizer object returned for every slot must not leak one slot's usages into another.
    shared = MXFP8Quantizer(E4M3)
    module, x, args, g = _build("LayerNormMLP")
    y_ref, g_ref = _run(module, x, args, g, MXFP8BlockScaling())
    y_sh, g_sh = _run(module, x, args, g, CustomRecipe(lambda role: shared))
    assert torch.equal(y_sh, y_ref)
    for name in g_ref:
        assert torch.equal(g_sh[name], g_ref[name]), name


def test_gemm_quantizers_reused_while_states_and_roles_are():
    """The per-GEMM quantizer records are built once per recipe state (host time) and follow
    a new recipe or a boundary role set after the first call."""
    m = lowprec.Linear(32, 32, name="proj")
    recipe = lowprec.Float8CurrentScaling()
    with lowprec.autocast(recipe=recipe):
        first, _, _ = m.gemm_quantizers(torch.device("cpu"))
        again, _, _ = m.gemm_quantizers(torch.device("cpu"))
    assert again is first and first[0].output is None
    m.output_quantizer_role = R("attn", "input", "next")
    with lowprec.autocast(recipe=recipe):
        bounded, _, _ = m.gemm_quantizers(torch.device("cpu"))
    assert bounded is not first and bounded[0].output is not None
    with lowprec.autocast(recipe=lowprec.Float8BlockScaling()):
        block, _, _ = m.gemm_quantizers(torch.device("cpu"))
    assert type(block[0].input).__name__ == "Float8BlockQuantizer"


@pytest.mark.parametrize("slot", ["output", "grad_input"])
def test_boundary_role_set_after_the_first_forward_takes_effect(slot):
    seen = []

    def factory(role):
        seen.append(role)
        if role is not None and role.tensor_type in ("output", "grad_input"):
            return MXFP8Quantizer()
        return IdentityQuantizer()

    recipe = CustomRecipe(qfactory=factory)
    torch.manual_seed(0)
    lin = lowprec.Linear(64, 32, name="l")
    x = torch.randn(32, 64, requires_grad=True)
    grads = []

    def step():
        grads.clear()
        with autocast(recipe=recipe):
            h = x * 1.0
            # record the gradient; hand the rest of the graph its values
            h.register_hook(lambda g: grads.append(g) or (
                g.dequantize() if isinstance(g, lowprec.QuantizedTensor) else g))
            y = lin(h)
        if isinstance(y, lowprec.QuantizedTensor):
            return y  # a quantized output is for a consumer that takes one: forward only
        y.sum().backward()
        return y

    y = step()
    assert not isinstance(y, lowprec.QuantizedTensor)
    assert not isinstance(grads[0], lowprec.QuantizedTensor)
    role = R("linear", slot, "boundary")
    setattr(lin, f"{slot}_quantizer_role", role)
    y = step()
    assert role in seen  # the factory saw the new role
    if slot == "output":
        assert isinstance(y, lowprec.MXFP8Tensor)
    else:
        assert isinstance(grads[0], lowprec.MXFP8Tensor)
    setattr(lin, f"{slot}_quantizer_role", None)  # and back
    y = step()
    assert not isinstance(y, lowprec.QuantizedTensor)
    assert not isinstance(grads[0], lowprec.QuantizedTensor)


def test_renamed_module_gets_roles_of_its_new_name():
    seen = []
    recipe = CustomRecipe(qfactory=lambda role: seen.append(role) or IdentityQuantizer())
    lin = lowprec.Linear(16, 16, name="old")
    with autocast(recipe=recipe):
        lin(torch.randn(4, 16))
    lin.name = "new"
    seen.clear()
    with autocast(recipe=recipe):
        lin(torch.randn(4, 16))
    assert {r.name for r in seen if r is not None} == {"new"}


def test_role_change_keeps_the_delayed_scaling_history():
    recipe = DelayedScaling(amax_history_len=4)
    lin = lowprec.Linear(16, 16, name="l")
    x = torch.randn(8, 16) * 3
    with autocast(recipe=recipe):
        lin(x).sum().backward()
    hist = lin.scaling_state()["forward"]["amax_history"].clone()
    lin.output_quantizer_role = R("linear", "output", "l")
    with autocast(recipe=recipe):
        assert isinstance(lin(x), lowprec.Float8Tensor)
    now = lin.scaling_state()["forward"]["amax_history"]
    assert torch.equal(now[1], hist[0])


# =============================================================================================
# a callable amax_compute_algo must return n floating-point amaxes
# =============================================================================================
def _delayed_state(algo, n=3, history_len=4):
    recipe = DelayedScaling(amax_history_len=history_len, amax_compute_algo=algo)
    st = DelayedScalingState(recipe, n, [E4M3] * n, torch.device("cpu"))
    st.amax_current.copy_(torch.arange(1.0, n + 1))
    st.pending = True
    return st


def _scalar_amax(h):
    return h.amax()


def _list_amax(h):
    return h.amax(dim=0).tolist()


def _int_amax(h):
    return h.amax(dim=0).to(torch.int32)


def test_amax_compute_algo_wrong_shape_names_option_and_shape():
    # must name the option, not fail in reshape ("shape '[3]' is invalid for input of size 1")
    st = _delayed_state(_scalar_amax)
    with pytest.raises(ValueError) as err:
        st.update()
    msg = str(err.value)
    assert "amax_compute_algo" in msg and "_scalar_amax" in msg
    assert "shape (3,)" in msg and "floating-point" in msg and "()" in msg


@pytest.mark.parametrize("algo,what", [(_list_amax, "list"), (lambda h: 2.0, "float"),
                                       (lambda h: None, "NoneType"), (_int_amax, "torch.int32")])
def test_amax_compute_algo_non_float_tensor_result_is_a_type_error(algo, what):
    st = _delayed_state(algo)
    with pytest.raises(TypeError) as err:
        st.update()
    msg = str(err.value)
    assert "amax_compute_algo" in msg and what in msg and "torch.Tensor of shape (3,)" in msg


def test_amax_compute_algo_bad_result_is_reported_by_batched_updates_too():
    states = [_delayed_state(_scalar_amax), _delayed_state(_scalar_amax)]
    with pytest.raises(ValueError, match="amax_compute_algo"):
        state_batch.update_states(states)


@pytest.mark.parametrize("algo", [lambda h: h.amax(dim=0, keepdim=True),
                                  lambda h: h.amax(dim=0).double(),
                                  lambda h: h.amax(dim=0).bfloat16()],
                         ids=["keepdim", "float64", "bfloat16"])
def test_amax_compute_algo_takes_n_floating_amaxes(algo):
    st = _delayed_state(algo)
    st.update()
    assert st.scale.dtype == torch.float32 and st.scale.shape == (3,)
    expected = torch.full((3,), 448.0) / torch.tensor([1.0, 2.0, 3.0])  # fp32, amaxes 1, 2, 3
    assert torch.equal(st.scale, expected)


@pytest.mark.parametrize("margin", [0, 1, 0.5, 1.7, 3.3, 31.25, 126.9, 127])
def test_inv_margin_is_torch_fp32_reciprocal(margin):
    """The update's margin factor is the fp32 reciprocal of the fp32 divisor, as torch's
    CUDA division by a scalar multiplies; computed without tensors, so it also runs where
    a compiler traces the backward with fake tensors (a tensor's ``item`` would raise)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from lowprec.formats.float8 import inv_margin as _inv_margin
    with FakeTensorMode():  # first: nothing cached from an eager call
        traced = _inv_margin(margin)
    div = torch.tensor(2.0 ** margin, dtype=torch.float32)
    expected = float(torch.ones((), dtype=torch.float32) / div)
    assert traced == _inv_margin(margin) == expected


@pytest.mark.parametrize("algo", ["max", "most_recent"])
def test_pushed_amaxes_traces_without_data_dependence(algo):
    """The traced backward's update is plain tensor ops: it traces with fake tensors."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from lowprec.recipe.state import pushed_amaxes
    h, scale = torch.rand(4, 3), torch.ones(3)
    fmax, cur = torch.full((3,), 448.0), torch.rand(3)
    traced = make_fx(lambda *a: pushed_amaxes(*a, algo, 0.5), tracing_mode="fake")(
        h, scale, fmax, cur)
    got, want = traced(h, scale, fmax, cur), pushed_amaxes(h, scale, fmax, cur, algo, 0.5)
    for g, w in zip(got, want):
        assert torch.equal(g, w)


@pytest.mark.parametrize("name", ["history", "current", "scale"])
def test_update_kernel_refuses_a_non_contiguous_state(name):
    """The one-launch update reads the state's tensors as contiguous; a traced backward
    does not ask (dynamo cannot answer while it speculates), so the op checks when it runs
    and names the tensor, before any launch."""
    from lowprec.formats.float8.launch import fp8_delayed_update
    state = {"history": torch.zeros(4, 3), "current": torch.zeros(3),
             "scale": torch.ones(3)}
    wide = torch.zeros(*state[name].shape[:-1], 6)
    state[name] = wide[..., ::2]  # the same shape, every other column
    with pytest.raises(ValueError, match=f"the state's {name} .* must be contiguous"):
        fp8_delayed_update(state["history"], state["current"], state["scale"],
                           torch.full((3,), 448.0), 1.0, False)
