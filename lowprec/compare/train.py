"""One training run per recipe: same seed, same initial weights, same batches.

The model's parameters are bf16 (what the GEMMs read); AdamW updates fp32 master
copies and writes them back each step, as mixed-precision training does, so a
recipe's effect is not hidden under bf16 update rounding (``--optim-states`` variants
run ``lowprec.optim.AdamW`` on the bf16 parameters instead, with the state precision
they name). ``bf16`` runs the model
without lowprec autocast; every other recipe runs its forward under
``lowprec.autocast(recipe=...)``.
"""

from __future__ import annotations

import contextlib
import math
import time
import traceback
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

import torch
import torch.nn.functional as F

from ..optim import AdamW as LowprecAdamW
from ..recipe import autocast
from .data import Batches, Corpus
from .model import GPT, ModelConfig
from .probe import SavedTensorMeter, SQNRProbe, SQNRRecord
from .progress import Progress
from .recipes import OPTIM_STATES, RecipeSpec
from .user_model import ModelSource, logits_of

if TYPE_CHECKING:  # resume imports this module
    from .resume import RecipeCheckpoint


INTERRUPTED = ("interrupted (Ctrl-C); the remaining recipes were not run (the same command "
               "with --resume continues from the last checkpoint)")


@dataclass
class StepRecord:
    step: int
    loss: float
    tokens_per_s: float
    step_ms: float


@dataclass
class RunResult:
    name: str
    description: str
    steps: list[StepRecord] = field(default_factory=list)
    status: str = "ok"          # ok | nan | error
    status_detail: str = ""
    val_loss: float | None = None
    val_losses: list[float] = field(default_factory=list)
    sqnr: list[SQNRRecord] = field(default_factory=list)
    saved_bytes: int | None = None
    #: CUDA peak of the training steps and the evaluation; with more than one step, the
    #: last (the measurement step, eager with the SQNR probe) is left out: ``probe_peak_bytes``
    peak_mem_bytes: int | None = None
    #: CUDA peak of the measurement step alone (None on CPU, or where it did not run)
    probe_peak_bytes: int | None = None
    wall_s: float = 0.0
    cpu_s: float = 0.0
    traceback: str = ""
    tokens_per_step: int = 0

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def median_step_ms(self) -> float | None:
        """Median step time, leaving out the first step (allocations, lazy state, compiling)
        and, with more than two steps, the last (it measures SQNR and saved bytes)."""
        times = [s.step_ms for s in self.steps if math.isfinite(s.loss)]
        if len(times) > 2:
            times = times[1:-1]
        elif len(times) > 1:
            times = times[1:]
        if not times:
            return None
        times = sorted(times)
        mid = len(times) // 2
        return times[mid] if len(times) % 2 else 0.5 * (times[mid - 1] + times[mid])


