"""lowprec's torchtitan 0.3 integration (lowprec/integrations/torchtitan/) on torchtitan's
debug models, on the CPU: the config parses from a command line naming the recipe
(``--module lowprec.integrations.torchtitan --config llama3_debugmodel --lowprec.recipe
...``), the model spec is converted as ``LowprecTrainer`` converts it, and the model goes
through torchtitan's own build steps (config tree, meta-device build, Module-protocol
check, ``parallelize_fn`` with its default selective activation checkpointing, per-block
compile and FSDP2, ``init_weights``, its optimizer with ``post_optimizer_build_fn`` and its
chunked loss) and trains; two gloo ranks with quantized all-gathers train as one process
does, bit for bit.

torchtitan's Trainer needs a GPU, so the tests run its pieces in its order. FlexAttention
has no CPU backward: ``--override.imports titan_cpu.sdpa_attention`` swaps in SDPA.
Skipped where torchtitan 0.3 does not import (the ``torchtitan`` extra in pyproject.toml;
it needs torch's ``DataParallelMeshDims``, which torch 2.11 lacks)."""

from __future__ import annotations

import datetime
import os
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import spawn  # noqa: E402

try:  # torchtitan 0.3 and what it imports (spmd_types, tyro, datasets, triton, ...)
    import torchtitan.trainer  # noqa: F401

    from lowprec.integrations import torchtitan as integration
except ImportError as err:  # any of them missing, or a torch without its APIs
    pytest.skip(f"torchtitan 0.3 does not import: {err}", allow_module_level=True)

import torchtitan.distributed.parallel_dims as titan_parallel_dims  # noqa: E402
from torch.distributed.fsdp import FSDPModule  # noqa: E402
from torchtitan.config import ConfigManager  # noqa: E402
from torchtitan.config.override import apply_overrides  # noqa: E402
from torchtitan.distributed import ParallelDims  # noqa: E402
from torchtitan.distributed import utils as dist_utils  # noqa: E402
from torchtitan.models.common.linear import Linear as TitanLinear  # noqa: E402

import lowprec  # noqa: E402
from lowprec.distributed import QuantizedGatherWeight  # noqa: E402
from lowprec.integrations.torchtitan import (  # noqa: E402
    LowprecConverter,
    LowprecGroupedExperts,
    LowprecLinear,
    LowprecTrainer,
)

SEQ, BATCH, STEPS = 64, 2, 3
#: recipes every debug-model Linear can take (dims 256, 768, 2048), bf16 included
RECIPES = ["fp8_current", "fp8_delayed", "fp8_block", "mxfp8", "nvfp4", "bf16"]
#: Linears of the Llama 3 debug model but the LM head: wqkv, wo, w1, w2, w3 in 6 layers
LINEARS = 5 * 6
FP32 = ("--training.mixed_precision_param", "float32")
#: torchtitan 0.3.0's default spmd_types backend hands FSDP2 plain annotated parameters
#: with ``dp_mesh_dims``, which torch 2.13's fully_shard refuses at world size > 1 (stock
#: torchtitan models too); partial_dtensor is its DTensor path for FSDP
PARTIAL = ("--parallelism.spmd_backend", "partial_dtensor")
COMPILE = ("--compile.enable", "--compile.components", "model", "--compile.backend", "aot_eager")


def job_config(*args: str, config: str = "llama3_debugmodel"):
    """torchtitan's config parsed from a command line, through lowprec's config module."""
    return ConfigManager().parse_args([
        "--module", "lowprec.integrations.torchtitan", "--config", config,
        "--override.imports", "titan_cpu.sdpa_attention",
        "--training.seq_len", str(SEQ), "--training.local_batch_size", str(BATCH), *args])


def _clean(name: str) -> str:
    for wrapper in ("_orig_mod.", "_checkpoint_wrapped_module."):
        name = name.replace(wrapper, "")
    return name


def model_config(cfg):
    """What Trainer.__init__ does to the config before building: LowprecTrainer's
    conversion of the model spec, update_from_config, the --override.imports overrides."""
    LowprecTrainer.prepare(cfg)
    dist_utils.set_spmd_backend(cfg.parallelism.spmd_backend)
    cfg.model_spec.model.update_from_config(config=cfg)
    apply_overrides(cfg.override, cfg)
    return cfg.model_spec.model


