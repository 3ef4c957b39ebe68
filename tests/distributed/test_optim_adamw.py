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


def _fsdp_model():
    from torch.distributed.fsdp import fully_shard
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(160, 66), torch.nn.GELU(),
                                torch.nn.Linear(66, 32)).to(BF16)
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    return model


def _train(model, opt, steps, first):
    for step in range(first, first + steps):
        g = torch.Generator().manual_seed(50 + step)
        x = torch.randn(8, 160, generator=g).to(BF16)
        model(x).float().square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def _dcp_worker(rank, world, out_dir):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    init_device_mesh("cpu", (world,))
    model = _fsdp_model()
    opt = AdamW(model.parameters(), **KW)
    _train(model, opt, 2, 0)
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=f"{out_dir}/ckpt")
    _train(model, opt, 2, 2)
    whole = [p.detach().full_tensor() for p in model.parameters()]

    fresh = _fsdp_model()
    opt2 = AdamW(fresh.parameters(), **KW)
    msd, osd = get_state_dict(fresh, opt2)  # DCP loads into these (the state made first)
    dcp.load({"model": msd, "optim": osd}, checkpoint_id=f"{out_dir}/ckpt")
    set_state_dict(fresh, opt2, model_state_dict=msd, optim_state_dict=osd)
    for p in fresh.parameters():
        st = opt2.state[p]
        assert st["exp_avg"].dtype == (torch.float8_e4m3fn if p.dim() == 2 else BF16)
    _train(fresh, opt2, 2, 2)
    resumed = [p.detach().full_tensor() for p in fresh.parameters()]
    if rank == 0:
        torch.save({"whole": whole, "resumed": resumed}, f"{out_dir}/dcp.pt")


def test_dcp_resume_is_bit_identical(tmp_path):
    """FSDP2 on 2 ranks: saved with DCP (torch.distributed.checkpoint's get_state_dict /
    set_state_dict, FP8 moments and their scales as DTensors) and resumed into a fresh
    model and optimizer, training goes on as the uninterrupted run, bit for bit (zeroing
    the loaded second moments makes it fail)."""
    spawn.run(_dcp_worker, 2, str(tmp_path))
    got = torch.load(tmp_path / "dcp.pt")
    for w, r in zip(got["whole"], got["resumed"]):
        assert torch.equal(w, r)
