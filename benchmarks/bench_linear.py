"""Linear and LayerNormMLP forward+backward per recipe, against bf16 and torchao.

One step is ``y = module(x); y.backward(dy)`` with bf16 activations, x requiring
grad (so dgrad and wgrad both run) and the weight gradient reset each step.
Peers, each timed in the same run as its baseline:

* ``bf16``: ``torch.nn.Linear`` (eager; one cuBLAS GEMM per direction);
* ``lowprec/<recipe>``: ``lowprec.Linear`` under ``lowprec.autocast(recipe)`` (eager);
* ``torchao/tensorwise``, ``torchao/rowwise``: ``Float8Linear`` from
  ``torchao.float8.convert_to_float8_training``, ``torch.compile``d (skipped when
  torchao does not import).

LayerNormMLP (``--mlp``): ``lowprec.LayerNormMLP(K, N, activation="gelu")`` on an
(M, K) input, against the same module outside autocast (bf16) and a plain torch
LayerNorm -> Linear -> GELU -> Linear.

Ops (``--ops``): that MLP as ``lowprec.ops.Sequential``, compiled (traced into the graph,
and declining its traced form: one opaque op) and eager, with ``LayerNormMLP`` compiled,
against the torch modules compiled.

``ratio`` in the CSV is peer time / bf16 time (below 1 = faster); the table
also prints the speedup (bf16 time / peer time).

    python benchmarks/bench_linear.py [--shapes 16384x4096x4096,...] [--recipes ...] [--mlp]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import (  # noqa: E402
    append_rows,
    compare,
    compare_alternating,
    graphed_step,
    l2_rotation,
    print_table,
)

import lowprec  # noqa: E402

SHAPES = ["16384x4096x4096", "16384x4096x14336", "16384x14336x4096"]
RECIPES = {name: functools.partial(lowprec.recipe.Recipe.from_name, name)
           for name in ("current", "delayed", "block", "mxfp8", "nvfp4")}
TORCHAO = ["tensorwise", "rowwise"]


def split_list(s: str) -> list[str]:
    return [v for v in s.split(",") if v]


def parse_shape(s):
    return tuple(int(v) for v in s.lower().split("x"))


# ---- step functions -----------------------------------------------------------------------
# ``fresh=True`` feeds the module ``x * 1.0``, an activation that only autograd keeps alive
# (as a previous layer's output would be), so the memory bench sees what each peer saves.
def plain_step(module, fresh=False, on_forward=None, recipe=None, cuda_graphs=False):
    """One ``y = module(x); y.backward(dy)`` step (under ``lowprec.autocast(recipe,
    cuda_graphs=cuda_graphs)`` when a recipe is given); ``fresh``: the module input is an
    activation made inside the step."""
    params = [p for p in module.parameters()]

    def step(x, dy):
        for p in params:
            p.grad = None
        x.grad = None
        with (lowprec.autocast(recipe=recipe, cuda_graphs=cuda_graphs) if recipe is not None
              else contextlib.nullcontext()):
            y = module(x * 1.0 if fresh else x)
        if on_forward is not None:
            on_forward()
        y.backward(dy)
    step.zero_grads = lambda: [setattr(p, "grad", None) for p in params]
    return step


def lowprec_step(module, recipe, fresh=False, on_forward=None, cuda_graphs=False):
    return plain_step(module, fresh, on_forward, recipe, cuda_graphs)


def torchao_linear(k, n, recipe_name, device):
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    model = nn.Sequential(nn.Linear(k, n, bias=False, device=device, dtype=torch.bfloat16))
    convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name(recipe_name))
    return torch.compile(model)


def make_inputs(m, k, n, device, count_bytes=True):
    gen = torch.Generator(device=device).manual_seed(m + k + n)

    def one():
        x = torch.randn(m, k, device=device, generator=gen, dtype=torch.bfloat16)
        dy = torch.randn(m, n, device=device, generator=gen, dtype=torch.bfloat16)
        return x.requires_grad_(True), dy
    return l2_rotation(one, 2 * (m * k + m * n), min_sets=2, max_sets=3)


# ---- benches ------------------------------------------------------------------------------
def linear_peers(m, k, n, recipes, torchao_recipes, device="cuda", cuda_graphs=False,
                 **step_kw):
    """(name, step) for one shape, the bf16 baseline first; ``cuda_graphs``: the lowprec
    peers replay their Linear calls from CUDA graphs (``lowprec.autocast(cuda_graphs=
    True)``)."""
    torch.manual_seed(0)
    base = nn.Linear(k, n, bias=False, device=device, dtype=torch.bfloat16)
    peers = [("bf16", plain_step(base, **step_kw))]
    for r in recipes:
        mod = lowprec.Linear(k, n, bias=False, params_dtype=torch.bfloat16, device=device)
        with torch.no_grad():
            mod.weight.copy_(base.weight)
        name = f"lowprec/{r}" + ("+graphs" if cuda_graphs else "")
        peers.append((name, lowprec_step(mod, RECIPES[r](), cuda_graphs=cuda_graphs,
                                         **step_kw)))
    for r in torchao_recipes:
        try:
            peers.append((f"torchao/{r}",
                          plain_step(torchao_linear(k, n, r, device), **step_kw)))
        except Exception as e:  # noqa: BLE001 - torchao missing or refusing
            print(f"torchao/{r}: skipped ({type(e).__name__}: {e})")
    return peers


def shape_peers(args, m, k, n, **step_kw):
    """``linear_peers`` for one shape with the options of ``add_peer_args``."""
    return linear_peers(m, k, n, split_list(args.recipes), split_list(args.torchao),
                        cuda_graphs=getattr(args, "cuda_graphs", False), **step_kw)


def stack_peers(layers, m, k, recipes, device="cuda", **step_kw):
    """(name, step) for ``layers`` bias-free K x K Linear layers in a row on M tokens, the
    bf16 ``nn.Linear`` stack first: per-module host costs add up here."""
    torch.manual_seed(0)
    base = nn.Sequential(*[nn.Linear(k, k, bias=False, device=device, dtype=torch.bfloat16)
                           for _ in range(layers)])
    peers = [("bf16", plain_step(base, **step_kw))]
    for r in recipes:
        mod = nn.Sequential(*[lowprec.Linear(k, k, bias=False, params_dtype=torch.bfloat16,
                                             device=device) for _ in range(layers)])
        with torch.no_grad():
            for a, b in zip(mod, base):
                a.weight.copy_(b.weight)
        peers.append((f"lowprec/{r}", lowprec_step(mod, RECIPES[r](), **step_kw)))
    return peers


def mlp_peers(m, hidden, ffn, recipes, device="cuda", **step_kw):
    torch.manual_seed(0)
    mod = lowprec.LayerNormMLP(hidden, ffn, bias=False, activation="gelu",
                               params_dtype=torch.bfloat16, device=device)
    ref = nn.Sequential(nn.LayerNorm(hidden, device=device, dtype=torch.bfloat16),
                        nn.Linear(hidden, ffn, bias=False, device=device, dtype=torch.bfloat16),
                        nn.GELU(),
                        nn.Linear(ffn, hidden, bias=False, device=device, dtype=torch.bfloat16))
    peers = [("bf16", plain_step(ref, **step_kw)), ("lowprec/bf16", plain_step(mod, **step_kw))]
    for r in recipes:
        peers.append((f"lowprec/{r}", lowprec_step(copy.deepcopy(mod), RECIPES[r](), **step_kw)))
        if r in ("current", "mxfp8"):
            # the same recipe with norm and activation run apart from their quantize
            peers.append((f"lowprec/{r}/unfused", unfused(lowprec_step(copy.deepcopy(mod),
                                                                       RECIPES[r](), **step_kw))))
    return peers


class _OpaqueSequential(lowprec.ops.Sequential):
    """A Sequential that declines its traced form: the whole run one opaque op."""

    def traced_forward(self, x, *extra_inputs):
        return "benchmark peer: the opaque op"


def ops_peers(m, hidden, ffn, recipes, device="cuda", **step_kw):
    """The LayerNormMLP computation as ``lowprec.ops.Sequential(LayerNorm, Linear, GELU,
    Linear)``, compiled: traced (``lowprec.ops.traced``), as the opaque op, and eager;
    against ``LayerNormMLP`` compiled and the torch modules compiled (the baseline)."""
    torch.manual_seed(0)
    kw = dict(device=device, dtype=torch.bfloat16)
    ref = nn.Sequential(nn.LayerNorm(hidden, **kw), nn.Linear(hidden, ffn, **kw), nn.GELU(),
                        nn.Linear(ffn, hidden, **kw))
    peers = [("bf16/compiled", plain_step(torch.compile(ref), **step_kw))]
    lkw = dict(params_dtype=torch.bfloat16, device=device)

    def seq(cls):
        return cls(lowprec.ops.LayerNorm(hidden, **lkw), lowprec.ops.Linear(hidden, ffn, **lkw),
                   lowprec.ops.GELU(), lowprec.ops.Linear(ffn, hidden, **lkw))
    for r in recipes:
        mlp = lowprec.LayerNormMLP(hidden, ffn, activation="gelu", **lkw)
        peers += [
            (f"mlp/{r}/compiled", lowprec_step(torch.compile(mlp), RECIPES[r](), **step_kw)),
            (f"ops/{r}/compiled", lowprec_step(torch.compile(seq(lowprec.ops.Sequential)),
                                               RECIPES[r](), **step_kw)),
            (f"ops/{r}/opaque", lowprec_step(torch.compile(seq(_OpaqueSequential)),
                                             RECIPES[r](), **step_kw)),
            (f"ops/{r}/eager", lowprec_step(seq(lowprec.ops.Sequential), RECIPES[r](),
                                            **step_kw))]
    return peers


def within(context, step):
    """``step`` run inside ``context()`` (keeps ``zero_grads``)."""
    def run(x, dy):
        with context():
            step(x, dy)
    run.zero_grads = step.zero_grads
    return run


def unfused(step):
    return within(lowprec.fused.unfused, step)


def host_time(step, inputs, n=10):
    """CPU time to issue one step (ms), from a queue already drained: when it reaches the
    GPU time the step is launch-bound."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i in range(n):
        step(*inputs[i % len(inputs)])
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) * 1e3 / n