def initial_weights(cfg) -> dict:
    """The model's weights as torchtitan initializes them unsharded (seed 0), by name."""
    torch.manual_seed(0)
    model = model_config(cfg).build()
    with torch.no_grad():
        model.init_weights()
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def build(cfg, world: int = 1, weights: dict | None = None):
    """What torchtitan's Trainer does to build the model and its optimizer (trainer.py):
    meta-device model from the converted config, the Module-protocol check,
    parallelize_fn, to_empty + init_weights, the optimizer and post_optimizer_build_fn,
    the loss (ChunkedLossWrapper over the LM head). ``weights`` (by name) then replace
    the initialized ones, on every rank the same."""
    mc = model_config(cfg)
    spec = cfg.model_spec
    dims = ParallelDims.from_config(cfg.parallelism, world)
    with torch.device("meta"):
        model = mc.build()
    model.verify_module_protocol()
    model = spec.parallelize_fn(model, parallel_dims=dims, training=cfg.training,
                                parallelism=cfg.parallelism, compile_config=cfg.compile,
                                ac_config=cfg.activation_checkpoint, dump_folder="/tmp")
    if world > 1:
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
            load(model, weights)
    model.train()
    optimizers = cfg.optimizer.build(model_parts=[model])
    spec.post_optimizer_build_fn(optimizers, [model], dims)
    loss_fn = cfg.loss.build(compile_config=cfg.compile)
    loss_fn.set_lm_head(model.lm_head)
    model._skip_lm_head = True
    return model, optimizers, loss_fn, dims


def load(model, weights: dict) -> None:
    from torch.distributed.tensor import distribute_tensor
    for name, p in model.named_parameters():
        full = weights[_clean(name)]
        if hasattr(p, "device_mesh"):  # an FSDP2 shard
            full = distribute_tensor(full, p.device_mesh, p.placements).to_local()
            p = p.to_local()
        p.copy_(full)


def batch(step: int):
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, 2048, (BATCH, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def train(model, optimizers, loss_fn, dims, steps: int = STEPS, world: int = 1,
          emulate: int = 1) -> torch.Tensor:
    """torchtitan's train step on the same batch on every rank: forward (hidden states),
    its chunked loss (sum over the global token count), backward, gradient clipping,
    optimizer step (and its post-hooks). Returns the losses summed over ranks.

    ``emulate``: one process computes what each of ``emulate`` such ranks computes (its
    loss over ``emulate`` times its tokens) and sums the gradients as FSDP2's
    reduce-scatter does (``emulate`` equal terms: a multiplication, exact)."""
    torch.manual_seed(1)  # NVFP4's stochastic rounding draws from it
    context = dist_utils.get_spmd_context(parallel_dims=dims)
    losses = []
    for step in range(steps):
        optimizers.zero_grad()
        inputs, labels = batch(step)
        tokens = torch.tensor(labels.numel() * world * emulate)
        with context():
            loss, _ = loss_fn(model(inputs), labels, tokens)
            loss.backward()
        for p in model.parameters():
            if emulate > 1 and p.grad is not None:
                p.grad.mul_(emulate)
        torch.nn.utils.clip_grad_norm_(list(model.parameters()), 1e9)
        optimizers.step()
        loss = loss.detach() * emulate
        if world > 1:
            dist.all_reduce(loss)
        losses.append(loss)
    return torch.stack(losses)


@pytest.fixture(scope="module")
def one_rank():
    """A one-rank gloo group (torchtitan's FSDP2 wraps the model at world size one too)."""
    titan_parallel_dims.device_type = "cpu"  # torchtitan's meshes: "cuda" without a GPU
    owned = not dist.is_initialized()
    if owned:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(spawn.free_port()))
        dist.init_process_group("gloo", rank=0, world_size=1,
                                timeout=datetime.timedelta(seconds=spawn.PG_TIMEOUT))
    yield
    if owned:
        dist.destroy_process_group()


def linear_kinds(model) -> dict:
    """fqn -> LowprecLinear or TitanLinear (FSDP2 subclasses the modules it wraps)."""
    return {_clean(n): LowprecLinear if isinstance(m, LowprecLinear) else TitanLinear
            for n, m in model.named_modules() if isinstance(m, (TitanLinear, LowprecLinear))}


