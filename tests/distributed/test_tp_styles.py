"""DTensor tensor parallelism of lowprec modules: ``parallelize_module`` with
``lowprec.distributed.ColwiseParallel``/``RowwiseParallel`` computes what the modules' own
``tp_group`` split computes, bit for bit; other layouts redistribute through DTensor;
``fully_shard`` composes over a 2-D mesh (TP first)."""

from __future__ import annotations

import pytest
import spawn
import torch
import torch.distributed as dist
from test_tensor_parallel import BATCH, HIDDEN, SEQ, TP, _batch, _rows
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import parallelize_module

import lowprec
from lowprec.distributed import ColwiseParallel, RowwiseParallel

RECIPES = {"none": lambda: None, "current": lambda: lowprec.Float8CurrentScaling(),
           "mxfp8": lambda: lowprec.MXFP8BlockScaling()}


class Net(nn.Module):
    def __init__(self, group=None, sp: bool = False):
        super().__init__()
        kw = dict(tp_group=group, sequence_parallel=sp)
        self.qkv = lowprec.LayerNormLinear(HIDDEN, 2 * HIDDEN, parallel_mode="column", **kw)
        self.proj = lowprec.Linear(2 * HIDDEN, HIDDEN, parallel_mode="row", **kw)
        self.fc1 = lowprec.Linear(HIDDEN, 2 * HIDDEN, parallel_mode="column", **kw)
        self.fc2 = lowprec.Linear(2 * HIDDEN, HIDDEN, parallel_mode="row", **kw)

    def forward(self, x):
        h = x + self.proj(torch.relu(self.qkv(x)))
        return h + self.fc2(torch.relu(self.fc1(h)))


#: torch DTensor placement of each parameter split by the styles
SPLIT = {"qkv.weight": 0, "qkv.bias": 0, "fc1.weight": 0, "fc1.bias": 0,
         "proj.weight": 1, "fc2.weight": 1}


def _plan(sp: bool) -> dict:
    if sp:
        return {"qkv": ColwiseParallel(input_layouts=Shard(0)),
                "proj": RowwiseParallel(output_layouts=Shard(0)),
                "fc1": ColwiseParallel(input_layouts=Shard(0)),
                "fc2": RowwiseParallel(output_layouts=Shard(0))}
    return {"qkv": ColwiseParallel(), "proj": RowwiseParallel(),
            "fc1": ColwiseParallel(), "fc2": RowwiseParallel()}


def _step(model, recipe, x, t):
    with lowprec.autocast(enabled=recipe is not None, recipe=recipe):
        y = model(x)
    ((y.float() - t) ** 2).sum().backward()
    return y.detach()


def _local(t):
    return t.to_local() if isinstance(t, DTensor) else t


def _styles_worker(rank, world, rname, sp):
    device = spawn.device(rank)
    mesh = init_device_mesh(device.type, (world,))
    torch.manual_seed(0)
    dt = parallelize_module(Net().to(device), mesh, _plan(sp))
    module_tp = Net(dist.group.WORLD, sp).to(device)
    with torch.no_grad():
        for name, p in module_tp.named_parameters():
            p.copy_(_local(dict(dt.named_parameters())[name]))
    for name, dim in SPLIT.items():
        p = dict(dt.named_parameters())[name]
        assert isinstance(p, DTensor) and p.placements == (Shard(dim),), name
    x, t = _batch(0, device)
    x, t = _rows(x, rank, sp), _rows(t, rank, sp)
    recipe = RECIPES[rname]()
    y_dt, y_tp = _step(dt, recipe, x, t), _step(module_tp, recipe, x, t)
    assert torch.equal(y_dt, y_tp)
    for name, p in module_tp.named_parameters():
        g = dict(dt.named_parameters())[name].grad
        assert torch.equal(_local(g), p.grad), name


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp_sp"])
@pytest.mark.parametrize("rname", list(RECIPES))
def test_styles_match_module_tensor_parallel(rname, sp):
    """Parameters become DTensors sharded as torch's styles shard nn.Linear; outputs and
    gradients equal the tp_group modules' (sequence parallel: Shard(0) layouts run the
    modules' quantized gathers)."""
    spawn.run(_styles_worker, TP, rname, sp)