def run_peers(bench, shape_str, peers, inputs, args, graphed=False):
    """Times every peer against the first (the baseline); ``graphed``: each step captured
    in CUDA graphs first (``harness.graphed_step``), the baseline's too."""
    rows = []
    baseline_name, baseline = peers[0]
    if graphed:
        baseline = graphed_step(baseline, inputs)
    for name, step in peers:
        try:
            if graphed:
                step = baseline if name == baseline_name else graphed_step(step, inputs)
            if args.alternate:
                peer_ms, base_ms = compare_alternating(step, baseline, inputs, inputs,
                                                       warmup=args.warmup,
                                                       iters=args.rounds * args.iters)
            else:
                peer_ms, base_ms = compare(step, baseline, inputs, inputs, rounds=args.rounds,
                                           warmup=args.warmup, iters=args.iters,
                                           warmup_s=args.warmup_seconds)
            host_ms = host_time(step, inputs)
        except Exception as e:  # noqa: BLE001 - report and go on
            print(f"{bench} {shape_str} {name}: FAILED {type(e).__name__}: {e}")
            continue
        rows.append({"bench": bench, "shape": shape_str, "recipe": name, "metric": "ms",
                     "value": peer_ms, "baseline": baseline_name, "baseline_value": base_ms,
                     "ratio": peer_ms / base_ms,
                     "note": (
                         f"speedup {base_ms / peer_ms:.3f}x; host {host_ms:.2f} ms/step; "
                         f"{'CUDA graph replays; ' if graphed else ''}"
                         f"{'alternating calls' if args.alternate else 'rounds'}"
                         f"{f', warm-up {args.warmup_seconds:g} s' if args.warmup_seconds else ''}"
                     )})
        print(f"  {bench:6s} {shape_str:18s} {name:22s} {peer_ms:8.3f} ms  bf16 {base_ms:8.3f} ms"
              f"  speedup {base_ms / peer_ms:.3f}x  host {host_ms:.2f} ms/step", flush=True)
    return rows


