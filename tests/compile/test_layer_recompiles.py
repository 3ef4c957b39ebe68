"""A Hugging Face Llama compiled decoder layer by decoder layer (the torchtitan order)
compiles the layer's code once: the layers' Linears differ in name only
(``tools/layer_recompiles.py``). Delayed scaling's state and a name-reading
``CustomRecipe``'s quantizers are made for the whole model as its first layer is traced,
and the compiled steps are eager's, bit for bit."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import lowprec

pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))

from layer_recompiles import run  # noqa: E402


# NVFP4's emulation takes 28 s here; test_fsdp's compiled layers check NVFP4's one code
# per layer type in the default run
@pytest.mark.parametrize("recipe", ["current", pytest.param("nvfp4", marks=pytest.mark.slow),
                                    "fp8_row_mxfp8_col"])
def test_decoder_layers_share_compiled_code(recipe):
    got = run(recipe, layers=2)
    assert (got["frames"], got["breaks"], got["fallbacks"]) == (1, 0, []), got["reasons"]


def _by_name(role):
    """A factory that reads role names (as ``nvfp4_fp8_head``'s does, at the cost of FP8
    current scaling): E5M2 for the down projections' inputs, E4M3 elsewhere, E5M2
    gradients."""
    e5m2 = role is not None and (role.is_gradient or (role.tensor_type == "input"
                                                     and role.name.endswith("down_proj")))
    return lowprec.Float8CurrentScalingQuantizer(
        torch.float8_e5m2 if e5m2 else torch.float8_e4m3fn)


@pytest.mark.parametrize("recipe", ["delayed", "by_name"])
def test_per_module_state_is_made_before_the_layers_are_guarded(recipe):
    """Delayed scaling (each module its own scales, made at its first call) and a factory
    that reads role names: one frame for two layers, nothing opaque, and two steps
    (delayed scaling's scales moving between them) equal to eager's bit for bit."""
    if recipe == "by_name":
        recipe = lowprec.CustomRecipe(qfactory=_by_name)
    got = run(recipe, layers=2, steps=2)
    assert (got["frames"], got["breaks"], got["fallbacks"]) == (1, 0, []), got["reasons"]
    ref = run(recipe, layers=2, steps=2, compiled=False)
    for a, b in zip(got["losses"] + got["grads"], ref["losses"] + ref["grads"], strict=True):
        assert torch.equal(a, b)