def _layout_worker(rank, world):
    device = spawn.device(rank)
    mesh = init_device_mesh(device.type, (world,))
    torch.manual_seed(0)
    full = Net().to(device)
    torch.manual_seed(0)
    dt = parallelize_module(Net().to(device), mesh, {
        "qkv": ColwiseParallel(input_layouts=Shard(1)),
        "proj": RowwiseParallel(output_layouts=Shard(1)),
        "fc1": ColwiseParallel(input_layouts=Shard(1)),
        "fc2": RowwiseParallel(output_layouts=Shard(1))})
    # (batch, seq, hidden): the sequence is dim 1, moved by DTensor redistributions
    x, t = (v.transpose(0, 1).contiguous() for v in _batch(0, device))
    y_full = _step(full, None, x, t)
    y = _step(dt, None, x.chunk(world, 1)[rank], t.chunk(world, 1)[rank])
    torch.testing.assert_close(y, y_full.chunk(world, 1)[rank], rtol=1e-5, atol=1e-5)
    fulls = dict(full.named_parameters())
    for name, p in dt.named_parameters():
        torch.testing.assert_close(p.grad.full_tensor(), fulls[name].grad, rtol=1e-4, atol=1e-4,
                                   msg=name)
    row = parallelize_module(lowprec.Linear(2 * HIDDEN, HIDDEN).to(device), mesh,
                             RowwiseParallel(output_layouts=Shard(1), use_local_output=False))
    out = row(torch.randn(BATCH, SEQ, HIDDEN, device=device))
    assert isinstance(out, DTensor) and out.placements == (Shard(1),)
    assert out.shape == (BATCH, SEQ, HIDDEN)


def test_styles_with_other_layouts():
    """Batch-first sequence sharding (Shard(1)) goes through DTensor redistributions and
    matches the unsplit model to fp32 rounding; the output is a DTensor when asked."""
    spawn.run(_layout_worker, TP)


def _fsdp_worker(rank, world, rname):
    from torch.distributed.fsdp import fully_shard
    device = spawn.device(rank)
    mesh = init_device_mesh(device.type, (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    full = Net().to(device)
    torch.manual_seed(0)
    model = parallelize_module(Net().to(device), mesh["tp"], _plan(False))
    fully_shard(model, mesh=mesh["dp"])
    recipe = RECIPES[rname]()
    opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (full, model)]
    for step in range(2):
        x, t = _batch(step, device)  # every rank the same batch: dp averages equal grads
        losses = []
        for m, opt in zip((full, model), opts):
            with lowprec.autocast(enabled=recipe is not None, recipe=recipe):
                loss = ((m(x).float() - t) ** 2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
        tol = 1e-5 if recipe is None else 2e-2
        torch.testing.assert_close(losses[1], losses[0], rtol=tol, atol=tol)
    fulls = dict(full.named_parameters())
    for name, p in model.named_parameters():
        tol = 1e-5 if recipe is None else 5e-2
        torch.testing.assert_close(p.full_tensor(), fulls[name], rtol=tol, atol=tol, msg=name)


@pytest.mark.parametrize("rname", ["none", "current"])
def test_styles_compose_with_fully_shard(rname):
    """TP on one mesh dimension, FSDP2 on the other (4 ranks): training follows the
    unsplit model (to fp32 rounding without a recipe)."""
    spawn.run(_fsdp_worker, 4, rname)


def _errors_worker(rank, world):
    mesh = init_device_mesh(spawn.device(rank).type, (world,))
    with pytest.raises(NotImplementedError, match="tp_group"):
        parallelize_module(lowprec.LayerNormLinear(8, 8), mesh, RowwiseParallel())
    with pytest.raises(NotImplementedError, match="tp_group"):
        parallelize_module(lowprec.LayerNormMLP(8, 8), mesh, ColwiseParallel())
    m = parallelize_module(lowprec.Linear(8, 8), mesh, ColwiseParallel())
    with pytest.raises(ValueError, match="already"):
        parallelize_module(m, mesh, ColwiseParallel())
    # torch's own modules still go to torch's styles
    lin = parallelize_module(nn.Linear(8, 8), mesh, ColwiseParallel())
    assert isinstance(lin.weight, DTensor)


def test_style_errors():
    spawn.run(_errors_worker, TP)
