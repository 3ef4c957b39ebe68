"""FSDP2 (fully_shard) over lowprec modules, on CPU gloo ranks: training matches one
process bit for bit, and quantized_all_gather gathers each format's codes and scales."""

from __future__ import annotations

import pytest
import spawn
import torch
from torch import nn

import lowprec
from lowprec.distributed import (
    QuantizedGatherWeight,
    precompute_gather_statistics,
    quantized_all_gather,
)
from lowprec.formats.base import QuantizedTensor
from lowprec.recipe import factories

fsdp = pytest.importorskip("torch.distributed.fsdp")
fully_shard = fsdp.fully_shard

def _nvfp4_sr_everywhere(role):
    return lowprec.NVFP4Quantizer(stochastic_rounding=True)


def _nvfp4_1x16_everywhere(role):
    return lowprec.NVFP4Quantizer()


def _block_1x128_everywhere(role):
    return lowprec.Float8BlockQuantizer(torch.float8_e4m3fn, block_scaling_dim=1)


RECIPES = {
    "current": lambda: lowprec.Float8CurrentScaling(),
    "delayed": lambda: lowprec.DelayedScaling(),
    "block": lambda: lowprec.Float8BlockScaling(),
    "mxfp8": lambda: lowprec.MXFP8BlockScaling(),
    "nvfp4": lambda: lowprec.NVFP4BlockScaling(disable_stochastic_rounding=True),
    # 1x16 weight blocks: the columnwise codes do not derive (gathered apart, as MXFP8's)
    "nvfp4_1x16": lambda: lowprec.CustomRecipe(qfactory=_nvfp4_1x16_everywhere),
    "block_1x128": lambda: lowprec.CustomRecipe(qfactory=_block_1x128_everywhere),
}
#: gathered in high precision (see test_formats_gathered_in_high_precision)
HP_RECIPES = {
    "nvfp4_sr": lambda: lowprec.CustomRecipe(qfactory=_nvfp4_sr_everywhere),
    "hybrid": lambda: lowprec.CustomRecipe(qfactory=factories.mxfp8_fwd_nvfp4_bwd_factory),
}
#: the unsharded weight's class during forward with quantized_all_gather (None: the
#: weight is gathered in high precision)
GATHERED = {"current": lowprec.Float8Tensor, "delayed": None,
            "block": lowprec.Float8BlockwiseTensor, "mxfp8": lowprec.MXFP8Tensor,
            "nvfp4": lowprec.NVFP4Tensor, "nvfp4_1x16": lowprec.NVFP4Tensor,
            "block_1x128": lowprec.Float8BlockwiseTensor, "nvfp4_sr": None,
            "hybrid": None}
RECIPES.update(HP_RECIPES)
HIDDEN, TOKENS, STEPS = 256, 64, 3


class Model(nn.Module):
    def __init__(self, rows: int = HIDDEN, hidden: int = HIDDEN):
        super().__init__()
        self.layers = nn.ModuleList([
            lowprec.Linear(hidden, rows, name="l0"),
            lowprec.LayerNormMLP(rows, 2 * hidden, name="mlp"),
            lowprec.Linear(rows, hidden, name="l2")])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def _data(step: int, device, tokens: int = TOKENS, hidden: int = HIDDEN):
    g = torch.Generator().manual_seed(100 + step)
    x, t = torch.randn(tokens, hidden, generator=g), torch.randn(tokens, hidden, generator=g)
    return x.to(device), t.to(device)


