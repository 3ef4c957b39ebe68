"""``lowprec compare``: train one small GPT per recipe from the same seed and compare.

Console script ``lowprec`` (and ``python -m lowprec``); see ``lowprec compare --help``.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import tempfile
import textwrap

import torch

from .. import gemm
from . import make_llama, report
from .data import load_data
from .model import PRESETS, check_config
from .progress import Progress
from .recipes import (
    BASELINE,
    DEFAULT_RECIPES,
    NAMED_RECIPES,
    OPTIM_STATES,
    RecipeError,
    build_named,
    check_backward_mode,
    load_recipe_file,
    noise_floor_spec,
    parse_optim_states,
    parse_recipe_names,
    validate_recipe,
    with_optim_states,
)
from .resume import (
    CHECKPOINT_DIR,
    DEFAULT_SAVE_EVERY,
    CheckpointStore,
    ResumeError,
    atomic_path,
    data_fingerprint,
    environment,
    file_sha256,
)
from .train import INTERRUPTED, TrainSettings, train_one
from .user_model import ModelError, resolve_model, run_config

DEFAULT_OUT = "lowprec-compare"


def _recipe_help() -> str:
    return "\n".join(f"  {name:<20} {entry.help}" for name, entry in NAMED_RECIPES.items())


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lowprec", description="lowprec command-line tools.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    p = sub.add_parser(
        "compare", formatter_class=argparse.RawDescriptionHelpFormatter,
        help="train the same small GPT once per recipe and compare loss, speed and SQNR",
        description=textwrap.fill(
            "Train the same small byte-level GPT (every GEMM a lowprec module) from the same "
            "seed on the same batches of Python standard-library source, once per recipe, "
            "and report side by side: results.csv, loss.png, report.md in --out, and a "
            "table on the terminal.", 79),
        epilog="named recipes:\n" + _recipe_help() + (
            "\n\nmodel presets:\n" + "\n".join(f"  {k:<8} {v.describe()}, {v.default_steps} "
                                                f"steps by default" for k, v in PRESETS.items())
            + "\n\nexamples:\n  lowprec compare\n  lowprec compare --recipes bf16,fp8_block,"
              "mxfp8_fwd_nvfp4_bwd --steps 200\n  lowprec compare --recipe-file my.py:factory "
              "--model medium --device cuda"))
    p.add_argument("--recipes", default=None, metavar="LIST",
                   help=f"comma-separated recipe names (default: {','.join(DEFAULT_RECIPES)}; "
                        f"with --recipe-file only: bf16 and the file's)")
    p.add_argument("--recipe-file", action="append", default=[], metavar="PATH.py:FACTORY",
                   help="a Python file and the name of a qfactory(role) -> Quantizer in it "
                        "(or of a lowprec recipe object); may be given more than once")
    p.add_argument("--backward-mode", default=None, metavar="MODE",
                   help="default | high_precision | dequantized (aliases unquant, dequant), "
                        "for every recipe")
    p.add_argument("--steps", type=int, default=None,
                   help="training steps per recipe (default: the preset's)")
    p.add_argument("--model", default="small", metavar="MODEL",
                   help=f"a preset ({', '.join(PRESETS)}; default small; medium/large are for a "
                        f"GPU), a local Hugging Face model directory (config.json, with or "
                        f"without weights), or path/to/file.py:build / module:build (build() "
                        f"returns an nn.Module mapping token ids (batch, seq) to logits)")
    p.add_argument("--vocab", type=int, default=None,
                   help="vocabulary size, where it cannot be read from --model")
    p.add_argument("--keep-high-precision", action="append", default=[], metavar="PATTERN",
                   help="qualified names of Linears of a Hugging Face or user model to leave "
                        "unconverted (fnmatch patterns, comma-separated or repeated; e.g. "
                        "lm_head), the same for every recipe")
    p.add_argument("--data", default=None, metavar="PATH",
                   help="training text: a text file, a directory of text files (recursively), "
                        "or a .npy/.bin array of token ids (uint16 .bin as nanoGPT writes; "
                        "PATH.bin:uint32 for 32-bit ids); tokenized with the model directory's "
                        "tokenizer where it has one, else as bytes (default: Python "
                        "standard-library source)")
    p.add_argument("--data-glob", default=None, metavar="GLOB",
                   help="with a --data directory: the files to read (e.g. '**/*.md')")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sequence")
    p.add_argument("--batch-size", type=int, default=None, help="sequences per micro-batch")
    p.add_argument("--grad-accum", type=int, default=1,
                   help="micro-batches per optimizer step (default 1)")
    p.add_argument("--warmup", type=int, default=None,
                   help="learning-rate warm-up in steps (default: a fixed minimum or 10%% of "
                        "the steps, whichever is longer)")
    p.add_argument("--device", default=None,
                   help="torch device (default: cuda when available, else cpu)")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="run every recipe's training forward through torch.compile (default: "
                        "on for CUDA, off for CPU)")
    p.add_argument("--optim-states", default="fp32", metavar="NAMES",
                   help="optimizer-state variants to run every recipe under too, comma-"
                        "separated (fp32, torch's AdamW, is every run's default): "
                        + "; ".join(f"{name}: {desc}"
                                    for name, (_, desc) in OPTIM_STATES.items()))
    p.add_argument("--cuda-graphs", action="store_true",
                   help="on CUDA, replay kernels from CUDA graphs so the step time is the "
                        "GPU's, not the host's (the same numbers; more memory): compiled, "
                        "in mode='reduce-overhead'; eager, each lowprec Linear's "
                        "(lowprec.autocast(cuda_graphs=True))")
    p.add_argument("--cpp-wrapper", action="store_true",
                   help="with --compile: inductor's C++ wrapper launches each compiled graph's "
                        "kernels instead of its Python one (less host time a kernel, which "
                        "host-bound steps feel: quantized recipes launch 2-3x bf16's kernels; "
                        "longer compiles; needs a C++ compiler)")
    p.add_argument("--seed", type=int, default=0, help="seed for weights and batches (default 0)")
    p.add_argument("--lr", type=float, default=None, help="peak learning rate (default: preset's)")
    p.add_argument("--out", default=DEFAULT_OUT, metavar="DIR",
                   help=f"output directory (default: ./{DEFAULT_OUT}); each recipe's checkpoint "
                        f"goes to DIR/{CHECKPOINT_DIR}/RECIPE.pt")
    p.add_argument("--save-every", type=int, default=DEFAULT_SAVE_EVERY, metavar="N",
                   help=f"save each recipe's training state every N steps, and its result when "
                        f"it ends (default {DEFAULT_SAVE_EVERY}; 0: only the result)")
    p.add_argument("--resume", action="store_true",
                   help="continue an interrupted command from the checkpoints in --out: "
                        "finished recipes are not run again, an unfinished one goes on from "
                        "its last checkpoint, bit for bit as if never stopped; the options must "
                        "be those of the interrupted command (a difference is refused, naming "
                        "it). Without --resume, checkpoints in --out are ignored and "
                        "overwritten")
    p.add_argument("--noise-floor", action=argparse.BooleanOptionalAction, default=True,
                   help="also train bf16 from other initial weights (seed + 1), to show how far "
                        "seed-to-seed noise alone moves the loss (default: on when bf16 runs)")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads for torch (default on CPU: half the cores, at least 1: the "
                        "emulated formats are many small ops, where threads mostly add "
                        "synchronisation)")
    p.add_argument("--list-recipes", action="store_true", help="list the named recipes and exit")
    m = sub.add_parser("make-llama", description=make_llama.DESCRIPTION,
                       help="write a Llama config and a byte-level BPE tokenizer trained "
                            "locally (default: the README's ./llama-110m) for --model")
    make_llama.add_arguments(m)
    return parser


class UsageError(Exception):
    pass


def check_out_dir(path: str) -> str:
    """Create ``path`` if needed and prove a file can be written there, before any training."""
    path = os.path.abspath(path)
    if os.path.exists(path) and not os.path.isdir(path):
        raise UsageError(f"--out {path!r} exists and is not a directory")
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".write-test-"):
            pass
    except OSError as err:
        raise UsageError(f"cannot write to the output directory {path!r}: "
                         f"{err.strerror or err}") from None
    return path


def resolve_device(text: str | None) -> torch.device:
    if text is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(text)
    except (RuntimeError, ValueError) as err:
        raise UsageError(f"--device {text!r}: {err}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"--device {text!r}: CUDA is not available here; use --device cpu")
    return device


def resolve_recipes(args, files: dict | None = None) -> list:
    """The runs the command asks for, in order (the noise-floor run after bf16).
    ``files``, when given, receives each recipe file's run name -> its path."""
    mode = check_backward_mode(args.backward_mode)
    if args.recipes is not None:
        names = parse_recipe_names(args.recipes)
    else:
        names = ["bf16"] if args.recipe_file else list(DEFAULT_RECIPES)
    specs = [build_named(n, mode) for n in names]
    if args.noise_floor and BASELINE in names:
        specs.insert(names.index(BASELINE) + 1, noise_floor_spec())
    for item in args.recipe_file:
        spec = load_recipe_file(item, mode)
        taken = {s.name for s in specs}
        base, i = spec.name, 2
        while spec.name in taken:
            spec.name = f"{base}_{i}"
            i += 1
        specs.append(spec)
        if files is not None:
            files[spec.name] = item.rpartition(":")[0]
    specs = with_optim_states(specs, parse_optim_states(args.optim_states))
    if files is not None:  # a recipe file's variants come from the same file
        for spec in specs:
            base = spec.name.partition("+")[0]
            if spec.name not in files and base in files:
                files[spec.name] = files[base]
    return specs


