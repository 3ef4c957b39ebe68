"""Checkpoints of ``lowprec compare`` (``--save-every``, ``--resume``) and atomic file writes.

Each recipe's run is saved in ``<out>/.checkpoints/<recipe>.pt``: every ``--save-every``
steps while it trains (a *progress* checkpoint), and once more when it ends (a
*finished* one, holding only its result). ``--resume`` takes a finished recipe's result
as saved and continues an unfinished one from its last progress checkpoint, bit for bit:
the checkpoint holds everything the next step reads.

* the model's ``state_dict()`` (its bf16 parameters, buffers and each lowprec module's
  ``_extra_state``: delayed scaling's scales, amax history and the amaxes recorded
  since the last update);
* the fp32 master weights and the AdamW state;
* the state of the batch generator and of torch's global generator (CPU, and CUDA when
  the run is on a GPU): NVFP4's stochastic rounding draws from the latter;
* the run's result so far (its step records; after the last step its SQNR and
  saved-tensor bytes too).

Every checkpoint also carries the settings that decide the numbers (model, data, steps,
seed, lr, warm-up, shapes, recipe, ...). ``--resume`` compares them with the command's
and refuses, naming each setting that differs, rather than mix two runs.

Files are written to a temporary name in the same directory and moved into place with
``os.replace`` (:func:`atomic_path`), so an interrupt or a full disk never leaves a
half-written checkpoint, results.csv or report.md behind: the previous file stays.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os
import pickle
import secrets
import sys
from typing import Iterator

import torch

from .probe import SQNRRecord
from .train import RunResult, StepRecord

#: Bumped when what a checkpoint holds changes; a checkpoint of another format is refused.
FORMAT = 1
#: Hidden, beside the outputs a user reads (results.csv, report.md, the plots).
CHECKPOINT_DIR = ".checkpoints"
DEFAULT_SAVE_EVERY = 50

#: How each saved setting is named when a resumed command differs from it.
SETTING_LABELS = {
    "model": "--model",
    "architecture": "the model's architecture (--model)",
    "vocab": "--vocab (the vocabulary)",
    "keep_high_precision": "--keep-high-precision",
    "seq_len": "--seq-len",
    "batch_size": "--batch-size",
    "grad_accum": "--grad-accum",
    "steps": "--steps",
    "seed": "--seed",
    "lr": "--lr (the peak learning rate)",
    "warmup": "--warmup (warm-up steps)",
    "data": "--data (the training tokens)",
    "device": "--device (device type)",
    "compile": "--compile",
    "backward_mode": "--backward-mode",
    "recipe": "the recipe",
    "description": "the recipe's definition",
    "recipe_file_sha256": "the recipe file's contents (--recipe-file)",
    "init_seed_offset": "the recipe's initial-weight seed offset",
    "eval_batches": "the number of held-out batches",
    "grad_clip": "the gradient-clipping norm",
}

#: Environment that may change the last bits of a run without changing what it is: a
#: difference is reported, not refused.
ENVIRONMENT_LABELS = {"torch": "torch", "lowprec": "lowprec", "device_name": "device",
                      "threads": "CPU threads"}


class ResumeError(Exception):
    """A checkpoint ``--resume`` cannot use (other settings, unreadable); says which and why."""


# ---- atomic writes ---------------------------------------------------------------------
@contextlib.contextmanager
def atomic_path(path: str) -> Iterator[str]:
    """Yield a temporary path next to ``path`` to write to; on success move it onto ``path``.

    The temporary file keeps ``path``'s extension (matplotlib picks the image format from
    it). If the body raises (KeyboardInterrupt included) the temporary file is removed and
    ``path`` is left as it was. If the body wrote nothing (a plot skipped), nothing moves.
    """
    directory, base = os.path.split(os.path.abspath(path))
    stem, ext = os.path.splitext(base)
    # Not mkstemp: that creates the file 0600, and the writer should create it with the
    # permissions any file it writes gets (the umask's).
    tmp = os.path.join(directory, f".{stem}.{os.getpid()}-{secrets.token_hex(4)}.tmp{ext}")
    try:
        yield tmp
        if os.path.exists(tmp):
            _fsync(tmp)
            os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


def _fsync(path: str) -> None:
    # The data reaches the disk before the rename makes it the file: after a power cut the
    # name holds either the old contents or the complete new ones.
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ---- settings ----------------------------------------------------------------------------
def data_fingerprint(corpus) -> str:
    """The training and held-out tokens, summed up: their kind, counts and SHA-256."""
    digest = hashlib.sha256()
    for part in (corpus.train, corpus.val):
        t = part.detach().contiguous().cpu()
        digest.update(f"{t.dtype}:{t.numel()};".encode())
        digest.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return (f"{corpus.kind}, {corpus.train.numel()} training + {corpus.val.numel()} held-out "
            f"tokens, sha256 {digest.hexdigest()[:16]}")


def file_sha256(path: str) -> str:
    """SHA-256 of a file's bytes (a recipe file whose code changed is another recipe)."""
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def environment(device: torch.device) -> dict:
    """What ran the numbers, beyond the settings: versions, device model, CPU threads."""
    return {"torch": str(torch.__version__), "lowprec": _lowprec_version(),
            "device_name": (torch.cuda.get_device_name(device) if device.type == "cuda"
                            else "cpu"),
            "threads": torch.get_num_threads()}


