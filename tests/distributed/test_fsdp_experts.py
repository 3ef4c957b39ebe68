"""FSDP2 (fully_shard) over GroupedExperts on CPU gloo ranks: the 3-D expert weights are
sharded along the experts and gathered in high precision, or, under
``quantized_all_gather``, as FP8 codes with one scale an expert (FP8 current scaling) or
one a 128x128 block (FP8 block scaling), or as NVFP4 codes (16x16 blocks, one global
scale an expert); training matches one process bit for bit."""

from __future__ import annotations

import pytest
import spawn
import torch
from torch import nn

import lowprec
from lowprec.distributed import quantized_all_gather
from lowprec.recipe.recipes import (
    Float8BlockScaling,
    Float8CurrentScaling,
    MXFP8BlockScaling,
    NVFP4BlockScaling,
)

fsdp = pytest.importorskip("torch.distributed.fsdp")

# features of whole 128x128 blocks, so that block scaling gathers its experts quantized
E, H, I, K, T, STEPS = 4, 128, 128, 2, 40, 3
RECIPES = {"current": Float8CurrentScaling, "mxfp8": MXFP8BlockScaling,
           "block": Float8BlockScaling, "nvfp4": NVFP4BlockScaling}
#: what each recipe's quantized gather brings the experts' GEMMs
GATHERED = {"current": "Float8Experts", "mxfp8": "Parameter", "block": "Float8BlockExperts",
            "nvfp4": "NVFP4Experts"}


class MoE(nn.Module):
    def __init__(self):
        super().__init__()
        self.experts = lowprec.GroupedExperts(E, H, I, name="experts")

    def forward(self, x, idx, w):
        return self.experts(x, idx, w)


