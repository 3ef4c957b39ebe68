"""lowprec's torchtitan model converter (lowprec/integrations/torchtitan.py) on torchtitan's
debug Llama 3, on the CPU: the config parses with the ``[lowprec]`` section, the converter
is found in ``model.converters``'s registry, and the model goes through torchtitan's own
build steps (meta-device model, converters, ``parallelize_fn`` with per-block compile and
FSDP2, ``init_weights``, its optimizer and loss) and trains; two gloo ranks with quantized
all-gathers train as one process does, bit for bit.

Skipped where torchtitan does not import (the ``torchtitan`` extra in pyproject.toml)."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))
import spawn  # noqa: E402

try:  # torchtitan 0.2.x and what it imports (datasets, tensorboard, triton, ...)
    import torchtitan.protocols.model_converter  # noqa: F401
except ImportError as err:  # any of them missing
    pytest.skip(f"torchtitan does not import: {err}", allow_module_level=True)

import torchtitan.distributed.parallel_dims as titan_parallel_dims  # noqa: E402
from torch.distributed.fsdp import FSDPModule  # noqa: E402
from torchtitan.config import ConfigManager  # noqa: E402
from torchtitan.distributed import ParallelDims  # noqa: E402
from torchtitan.protocols.model_converter import build_model_converters  # noqa: E402
from torchtitan.protocols.train_spec import get_train_spec  # noqa: E402

import lowprec  # noqa: E402
from lowprec.distributed import QuantizedGatherWeight  # noqa: E402

SEQ, BATCH, STEPS = 64, 2, 3
#: recipes every debug-model Linear can take (dims 256 and 768), bf16 included
RECIPES = ["fp8_current", "fp8_delayed", "fp8_block", "mxfp8", "nvfp4", "bf16"]


def job_config(*args: str):
    """torchtitan's JobConfig parsed from a command line, with lowprec's section."""
    return ConfigManager().parse_args([
        "--job.custom_config_module", "lowprec.integrations.torchtitan",
        "--model.name", "llama3", "--model.flavor", "debugmodel",
        "--training.seq_len", str(SEQ), "--training.local_batch_size", str(BATCH),
        *args])


def parallel_dims(cfg, world: int) -> ParallelDims:
    p = cfg.parallelism
    return ParallelDims(dp_shard=p.data_parallel_shard_degree,
                        dp_replicate=p.data_parallel_replicate_degree,
                        cp=p.context_parallel_degree, tp=p.tensor_parallel_degree,
                        pp=p.pipeline_parallel_degree, ep=p.expert_parallel_degree,
                        etp=p.expert_tensor_parallel_degree, world_size=world)


def _clean(name: str) -> str:
    for wrapper in ("_orig_mod.", "_checkpoint_wrapped_module."):
        name = name.replace(wrapper, "")
    return name


def initial_weights(cfg) -> dict:
    """The debug model's weights as torchtitan initializes them (seed 0), by name."""
    spec = get_train_spec(cfg.model.name)
    args = copy.deepcopy(spec.model_args[cfg.model.flavor])
    args.update_from_config(cfg)
    torch.manual_seed(0)
    model = spec.model_cls(args)
    with torch.no_grad():
        model.init_weights()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def build(cfg, world: int = 1, weights: dict | None = None):
    """What torchtitan's Trainer does to build the model and its optimizer (train.py):
    meta-device model, converters, parallelize_fn, to_empty + init_weights, optimizers
    with the converters' post-optimizer hook. ``weights`` (by name) then replace the
    initialized ones, on every rank the same."""
    dims = parallel_dims(cfg, world)
    spec = get_train_spec(cfg.model.name)
    args = copy.deepcopy(spec.model_args[cfg.model.flavor])
    args.update_from_config(cfg)
    with torch.device("meta"):
        model = spec.model_cls(args)
    converters = build_model_converters(cfg, dims)
    converters.convert(model)
    model = spec.parallelize_fn(model, dims, cfg)
    if dims.fsdp_enabled and torch.distributed.get_backend() == "gloo":
        # torchtitan sets FSDP's gradient divide factor to 1 (its loss is divided by the
        # global token count), which FSDP reduces with PREMUL_SUM, which gloo lacks
        for m in model.modules():
            if isinstance(m, FSDPModule):
                m.set_force_sum_reduction_for_comms(True)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
        if weights is not None:
            for name, p in model.named_parameters():
                full = weights[_clean(name)]
                if hasattr(p, "device_mesh"):  # an FSDP2 shard
                    from torch.distributed.tensor import distribute_tensor
                    full = distribute_tensor(full, p.device_mesh, p.placements).to_local()
                    p = p.to_local()
                p.copy_(full)
    model.train()
    optimizers = spec.build_optimizers_fn([model], cfg.optimizer, dims)
    optimizers.register_step_post_hook(
        lambda *args, **kwargs: converters.post_optimizer_hook([model]))
    loss_fn = spec.build_loss_fn(cfg, parallel_dims=dims)
    return model, optimizers, loss_fn, converters


