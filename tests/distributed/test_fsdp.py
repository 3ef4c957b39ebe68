"""FSDP2 (fully_shard) over lowprec modules, on CPU gloo ranks: training matches one
process bit for bit, and quantized_all_gather gathers each format's codes and scales."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import lowprec
from lowprec.distributed import QuantizedGatherWeight, quantized_all_gather

import spawn

fsdp = pytest.importorskip("torch.distributed.fsdp")
fully_shard = fsdp.fully_shard

RECIPES = {
    "current": lambda: lowprec.Float8CurrentScaling(),
    "delayed": lambda: lowprec.DelayedScaling(),
    "block": lambda: lowprec.Float8BlockScaling(),
    "mxfp8": lambda: lowprec.MXFP8BlockScaling(),
    "nvfp4": lambda: lowprec.NVFP4BlockScaling(disable_stochastic_rounding=True),
}
#: the unsharded weight's class during forward with quantized_all_gather (None: the
#: weight is gathered in high precision)
GATHERED = {"current": lowprec.Float8Tensor, "delayed": None,
            "block": lowprec.Float8BlockwiseTensor, "mxfp8": lowprec.MXFP8Tensor,
            "nvfp4": lowprec.NVFP4Tensor}
HIDDEN, TOKENS, STEPS = 256, 64, 3


class Model(nn.Module):
    def __init__(self, rows: int = HIDDEN):
        super().__init__()
        self.layers = nn.ModuleList([
            lowprec.Linear(HIDDEN, rows, name="l0"),
            lowprec.LayerNormMLP(rows, 2 * HIDDEN, name="mlp"),
            lowprec.Linear(rows, HIDDEN, name="l2")])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def _data(step: int):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(TOKENS, HIDDEN, generator=g), torch.randn(TOKENS, HIDDEN, generator=g)


def train(model, recipe, steps: int = STEPS, record=None):
    """Losses of ``steps`` SGD steps on the same batches; ``record(module)`` is called in
    each Linear's forward."""
    hooks = []
    if record is not None:
        for m in model.modules():
            if isinstance(m, lowprec.Linear):
                hooks.append(m.register_forward_pre_hook(lambda mod, args: record(mod)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    for step in range(steps):
        x, target = _data(step)
        with lowprec.autocast(recipe=recipe):
            y = model(x)
        loss = ((y.float() - target) ** 2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    for h in hooks:
        h.remove()
    return torch.stack(losses)


def full_state(model) -> dict:
    out = {}
    for k, v in model.state_dict().items():
        if isinstance(v, torch.Tensor):
            v = v.full_tensor() if hasattr(v, "full_tensor") else v
            out[k] = torch.Tensor(v._data) if isinstance(v, QuantizedGatherWeight) else v
    return out


def _worker(rank, world, rname, wrap, rows, reshard, out_dir):
    torch.manual_seed(0)
    model = Model(rows)
    recipe = RECIPES[rname]()
    if wrap:
        quantized_all_gather(model, recipe)
    for layer in model.layers:
        fully_shard(layer, reshard_after_forward=reshard)
    fully_shard(model, reshard_after_forward=reshard)
    seen = []
    losses = train(model, recipe, record=lambda m: seen.append(type(m.weight).__name__))
    state = full_state(model)
    if rank == 0:
        torch.save({"losses": losses, "state": state, "seen": seen}, f"{out_dir}/fsdp.pt")


def _single(rname, rows):
    torch.manual_seed(0)
    model = Model(rows)
    losses = train(model, RECIPES[rname]())
    return losses, {k: v for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}


@pytest.mark.parametrize("reshard", [True, False], ids=["reshard", "keep"])
@pytest.mark.parametrize("wrap", [True, False], ids=["quantized_gather", "hp_gather"])
@pytest.mark.parametrize("rname", list(RECIPES))
def test_fsdp_matches_single_process(tmp_path, rname, wrap, reshard):
    """Two ranks on the same batches (the averaged gradient is the one process's exactly):
    losses and the final weights bit-identical to one process."""
    spawn.run(_worker, 2, rname, wrap, HIDDEN, reshard, str(tmp_path))
    got = torch.load(tmp_path / "fsdp.pt", weights_only=False)
    losses, state = _single(rname, HIDDEN)
    assert torch.equal(got["losses"], losses), (got["losses"], losses)
    assert state.keys() == got["state"].keys()
    for k in state:
        assert torch.equal(got["state"][k], state[k]), k
    expect = GATHERED[rname].__name__ if wrap and GATHERED[rname] else "Parameter"
    assert set(got["seen"]) == {expect} or (
        expect == "Parameter" and set(got["seen"]) == {"Tensor"}), got["seen"]


def _bytes_worker(rank, world, rname, wrap, out_dir):
    from lowprec.distributed.diagnostics import count_all_gather_bytes
    torch.manual_seed(0)
    model = Model()
    recipe = RECIPES[rname]()
    if wrap:
        quantized_all_gather(model, recipe)
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    train(model, recipe, steps=1)  # the first step sizes FSDP's buffers
    with count_all_gather_bytes() as counter:
        train(model, recipe, steps=1)
    if rank == 0:
        torch.save(counter.bytes, f"{out_dir}/bytes.pt")


def _gathered_bytes(tmp_path, rname, wrap):
    spawn.run(_bytes_worker, 2, rname, wrap, str(tmp_path))
    return torch.load(tmp_path / "bytes.pt")


#: bytes per weight element a step gathers, twice (forward, and backward again after
#: resharding), against fp32 parameters' 2 x 4: FP8 data, fp32 128x128 block scales, E8M0
#: 1x32 scales, E2M1 codes with E4M3 16x16 scales (per-tensor scales travel apart)
GATHER_BYTES = {"current": 2 * 1, "block": 2 * (1 + 4 / 128 ** 2),
                "mxfp8": 2 * (1 + 1 / 32), "nvfp4": 2 * (0.5 + 1 / 16 ** 2)}


@pytest.mark.parametrize("rname", list(GATHER_BYTES))
def test_quantized_all_gather_bytes(tmp_path, rname):
    """The gathers of a training step move the format's bytes per weight element (plus the
    norms and biases, gathered in their fp32)."""
    hp = _gathered_bytes(tmp_path, rname, False)
    q = _gathered_bytes(tmp_path, rname, True)
    weights = 2 * HIDDEN * HIDDEN + 2 * (2 * HIDDEN * HIDDEN)
    others = hp - 2 * 4 * weights  # forward and backward gathers, 4 bytes an element
    assert others >= 0
    assert q == pytest.approx(weights * GATHER_BYTES[rname] + others, rel=1e-6), (q, hp)