def _batch(step: int):
    g = torch.Generator().manual_seed(200 + step)
    x = torch.randn(T, H, generator=g)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    idx[: T // 4] = 1  # an uneven routing
    return x, idx, torch.rand(T, K, generator=g), torch.randn(T, H, generator=g)


def _train(model, recipe, forward=lambda model, x, idx, w: model(x, idx, w)):
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    for step in range(STEPS):
        x, idx, w, target = _batch(step)
        with lowprec.autocast(recipe=recipe):
            y = forward(model, x, idx, w)
        loss = ((y - target) ** 2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    return torch.stack(losses)


def _model():
    torch.manual_seed(0)
    return MoE()


def _worker(rank, world, rname, out_dir, quantized=False, compiled=False):
    model = _model()
    seen = []
    if quantized:
        quantized_all_gather(model, RECIPES[rname]())
    if compiled:
        # as torchtitan compiles its blocks: the module compiled, then sharded
        model.experts = torch.compile(model.experts, fullgraph=True, backend="aot_eager")
    if quantized:
        # what the experts' GEMMs receive: the unsharded parameter FSDP made (the hook on
        # the compiled wrapper runs eagerly; FSDP's unshard runs before it)
        model.experts.register_forward_pre_hook(
            lambda m, args: seen.append(type(m.gate_up_proj).__name__))
    fsdp.fully_shard(model.experts)
    fsdp.fully_shard(model)
    losses = _train(model, RECIPES[rname]())
    state = {k.replace("._orig_mod", ""): v.full_tensor()
             for k, v in model.state_dict().items()
             if isinstance(v, torch.Tensor) and hasattr(v, "full_tensor")}
    if rank == 0:
        torch.save({"losses": losses, "state": state, "seen": seen},
                   f"{out_dir}/fsdp-{rname}-{quantized}{'-compiled' if compiled else ''}.pt")


def _bf16_worker(rank, world, out_dir, quantized):
    """FSDP computing in bf16 over fp32 experts (MixedPrecisionPolicy), the experts
    gathered in FP8 or in bf16."""
    model = _model()
    if quantized:
        quantized_all_gather(model, Float8CurrentScaling())
    seen = []
    model.experts.register_forward_pre_hook(
        lambda m, args: seen.append((type(m.gate_up_proj).__name__, m.gate_up_proj.dtype)))
    policy = fsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    fsdp.fully_shard(model.experts, mp_policy=policy)
    fsdp.fully_shard(model, mp_policy=policy)
    losses = _train(model, Float8CurrentScaling())
    state = _full(model)
    if rank == 0:
        torch.save({"losses": losses, "state": state, "seen": seen},
                   f"{out_dir}/bf16-{quantized}.pt")


def _all_workers(rank, world, out_dir):
    """Every distributed run of this file in one pair of processes (each spawn costs
    seconds of start-up); each writes its own file for its test."""
    for rname in RECIPES:
        for quantized in (False, True):
            _worker(rank, world, rname, out_dir, quantized)
    for rname in COMPILED:
        _worker(rank, world, rname, out_dir, True, compiled=True)
    for rname in TITAN:
        _titan_worker(rank, world, out_dir, rname)
    _resume_worker(rank, world, out_dir)
    for quantized in (False, True):
        _bf16_worker(rank, world, out_dir, quantized)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp_experts")
    spawn.run(_all_workers, 2, str(out))
    return out


@pytest.mark.parametrize("rname", list(RECIPES))
@pytest.mark.parametrize("quantized", [False, True], ids=["hp-gather", "quantized-gather"])
def test_fsdp_experts_match_single_process(runs, rname, quantized):
    # FP8 current and block scaling and NVFP4 gather the experts quantized; MXFP8 (whose
    # rowwise and columnwise blocks differ) in high precision
    _assert_single_process(runs / f"fsdp-{rname}-{quantized}.pt", rname,
                           [GATHERED[rname]] * STEPS if quantized else [])


def _assert_single_process(path, rname, seen):
    """The run saved at ``path`` saw ``seen`` and trained as one process does, losses and
    final experts bit for bit."""
    got = torch.load(path, weights_only=False)
    assert got["seen"] == seen
    model = _model()
    losses = _train(model, RECIPES[rname]())
    assert torch.equal(got["losses"], losses), (got["losses"], losses)
    assert set(got["state"]) == {"experts.gate_up_proj", "experts.down_proj"}
    for k, v in got["state"].items():
        assert torch.equal(v, model.state_dict()[k]), k


#: recipes whose quantized gathers are also run under torch.compile
COMPILED = ("current", "block", "nvfp4")


@pytest.mark.parametrize("rname", COMPILED)
def test_fsdp_compiled_experts_gathered_quantized_match_single_process(runs, rname):
    """The experts compiled (fullgraph) and then sharded, as torchtitan compiles its
    blocks: the gathered quantized experts enter the compiled call and training still
    equals one eager process bit for bit."""
    _assert_single_process(runs / f"fsdp-{rname}-True-compiled.pt", rname,
                           [GATHERED[rname]] * STEPS)


def _sharded(rank):
    model = _model()
    quantized_all_gather(model, Float8CurrentScaling())
    fsdp.fully_shard(model.experts)
    fsdp.fully_shard(model)
    return model


def _adamw(model, steps, first):
    opt_losses = []
    for step in range(first, first + steps):
        x, idx, w, target = _batch(step)
        with lowprec.autocast(recipe=Float8CurrentScaling()):
            loss = ((model(x, idx, w) - target) ** 2).mean()
        loss.backward()
        model.opt.step()
        model.opt.zero_grad(set_to_none=True)
        opt_losses.append(loss.detach())
    return opt_losses


def _full(model):
    return {k: v.full_tensor() for k, v in model.state_dict().items() if hasattr(v, "full_tensor")}


def _resume_worker(rank, world, out_dir):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    def fresh():
        model = _sharded(rank)
        model.opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        return model
    model = fresh()
    straight = _adamw(model, 3, 0)
    want = _full(model)
    model = fresh()
    first = _adamw(model, 2, 0)
    msd, osd = get_state_dict(model, model.opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=f"{out_dir}/ckpt")
    model = fresh()  # before any forward, as a new process's
    msd, osd = get_state_dict(model, model.opt)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=f"{out_dir}/ckpt")
    set_state_dict(model, model.opt, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])
    resumed = first + _adamw(model, 1, 2)
    got = _full(model)  # a collective: every rank
    if rank == 0:
        torch.save({"straight": straight, "resumed": resumed, "want": want, "got": got},
                   f"{out_dir}/resume.pt")


