"""A steady training step of lowprec modules never waits for the GPU: no host-device
synchronization (``torch.cuda.set_sync_debug_mode("error")``), for every built-in recipe.
CUDA graphs (``mode="reduce-overhead"``) and a host that runs ahead of the GPU need it."""

from __future__ import annotations

import pytest
import torch
from helpers import GPU_ONLY

import lowprec
import lowprec.kernels
from lowprec.recipe.recipes import Recipe

pytestmark = GPU_ONLY


def _model():
    torch.manual_seed(0)
    kw = {"params_dtype": torch.bfloat16, "device": "cuda"}
    return torch.nn.Sequential(lowprec.LayerNormLinear(256, 256, name="qkv", **kw),
                               lowprec.Linear(256, 256, name="proj", **kw),
                               lowprec.LayerNormMLP(256, 512, name="mlp", **kw))


@pytest.mark.parametrize("name", ["current", "delayed", "block", "mxfp8", "nvfp4"])
def test_a_steady_training_step_does_not_synchronize(name):
    recipe = Recipe.from_name(name)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(256, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)

    def step():
        with lowprec.autocast(recipe=recipe):
            loss = model(x).float().square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()  # the first step creates the recipe states and prepares the launches
    step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
