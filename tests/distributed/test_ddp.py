"""DDP over lowprec modules, and delayed scaling's amax reduction under DDP and FSDP2:
with ``amax_reduction_group`` every rank ends each step with the same scales (CPU gloo
ranks, or NCCL with LOWPREC_DIST_BACKEND=nccl)."""

from __future__ import annotations

import pytest
import spawn
import torch
import torch.distributed as dist
from test_fsdp import HIDDEN, _model
from torch.nn.parallel import DistributedDataParallel as DDP

import lowprec

STEPS = 3


def _states(model) -> dict:
    """Every module's delayed-scaling state, flattened to tensors."""
    out = {}
    for name, m in model.named_modules():
        if isinstance(m, (lowprec.Linear, lowprec.LayerNormMLP)):
            for mode, sd in m.scaling_state().items():
                for k, v in sd.items():
                    out[f"{name}.{mode}.{k}"] = v.detach().cpu().clone()
    return out


def _worker(rank, world, wrapper, reduce, out_dir):
    model = _model(rank=rank)
    device = spawn.device(rank)
    if wrapper == "ddp":
        net = DDP(model)
    else:
        from torch.distributed.fsdp import fully_shard
        for layer in model.layers:
            fully_shard(layer)
        net = fully_shard(model)
    recipe = lowprec.DelayedScaling(amax_history_len=4)
    group = dist.group.WORLD if reduce else None
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(1000 + rank)  # each rank its own data
    for _ in range(STEPS):
        x = (torch.randn(32, HIDDEN, generator=g) * (rank + 1)).to(device)
        with lowprec.autocast(recipe=recipe, amax_reduction_group=group):
            y = net(x)
        (y.float() ** 2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    torch.save(_states(model), f"{out_dir}/states{rank}.pt")


@pytest.mark.parametrize("wrapper", ["ddp", "fsdp2"])
@pytest.mark.parametrize("reduce", [True, False], ids=["amax_reduction_group", "no_group"])
def test_delayed_scaling_states_agree_across_ranks(tmp_path, wrapper, reduce):
    """Ranks see different data (rank 1's inputs twice rank 0's): with the group their
    amax histories and scales are equal after every step; without it they differ (so the
    check can fail)."""
    spawn.run(_worker, 2, wrapper, reduce, str(tmp_path))
    s0, s1 = (torch.load(tmp_path / f"states{r}.pt") for r in range(2))
    assert s0.keys() == s1.keys() and s0
    same = all(torch.equal(s0[k], s1[k]) for k in s0)
    assert same == reduce


def _ddp_train_worker(rank, world, rname, out_dir):
    from test_fsdp import RECIPES, train
    model = _model(rank=rank)
    net = DDP(model)
    losses = train(net, RECIPES[rname]())
    if rank == 0:
        torch.save({"losses": losses.cpu(),
                    "state": {k: v.cpu() for k, v in model.state_dict().items()
                              if isinstance(v, torch.Tensor)}}, f"{out_dir}/ddp.pt")


@pytest.mark.parametrize("rname", ["current", "mxfp8", "nvfp4"])
def test_ddp_matches_single_process(tmp_path, rname):
    """DDP on two ranks with the same batches: the averaged gradient is one process's, so
    the losses and weights are bit-identical to one process."""
    from test_fsdp import _single
    spawn.run(_ddp_train_worker, 2, rname, str(tmp_path))
    got = torch.load(tmp_path / "ddp.pt", weights_only=False)
    losses, state = _single(rname, HIDDEN)
    assert torch.equal(got["losses"], losses)
    for k in state:
        assert torch.equal(got["state"][k], state[k]), k



def _dcp_delayed_worker(rank, world, out_dir):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.fsdp import fully_shard

    def sharded():
        model = _model(rank=rank)
        for layer in model.layers:
            fully_shard(layer)
        fully_shard(model)
        return model

    model = sharded()
    recipe = lowprec.DelayedScaling(amax_history_len=4)
    g = torch.Generator().manual_seed(1000 + rank)
    for _ in range(STEPS):
        x = (torch.randn(32, HIDDEN, generator=g) * (rank + 1)).to(spawn.device(rank))
        with lowprec.autocast(recipe=recipe, amax_reduction_group=dist.group.WORLD):
            (model(x).float() ** 2).mean().backward()
    dcp.save(model.state_dict(), checkpoint_id=f"{out_dir}/ckpt")
    fresh = sharded()  # no forward yet: its delayed-scaling state does not exist
    assert all(v.numel() == 0 for k, v in fresh.state_dict().items() if "_extra_state" in k)
    # made now (fresh), so each _extra_state tensor has the saved size for DCP's in-place load
    lowprec.init_scaling_state(fresh, recipe)
    sd = fresh.state_dict()
    dcp.load(sd, checkpoint_id=f"{out_dir}/ckpt")
    fresh.load_state_dict(sd)
    with lowprec.autocast(recipe=recipe):  # the first forward takes the loaded state up
        with torch.no_grad():
            fresh(torch.zeros(32, HIDDEN, device=spawn.device(rank)))
    torch.save({"want": _states(model), "got": _states(fresh)}, f"{out_dir}/dcp{rank}.pt")


def test_dcp_restores_delayed_scaling_state_into_a_fresh_model(tmp_path):
    spawn.run(_dcp_delayed_worker, 2, str(tmp_path))
    for r in range(2):
        res = torch.load(tmp_path / f"dcp{r}.pt")
        assert res["want"].keys() == res["got"].keys() and res["want"]
        for k, v in res["want"].items():
            assert torch.equal(res["got"][k], v), (r, k)


def _quantized_model(rank):
    torch.manual_seed(0)
    with lowprec.quantized_model_init(recipe=lowprec.Float8CurrentScaling()):
        return _model(rank=rank)


def _quantized_train(model, steps=STEPS):
    from test_fsdp import _data

    from lowprec.optim import QuantizedWeightOptimizer
    opt = QuantizedWeightOptimizer(model, torch.optim.SGD, lr=0.05)
    device = next(model.parameters()).device
    losses = []
    for step in range(steps):
        x, target = _data(step, device)
        with lowprec.autocast(recipe=lowprec.Float8CurrentScaling()):
            loss = ((model(x).float() - target) ** 2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach().cpu())
    return torch.stack(losses)


def _ddp_quantized_worker(rank, world, out_dir):
    model = _quantized_model(rank)
    try:
        DDP(model)
    except RuntimeError as exc:
        assert "init_sync=False" in str(exc), exc
    else:
        raise AssertionError("DDP's constructor broadcast flattened quantized weights")
    net = DDP(model, init_sync=False)  # every rank built the same weights (same seed)
    losses = _quantized_train(net)
    if rank == 0:
        torch.save({"losses": losses, "weight": model.layers[0].weight.dequantize().cpu()},
                   f"{out_dir}/ddpq.pt")


def test_ddp_over_quantized_weights(tmp_path):
    """quantized_model_init weights under DDP: the constructor's broadcast (which flattens
    every parameter) raises naming init_sync=False; with it, training with
    QuantizedWeightOptimizer matches one process bit for bit."""
    spawn.run(_ddp_quantized_worker, 2, str(tmp_path))
    got = torch.load(tmp_path / "ddpq.pt")
    model = _quantized_model(0)
    losses = _quantized_train(model)
    assert torch.equal(got["losses"], losses)
    assert torch.equal(got["weight"], model.layers[0].weight.dequantize().cpu())
