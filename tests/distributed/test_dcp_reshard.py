"""torch.distributed.checkpoint of an FSDP2-sharded lowprec model and its AdamW state,
saved on one world size and loaded on another (CPU gloo ranks, or NCCL with
LOWPREC_DIST_BACKEND=nccl).

A checkpoint is saved on 2 ranks after ``K`` steps (``fully_shard`` per layer and at the
root); it is loaded into a fresh model on 3 ranks (the 256 rows split 86/86/84) and into an
unsharded model in one process, and training goes on for ``N`` steps there. The reference is
an uninterrupted 2-rank run of ``K + N`` steps on the same batches. Delayed scaling's
module state (``_extra_state``) is saved on 2 ranks and loaded on 3 the same way.

Every save runs in one 2-rank spawn and every 3-rank load in one 3-rank spawn (module
fixtures): starting the ranks is most of these tests' time."""

from __future__ import annotations

import contextlib

import pytest
import spawn
import torch
import torch.distributed as dist
from test_ddp import _states
from test_fsdp import HIDDEN, _data, _model, full_state, fully_shard

import lowprec
from lowprec.distributed import QuantizedGatherWeight, quantized_all_gather

#: DCP's note on a load without a process group (the one-process loads, meant so)
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

K, N = 2, 2  # steps before the checkpoint, steps after it
LR = 1e-3

#: None: plain parameters, forwards outside lowprec.autocast (no quantization)
RECIPES = {
    "plain": lambda: None,
    "current": lambda: lowprec.Float8CurrentScaling(),
    "mxfp8": lambda: lowprec.MXFP8BlockScaling(),
}
OPTIM_KEYS = ("step", "exp_avg", "exp_avg_sq")


def _build(rname, rank, shard=True):
    """A fresh model (quantized gathers under a quantized recipe), sharded over the world
    unless ``shard`` is False, with its AdamW optimizer."""
    model = _model(rank=rank)
    recipe = RECIPES[rname]()
    if recipe is not None:
        quantized_all_gather(model, recipe)
    if shard:
        for layer in model.layers:
            fully_shard(layer)
        fully_shard(model)
    return model, recipe, torch.optim.AdamW(model.parameters(), lr=LR)


def _steps(model, recipe, opt, first, steps):
    """Losses of AdamW steps ``first .. first + steps - 1`` (batch ``_data(step)``)."""
    device = next(model.parameters()).device
    losses = []
    for step in range(first, first + steps):
        x, target = _data(step, device)
        ctx = lowprec.autocast(recipe=recipe) if recipe is not None else contextlib.nullcontext()
        with ctx:
            y = model(x)
        loss = ((y.float() - target) ** 2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach().cpu())
    return torch.stack(losses)


def _plain(t):
    t = t.full_tensor() if hasattr(t, "full_tensor") else t  # collective for a DTensor
    t = t._data if isinstance(t, QuantizedGatherWeight) else t
    return t.detach().cpu().clone()


def _full_optim(model, opt) -> dict:
    """The optimizer state as whole tensors, ``<param name>.<key>`` (gathered from the
    shards by DTensor, independently of torch.distributed.checkpoint.state_dict)."""
    out = {}
    for name, p in model.named_parameters():
        for k, v in opt.state[p].items():
            if isinstance(v, torch.Tensor):
                out[f"{name}.{k}"] = _plain(v)
    return out


def _snapshot(model, opt) -> dict:
    """Copies (``full_state`` of an unsharded CPU model aliases its live parameters)."""
    return {"model": {k: v.clone() for k, v in full_state(model).items()},
            "optim": _full_optim(model, opt)}


def _save(rank, rname, out_dir):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    model, recipe, opt = _build(rname, rank)
    straight = _steps(model, recipe, opt, 0, K + N)
    want = full_state(model)

    model, recipe, opt = _build(rname, rank)
    _steps(model, recipe, opt, 0, K)
    saved = _snapshot(model, opt)
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=f"{out_dir}/{rname}/ckpt")
    if rank == 0:
        torch.save({"straight": straight, "want": want, "saved": saved},
                   f"{out_dir}/{rname}/saved.pt")


def _save_worker(rank, world, out_dir):
    # one spawn for every run (starting ranks is the slow part of these tests)
    for rname in RECIPES:
        _save(rank, rname, out_dir)
    _delayed_save(rank, f"{out_dir}/delayed")