def _positive(name: str, value: int | None) -> None:
    if value is not None and value < 1:
        raise UsageError(f"{name} must be >= 1, got {value}")


def run(args, stdout=None, stderr=None) -> int:
    stdout = stdout or sys.stdout
    stderr = stderr or sys.stderr
    for name in ("steps", "seq_len", "batch_size", "grad_accum", "vocab", "threads"):
        _positive("--" + name.replace("_", "-"), getattr(args, name))
    if args.warmup is not None and args.warmup < 0:
        raise UsageError(f"--warmup must be >= 0, got {args.warmup}")
    if args.save_every < 0:
        raise UsageError(f"--save-every must be >= 0, got {args.save_every}")
    keep = tuple(p.strip() for item in args.keep_high_precision for p in item.split(","))
    try:
        source = resolve_model(args.model, vocab=args.vocab, keep_high_precision=keep)
        cfg = run_config(source, seq_len=args.seq_len, batch_size=args.batch_size, lr=args.lr,
                         steps=args.steps)
        if source.kind == "preset":
            check_config(cfg)
    except (ModelError, ValueError) as err:
        raise UsageError(str(err)) from None
    steps = cfg.default_steps
    device = resolve_device(args.device)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    elif device.type == "cpu":
        torch.set_num_threads(max(1, min(torch.get_num_threads(), (os.cpu_count() or 2) // 2)))
    recipe_files: dict[str, str] = {}
    specs = resolve_recipes(args, recipe_files)
    # Every quantizer every role will get, built and checked against its tensor shape now.
    shape_model = _shape_model(source)
    for spec in specs:
        try:
            validate_recipe(spec, shape_model, cfg.tokens_per_step)
        except RecipeError as err:
            if source.kind == "preset":
                raise
            raise RecipeError(f"{err} (keep such a layer out with --keep-high-precision, e.g. "
                              f"--keep-high-precision lm_head)") from None
    del shape_model
    out_dir = check_out_dir(args.out)
    try:
        corpus = load_data(args.data, tokenizer=source.tokenizer, vocab=cfg.vocab,
                           glob=args.data_glob)
        corpus.check_windows(cfg.seq_len)
    except (OSError, ValueError, TypeError) as err:
        raise UsageError(f"--data: {err}") from None

    compiled = device.type == "cuda" if args.compile is None else args.compile
    if args.cuda_graphs and device.type != "cuda":
        raise UsageError(f"--cuda-graphs needs a CUDA device; got device {device.type}")
    if args.cpp_wrapper and not compiled:
        raise UsageError("--cpp-wrapper needs a compiled run (--compile); got compile off")
    settings = TrainSettings(steps=steps, seed=args.seed, device=device, lr=cfg.lr,
                             compile=compiled, warmup=args.warmup,
                             cuda_graphs=args.cuda_graphs, cpp_wrapper=args.cpp_wrapper)
    model_desc = (cfg.describe() if source.kind == "preset" else
                  f"{source.describe()}, seq={cfg.seq_len}, batch={cfg.batch_size}")
    if args.grad_accum > 1:
        model_desc += f", {args.grad_accum} micro-batches a step"
    print(f"lowprec compare: model {args.model} ({model_desc}), {steps} steps x "
          f"{len(specs)} recipes on {device}{', compiled' if compiled else ''}", file=stderr)
    print(f"data: {corpus.describe()}", file=stderr)
    store = CheckpointStore(
        out_dir, run_settings(args, source, cfg, settings, corpus, device), environment(device),
        args.save_every, recipe_settings={name: {"recipe_file_sha256": file_sha256(path)}
                                          for name, path in recipe_files.items()},
        stream=stderr)
    # Every checkpoint is checked before anything trains: a mismatch is refused at once.
    saved = {spec.name: store.inspect(spec) for spec in specs} if args.resume else {}
    if args.resume:
        print(resume_summary(specs, saved, store, steps), file=stderr)
    results = []
    stopped: tuple | None = None  # (recipe, its checkpointer or None) of an interrupt
    for spec in specs:
        found = saved.get(spec.name)
        if found is not None and found.finished:
            print(f"{spec.name:<20} finished in an earlier run: result from {found.path}",
                  file=stderr)
            results.append(found.result)
            continue
        checkpoint = None
        try:
            if not args.resume:
                store.discard(spec)
            checkpoint = store.for_recipe(spec, found)
            progress = Progress(spec.name, steps, stream=stderr)
            result = train_one(spec, cfg, corpus, settings, progress,
                               source=None if source.kind == "preset" else source,
                               grad_accum=args.grad_accum, checkpoint=checkpoint)
        except KeyboardInterrupt:
            # outside the part train_one handles itself (building the model, closing the
            # bar): stop the same way, writing what there is
            stopped = (spec.name, checkpoint)
            break
        if result.status == "error" and result.traceback:
            print(result.traceback, file=stderr)
        results.append(result)
        if result.status_detail == INTERRUPTED:
            stopped = (spec.name, checkpoint)
            break  # write what there is, then stop
        if result.status in ("ok", "nan"):
            # A failed run (an exception) keeps its last progress checkpoint: --resume
            # tries it again from there.
            try:
                store.finish(spec, result)
            except (OSError, RuntimeError) as err:
                print(f"lowprec compare: warning: cannot save {spec.name}'s result to "
                      f"{store.path(spec.name)} ({type(err).__name__}: {err}); --resume would "
                      f"train it again", file=stderr)
            except KeyboardInterrupt:
                stopped = (spec.name, checkpoint)  # the result is complete: report it
                break

    native = gemm.native_routes()
    info = report.RunInfo(
        command="lowprec compare " + " ".join(shlex.quote(a) for a in args.argv),
        device=str(device),
        device_name=(torch.cuda.get_device_name(device) if device.type == "cuda"
                     else f"CPU, {torch.get_num_threads()} torch thread"
                          f"{'s' if torch.get_num_threads() > 1 else ''}"),
        torch_version=torch.__version__, model=args.model, model_desc=model_desc,
        lr=cfg.lr, warmup=settings.warmup_steps(),
        corpus=corpus.describe(), steps=steps, seed=args.seed,
        backward_mode=check_backward_mode(args.backward_mode) or "default",
        emulated=device.type != "cuda" or not native, backends=native, compiled=compiled,
        cuda_graphs=args.cuda_graphs, cpp_wrapper=args.cpp_wrapper)
    # Each file is written under a temporary name and then moved into place: an interrupt
    # or a failure while writing leaves the previous file, never a half-written one.
    with atomic_path(os.path.join(out_dir, "results.csv")) as tmp:
        report.write_csv(tmp, results)
    with atomic_path(os.path.join(out_dir, "loss.png")) as tmp:
        plot_note = report.plot(tmp, results)
    with atomic_path(os.path.join(out_dir, "sqnr.png")) as tmp:
        sqnr_note = report.plot_sqnr(tmp, results)
    with atomic_path(os.path.join(out_dir, "report.md")) as tmp:
        report.write_markdown(tmp, info, results, plot_note, sqnr_note)
    print(report.terminal_summary(info, results, out_dir, plot_note), file=stdout)
    size = store.disk_bytes()
    if size:
        amount = f"{size / 2**20:.1f} MiB" if size >= 2**20 else f"{size / 2**10:.0f} KiB"
        print(f"checkpoints: {store.dir} ({amount}; --resume continues from them, deleting "
              f"them frees the space)", file=stdout)
    if stopped is not None:
        print(interrupt_message(stopped[0], stopped[1], args.argv), file=stderr)
        return 130
    return 1 if any(r.status == "error" for r in results) else 0


def run_settings(args, source, cfg, settings: TrainSettings, corpus, device) -> dict:
    """The command's settings that decide a run's numbers, as a checkpoint records them
    (see ``resume.SETTING_LABELS``): resolved values, so ``--lr 1e-3`` and the preset's
    default 1e-3 are one setting."""
    return {
        "model": args.model,
        "architecture": cfg.describe() if source.kind == "preset" else source.describe(),
        "vocab": cfg.vocab,
        "keep_high_precision": tuple(source.keep_high_precision),
        "seq_len": cfg.seq_len,
        "batch_size": cfg.batch_size,
        "grad_accum": args.grad_accum,
        "steps": settings.steps,
        "seed": settings.seed,
        "lr": settings.lr,
        "warmup": settings.warmup_steps(),
        "data": data_fingerprint(corpus),
        "device": device.type,
        # inductor rounds the bf16 model's elementwise math differently from eager
        "compile": settings.compile,
        "backward_mode": check_backward_mode(args.backward_mode) or "default",
        "eval_batches": settings.eval_batches,
        "grad_clip": settings.grad_clip,
    }


def resume_summary(specs, saved: dict, store: CheckpointStore, steps: int) -> str:
    """One line on what ``--resume`` found for each recipe."""
    parts = []
    for spec in specs:
        found = saved.get(spec.name)
        if found is None:
            parts.append(f"{spec.name}: from the start")
        elif found.finished:
            parts.append(f"{spec.name}: finished")
        else:
            parts.append(f"{spec.name}: from step {found.step + 1}/{steps}")
    return f"resume from {store.dir}: " + "; ".join(parts)


def interrupt_message(name: str, checkpoint, argv: list) -> str:
    """What Ctrl-C left and the command that continues it."""
    command = "lowprec compare " + " ".join(shlex.quote(a) for a in argv)
    if "--resume" not in argv:
        command += " --resume"
    if checkpoint is not None and checkpoint.saved_step:
        where = (f"{name} will go on after step {checkpoint.saved_step}, its last checkpoint "
                 f"({checkpoint.path})")
    else:
        where = f"{name} had no checkpoint yet and will start again"
    return (f"lowprec compare: interrupted during {name}; finished recipes are saved and "
            f"{where}. To continue, run the same command with --resume:\n  {command}")


def _shape_model(source):
    """The model built on the meta device (shapes only), for the recipe checks."""
    with torch.device("meta"):
        try:
            return source.build("meta", shapes_only=True)
        except (RuntimeError, NotImplementedError, TypeError):
            pass  # a user model that cannot be built on meta: build it for real
    return source.build("cpu")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "make-llama":
        return make_llama.run(args)
    if args.command != "compare":  # pragma: no cover - argparse enforces the choices
        parser.error(f"unknown command {args.command!r}")
    if args.list_recipes:
        print(_recipe_help())
        return 0
    args.argv = argv[1:]
    try:
        return run(args)
    except (UsageError, RecipeError, ResumeError) as err:
        print(f"lowprec compare: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