def add_peer_args(ap: argparse.ArgumentParser) -> None:
    """The shapes, recipes and peers options shared with bench_memory.py."""
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--recipes", default=",".join(RECIPES))
    ap.add_argument("--torchao", default=",".join(TORCHAO), help="'' to skip torchao")
    ap.add_argument("--mlp", action="store_true", help="also LayerNormMLP (M x hidden x ffn)")
    ap.add_argument("--mlp-shape", default="16384x4096x14336")
    ap.add_argument("--no-linear", action="store_true")
    ap.add_argument("--ops", action="store_true",
                    help="also the MLP as lowprec.ops.Sequential, compiled (traced and "
                         "opaque) and eager (--mlp-shape; bench 'ops')")


def main(argv=None):
    ap = argparse.ArgumentParser()
    add_peer_args(ap)
    ap.add_argument("--stack", default="",
                    help="also a stack of Linear layers, LAYERSxMxK: that many K x K layers "
                         "on M tokens (bench 'stack'; host-bound steps where per-module host "
                         "costs add up)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup-seconds", type=float, default=0.0,
                    help="warm each round up for this long first (the GPU clock settles "
                         "under a sustained load)")
    ap.add_argument("--alternate", action="store_true",
                    help="time baseline and peer call by call, alternating (rounds x iters "
                         "calls each), instead of in interleaved rounds")
    ap.add_argument("--graphed", action="store_true",
                    help="also time every peer (bf16 included) with its step captured in a "
                         "CUDA graph and replayed: GPU time without the host's issue time "
                         "(bench 'linear_graph' in the CSV)")
    ap.add_argument("--cuda-graphs", action="store_true",
                    help="the lowprec Linear peers replay their calls from CUDA graphs "
                         "(lowprec.autocast(cuda_graphs=True)); the rest of the step eager")
    ap.add_argument("--no-csv", action="store_true")
    args = ap.parse_args(argv)
    recipes = split_list(args.recipes)
    rows = []
    if not args.no_linear:
        for s in args.shapes.split(","):
            m, k, n = parse_shape(s)
            inputs = make_inputs(m, k, n, "cuda")
            rows += run_peers("linear", s, shape_peers(args, m, k, n), inputs, args)
            if args.graphed:
                rows += run_peers("linear_graph", s, shape_peers(args, m, k, n), inputs, args,
                                  graphed=True)
            del inputs
            torch.cuda.empty_cache()
    if args.stack:
        layers, m, k = parse_shape(args.stack)
        rows += run_peers("stack", args.stack, stack_peers(layers, m, k, recipes),
                          make_inputs(m, k, k, "cuda"), args)
    if args.mlp:
        m, h, f = parse_shape(args.mlp_shape)
        inputs = make_inputs(m, h, h, "cuda")
        rows += run_peers("mlp", args.mlp_shape, mlp_peers(m, h, f, recipes), inputs, args)
    if args.ops:
        m, h, f = parse_shape(args.mlp_shape)
        inputs = make_inputs(m, h, h, "cuda")
        rows += run_peers("ops", args.mlp_shape, ops_peers(m, h, f, recipes), inputs, args)
    if rows:
        print_table(rows, ["bench", "shape", "recipe", "value", "baseline_value", "ratio", "note"])
        if not args.no_csv:
            append_rows(rows)
    report_targets(rows)
    return rows