def test_dcp_resume_with_fp8_expert_gathers_is_bit_identical(runs):
    """torch.distributed.checkpoint of sharded experts gathered in FP8, with AdamW's state:
    two steps, a checkpoint, a fresh model resuming for a third give the uninterrupted run's
    losses and weights bit for bit (the checkpoint holds the high-precision experts)."""
    got = torch.load(runs / "resume.pt", weights_only=False)
    assert all(torch.equal(a, b) for a, b in zip(got["straight"], got["resumed"]))
    assert set(got["want"]) == {"experts.gate_up_proj", "experts.down_proj"}
    for k, v in got["want"].items():
        assert torch.equal(got["got"][k], v), k


def _titan():
    """TorchtitanGroupedExperts over fp32 weights (torchtitan's layout: w1, w3 (E, F, D) and
    w2 (E, D, F)), computing in bf16 as torchtitan's grouped-mm experts do."""
    torch.manual_seed(0)
    src = nn.Module()
    for name, shape in (("w1", (I, H)), ("w2", (H, I)), ("w3", (I, H))):
        setattr(src, name, nn.Parameter(torch.randn(E, *shape) * 0.05))
    return lowprec.modules.experts.TorchtitanGroupedExperts.from_experts(src, "titan")


def _titan_forward(model, x, idx, w):
    """torchtitan's call: the rows sorted by expert (each token's first), the counts."""
    return model(x[idx[:, 0].argsort(stable=True)], torch.bincount(idx[:, 0], minlength=E))


def _titan_train(model, rname="current"):
    return _train(model, RECIPES[rname](), _titan_forward)


#: recipes torchtitan's experts are gathered quantized under
TITAN = ("current", "block", "nvfp4")


def _titan_worker(rank, world, out_dir, rname):
    model = _titan()
    quantized_all_gather(model, RECIPES[rname]())
    seen = []
    model.register_forward_pre_hook(
        lambda m, args: seen.append(sorted({type(getattr(m, n)).__name__
                                            for n in m.param_names})))
    fsdp.fully_shard(model)
    losses = _titan_train(model, rname)
    state = _full(model)
    if rank == 0:
        torch.save({"losses": losses, "state": state, "seen": seen},
                   f"{out_dir}/titan-{rname}.pt")


@pytest.mark.parametrize("rname", TITAN)
def test_fsdp_torchtitan_experts_gathered_quantized_match_single_process(runs, rname):
    """torchtitan's experts (converted) under quantized_all_gather: w1, w3 and w2 gathered
    as the recipe's quantized experts, quantized from the bf16 values the module computes
    on, and training equal to one process bit for bit."""
    got = torch.load(runs / f"titan-{rname}.pt", weights_only=False)
    assert got["seen"] == [[GATHERED[rname]]] * STEPS
    model = _titan()
    assert torch.equal(got["losses"], _titan_train(model, rname))
    assert set(got["state"]) == set(model.param_names)
    for k, v in got["state"].items():
        assert torch.equal(v, getattr(model, k)), k


def test_fsdp_in_bf16_fp8_expert_gathers_equal_bf16_gathers(runs):
    """FSDP computing in bf16 (MixedPrecisionPolicy) over fp32 experts: gathered as FP8
    experts of the compute dtype (quantized from the bf16 values), the run equals the one
    gathering the bf16 weights and quantizing them in the grouped path, bit for bit."""
    fp8 = torch.load(runs / "bf16-True.pt", weights_only=False)
    hp = torch.load(runs / "bf16-False.pt", weights_only=False)
    assert fp8["seen"] == [("Float8Experts", torch.bfloat16)] * STEPS
    assert hp["seen"] == [("Parameter", torch.bfloat16)] * STEPS
    assert torch.equal(fp8["losses"], hp["losses"]), (fp8["losses"], hp["losses"])
    for k, v in hp["state"].items():
        assert v.dtype == torch.float32 and torch.equal(fp8["state"][k], v), k
