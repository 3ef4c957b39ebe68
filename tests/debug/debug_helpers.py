"""A small model, its batches and a training loop for the lowprec.debug tests."""

from __future__ import annotations

import torch
from torch import nn

import lowprec

RECIPES = {
    "current": lowprec.Float8CurrentScaling,
    "delayed": lowprec.DelayedScaling,
    "mxfp8": lowprec.MXFP8BlockScaling,
    "nvfp4": lowprec.NVFP4BlockScaling,
}

DIM = 128


def make_model(seed: int = 0) -> nn.Sequential:
    """Two lowprec Linears (128 -> 128) named fc1 and fc2, a ReLU between them."""
    torch.manual_seed(seed)
    return nn.Sequential(lowprec.Linear(DIM, DIM, name="fc1"), nn.ReLU(),
                         lowprec.Linear(DIM, DIM, name="fc2"))


def batches(n: int, seed: int = 1, scale: float = 1.0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(DIM, DIM, generator=g) * scale for _ in range(n)]


def train(model: nn.Module, recipe, xs: list[torch.Tensor], rec=None, lr: float = 0.05):
    """SGD on ``mean(y^2)``, one step a batch; ``rec.step()`` after each optimizer step.
    Returns the losses and, per step, the gradients (cloned)."""
    torch.manual_seed(123)  # NVFP4's stochastic rounding draws from the default generator
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses, grads = [], []
    for x in xs:
        with lowprec.autocast(recipe=recipe):
            y = model(x)
        loss = y.square().mean()
        loss.backward()
        losses.append(loss.detach().clone())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad(set_to_none=True)
        if rec is not None:
            rec.step()
    return losses, grads


def state_quantizers(model: nn.Module) -> list:
    """Every quantizer the model's lowprec modules hold in their recipe states."""
    out = []
    for m in model.modules():
        for state in getattr(m, "_recipe_states", {}).values():
            if state is not None:
                out += state.quantizers + state.eval_twin.quantizers
    return out