def report_targets(rows):
    """Prints the issue's speed targets as met / not met with the measured ratios (eager
    steps, then CUDA-graphed ones when ``--graphed`` ran)."""
    for bench, what in (("linear", "eager steps"), ("linear_graph", "CUDA graph replays")):
        _report_bench(rows, bench, what)


def _report_bench(rows, bench, what):
    lin = {(r["shape"], r["recipe"]): r for r in rows if r["bench"] == bench}
    if not lin:
        return
    print(f"\ntargets (Linear fwd+bwd, {what}):")
    for shape in dict.fromkeys(s for s, _ in lin):
        first = shape == SHAPES[0]

        def speed(rec):
            r = lin.get((shape, rec))
            return None if r is None else r["baseline_value"] / r["value"]

        def line(name, ok, detail):
            print(f"  {shape:18s} {name:44s} {'MET' if ok else 'NOT MET':8s} {detail}")

        cur, tw = speed("lowprec/current"), speed("torchao/tensorwise")
        if cur is not None:
            need = 1.5 if first else 1.6
            line(f"Float8CurrentScaling >= {need}x bf16", cur >= need, f"{cur:.3f}x")
            if tw is not None:
                line("Float8CurrentScaling faster than torchao tensorwise", cur > tw,
                     f"{cur:.3f}x vs {tw:.3f}x")
        for rec, need in (("delayed", 1.6), ("block", 1.35)):
            s = speed(f"lowprec/{rec}")
            if s is not None:
                line(f"{rec} >= {need}x bf16", s >= need, f"{s:.3f}x")
        for rec, cap in (("mxfp8", 1.10), ("nvfp4", 1.25)):
            s = speed(f"lowprec/{rec}")
            if s is not None:
                line(f"{rec} time <= {cap}x bf16", 1 / s <= cap, f"{1 / s:.3f}x bf16 time")


if __name__ == "__main__":
    main()
