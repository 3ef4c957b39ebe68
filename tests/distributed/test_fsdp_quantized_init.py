"""FSDP2 over weights built under ``quantized_model_init``: ``quantized_all_gather`` turns
each into a sharded fp32 master gathered in the weight's format, and training matches one
process with ``QuantizedWeightOptimizer`` bit for bit (CPU gloo ranks)."""

from __future__ import annotations

import pytest
import spawn
import torch
from test_fsdp import RECIPES, STEPS, Model, _data, full_state

import lowprec
from lowprec.distributed import QuantizedGatherWeight, quantized_all_gather
from lowprec.optim import QuantizedWeightOptimizer

fsdp = pytest.importorskip("torch.distributed.fsdp")


def _qinit_model(rname: str, rank: int = 0):
    torch.manual_seed(0)
    with lowprec.quantized_model_init(recipe=RECIPES[rname]()):
        model = Model()
    return model.to(spawn.device(rank))


def _steps(model, opt, recipe, record=None):
    device = next(model.parameters()).device
    if record is not None:  # the weight the first GEMM reads
        model.layers[0].register_forward_pre_hook(
            lambda mod, args: record.append(type(mod.weight).__name__))
    losses = []
    for step in range(STEPS):
        x, t = _data(step, device)
        with lowprec.autocast(recipe=recipe):
            y = model(x)
        loss = ((y.float() - t) ** 2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach().cpu())
    return torch.stack(losses)


def _worker(rank, world, rname, out_dir):
    model = _qinit_model(rname, rank)
    quantized_all_gather(model, RECIPES[rname]())
    assert all(isinstance(m.weight, QuantizedGatherWeight) and m.weight.dtype == torch.float32
               for m in model.layers if isinstance(m, lowprec.Linear))
    for layer in model.layers:
        fsdp.fully_shard(layer)
    fsdp.fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    seen = []
    losses = _steps(model, opt, RECIPES[rname](), seen)
    state = {k: v for k, v in full_state(model).items() if not k.endswith("_extra_state")}
    if rank == 0:
        torch.save({"losses": losses, "state": state, "seen": seen}, f"{out_dir}/out.pt")


def _single(rname):
    model = _qinit_model(rname)
    opt = QuantizedWeightOptimizer(model, torch.optim.AdamW, lr=1e-3)
    opt.step()  # no gradients yet: only re-quantizes each weight from its fp32 master
    losses = _steps(model, opt, RECIPES[rname]())
    masters = {id(p): m for p, m in zip([link[2] for link in opt._links], opt.master_weights())}
    state = {}
    for name, p in model.named_parameters():
        state[name] = masters[id(p)] if id(p) in masters else p.detach()
    return losses, state


#: the weight class FSDP hands the GEMMs (the format's, gathered quantized)
GATHERED = {"current": "Float8Tensor", "block": "Float8BlockwiseTensor", "mxfp8": "MXFP8Tensor",
            "nvfp4": "NVFP4Tensor"}


@pytest.mark.parametrize("rname", list(GATHERED))
def test_fsdp_over_quantized_model_init_matches_one_process(tmp_path, rname):
    """Two ranks on the same batches: losses, fp32 masters and the other parameters after
    AdamW steps equal one process's QuantizedWeightOptimizer run bit for bit, the GEMMs
    reading the format's tensors gathered from the master shards."""
    spawn.run(_worker, 2, rname, str(tmp_path))
    got = torch.load(tmp_path / "out.pt", weights_only=False)
    losses, state = _single(rname)
    assert torch.equal(got["losses"], losses), (got["losses"], losses)
    assert got["state"].keys() == state.keys()
    for k, v in state.items():
        assert torch.equal(got["state"][k], v.cpu()), k
    assert set(got["seen"]) == {GATHERED[rname]}, got["seen"]


def test_fully_shard_of_a_quantized_weight_names_the_fix():
    """Without quantized_all_gather, FSDP2's split of a quantized weight says what to do."""
    with lowprec.quantized_model_init(recipe=lowprec.Float8CurrentScaling()):
        lin = lowprec.Linear(32, 32)
    with pytest.raises(NotImplementedError, match="quantized_all_gather"):
        torch.chunk(lin.weight, 2)


def test_master_dtype_needs_a_matching_param_dtype():
    """A bf16 quantized_model_init weight keeps an fp32 master: gathering it without
    FSDP2 computing in bf16 is an error naming MixedPrecisionPolicy."""
    with lowprec.quantized_model_init(recipe=lowprec.Float8CurrentScaling()):
        lin = lowprec.Linear(32, 32, params_dtype=torch.bfloat16)
    quantized_all_gather(lin, lowprec.Float8CurrentScaling())
    w = lin.weight
    assert isinstance(w, QuantizedGatherWeight) and w.dtype == torch.float32

    class Policy:
        param_dtype = None

    with pytest.raises(TypeError, match="MixedPrecisionPolicy"):
        w.fsdp_pre_all_gather(None, (32, 32), (32, 1), lin, Policy())