def _lowprec_version() -> str:
    from .. import __version__
    return __version__


def differences(saved: dict, current: dict, labels: dict) -> list[str]:
    """One line per setting whose value differs (or that only one side has)."""
    out = []
    for key in list(current) + [k for k in saved if k not in current]:
        old, new = saved.get(key, "<not recorded>"), current.get(key, "<not recorded>")
        if old != new or type(old) is not type(new):
            out.append(f"{labels.get(key, key)}: checkpoint {old!r}, this command {new!r}")
    return out


# ---- results -------------------------------------------------------------------------------
def result_to_dict(result: RunResult) -> dict:
    """A RunResult as plain Python values (what ``torch.load(weights_only=True)`` reads)."""
    return dataclasses.asdict(result)


def result_from_dict(data: dict) -> RunResult:
    data = dict(data)
    data["steps"] = [StepRecord(**s) for s in data.get("steps", [])]
    data["sqnr"] = [SQNRRecord(**{**r, "shape": tuple(r["shape"])}) for r in data.get("sqnr", [])]
    return RunResult(**data)


# ---- the checkpoints of one run ----------------------------------------------------------------
@dataclasses.dataclass
class Saved:
    """What ``--resume`` found for one recipe (the training state is read when it trains)."""

    path: str
    finished: bool
    step: int                     # steps done
    result: RunResult