def _resume(model, recipe, opt, ckpt: str) -> dict:
    """Load ``ckpt`` into the fresh ``model`` and ``opt`` (no forward yet), then train."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    # dcp.load fills the state dict's tensors in place (here the parameters' and the
    # optimizer state's own shards); set_state_dict loads the rest (the param groups)
    dcp.load(state, checkpoint_id=ckpt, no_dist=not dist.is_initialized())
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    loaded = _snapshot(model, opt)
    losses = _steps(model, recipe, opt, K, N)
    return {"loaded": loaded, "losses": losses, "final": full_state(model)}


def _load_worker(rank, world, out_dir):
    for rname in RECIPES:
        model, recipe, opt = _build(rname, rank)
        got = _resume(model, recipe, opt, f"{out_dir}/{rname}/ckpt")
        if rank == 0:
            torch.save(got, f"{out_dir}/{rname}/loaded{world}.pt")
    _delayed_load(rank, f"{out_dir}/delayed")


def _load_single(rname, ckpt) -> dict:
    """World of one: an unsharded model in this process (no process group: DCP reads the
    shards it needs as a plain single-process load)."""
    assert not dist.is_initialized()
    model, recipe, opt = _build(rname, 0, shard=False)
    return _resume(model, recipe, opt, ckpt)


@pytest.fixture(scope="module")
def saved_dir(tmp_path_factory):
    """The 2-rank save runs of every recipe and of delayed scaling (once per module)."""
    path = tmp_path_factory.mktemp("dcp_reshard")
    for rname in [*RECIPES, "delayed"]:
        (path / rname).mkdir()
    spawn.run(_save_worker, 2, str(path))
    return path


@pytest.fixture(scope="module")
def loaded3(saved_dir):
    """The 3-rank load runs of every recipe and of delayed scaling (once per module)."""
    spawn.run(_load_worker, 3, str(saved_dir))
    return saved_dir


def _reshard(request, saved_dir, rname, world):
    """(the save run's results, the load run's on ``world`` ranks)."""
    saved = torch.load(saved_dir / rname / "saved.pt", weights_only=False)
    if world == 1:
        spawn.check_world(1)
        got = _load_single(rname, str(saved_dir / rname / "ckpt"))
    else:
        path = request.getfixturevalue("loaded3")
        got = torch.load(path / rname / "loaded3.pt", weights_only=False)
    return saved, got


def _assert_loaded_exactly(saved, got):
    """Right after loading: every weight and every AdamW state tensor (step, exp_avg,
    exp_avg_sq of every parameter) is the saved run's, bit for bit."""
    want, loaded = saved["saved"], got["loaded"]
    assert loaded["model"].keys() == want["model"].keys() and want["model"]
    for k, v in want["model"].items():
        assert torch.equal(loaded["model"][k], v), k
    params = [k for k in want["model"] if not k.endswith("_extra_state")]
    assert want["optim"].keys() == {f"{p}.{s}" for p in params for s in OPTIM_KEYS}
    assert loaded["optim"].keys() == want["optim"].keys()
    for k, v in want["optim"].items():
        assert torch.equal(loaded["optim"][k], v), k
    assert all(v.item() == K for k, v in want["optim"].items() if k.endswith(".step"))
    # the checks compare real values: the weights moved in the steps since the checkpoint
    assert any(not torch.equal(saved["want"][k], v) for k, v in want["model"].items())


def _assert_continues(saved, got, world, rtol, atol):
    """The steps after loading against the uninterrupted 2-rank run (``saved``): the first
    loss exactly (the same weights and batch give the same forward, on any world size);
    then, on 1 rank over gloo, every loss and the final weights bit for bit (no gradient
    reduction at all, the same CPU kernels on one thread each); on 3 ranks (or NCCL), to
    ``rtol`` / ``atol`` (see the tests)."""
    straight, want = saved["straight"][K:], saved["want"]
    assert torch.isfinite(got["losses"]).all()
    assert torch.equal(got["losses"][0], straight[0])
    assert got["final"].keys() == want.keys()
    if world == 1 and spawn.BACKEND == "gloo":
        assert torch.equal(got["losses"], straight), (got["losses"], straight)
        for k, v in want.items():
            assert torch.equal(got["final"][k], v), k
        return
    torch.testing.assert_close(got["losses"], straight, rtol=rtol, atol=0)
    for k, v in want.items():
        torch.testing.assert_close(got["final"][k], v, rtol=rtol, atol=atol, msg=k)


