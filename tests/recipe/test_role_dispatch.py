"""How the built-in recipes pick a quantizer for a slot whose role is ``None`` or of a tensor
type they do not know, as Transformer Engine's recipe states do: the role's own tensor type
where it is a known one, else the type of the slot's place in the layout (forward
``[input, weight, output, ...]``, backward ``[grad_output, grad_input, ...]``); the mirror
factories of ``lowprec.recipe.factories`` go through the same rule."""

from __future__ import annotations

import pytest
import torch

from lowprec import QuantizerRole as R
from lowprec.formats import Float8BlockQuantizer, MXFP8Quantizer, NVFP4Quantizer
from lowprec.recipe import factories
from lowprec.recipe.recipes import (
    DelayedScaling,
    Float8BlockScaling,
    Float8CurrentScaling,
    Format,
    MXFP8BlockScaling,
    NVFP4BlockScaling,
)
from lowprec.recipe.roles import KNOWN_TENSOR_TYPES, slot_tensor_type
from lowprec.recipe.state import RecipeState, builtin_quantizer

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
INPUT_NV, WEIGHT_NV, GRAD_NV = (True, False, False), (False, True, False), (True, False, True)


def nv(q):
    assert type(q) is NVFP4Quantizer
    return (q.with_rht, q.with_2d_quantization, q.stochastic_rounding)


def quantizers(recipe, mode, roles):
    return RecipeState.create(recipe, mode, roles).quantizers


def test_slot_tensor_type():
    assert [slot_tensor_type(None, "forward", i) for i in range(6)] == \
        ["input", "weight", "output"] * 2
    assert [slot_tensor_type(None, "backward", i) for i in range(4)] == \
        ["grad_output", "grad_input"] * 2
    # an unknown tensor type falls back as None does; a known one is kept wherever it sits
    assert slot_tensor_type(R("dpa", "qkv", "a"), "backward", 0) == "grad_output"
    assert slot_tensor_type(R(), "forward", 1) == "weight"
    for t in KNOWN_TENSOR_TYPES:
        assert slot_tensor_type(R("linear", t, "a"), "forward", 0) == t
    with pytest.raises(ValueError, match="mode='sideways'.*'forward' or 'backward'"):
        slot_tensor_type(None, "sideways", 0)


def test_nvfp4_boundary_slots_follow_their_tensor_type():
    fwd = quantizers(NVFP4BlockScaling(), "forward", [R("linear", "input", "a"),
                                                      R("linear", "weight", "a"), None])
    bwd = quantizers(NVFP4BlockScaling(), "backward", [R("linear", "grad_output", "a"), None])
    assert [nv(q) for q in fwd] == [INPUT_NV, WEIGHT_NV, INPUT_NV]  # output: as an input
    assert [nv(q) for q in bwd] == [GRAD_NV, GRAD_NV]  # grad_input: as a gradient
    named = quantizers(NVFP4BlockScaling(), "backward", [R("linear", "grad_output", "a"),
                                                         R("linear", "grad_input", "b")])
    assert [nv(q) for q in named] == [GRAD_NV, GRAD_NV]


def test_nvfp4_unknown_roles_take_their_place_in_the_layout():
    fwd = quantizers(NVFP4BlockScaling(), "forward", [R("dpa", "qkv", "a"), R(), None])
    assert [nv(q) for q in fwd] == [INPUT_NV, WEIGHT_NV, INPUT_NV]
    bwd = quantizers(NVFP4BlockScaling(), "backward", [R("dpa", "dqkv", "a"), None])
    assert [nv(q) for q in bwd] == [GRAD_NV, GRAD_NV]


def test_block_scaling_unknown_and_unset_roles():
    r = Float8BlockScaling(fp8_format=Format.HYBRID, x_block_scaling_dim=1, w_block_scaling_dim=2,
                           grad_block_scaling_dim=2)
    fwd = quantizers(r, "forward", [None, R("x", "", "a"), R("x", "qkv", "a")])
    bwd = quantizers(r, "backward", [R("x", "qkv", "a"), None])
    assert all(type(q) is Float8BlockQuantizer for q in fwd + bwd)
    assert [(q.block_scaling_dim, q.fp8_dtype) for q in fwd] == [(1, E4M3), (2, E4M3), (1, E4M3)]
    assert [(q.block_scaling_dim, q.fp8_dtype) for q in bwd] == [(2, E5M2), (2, E5M2)]


def test_fp8_dtypes_of_unknown_roles_follow_their_place():
    bwd = quantizers(Float8CurrentScaling(), "backward", [R("dpa", "qkv", "a"), None])
    assert [q.fp8_dtype for q in bwd] == [E5M2, E5M2]
    bwd = quantizers(DelayedScaling(), "backward", [R("dpa", "qkv", "a"), None])
    assert [q.fp8_dtype for q in bwd] == [E5M2, E5M2]


def test_mxfp8_2d_only_for_a_named_forward_weight():
    r = MXFP8BlockScaling(enable_2d_quantization=True)
    fwd = quantizers(r, "forward", [R("linear", "input", "a"), R("linear", "weight", "a"), None,
                                    None, R(), None])
    assert all(type(q) is MXFP8Quantizer for q in fwd)
    assert [q.with_2d_quantization for q in fwd] == [False, True, False, False, False, False]
    assert not quantizers(r, "backward", [R("linear", "weight", "a"), None])[0].with_2d_quantization


@pytest.mark.parametrize("recipe,factory", [
    (Float8CurrentScaling(), factories.fp8_current_scaling_factory),
    (Float8BlockScaling(), factories.fp8_block_scaling_factory),
    (MXFP8BlockScaling(), factories.mxfp8_factory),
    (NVFP4BlockScaling(), factories.nvfp4_factory),
])
def test_mirror_factories_follow_the_builtin_rule(recipe, factory):
    for t in KNOWN_TENSOR_TYPES:
        role = R("linear", t, "a")
        mode = "backward" if role.is_gradient else "forward"
        assert repr(factory(role)) == repr(builtin_quantizer(recipe, role, mode))
    assert type(factory(None)).__name__ == "IdentityQuantizer"


def test_builtin_quantizer_refuses_other_recipes():
    with pytest.raises(TypeError, match="DelayedScaling.*accepted: Float8CurrentScaling"):
        builtin_quantizer(DelayedScaling(), R("linear", "input", "a"))