def test_config_from_command_line():
    """The recipe and options parse from the command line into LowprecTrainer's config;
    the converted spec holds LowprecLinear configs for every Linear but ``lm_head``."""
    cfg = job_config("--lowprec.recipe", "nvfp4", "--lowprec.filter_fqns", "lm_head,wo",
                     "--lowprec.backward_mode", "dequant")
    assert type(cfg) is LowprecTrainer.Config
    assert cfg.lowprec.recipe == "nvfp4" and cfg.lowprec.filter_fqns == ["lm_head", "wo"]
    mc = model_config(cfg)
    setup = cfg.model_spec.parallelize_fn
    assert setup.recipe == lowprec.NVFP4BlockScaling(backward_mode="dequant")
    kinds = {fqn: type(c) for fqn, c, _, _ in mc.traverse(TitanLinear.Config)}
    assert len(kinds) == LINEARS + 1 and kinds.pop("lm_head") is TitanLinear.Config
    assert {k for k, v in kinds.items() if v is TitanLinear.Config} == {
        f"layers.{i}.attention.wo" for i in range(6)}
    assert set(setup.converter.converted) == {k for k, v in kinds.items()
                                              if v is LowprecLinear.Config}
    # torchtitan's config function by model and name; the default recipe; no filter
    cfg = job_config("--lowprec.filter_fqns", "", config="llama3.llama3_debugmodel")
    assert cfg.lowprec.recipe == "fp8_current"
    model_config(cfg)
    assert "lm_head" in cfg.model_spec.parallelize_fn.converter.converted
    # the converter alone, as a custom config function passes it to model_registry
    from torchtitan.models.llama3 import model_registry
    spec = model_registry("debugmodel", converters=[LowprecConverter.Config(recipe="mxfp8")])
    names = [f for f, c, _, _ in spec.model.traverse(TitanLinear.Config)
             if isinstance(c, LowprecLinear.Config)]
    assert len(names) == LINEARS and "layers.0.attention.qkv_linear.wqkv" in names


def test_refusals():
    with pytest.raises(ValueError, match="--lowprec.recipe 'fp4'.*accepted names: bf16"):
        LowprecTrainer.prepare(job_config("--lowprec.recipe", "fp4"))
    with pytest.raises(ValueError, match="'llama9_tiny'.*e.g. llama3_debugmodel"):
        job_config(config="llama9_tiny")
    cfg = job_config("--parallelism.tensor_parallel_degree", "2")
    mc = model_config(cfg)
    with torch.device("meta"):
        model = mc.build()
    dims = ParallelDims.from_config(cfg.parallelism, 2)
    with pytest.raises(ValueError, match="tensor parallelism.*tensor_parallel_degree 2; "
                                         "accepted: 1"):
        cfg.model_spec.parallelize_fn(model, parallel_dims=dims, training=cfg.training,
                                      parallelism=cfg.parallelism,
                                      compile_config=cfg.compile,
                                      ac_config=cfg.activation_checkpoint, dump_folder="/tmp")
    cfg = job_config("--parallelism.expert_parallel_degree", "2", "--training.disable_cuda_graphs",
                     "--parallelism.data_parallel_shard_degree", "2",
                     config="deepseek_v3_debugmodel")
    mc = model_config(cfg)
    with torch.device("meta"):
        model = mc.build()
    dims = ParallelDims.from_config(cfg.parallelism, 2)
    with pytest.raises(ValueError, match="expert_parallel_degree 2; accepted: 1"):
        cfg.model_spec.parallelize_fn(model, parallel_dims=dims, training=cfg.training,
                                      parallelism=cfg.parallelism,
                                      compile_config=cfg.compile,
                                      ac_config=cfg.activation_checkpoint, dump_folder="/tmp")
    with pytest.raises(ValueError, match="already trains under lowprec"):
        integration.apply_lowprec(cfg.model_spec, cfg.lowprec)


@pytest.mark.parametrize("recipe", [
    # the block formats and per-tensor FP8 build and train alike (without state or draws):
    # MXFP8 by default, the others with --slow (per-tensor FP8 trains in the other debug
    # models and on two ranks below)
    r if r in ("bf16", "fp8_delayed", "mxfp8", "nvfp4") else pytest.param(
        r, marks=pytest.mark.slow) for r in RECIPES])