def train(model, recipe, steps: int = STEPS, record=None, after_step=None, input_grads=None,
          tokens: int = TOKENS, hidden: int = HIDDEN):
    """Losses of ``steps`` SGD steps on the same batches of ``tokens`` rows of ``hidden``;
    ``record(module)`` is called in each Linear's forward, ``after_step()`` after each
    optimizer step. ``input_grads``: a list that gets the gradient of each step's input
    (which every layer's dgrad makes)."""
    hooks = []
    if record is not None:
        for m in model.modules():
            if isinstance(m, lowprec.Linear):
                hooks.append(m.register_forward_pre_hook(lambda mod, args: record(mod)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    device = next(model.parameters()).device
    losses = []
    for step in range(steps):
        x, target = _data(step, device, tokens, hidden)
        x.requires_grad_(input_grads is not None)
        with lowprec.autocast(recipe=recipe):
            y = model(x)
        loss = ((y.float() - target) ** 2).mean()
        loss.backward()
        if input_grads is not None:
            input_grads.append(x.grad.cpu())
        opt.step()
        opt.zero_grad(set_to_none=True)
        if after_step is not None:
            after_step()
        losses.append(loss.detach())
    for h in hooks:
        h.remove()
    return torch.stack(losses)


def full_state(model) -> dict:
    out = {}
    for k, v in model.state_dict().items():
        if isinstance(v, torch.Tensor):
            v = v.full_tensor() if hasattr(v, "full_tensor") else v
            v = v._data if isinstance(v, QuantizedGatherWeight) else v
            out[k] = v.cpu()
    return out


def _model(rows: int = HIDDEN, rank: int = 0, hidden: int = HIDDEN):
    torch.manual_seed(0)
    return Model(rows, hidden).to(spawn.device(rank))


#: (quantized_all_gather, reshard_after_forward) of each run test_fsdp_matches_single_process
#: makes in one spawn
WAYS = [(True, True), (True, False), (False, True), (False, False)]


def _ways_worker(rank, world, rname, ways, out_dir):
    """``_worker`` for each of ``ways`` on the same ranks (starting ranks and their first
    calls cost more than a run), each saved to its own file."""
    import os
    for wrap, reshard in ways:
        way_dir = f"{out_dir}/{int(wrap)}{int(reshard)}"
        os.makedirs(way_dir, exist_ok=True)
        _worker(rank, world, rname, wrap, HIDDEN, reshard, way_dir)


def _worker(rank, world, rname, wrap, rows, reshard, out_dir, precompute=False):
    model = _model(rows, rank)
    recipe = RECIPES[rname]()
    if wrap:
        quantized_all_gather(model, recipe)
    for layer in model.layers:
        fully_shard(layer, reshard_after_forward=reshard)
    fully_shard(model, reshard_after_forward=reshard)
    seen, aligned = [], []
    with spawn.counted_all_reduces() as reduces:
        steps = []

        def after_step():  # precompute="once": after the first step only
            if precompute is True or not steps:
                precompute_gather_statistics(model)
                # each statistic 16-byte aligned, as the gathers' bound launches want them
                stats = [p._local_tensor._statistic[2] for p in model.parameters()
                         if isinstance(p._local_tensor, QuantizedGatherWeight)]
                aligned.append(bool(stats) and all(t.data_ptr() % 16 == 0 for t in stats))
            steps.append(1)
        losses = train(model, recipe, record=lambda m: seen.append(type(m.weight).__name__),
                       after_step=after_step if precompute else None)
    state = full_state(model)
    if rank == 0:
        torch.save({"losses": losses.cpu(), "state": state, "seen": seen, "reduces": reduces,
                    "aligned": aligned}, f"{out_dir}/fsdp.pt")


def _single(rname, rows):
    model = _model(rows)
    losses = train(model, RECIPES[rname]())
    return losses.cpu(), {k: v.cpu() for k, v in model.state_dict().items()
                          if isinstance(v, torch.Tensor)}


@pytest.mark.parametrize("rname", [r for r in RECIPES if r not in HP_RECIPES])
def test_fsdp_matches_single_process(tmp_path, rname, ways=WAYS):
    """Two ranks on the same batches (the averaged gradient is the one process's exactly),
    weights gathered quantized and in high precision, resharded after forward and kept:
    losses and the final weights bit-identical to one process."""
    spawn.run(_ways_worker, 2, rname, ways, str(tmp_path))
    losses, state = _single(rname, HIDDEN)
    for wrap, reshard in ways:
        way = f"quantized_all_gather={wrap} reshard_after_forward={reshard}"
        got = torch.load(tmp_path / f"{int(wrap)}{int(reshard)}" / "fsdp.pt",
                         weights_only=False)
        assert torch.equal(got["losses"], losses), (way, got["losses"], losses)
        assert state.keys() == got["state"].keys(), way
        for k in state:
            assert torch.equal(got["state"][k], state[k]), (way, k)
        expect = GATHERED[rname].__name__ if wrap and GATHERED[rname] else "Parameter"
        assert set(got["seen"]) == {expect} or (
            expect == "Parameter" and set(got["seen"]) == {"Tensor"}), (way, got["seen"])


def _compiled_worker(rank, world, rname, tokens, width, out_dir):
    model = _model(width, rank, width)
    recipe = RECIPES[rname]()
    # one group (torchtitan's converter attaches the recipe, which does the same): delayed
    # scaling's states are made for every layer as the first is traced
    lowprec.init_scaling_state(model, recipe)
    quantized_all_gather(model, recipe)
    for layer in model.layers:  # compiled, then sharded (torchtitan's order)
        # on GPUs inductor, whose partitioner chooses what the forward keeps
        layer.compile(backend="inductor" if spawn.BACKEND == "nccl" else "aot_eager")
        fully_shard(layer)
    fully_shard(model)
    torch._dynamo.utils.counters.clear()
    grads = []
    losses = train(model, recipe, input_grads=grads, tokens=tokens, hidden=width)
    breaks = dict(torch._dynamo.utils.counters["graph_break"])
    frames = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    # the classes of the quantized weights whose calls were decided outside the trace (a
    # decision's key holds the weight's key seventh: its class where it is quantized)
    from lowprec.linear import decided
    quantized = sorted({k[6][0].__name__ for k in decided._NAMES if isinstance(k[6][0], type)})
    state = full_state(model)
    if rank == 0:
        torch.save({"losses": losses.cpu(), "state": state, "breaks": breaks,
                    "graphs": frames, "grads": grads, "decided": quantized},
                   f"{out_dir}/fsdp.pt")


@pytest.mark.parametrize("rname", ["current", "delayed", "mxfp8", "nvfp4", "block",
                                   # (their columnwise gathers are MXFP8's path, its
                                   # formats run here under the named recipes)
                                   pytest.param("block_1x128", marks=pytest.mark.slow),
                                   pytest.param("nvfp4_1x16", marks=pytest.mark.slow)])
def test_compiled_layers_with_quantized_gathers(tmp_path, rname):
    """Layers (Linear, LayerNormMLP) compiled one by one before fully_shard, their weights
    gathered quantized: training matches one eager process bit for bit, losses, weights
    and every step's input gradient (which each layer's dgrad makes, from weights FSDP
    re-gathered for the backward). The graphs read the gathered tensors: per-tensor FP8,
    NVFP4 (16x16 tiles) and block FP8 (128x128 blocks) their rowwise codes, which dgrad
    transposes; MXFP8 (1x32 blocks), NVFP4 in 1x16 blocks and block FP8 in 1x128 blocks
    the columnwise codes that the backward's gather brings into the forward's buffers.
    With NCCL block FP8 runs 128 tokens at a width of 512, so that every GEMM is one
    cuBLAS takes (128x128 scales need K / 128 a multiple of 4 on CUDA; eager's fp32
    emulation of other shapes does not trace there); gloo ranks emulate any shape.
    Delayed scaling (gathered in high precision) reads each layer's own scales. No graph
    break: one graph for the two Linears (no recompile per module), one for the
    LayerNormMLP. Under the built-in recipes the gathered weights' calls are decided once
    outside the trace."""
    block = rname.startswith("block") and spawn.BACKEND == "nccl"
    tokens, width = (128, 512) if block else (TOKENS, HIDDEN)
    spawn.run(_compiled_worker, 2, rname, tokens, width, str(tmp_path))
    got = torch.load(tmp_path / "fsdp.pt", weights_only=False)
    assert got["breaks"] == {}, list(got["breaks"])
    assert got["graphs"] == 2, got["graphs"]
    # under a built-in recipe the gathered weights' calls are decided once, outside
    # dynamo's interpretation (lowprec.linear.decided); a CustomRecipe's factory is asked
    # in the trace, and delayed scaling gathers in high precision
    builtin = not rname.startswith(("nvfp4_", "block_")) and GATHERED[rname] is not None
    assert got["decided"] == ([GATHERED[rname].__name__] if builtin else []), got["decided"]
    model, grads = _model(width, hidden=width), []
    losses = train(model, RECIPES[rname](), input_grads=grads, tokens=tokens,
                   hidden=width).cpu()
    state = {k: v.cpu() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
    assert torch.equal(got["losses"], losses), (got["losses"], losses)
    for got_grad, grad in zip(got["grads"], grads, strict=True):  # every layer's dgrad
        assert torch.equal(got_grad, grad)
    for k in state:
        assert torch.equal(got["state"][k], state[k]), k


def _bytes_worker(rank, world, out_dir):
    """The bytes a step's gathers move in high precision (under per-tensor FP8: the recipe
    does not change what FSDP gathers of plain parameters), then quantized under each
    recipe of ``GATHER_BYTES``."""
    from lowprec.distributed.diagnostics import count_all_gather_bytes
    out = {}
    for rname, wrap in [("current", False)] + [(r, True) for r in GATHER_BYTES]:
        model = _model(rank=rank)
        recipe = RECIPES[rname]()
        if wrap:
            quantized_all_gather(model, recipe)
        for layer in model.layers:
            fully_shard(layer)
        fully_shard(model)
        train(model, recipe, steps=1)  # the first step sizes FSDP's buffers
        with count_all_gather_bytes() as counter:
            train(model, recipe, steps=1)
        out[rname if wrap else "hp"] = counter.bytes
    if rank == 0:
        torch.save(out, f"{out_dir}/bytes.pt")


#: bytes per weight element a step gathers, twice (forward, and backward again after
#: resharding), against fp32 parameters' 2 x 4: FP8 data, fp32 128x128 block scales, E8M0
#: 1x32 scales, E2M1 codes with E4M3 16x16 scales (per-tensor scales travel apart)
GATHER_BYTES = {"current": 2 * 1, "block": 2 * (1 + 4 / 128 ** 2),
                "mxfp8": 2 * (1 + 1 / 32), "nvfp4": 2 * (0.5 + 1 / 16 ** 2)}


def test_quantized_all_gather_bytes(tmp_path):
    """The gathers of a training step move each format's bytes per weight element (plus
    the norms and biases, gathered in their fp32)."""
    spawn.run(_bytes_worker, 2, str(tmp_path))
    got = torch.load(tmp_path / "bytes.pt")
    hp = got["hp"]
    weights = 2 * HIDDEN * HIDDEN + 2 * (2 * HIDDEN * HIDDEN)
    others = hp - 2 * 4 * weights  # forward and backward gathers, 4 bytes an element
    assert others >= 0
    for rname, per_element in GATHER_BYTES.items():
        q = got[rname]
        assert q == pytest.approx(weights * per_element + others, rel=1e-6), (rname, q, hp)


def _uneven_worker(rank, world, rnames, out_dir):
    for rname in rnames:
        model = _model(rank=rank)
        recipe = RECIPES[rname]()
        quantized_all_gather(model, recipe)
        for layer in model.layers:
            fully_shard(layer)
        fully_shard(model)
        seen = []
        losses = train(model, recipe, record=lambda m: seen.append(type(m.weight).__name__))
        state = full_state(model)
        if rank == 0:
            torch.save({"losses": losses.cpu(), "state": state, "seen": seen},
                       f"{out_dir}/{rname}.pt")


#: what an uneven shard (256 rows on 3 ranks) gathers: per-tensor FP8 sends one input,
#: which FSDP pads; the formats with scale inputs gather in high precision
UNEVEN = {"current": "Float8Tensor", "block": "Parameter", "mxfp8": "Parameter",
          "nvfp4": "Parameter"}


def test_uneven_shards(tmp_path):
    """World size 3 on 256 rows (shards of 86, 86 and 84 rows), under each recipe of
    ``UNEVEN`` (one spawn): the first forward is one process's bit for bit; the next
    steps, whose gradients are means over three equal contributions (rounded), stay
    within float tolerance of it."""
    spawn.run(_uneven_worker, 3, list(UNEVEN), str(tmp_path))
    for rname, gathered in UNEVEN.items():
        got = torch.load(tmp_path / f"{rname}.pt", weights_only=False)
        losses, state = _single(rname, HIDDEN)
        assert torch.equal(got["losses"][0], losses[0]), rname
        torch.testing.assert_close(got["losses"], losses, rtol=1e-3, atol=0, msg=rname)
        for k in state:
            torch.testing.assert_close(got["state"][k], state[k], rtol=1e-3, atol=1e-4,
                                       msg=f"{rname}: {k}")
        assert set(got["seen"]) == {gathered}, (rname, got["seen"])


def _meta_worker(rank, world, rname, out_dir):
    with torch.device("meta"):
        model = Model()
    recipe = RECIPES[rname]()
    quantized_all_gather(model, recipe)
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    model.to_empty(device=spawn.device(rank))
    torch.manual_seed(0)
    for m in model.modules():
        if isinstance(m, lowprec.Linear) or isinstance(m, lowprec.LayerNormMLP):
            m.reset_parameters()
    seen = []
    losses = train(model, recipe, record=lambda m: seen.append(type(m.weight).__name__))
    state = full_state(model)
    if rank == 0:
        torch.save({"losses": losses.cpu(), "state": state, "seen": seen}, f"{out_dir}/fsdp.pt")


@pytest.mark.parametrize("rname", ["current", "mxfp8"])
def test_meta_device_init(tmp_path, rname):
    """torchtitan's deferred init: meta model -> quantized_all_gather -> fully_shard ->
    to_empty -> reset_parameters, then training with quantized gathers."""
    spawn.run(_meta_worker, 2, rname, str(tmp_path))
    got = torch.load(tmp_path / "fsdp.pt", weights_only=False)
    assert torch.isfinite(got["losses"]).all()
    assert set(got["seen"]) == {GATHERED[rname].__name__}
    w = got["state"]["layers.0.weight"]
    bound = 1 / HIDDEN ** 0.5  # nn.Linear's init, drawn again by reset_parameters
    assert w.abs().max() <= bound * 1.01 and w.std() > bound / 4
    # the norm's weight starts at one (three small SGD steps since)
    assert (got["state"]["layers.1.layer_norm_weight"] - 1).abs().max() < 0.05


@pytest.mark.parametrize("rname", ["nvfp4_sr", "hybrid"])
def test_formats_gathered_in_high_precision(tmp_path, rname):
    """NVFP4 weights with stochastic rounding and hybrid formats depend on more than the
    shard: they gather in high precision and still train as one process does."""
    test_fsdp_matches_single_process(tmp_path, rname, ways=[(True, True)])


@pytest.mark.parametrize("precompute", [True, "once"], ids=["every_step", "first_step_only"])
@pytest.mark.parametrize("rname", ["current", "nvfp4"])
def test_precomputed_statistics(tmp_path, rname, precompute):
    """precompute_gather_statistics after each step: the same training bit for bit, and
    the gathers of the following steps run no all-reduce of their own (one per step for
    every weight instead of one per weight and gather). Called after the first step only,
    the later steps' gathers all-reduce their own statistics again (never the stale one):
    still bit for bit, one all-reduce a layer (its first weight's gather reduces the
    layer's statistics together)."""
    spawn.run(_worker, 2, rname, True, HIDDEN, True, str(tmp_path), precompute)
    got = torch.load(tmp_path / "fsdp.pt", weights_only=False)
    losses, state = _single(rname, HIDDEN)
    assert torch.equal(got["losses"], losses)
    for k in state:
        assert torch.equal(got["state"][k], state[k]), k
    assert got["aligned"] and all(got["aligned"]), got["aligned"]
    weights = 4
    # step 1: a reduce per weight in its forward's gather (the backward's reads the
    # forward's); after each step, one reduce of every weight's statistic (a row of four
    # int32 words each, 16 bytes); then no more in the gathers. Without the call, a
    # layer's gathers reduce once from the second step on: l0's, the LayerNormMLP's two
    # weights together (two rows), l2's
    if precompute is True:
        assert got["reduces"] == [1] * weights + [4 * weights] * STEPS, got["reduces"]
    else:
        assert got["reduces"] == [1] * weights + [4 * weights] + [1, 8, 1] * (STEPS - 2), \
            got["reduces"]


def _group_worker(rank, world, out_dir):
    from lowprec.distributed.fsdp import _fsdp_param_group
    model = _model(rank=rank)
    fully_shard(model.layers[1])
    fully_shard(model)  # layers 0 and 2 belong to the root's group
    groups = [_fsdp_param_group(model.layers[i], "weight") for i in (0, 2)]
    mlp = _fsdp_param_group(model.layers[1], "fc1_weight")
    assert groups[0] is not None and groups[0] is groups[1] and mlp is not None
    assert mlp is not groups[0]


def test_param_group_of_a_module_inside_a_sharded_one(tmp_path):
    """FSDP hands the gather hooks the module owning the weight; its parameter group (whose
    phase decides which directions to gather) is the enclosing fully_shard's."""
    spawn.run(_group_worker, 2, str(tmp_path))


def _sharded(rname, rank, wrap=True):
    model = _model(rank=rank)
    recipe = RECIPES[rname]()
    if wrap:
        quantized_all_gather(model, recipe)
    fully_shard(model.layers[1])
    fully_shard(model)  # layers 0 and 2 in the root's group, the MLP in its own
    return model, recipe


def _adamw_steps(model, recipe, opt, steps, first):
    device = next(model.parameters()).device
    losses = []
    for step in range(first, first + steps):
        x, target = _data(step, device)
        with lowprec.autocast(recipe=recipe):
            loss = ((model(x).float() - target) ** 2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach().cpu())
    return losses


def _resume_worker(rank, world, rname, out_dir):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    model, recipe = _sharded(rname, rank)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    straight = _adamw_steps(model, recipe, opt, 3, 0)
    want = full_state(model)

    model, recipe = _sharded(rname, rank)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    first = _adamw_steps(model, recipe, opt, 2, 0)
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=f"{out_dir}/ckpt")

    model, recipe = _sharded(rname, rank)  # a fresh process's model, before any forward
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=f"{out_dir}/ckpt")
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    resumed = first + _adamw_steps(model, recipe, opt, 1, 2)
    got = full_state(model)
    if rank == 0:
        torch.save({"straight": straight, "resumed": resumed, "want": want, "got": got},
                   f"{out_dir}/resume.pt")


@pytest.mark.parametrize("rname", ["current", "mxfp8"])
def test_dcp_resume_is_bit_identical(tmp_path, rname):
    """torch.distributed.checkpoint of a sharded model with quantized gathers and its
    AdamW state: stopping after two steps and resuming in a fresh model gives the
    uninterrupted run's third step and weights bit for bit (the checkpoint holds plain
    high-precision tensors)."""
    spawn.run(_resume_worker, 2, rname, str(tmp_path))
    got = torch.load(tmp_path / "resume.pt", weights_only=False)
    assert all(torch.equal(a, b) for a, b in zip(got["straight"], got["resumed"]))
    for k, v in got["want"].items():
        assert torch.equal(got["got"][k], v), k


def _round_trips(obj) -> None:
    """pickle, deepcopy and torch.save of ``obj``; a tensor comes back equal."""
    import copy
    import io
    import pickle
    clone = pickle.loads(pickle.dumps(obj))
    copy.deepcopy(obj)
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    if isinstance(obj, torch.Tensor):
        plain = (lambda t: t.dequantize()) if isinstance(obj, QuantizedTensor) else (lambda t: t)
        assert torch.equal(plain(clone), plain(obj)) and torch.equal(plain(loaded), plain(obj))


def _pickle_worker(rank, world, out_dir):
    import pickle
    model, recipe = _sharded("current", rank)
    gathered = []

    def record(m):
        # the unsharded weight is valid while FSDP holds it gathered (its storage is freed
        # at reshard, as a plain FSDP parameter's is)
        if torch.is_grad_enabled():
            gathered.append(type(m.weight))
            _round_trips(m.weight)
    train(model, recipe, steps=2, record=record)
    assert gathered and set(gathered) == {lowprec.Float8Tensor}
    x, _ = _data(0, spawn.device(rank))
    with lowprec.autocast(recipe=recipe):
        y = model(x)
    y.sum().backward()
    with lowprec.autocast(recipe=recipe):
        quantizers = model.layers[0].gemm_quantizers(x.device)[0][0]
    for obj in (y.detach(), quantizers, recipe, quantizers.input.quantize(x)):
        _round_trips(obj)
    # the wrapped weight saves as its plain high-precision values: a Parameter where torch
    # marks FSDP's local shard as one (2.13), a plain tensor where it does not (2.11)
    w = model.layers[0].weight.to_local()
    loaded = pickle.loads(pickle.dumps(w))
    assert type(loaded) in (torch.Tensor, torch.nn.Parameter), type(loaded)
    assert torch.equal(loaded, w._data)


def test_no_process_group_stays_behind(tmp_path):
    """Around a distributed forward and backward, the gathered quantized weight, the
    output, the quantizers, their quantized tensors and the recipe pickle, deep-copy and
    torch.save. (Modules under fully_shard cannot be pickled in any case: FSDP2 gives
    them classes and hooks made at run time.)"""
    spawn.run(_pickle_worker, 2, str(tmp_path))