@pytest.mark.parametrize("world", [3, 1])
def test_plain_checkpoint_reshards(request, saved_dir, world):
    """Plain parameters (forwards outside lowprec.autocast) saved after 2 AdamW steps on 2
    ranks, loaded into a fresh model on ``world`` ranks (3: uneven shards; 1: an unsharded
    model in one process), 2 more steps there. Right after loading, the whole weights and
    the AdamW state equal the saved ones bit for bit. The next loss is the uninterrupted
    run's exactly. On 3 ranks the gradient is then a reduce-scatter mean over three
    ranks, rounded otherwise than over two, so the later losses and the final weights
    match the uninterrupted 2-rank run to float rounding: rtol 1e-5 with atol 1e-7 (seen:
    1 ulp, 7e-9 on weights of 0.06), far below a step's update (lr 1e-3), which an
    optimizer state that did not load would change. On 1 rank (gloo): bit for bit."""
    saved, got = _reshard(request, saved_dir, "plain", world)
    _assert_loaded_exactly(saved, got)
    _assert_continues(saved, got, world, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("world", [3, 1])
@pytest.mark.parametrize("rname", ["current", "mxfp8"])
def test_quantized_gather_checkpoint_reshards(request, saved_dir, rname, world):
    """The same with a quantized recipe and ``quantized_all_gather`` applied before
    ``fully_shard`` on both sides (on one process the unsharded model keeps the wrappers,
    whose ops run on the weight inside): the checkpoint holds plain tensors and loads on
    another world size (on 3 ranks the uneven MXFP8 shards gather in high precision,
    per-tensor FP8 pads its one input); the weights and AdamW state equal the saved ones
    bit for bit right after loading and the next loss is the uninterrupted run's exactly.
    Training goes on: finite losses within rtol 5e-2 of the uninterrupted run's, the
    final weights within rtol 5e-2 / atol 1e-4 (a quantized forward can turn a rounding
    difference of the gradient into a code one step apart); on 1 rank (gloo) bit for bit."""
    saved, got = _reshard(request, saved_dir, rname, world)
    _assert_loaded_exactly(saved, got)
    _assert_continues(saved, got, world, rtol=5e-2, atol=1e-4)


# ---- delayed scaling ---------------------------------------------------------------------
DELAYED_STEPS = 3


def _delayed(rank):
    model = _model(rank=rank)
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=LR), lowprec.DelayedScaling(
        amax_history_len=4)


def _delayed_save(rank, out_dir):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    model, opt, recipe = _delayed(rank)
    g = torch.Generator().manual_seed(1000 + rank)  # each rank its own data
    for _ in range(DELAYED_STEPS):
        x = (torch.randn(32, HIDDEN, generator=g) * (rank + 1)).to(spawn.device(rank))
        with lowprec.autocast(recipe=recipe, amax_reduction_group=dist.group.WORLD):
            y = model(x)
        (y.float() ** 2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=f"{out_dir}/ckpt")
    torch.save({"states": _states(model), "model": full_state(model)},
               f"{out_dir}/saved{rank}.pt")


def _delayed_load(rank, out_dir):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    model, opt, recipe = _delayed(rank)
    assert _states(model) == {}  # before its first forward a module has no state
    # the recipe attached: each module makes its (fresh) state now, so its _extra_state
    # tensor has the saved size and DCP loads into it in place
    lowprec.attach_recipe(model, recipe, amax_reduction_group=dist.group.WORLD)
    fresh = _states(model)
    assert fresh and all(not v.any() for k, v in fresh.items() if "amax" in k)
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=f"{out_dir}/ckpt")
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    # the first forward takes the loaded state up (a no_grad forward does not move it)
    with lowprec.autocast(recipe=recipe, amax_reduction_group=dist.group.WORLD):
        with torch.no_grad():
            model(torch.zeros(32, HIDDEN, device=spawn.device(rank)))
    torch.save({"states": _states(model), "model": full_state(model)},
               f"{out_dir}/loaded{rank}.pt")


def test_delayed_scaling_state_reshards(saved_dir, loaded3):
    """Delayed scaling with ``amax_reduction_group=WORLD`` (every rank holds the same
    state although the ranks see different data): each module's ``_extra_state``
    (a tensor: scales and amax histories, forward and backward) saved on 2 ranks loads
    into a fresh model with the recipe attached on 3 ranks before its first forward, and
    after that forward every rank's state equals the saved one bit for bit (as do the
    weights)."""
    path = saved_dir / "delayed"
    s0, s1 = (torch.load(path / f"saved{r}.pt") for r in range(2))
    want = s0["states"]
    assert want and want.keys() == s1["states"].keys()
    assert all(torch.equal(s1["states"][k], v) for k, v in want.items())
    # a state of its own, unlike a fresh one (scales of one, an empty history)
    assert any(k.endswith("scale") and not torch.equal(v, torch.ones_like(v))
               for k, v in want.items())
    assert any(k.endswith("amax_history") and v.any() for k, v in want.items())
    for r in range(3):
        got = torch.load(path / f"loaded{r}.pt")
        assert got["states"].keys() == want.keys(), r
        for k, v in want.items():
            assert torch.equal(got["states"][k], v), (r, k)
        for k, v in s0["model"].items():
            assert torch.equal(got["model"][k], v), (r, k)