def batch(step: int):
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, 2048, (BATCH, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def train(model, optimizers, loss_fn, steps: int = STEPS, world: int = 1,
          emulate: int = 1) -> torch.Tensor:
    """torchtitan's train_step on the same batch on every rank: the loss sum over the
    global token count, backward, gradient clipping, optimizer step. Returns the losses
    (summed over ranks: the global average loss, as torchtitan logs it).

    ``emulate``: one process computes what each of ``emulate`` such ranks computes (its
    loss over ``emulate`` times its tokens) and sums the gradients as FSDP2's
    reduce-scatter does (``emulate`` equal terms: a multiplication, exact)."""
    torch.manual_seed(1)  # NVFP4's stochastic rounding draws from it
    losses = []
    for step in range(steps):
        optimizers.zero_grad()
        inputs, labels = batch(step)
        loss = loss_fn(model(inputs), labels) / (labels.numel() * world * emulate)
        loss.backward()
        for p in model.parameters():
            if emulate > 1 and p.grad is not None:
                p.grad.mul_(emulate)
        torch.nn.utils.clip_grad_norm_(list(model.parameters()), 1e9)
        optimizers.step()
        loss = loss.detach() * emulate
        if world > 1:
            torch.distributed.all_reduce(loss)
        losses.append(loss)
    return torch.stack(losses)


def test_registered_on_import():
    from torchtitan.protocols.model_converter import _registry_model_converter_cls as reg

    from lowprec.integrations import torchtitan as integration
    assert reg["lowprec"] is integration.LowprecConverter
    assert reg["lowprec.mxfp8"].recipe_name == "mxfp8" and "lowprec.delayed" in reg
    cfg = job_config("--model.converters", "lowprec", "--lowprec.recipe", "nvfp4",
                     "--lowprec.filter_fqns", "output,wo", "--lowprec.backward_mode", "dequant")
    assert cfg.lowprec.recipe == "nvfp4" and cfg.lowprec.filter_fqns == ["output", "wo"]
    converter = build_model_converters(cfg, parallel_dims(cfg, 1)).converters[0]
    assert converter.recipe == lowprec.NVFP4BlockScaling(backward_mode="dequant")
    cfg = job_config("--model.converters", "lowprec.mxfp8", "--lowprec.recipe", "nvfp4",
                     "--lowprec.no-quantized-all-gather",
                     "--parallelism.data_parallel_shard_degree", "2")
    converter = build_model_converters(cfg, parallel_dims(cfg, 2)).converters[0]
    assert converter.recipe == lowprec.MXFP8BlockScaling()  # the name wins
    assert not converter.quantized_gathers
    # imported by --experimental.custom_import alone: no [lowprec] section, the defaults
    cfg = ConfigManager().parse_args([
        "--experimental.custom_import", "lowprec.integrations.torchtitan",
        "--model.converters", "lowprec.fp8_block"])
    assert not hasattr(cfg, "lowprec")
    converter = build_model_converters(cfg, parallel_dims(cfg, 1)).converters[0]
    assert converter.recipe == lowprec.Float8BlockScaling() and converter.filter_fqns == [
        "output"]


@pytest.mark.parametrize("recipe", RECIPES)
def test_debug_model_trains(recipe):
    """Built as torchtitan builds it (meta device, converter, init_weights): the Linears
    but the output head are lowprec's, the losses are finite and fall, and they are those
    of the same model converted by hand on the CPU, bit for bit."""
    cfg = job_config("--model.converters", "lowprec", "--lowprec.recipe", recipe)
    weights = initial_weights(cfg)
    model, optimizers, loss_fn, _ = build(cfg, weights=weights)
    linears = {_clean(n): isinstance(m, lowprec.Linear) for n, m in model.named_modules()
               if isinstance(m, (torch.nn.Linear, lowprec.Linear))}
    assert len(linears) == 6 * 7 + 1 and not linears.pop("output")
    assert set(linears.values()) == {recipe != "bf16"}
    if recipe != "bf16":
        assert lowprec.attached_recipe(model).recipe == lowprec.Recipe.from_name(recipe)
    losses = train(model, optimizers, loss_fn)
    assert torch.isfinite(losses).all() and losses[-1] < losses[0], losses

    # the reference: the plain model on the CPU, converted and attached by hand
    spec = get_train_spec("llama3")
    args = copy.deepcopy(spec.model_args["debugmodel"])
    args.update_from_config(cfg)
    ref = spec.model_cls(args)
    ref.load_state_dict(weights)
    r = lowprec.Recipe.from_name(recipe)
    if r is not None:
        lowprec.convert_model(ref, r, lambda m, n: n != "output", fuse_norms=False,
                              attach=True)
    opt = spec.build_optimizers_fn([ref], cfg.optimizer, parallel_dims(cfg, 1))
    assert torch.equal(train(ref, opt, loss_fn), losses)


def test_per_block_compile():
    """``--compile.enable``: torchtitan compiles each TransformerBlock (fullgraph) with the
    lowprec modules inside; the losses are eager's. The ``aot_eager`` backend keeps it to
    a minute on the CPU (inductor also gave eager's losses bit for bit, in 7 minutes)."""
    args = ("--model.converters", "lowprec", "--lowprec.recipe", "mxfp8")
    weights = initial_weights(job_config(*args))
    torch._dynamo.reset()
    compiled = build(job_config(*args, "--compile.enable", "--compile.components", "model",
                               "--compile.backend", "aot_eager"),
                     weights=weights)
    assert type(compiled[0].layers["0"]).__name__ == "OptimizedModule"
    eager = build(job_config(*args), weights=weights)
    torch.testing.assert_close(train(*compiled[:3]), train(*eager[:3]), rtol=0, atol=0)


def test_refusals():
    cfg = job_config("--model.converters", "lowprec,quantize.linear.float8")
    with pytest.raises(ValueError, match="both convert"):
        build_model_converters(cfg, parallel_dims(cfg, 1))
    cfg = job_config("--model.converters", "lowprec", "--lowprec.recipe", "fp4")
    with pytest.raises(ValueError, match="unknown recipe name 'fp4'"):
        build_model_converters(cfg, parallel_dims(cfg, 1))
    cfg = job_config("--model.converters", "lowprec",
                     "--parallelism.tensor_parallel_degree", "2")
    with pytest.raises(ValueError, match="tensor parallelism"):
        build_model_converters(cfg, parallel_dims(cfg, 2))


def _fsdp_worker(rank, world, recipe, extra, out_dir):
    # torchtitan builds its meshes on its device type ("cuda" when no accelerator is found)
    titan_parallel_dims.device_type = spawn.device(rank).type
    cfg = job_config("--model.converters", "lowprec", "--lowprec.recipe", recipe,
                     "--parallelism.data_parallel_shard_degree", str(world),
                     *(() if BF16 == extra else ("--training.mixed_precision_param",
                                                 "float32")), *extra)
    model, optimizers, loss_fn, converters = build(cfg, world, weights=initial_weights(cfg))
    seen = []
    hooks = [] if cfg.compile.enable else [  # (a hook in a compiled block is traced)
        m.register_forward_pre_hook(lambda mod, args: seen.append(type(mod.weight).__name__))
        for m in model.modules() if isinstance(m, lowprec.Linear)]
    wrapped = [type(p.to_local()).__name__ for p in model.parameters()]
    losses = train(model, optimizers, loss_fn, world=world)
    for h in hooks:
        h.remove()
    state = {}
    for name, p in model.named_parameters():
        full = p.full_tensor()
        state[_clean(name)] = (full._data if isinstance(full, QuantizedGatherWeight)
                               else full).detach().clone()
    if rank == 0:
        converter = converters.converters[0]
        torch.save({"losses": losses, "state": state, "seen": sorted(set(seen)),
                    "wrapped": wrapped.count("QuantizedGatherWeight"),
                    "precompute": converter.precompute,
                    "high": len(converter.high_precision_gathers)}, f"{out_dir}/fsdp.pt")


NO_AC = ("--activation_checkpoint.mode", "none")
BF16 = ("--training.mixed_precision_param", "bfloat16")
COMPILE = ("--compile.enable", "--compile.components", "model", "--compile.backend", "aot_eager")
LINEARS = 6 * 7


@pytest.mark.parametrize("recipe,extra,wrapped,gathered", [
    ("fp8_current", (), LINEARS, "Float8Tensor"),  # torchtitan's default selective AC
    ("mxfp8", (), 0, None),  # AC: MXFP8 1x32 weights gather in high precision
    # about 30 s each on a 2-core machine (75 s compiled): run with --slow
    pytest.param("mxfp8", NO_AC, LINEARS, "MXFP8Tensor", marks=pytest.mark.slow),
    # delayed scaling gathers in high precision
    pytest.param("fp8_delayed", (), LINEARS, None, marks=pytest.mark.slow),
    # per-block compile: the compiled Linears read the gathered per-tensor FP8 weights
    pytest.param("fp8_current", COMPILE, LINEARS, None, marks=pytest.mark.slow),
    # and MXFP8's do not: high-precision gathers
    pytest.param("mxfp8", (*NO_AC, *COMPILE), 0, None, marks=pytest.mark.slow),
    # FSDP computing in bf16
    pytest.param("fp8_current", BF16, LINEARS, "Float8Tensor", marks=pytest.mark.slow),
], ids=["fp8_current", "mxfp8-ac", "mxfp8-no_ac", "fp8_delayed", "compile", "mxfp8-compile",
        "bf16"])
def test_fsdp_two_ranks(tmp_path, recipe, extra, wrapped, gathered):
    """torchtitan's FSDP2 (data_parallel_shard_degree 2: its fully_shard of each block)
    with lowprec's quantized all-gathers where they apply, both ranks on the same batches.
    The Linears compute on weights gathered in the recipe's format, and the losses and
    final weights are those of one process computing a rank's share, bit for bit (in
    fp32; FSDP computing in bf16, torchtitan's default, is checked to train)."""
    if COMPILE[0] in extra:
        torch._dynamo.reset()
    spawn.run(_fsdp_worker, 2, recipe, extra, str(tmp_path))
    got = torch.load(tmp_path / "fsdp.pt", weights_only=False)
    assert got["wrapped"] == wrapped and got["precompute"] == bool(wrapped)
    assert got["high"] == (LINEARS if recipe == "mxfp8" and not wrapped
                           and COMPILE[0] not in extra else 0)
    if gathered:
        assert got["seen"] == [gathered]
    else:
        assert set(got["seen"]) <= {"Parameter", "Tensor"}, got["seen"]
    if extra == BF16:
        losses = got["losses"]
        assert torch.isfinite(losses).all() and losses[-1] < losses[0], losses
        return
    cfg = job_config("--model.converters", "lowprec", "--lowprec.recipe", recipe, *extra)
    model, optimizers, loss_fn, _ = build(cfg, weights=initial_weights(cfg))
    losses = train(model, optimizers, loss_fn, emulate=2)
    assert torch.equal(got["losses"], losses), (got["losses"], losses)
    state = {_clean(k): v for k, v in model.state_dict().items() if "_extra_state" not in k}
    assert state.keys() == got["state"].keys()
    for k in state:
        assert torch.equal(got["state"][k], state[k]), k


@pytest.mark.parametrize("name,flavor", [("deepseek_v3", "debugmodel"),
                                         ("qwen3", "debugmodel_moe")])
def test_moe_debug_model_converted(name, flavor):
    """torchtitan's MoE debug models through the converter (meta device, converter,
    init_weights): the routed experts become TorchtitanGroupedExperts initialized by
    torchtitan's own init_weights, the router's gate stays high precision, and the experts
    train under FP8. (torchtitan 0.2's router calls torch.histc on integers, which the CPU
    lacks, so the whole model's step runs on a GPU only.)"""
    cfg = job_config("--model.converters", "lowprec", "--lowprec.recipe", "fp8_current",
                     "--model.name", name, "--model.flavor", flavor)
    model, _, _, _ = build(cfg)
    experts = [m for m in model.modules()
               if isinstance(m, lowprec.modules.experts.TorchtitanGroupedExperts)]
    assert experts and all(m.name.endswith("experts") for m in experts)
    routers = [_clean(n) for n, m in model.named_modules() if _clean(n).endswith("router.gate")]
    assert routers and all(type(model.get_submodule(r)) is torch.nn.Linear for r in routers)
    ex = experts[0]
    assert all(p.std() > 0 for p in ex.parameters())  # torchtitan's init_weights ran
    d = ex.w1.shape[-1]
    counts = torch.tensor([3, 0] + [1] * (ex.num_experts - 2))
    x = torch.randn(int(counts.sum()), d, requires_grad=True)
    with lowprec.autocast(recipe=lowprec.Float8CurrentScaling()):
        y = ex(x, counts)
    y.float().square().sum().backward()
    assert torch.isfinite(y).all() and ex.w1.grad is not None and x.grad.abs().sum() > 0