@dataclass
class TrainSettings:
    steps: int
    seed: int
    device: torch.device
    lr: float
    eval_batches: int = 16
    grad_clip: float = 1.0
    warmup_frac: float = 0.1
    #: run the training forward through torch.compile (every recipe alike)
    compile: bool = False
    #: CUDA graphs (the same numbers, no host time): compiled, mode "reduce-overhead";
    #: eager, the lowprec Linears' own (``lowprec.autocast(cuda_graphs=True)``)
    cuda_graphs: bool = False
    #: inductor's C++ wrapper launches the compiled graphs' kernels (less host time a kernel)
    cpp_wrapper: bool = False
    #: learning-rate warm-up in steps (0: none); None: the default rule of warmup_steps()
    warmup: int | None = None

    #: The shortest default warm-up: ten steps, so that even a short run ramps up over
    #: several steps of second-moment estimates (the 10% rule alone gives a 40-step run 4
    #: warm-up steps, and such a run spiked at step 2-3 on an H100; see lr_at).
    WARMUP_MIN_STEPS: ClassVar[int] = 10

    def warmup_steps(self) -> int:
        """Warm-up length in steps: ``warmup`` when given, else the longer of
        WARMUP_MIN_STEPS and ``warmup_frac`` of the run, but never more than half of it."""
        if self.warmup is not None:
            return max(0, self.warmup)
        warm = max(self.WARMUP_MIN_STEPS, int(self.steps * self.warmup_frac))
        # A short run still needs its decay half: that is where the last iterates settle.
        return max(1, min(warm, self.steps // 2))


def inductor_config(cpp_wrapper: bool):
    """The inductor settings a compiled run's steps run under (a context manager), also
    ``benchmarks/bench_model.py``'s.

    The C++ wrapper is held as inductor's config around each step, not passed as a
    ``torch.compile`` option: the backward graph compiles at the first ``backward()``, after
    the options' scope has closed, and a backward compiled without the option's companion
    settings fails to build its C++ wrapper on some torch releases (pytorch#178845)."""
    if not cpp_wrapper:
        return contextlib.nullcontext()
    from torch._inductor import config
    return config.patch(cpp_wrapper=True)


def lr_at(step: int, settings: TrainSettings) -> float:
    """Quadratic warm-up over ``settings.warmup_steps()`` steps, then cosine decay to zero
    (``step`` from 1).

    The warm-up is quadratic, lr * (step / warmup)^2, not linear: Adam's first updates move
    every weight by about lr whatever its gradient, so a fresh model's first steps need an
    lr far below the peak, and a quadratic ramp starts warmup^2 times below it instead of
    warmup times (half the peak comes at 70% of the warm-up). Measured with bf16 on H100
    and H200 GPUs over 40 steps: under a 10-step linear ramp the medium preset (lr 1e-3) spiked at
    step 3 (4.4 -> 6.5) and the large one at lr 6e-4 went 5.5 -> 8.0 by step 3; under the
    quadratic ramp medium trained without a spike, and large did at its preset lr of 3e-4
    (at 6e-4 it still spiked at step 3), over 300 steps too.

    Decaying to zero settles the last iterates, which keeps the seed-to-seed noise of the
    final loss small (0.009-0.012 measured on the small preset), so a recipe's effect of
    that size shows as such."""
    warm = settings.warmup_steps()
    if step <= warm:
        return settings.lr * (step / warm) ** 2
    progress = (step - warm) / (settings.steps - warm + 1)
    return settings.lr * 0.5 * (1.0 + math.cos(math.pi * progress))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _peak_bytes(device: torch.device) -> int | None:
    """The CUDA peak since the last call (None off CUDA); starts the next one."""
    if device.type != "cuda":
        return None
    peak = torch.cuda.max_memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    return peak


def _close_peak(result: RunResult, device: torch.device) -> None:
    """Fold the peak since the last reset into ``result.peak_mem_bytes`` and reset it."""
    peak = _peak_bytes(device)
    if peak is not None:
        result.peak_mem_bytes = max(result.peak_mem_bytes or 0, peak)


def train_one(spec: RecipeSpec, cfg: ModelConfig, corpus: Corpus, settings: TrainSettings,
              progress: Progress | None = None, source: ModelSource | None = None,
              grad_accum: int = 1, checkpoint: RecipeCheckpoint | None = None) -> RunResult:
    """Train under ``spec``; a NaN/Inf loss stops the run (status ``nan``).

    ``source``: the model to build (default: the preset GPT of ``cfg``). ``grad_accum``:
    micro-batches of ``cfg.batch_size`` sequences per optimizer step. ``checkpoint``
    (:class:`~lowprec.compare.resume.RecipeCheckpoint`): saves the training state at the
    step boundaries it asks for, and when it holds a saved run, the training continues
    from there (bit for bit the run that was saved) instead of from scratch.

    Ctrl-C (KeyboardInterrupt) ends the run with ``status_detail`` :data:`INTERRUPTED`;
    the checkpoint on disk is then the last one saved, which only a completed step
    writes."""
    tokens = cfg.tokens_per_step * grad_accum
    result = RunResult(spec.name, spec.description, tokens_per_step=tokens)
    device = settings.device
    enabled = spec.recipe is not None
    t_wall, t_cpu = time.perf_counter(), time.process_time()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    _peak_bytes(device)
    torch.manual_seed(settings.seed + spec.init_seed_offset)
    model = (source.build(device) if source is not None
             else GPT(cfg, dtype=torch.bfloat16, device=device))
    params = [p for p in model.parameters() if p.requires_grad]
    adam = dict(lr=settings.lr, betas=(0.9, 0.95), weight_decay=0.0)
    if spec.optim_states == "fp32":
        master = [p.detach().float().clone().requires_grad_(True) for p in params]
        opt = torch.optim.AdamW(master, fused=device.type == "cuda", **adam)
    else:  # the optimizer keeps its own state in the precision the variant names
        master = []
        opt = LowprecAdamW(params, seed=settings.seed, **adam,
                           **OPTIM_STATES[spec.optim_states][0])
    # Checkpoint weights are the same for every seed: the reseeded noise-floor run draws
    # its batches in another order instead.
    batch_seed = settings.seed + (spec.init_seed_offset if source is not None
                                  and source.pretrained else 0)
    batches = Batches(corpus, cfg.seq_len, cfg.batch_size, batch_seed, device)
    probe = SQNRProbe(model)
    # The SQNR probe and the saved-tensor meter of the last step hook the eager modules;
    # that step runs eagerly.
    if settings.compile:
        # Every recipe's model is a new object running the same code, and dynamo counts the
        # compiles of one code object against one recompile limit (8): past it, a later
        # recipe would train eagerly. Each recipe starts from an empty cache instead.
        torch._dynamo.reset()
    forward = (torch.compile(model, mode="reduce-overhead" if settings.cuda_graphs else None)
               if settings.compile else model)
    base_wall = base_cpu = 0.0  # time spent in the saved part of a resumed run
    try:
        first = 1
        if checkpoint is not None:
            # After the build: restoring sets the global generator to the saved run's.
            first = checkpoint.restore(result, model, master, opt, batches, device)
            base_wall, base_cpu = result.wall_s, result.cpu_s
            if first > 1 and progress is not None and result.steps:
                last_rec = result.steps[-1]
                progress.update(last_rec.step, last_rec.loss, last_rec.step_ms,
                                note=f"resumed after step {first - 1}")
        for step in range(first, settings.steps + 1):
            last = step == settings.steps
            _sync(device)
            if last and step > 1:
                _close_peak(result, device)  # the measurement step's peak is kept apart
            t0 = time.perf_counter()
            if last and enabled:
                probe.arm(spec.recipe, device)
            meter = SavedTensorMeter(model) if last else None
            losses = []
            with inductor_config(settings.cpp_wrapper):
                for micro in range(grad_accum):
                    x, y = batches.train_batch()
                    # eager --cuda-graphs: the Linears replay CUDA graphs (not in the
                    # measurement step, whose meter and probe hook the eager modules)
                    graphs = settings.cuda_graphs and not settings.compile and not last
                    with autocast(enabled=enabled, recipe=spec.recipe, cuda_graphs=graphs):
                        if meter is not None and micro == 0:
                            with meter:
                                logits = logits_of(model(x))
                        else:
                            logits = logits_of(forward(x))
                    loss = F.cross_entropy(logits.float().view(-1, cfg.vocab),
                                           y.reshape(-1)) / grad_accum
                    loss.backward()
                    losses.append(loss.detach())
            for p, m in zip(params, master):
                m.grad = None if p.grad is None else p.grad.float()
                p.grad = None
            torch.nn.utils.clip_grad_norm_(master or params, settings.grad_clip)
            for group in opt.param_groups:
                group["lr"] = lr_at(step, settings)
            opt.step()
            opt.zero_grad(set_to_none=True)
            if master:
                with torch.no_grad():
                    torch._foreach_copy_(params, master)
            # Read once, after the update is queued: a read between forward and backward, or
            # before the update, would leave the GPU idle while the host queues the next
            # kernels. A non-finite loss stops the run here; the update it made is never used.
            loss_value = sum(torch.stack(losses).tolist(), 0.0)
            if not math.isfinite(loss_value):
                _sync(device)
                ms = (time.perf_counter() - t0) * 1e3
                result.steps.append(StepRecord(step, loss_value, tokens / (ms / 1e3), ms))
                result.status = "nan"
                result.status_detail = f"loss became {loss_value} at step {step}; run stopped"
                if progress is not None:
                    progress.update(step, loss_value, ms, note="NaN: stopped")
                break
            _sync(device)
            ms = (time.perf_counter() - t0) * 1e3
            if last:
                probe.disarm()
                result.sqnr = probe.results()
                result.saved_bytes = meter.bytes
                if step > 1:
                    result.probe_peak_bytes = _peak_bytes(device)
            result.steps.append(StepRecord(step, loss_value, tokens / (ms / 1e3), ms))
            if progress is not None:
                progress.update(step, loss_value, ms)
            if checkpoint is not None and checkpoint.due(step):
                result.wall_s = base_wall + time.perf_counter() - t_wall
                result.cpu_s = base_cpu + time.process_time() - t_cpu
                _close_peak(result, device)
                checkpoint.save(step, result, model, master, opt, batches, device)
        if result.ok:
            result.val_losses = evaluate(model, spec, batches, settings, cfg)
            result.val_loss = sum(result.val_losses) / len(result.val_losses)
            if not math.isfinite(result.val_loss):
                result.status = "nan"
                result.status_detail = "held-out loss is not finite"
    except KeyboardInterrupt:
        result.status = "error"
        result.status_detail = INTERRUPTED
    except Exception as err:  # noqa: BLE001 - one recipe's failure must not end the comparison
        result.status = "error"
        result.status_detail = f"{type(err).__name__}: {err}"
        result.traceback = traceback.format_exc()
        if progress is not None:
            progress.update(len(result.steps), float("nan"), 0.0,
                            note=f"error: {type(err).__name__}")
    finally:
        probe.disarm()
    # a resumed run's peak is the larger of the saved part's and this process's
    _close_peak(result, device)
    if settings.steps == 1 and result.steps:  # the one step is the measurement step
        result.probe_peak_bytes = result.peak_mem_bytes
    result.wall_s = base_wall + time.perf_counter() - t_wall
    result.cpu_s = base_cpu + time.process_time() - t_cpu
    if progress is not None:
        progress.close(result)
    return result


@torch.no_grad()
def evaluate(model: GPT, spec: RecipeSpec, batches: Batches, settings: TrainSettings,
             cfg: ModelConfig) -> list[float]:
    """Mean loss on fixed held-out batches, with the recipe's quantized forward."""
    losses = []
    for x, y in batches.val_batches(settings.eval_batches):
        with autocast(enabled=spec.recipe is not None, recipe=spec.recipe):
            logits = logits_of(model(x))
        losses.append(float(F.cross_entropy(logits.float().view(-1, cfg.vocab), y.reshape(-1))))
    return losses