def test_debug_model_trains(one_rank, recipe):
    """Built as torchtitan builds it (converted config, meta device, FSDP2 on one rank,
    its default selective activation checkpointing, init_weights): the Linears but the LM
    head are lowprec's, the losses are finite and fall, and they are those of the same
    model converted by hand (``lowprec.convert_model``) without torchtitan's
    parallelization, bit for bit."""
    args = ("--lowprec.recipe", recipe, *FP32)
    weights = initial_weights(job_config(*args))
    model, optimizers, loss_fn, dims = build(job_config(*args), weights=weights)
    kinds = linear_kinds(model)
    assert len(kinds) == LINEARS + 1 and kinds.pop("lm_head") is TitanLinear
    assert set(kinds.values()) == {LowprecLinear if recipe != "bf16" else TitanLinear}
    if recipe != "bf16":
        assert lowprec.attached_recipe(model).recipe == lowprec.Recipe.from_name(recipe)
    losses = train(model, optimizers, loss_fn, dims)
    assert torch.isfinite(losses).all() and losses[-1] < losses[0], losses

    # the reference: the plain torchtitan model, converted and attached by hand
    cfg = job_config("--lowprec.recipe", "bf16", "activation-checkpoint:none")
    ref = model_config(cfg).build()
    with torch.no_grad():
        load(ref, weights)
    r = lowprec.Recipe.from_name(recipe)
    if r is not None:
        lowprec.convert_model(ref, r, lambda m, n: n != "lm_head", fuse_norms=False,
                              attach=True)
    opt = cfg.optimizer.build(model_parts=[ref])
    ref_loss = cfg.loss.build(compile_config=cfg.compile)
    ref_loss.set_lm_head(ref.lm_head)
    ref._skip_lm_head = True
    assert torch.equal(train(ref, opt, ref_loss, dims), losses)


def test_per_block_compile(one_rank):
    """``--compile.enable``: torchtitan compiles each block (with its selective
    checkpointing) with the lowprec modules inside; the losses are eager's. The
    ``aot_eager`` backend keeps it short on the CPU."""
    args = ("--lowprec.recipe", "mxfp8", *FP32)
    weights = initial_weights(job_config(*args))
    torch._dynamo.reset()
    compiled = build(job_config(*args, *COMPILE), weights=weights)
    assert all(block._compiled_call_impl is not None  # nn.Module.compile, in place
               for block in compiled[0].layers.values())
    eager = build(job_config(*args), weights=weights)
    torch.testing.assert_close(train(*compiled), train(*eager), rtol=0, atol=0)
    torch._dynamo.reset()


@pytest.mark.parametrize("config", ["qwen3_debugmodel", "deepseek_v3_debugmodel"])
def test_other_debug_models(one_rank, config):
    """Qwen3's and DeepSeek-V3's (MoE) debug models through the converter: converted
    Linears, high-precision LM head; DeepSeek-V3's routed experts are
    LowprecGroupedExperts initialized by their param_init and its routers stay high
    precision; one training step runs forward and backward under FP8."""
    model, optimizers, loss_fn, dims = build(job_config("--lowprec.recipe", "fp8_current",
                                                        config=config))
    moe = config.startswith("deepseek")
    experts = [m for m in model.modules() if isinstance(m, LowprecGroupedExperts)]
    assert bool(experts) == moe and all(m.name.endswith("experts") for m in experts)
    assert all(p.std() > 0 for m in experts for p in m.parameters())  # param_init ran
    kinds = linear_kinds(model)
    routers = [n for n in kinds if n.endswith("router.gate")]
    assert bool(routers) == moe and all(kinds[n] is TitanLinear for n in routers)
    assert kinds.pop("lm_head") is TitanLinear
    assert LowprecLinear in set(kinds.values())
    losses = train(model, optimizers, loss_fn, dims, steps=1)
    assert torch.isfinite(losses).all()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for m in experts
               for p in m.parameters())


def test_spmd_typechecking(one_rank):
    """``--debug.spmd_typechecking`` (torchtitan's spmd_types backend) propagates types
    through lowprec's autograd functions, registered as local ones; unregistered, the
    checker refuses them. (The model is parallelized by ``Module.parallelize`` alone:
    at world size one the checker also refuses FSDP2's own autograd functions.)"""
    from spmd_types.runtime import _LOCAL_AUTOGRAD_FUNCTIONS
    from spmd_types.types import SpmdTypeError
    from torchtitan.distributed.spmd_types import annotate_input_spmd_types

    from lowprec.linear.function import EagerLinearFunction
    assert set(integration.modules.LOCAL_AUTOGRAD_FUNCTIONS) <= _LOCAL_AUTOGRAD_FUNCTIONS
    cfg = job_config("--lowprec.recipe", "fp8_current")
    mc = model_config(cfg)
    dims = ParallelDims.from_config(cfg.parallelism, 1)
    torch.manual_seed(0)
    model = mc.build()
    with torch.no_grad():
        model.init_weights()
    model.parallelize(dims)
    lowprec.attach_recipe(model, cfg.model_spec.parallelize_fn.recipe)
    context = dist_utils.get_spmd_context(parallel_dims=dims, spmd_typechecking=True)

    def forward():
        with context():
            inputs, _, _ = annotate_input_spmd_types(dims, *batch(0), {})
            return model(inputs)
    assert torch.isfinite(forward()).all()
    _LOCAL_AUTOGRAD_FUNCTIONS.discard(EagerLinearFunction)
    try:
        with pytest.raises(SpmdTypeError, match="EagerLinearFunction"):
            forward()
    finally:
        _LOCAL_AUTOGRAD_FUNCTIONS.add(EagerLinearFunction)