class CheckpointStore:
    """The checkpoints of one ``lowprec compare`` command, one file per recipe.

    ``settings``: the command's settings that decide the numbers (see
    :data:`SETTING_LABELS`); each recipe's file adds its own (name, definition).
    ``recipe_settings``: per recipe name, further settings of that recipe (a recipe
    file's hash). ``save_every``: steps between progress checkpoints (0: none, only
    the finished result)."""

    def __init__(self, out_dir: str, settings: dict, env: dict, save_every: int,
                 recipe_settings: dict | None = None, stream=None) -> None:
        self.dir = os.path.join(out_dir, CHECKPOINT_DIR)
        self.settings, self.env, self.save_every = settings, env, save_every
        self.recipe_settings = recipe_settings or {}
        self.stream = stream if stream is not None else sys.stderr

    def path(self, name: str) -> str:
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in name)
        return os.path.join(self.dir, safe + ".pt")

    def settings_for(self, spec) -> dict:
        """The settings a checkpoint of ``spec`` must match: the command's and the recipe's."""
        return {**self.settings, "recipe": spec.name, "description": spec.description,
                "init_seed_offset": spec.init_seed_offset,
                **self.recipe_settings.get(spec.name, {})}

    def _read(self, path: str) -> dict:
        try:
            data = torch.load(path, map_location="cpu", weights_only=True)
        except (OSError, RuntimeError, EOFError, pickle.UnpicklingError, ValueError) as err:
            raise ResumeError(f"cannot read the checkpoint {path}: {type(err).__name__}: "
                              f"{err}; delete it, or run without --resume to start "
                              f"afresh") from None
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            fmt = data.get("format") if isinstance(data, dict) else None
            raise ResumeError(f"{path} is not a lowprec compare checkpoint of format {FORMAT} "
                              f"(found {fmt!r}); run without --resume to start afresh")
        return data

    def inspect(self, spec) -> Saved | None:
        """The checkpoint of ``spec`` checked against this command, or None when there is
        none. Raises :class:`ResumeError` naming every setting that differs."""
        path = self.path(spec.name)
        if not os.path.exists(path):
            return None
        data = self._read(path)
        diff = differences(data.get("settings", {}), self.settings_for(spec), SETTING_LABELS)
        if diff:
            raise ResumeError(
                f"--resume: the checkpoint {path} of recipe {spec.name!r} was made with other "
                f"settings than this command's:\n  " + "\n  ".join(diff) +
                "\nresume with the options of the interrupted command, or run without --resume "
                "to start afresh (this overwrites the checkpoints)")
        env_diff = differences(data.get("environment", {}), self.env, ENVIRONMENT_LABELS)
        if env_diff:
            print(f"lowprec compare: note: {path} was saved elsewhere ({'; '.join(env_diff)}); "
                  f"the resumed {spec.name} may differ from an uninterrupted run in its last "
                  f"bits", file=self.stream)
        return Saved(path, data["kind"] == "finished", int(data["step"]),
                     result_from_dict(data["result"]))

    def discard(self, spec) -> None:
        """Remove ``spec``'s checkpoint: a run without --resume starts that recipe afresh."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path(spec.name))

    def for_recipe(self, spec, saved: Saved | None) -> "RecipeCheckpoint":
        """The checkpointer ``train_one`` saves ``spec``'s progress through (continuing
        from ``saved`` when given)."""
        return RecipeCheckpoint(self, spec, saved)

    def _write(self, path: str, data: dict) -> None:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with atomic_path(path) as tmp:
            torch.save(data, tmp)

    def _header(self, spec, kind: str, step: int, result: RunResult) -> dict:
        return {"format": FORMAT, "kind": kind, "step": step,
                "settings": self.settings_for(spec), "environment": self.env,
                "result": result_to_dict(result)}

    def disk_bytes(self) -> int:
        """Bytes the checkpoint directory holds (0 when there is none)."""
        try:
            return sum(e.stat().st_size for e in os.scandir(self.dir) if e.is_file())
        except FileNotFoundError:
            return 0

    def finish(self, spec, result: RunResult) -> None:
        """Record ``spec``'s final result (replacing its progress checkpoint): --resume
        takes it as it is."""
        self._write(self.path(spec.name),
                    self._header(spec, "finished", len(result.steps), result))


class RecipeCheckpoint:
    """Saves and restores one recipe's training state; what ``train_one`` is given.

    ``saved_step``: the step the newest checkpoint on disk holds (0: none), where a
    resumed run would continue."""

    def __init__(self, store: CheckpointStore, spec, saved: Saved | None) -> None:
        self.store, self.spec = store, spec
        self.every = store.save_every
        self.path = store.path(spec.name)
        self.resume_from = saved if saved is not None and not saved.finished else None
        self.saved_step = 0 if self.resume_from is None else self.resume_from.step
        self._warned = False

    def due(self, step: int) -> bool:
        """Whether to save after ``step``."""
        return self.every > 0 and step % self.every == 0

    def restore(self, result: RunResult, model, master, opt, batches, device) -> int:
        """Load the saved state into freshly built ``model``, ``master``, ``opt`` and
        ``batches``, and the saved records into ``result``; return the next step (1 when
        there is nothing to continue from). Call after the model is built: the global
        generator is set to where the saved run was."""
        if self.resume_from is None:
            return 1
        data = self.store._read(self.path)
        if data.get("kind") != "progress" or int(data["step"]) != self.resume_from.step:
            raise ResumeError(f"{self.path} changed since it was checked; run again")
        state = data["train"]
        model.load_state_dict(state["model"])
        if len(state["master"]) != len(master):
            raise ResumeError(f"{self.path}: {len(state['master'])} master tensors saved, the "
                              f"model has {len(master)}")
        with torch.no_grad():
            for m, saved in zip(master, state["master"]):
                m.copy_(saved)
        opt.load_state_dict(state["optimizer"])
        batches.generator.set_state(state["batch_rng"])
        torch.set_rng_state(state["torch_rng"])
        if device.type == "cuda" and state.get("cuda_rng") is not None:
            torch.cuda.set_rng_state(state["cuda_rng"], device)
        saved = result_from_dict(data["result"])
        for name in ("steps", "sqnr", "saved_bytes", "peak_mem_bytes", "probe_peak_bytes",
                     "wall_s", "cpu_s"):
            setattr(result, name, getattr(saved, name))
        return int(data["step"]) + 1

    def save(self, step: int, result: RunResult, model, master, opt, batches, device) -> None:
        """Save the state after ``step`` (a step boundary: nothing half-updated). A write
        that fails is reported once and training goes on (--resume then continues from
        the last checkpoint that was written)."""
        train = {"model": model.state_dict(), "master": [m.detach() for m in master],
                 "optimizer": opt.state_dict(), "batch_rng": batches.generator.get_state(),
                 "torch_rng": torch.get_rng_state(),
                 "cuda_rng": (torch.cuda.get_rng_state(device) if device.type == "cuda"
                              else None)}
        data = self.store._header(self.spec, "progress", step, result)
        data["train"] = train
        try:
            self.store._write(self.path, data)
        except (OSError, RuntimeError) as err:
            if not self._warned:
                print(f"\nlowprec compare: warning: cannot save the checkpoint {self.path} "
                      f"({type(err).__name__}: {err}); training goes on without it",
                      file=self.store.stream)
                self._warned = True
            return
        self.saved_step = step


__all__ = ["FORMAT", "CHECKPOINT_DIR", "DEFAULT_SAVE_EVERY", "SETTING_LABELS", "ResumeError",
           "atomic_path", "data_fingerprint", "file_sha256", "environment", "differences",
           "result_to_dict", "result_from_dict", "Saved", "CheckpointStore", "RecipeCheckpoint"]
