"""lowprec.optim.AdamW over DTensor parameters (FSDP2's: sharded along dim 0): on 2 ranks
the whole tensors after every step equal one process's plain-tensor run bit for bit, the
stochastic roundings included (their random bits follow the element's index in the whole
tensor), with a row count that does not split evenly."""

from __future__ import annotations

import pytest
import spawn
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from lowprec.optim import AdamW

BF16 = torch.bfloat16
SHAPES = [(33, 160), (7,), (5, 3, 5)]
KW = dict(lr=1e-2, weight_decay=0.1, exp_avg_dtype=torch.float8_e4m3fn,
          exp_avg_sq_dtype=BF16, master_weights="stochastic", seed=3)
STEPS = 3


def _full(step=None):
    """The whole parameters (step None) or the whole gradients of ``step``."""
    g = torch.Generator().manual_seed(0 if step is None else 10 + step)
    return [torch.randn(s, generator=g).to(BF16) for s in SHAPES]


def _run_plain():
    ps = [torch.nn.Parameter(t) for t in _full()]
    opt = AdamW(ps, **KW)
    for step in range(STEPS):
        for p, g in zip(ps, _full(step)):
            p.grad = g
        opt.step()
    return [p.detach() for p in ps], [opt.state[p] for p in ps]


def _whole(t):
    """The whole tensor of a DTensor (FP8 codes gathered as bytes: gloo has no FP8)."""
    if t.dtype != torch.float8_e4m3fn:
        return t.full_tensor()
    raw = DTensor.from_local(t.to_local().view(torch.uint8), t.device_mesh, t.placements,
                             shape=t.shape, stride=t.stride())
    return raw.full_tensor().view(t.dtype)


def _worker(rank, world, out_dir):
    mesh = init_device_mesh("cpu", (world,))
    place = [[Shard(0)], [Replicate()], [Shard(0)]]
    ps = [torch.nn.Parameter(distribute_tensor(t, mesh, pl)) for t, pl in zip(_full(), place)]
    opt = AdamW(ps, **KW)
    for step in range(STEPS):
        for p, g, pl in zip(ps, _full(step), place):
            p.grad = distribute_tensor(g, mesh, pl)
        opt.step()
    full = [p.detach().full_tensor() for p in ps]
    states = [{k: _whole(v) if k != "step" else v for k, v in opt.state[p].items()}
              for p in ps]
    if rank == 0:
        torch.save({"params": full, "states": states}, f"{out_dir}/dtensor.pt")


def test_dtensor_parameters_match_one_process(tmp_path):
    spawn.run(_worker, 2, str(tmp_path))
    got = torch.load(tmp_path / "dtensor.pt")
    want_params, want_states = _run_plain()
    for g, w in zip(got["params"], want_params):
        assert torch.equal(g, w)
    for gs, ws in zip(got["states"], want_states):
        for k in ws:
            assert torch.equal(gs[k], ws[k]), k


def test_other_placements_are_refused():
    class Fake(torch.Tensor):
        pass
    with pytest.raises(TypeError, match="plain tensors and DTensors"):
        AdamW([torch.zeros(3).as_subclass(Fake)])