def _fsdp_worker(rank, world, recipe, extra, out_dir):
    # torchtitan builds its meshes on its device type ("cuda" when no accelerator is found)
    titan_parallel_dims.device_type = spawn.device(rank).type
    args = ("--lowprec.recipe", recipe, "--parallelism.data_parallel_shard_degree",
            str(world), *PARTIAL, *FP32, *extra)
    cfg = job_config(*args)
    model, optimizers, loss_fn, dims = build(cfg, world, weights=initial_weights(job_config(*args)))
    setup = cfg.model_spec.parallelize_fn
    seen = []
    hooks = [m.register_forward_pre_hook(lambda mod, a: seen.append(type(mod.weight).__name__))
             for m in model.modules() if isinstance(m, lowprec.Linear)]
    wrapped = [type(p.to_local()).__name__ for p in model.parameters()]
    losses = train(model, optimizers, loss_fn, dims, world=world)
    for h in hooks:
        h.remove()
    state = {}
    for name, p in model.named_parameters():
        full = p.full_tensor()
        state[_clean(name)] = (full._data if isinstance(full, QuantizedGatherWeight)
                               else full).detach().clone()
    if rank == 0:
        torch.save({"losses": losses, "state": state, "seen": sorted(set(seen)),
                    "wrapped": wrapped.count("QuantizedGatherWeight"),
                    "precompute": setup.precompute,
                    "high": len(setup.high_precision_gathers)}, f"{out_dir}/fsdp.pt")


@pytest.mark.parametrize("recipe,extra,wrapped,gathered", [
    # torchtitan's default selective AC: per-tensor FP8 serves the recompute
    ("fp8_current", (), LINEARS, "Float8Tensor"),
    # about 40 s each on a 2-core machine: run with --slow
    pytest.param("mxfp8", ("activation-checkpoint:none",), LINEARS, "MXFP8Tensor",
                 marks=pytest.mark.slow),
    pytest.param("mxfp8", (), 0, None, marks=pytest.mark.slow),  # AC: high precision
], ids=["fp8_current", "mxfp8-no_ac", "mxfp8-ac"])
def test_fsdp_two_ranks(tmp_path, recipe, extra, wrapped, gathered):
    """torchtitan's FSDP2 (data_parallel_shard_degree 2) with lowprec's quantized
    all-gathers where they apply, both ranks on the same batches: the Linears compute on
    weights gathered in the recipe's format, and the losses and final weights are those
    of one process computing a rank's share, bit for bit (in fp32). Under the
    partial_dtensor backend (see PARTIAL)."""
    spawn.run(_fsdp_worker, 2, recipe, extra, str(tmp_path))
    got = torch.load(tmp_path / "fsdp.pt", weights_only=False)
    assert got["wrapped"] == wrapped and got["precompute"] == bool(wrapped)
    assert got["high"] == (LINEARS if not wrapped else 0)
    if gathered:
        assert got["seen"] == [gathered]
    else:
        assert set(got["seen"]) <= {"Parameter", "Tensor"}, got["seen"]
    _one_rank_reference(recipe, extra, got)


def _one_rank_reference(recipe, extra, got):
    titan_parallel_dims.device_type = "cpu"
    owned = not dist.is_initialized()
    if owned:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(spawn.free_port()))
        dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        args = ("--lowprec.recipe", recipe, *PARTIAL, *FP32, *extra)
        model, optimizers, loss_fn, dims = build(job_config(*args),
                                                 weights=initial_weights(job_config(*args)))
        losses = train(model, optimizers, loss_fn, dims, emulate=2)
        assert torch.equal(got["losses"], losses), (got["losses"], losses)
        state = {_clean(k): v.full_tensor() if hasattr(v, "full_tensor") else v
                 for k, v in model.named_parameters()}
        assert state.keys() == got["state"].keys()
        for k in state:
            assert torch.equal(got["state"][k], state[k]), k
    finally:
        if owned:
            dist.destroy_process_group()
