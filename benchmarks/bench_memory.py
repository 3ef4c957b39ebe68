"""Peak GPU memory of the forward+backward steps of bench_linear.py, per recipe vs bf16.

The module input is an activation made inside the step (``x * 1.0``), so, as for
a layer inside a network, it lives on only if the peer saves it for backward.
For each peer: one warm-up step, then ``torch.cuda.reset_peak_memory_stats()``
and one more step. Two figures, both relative to what was allocated before the
step (parameters, the leaf input and dy already exist then):

* ``peak MiB``: the peak during the step (saved activations, quantized copies,
  temporaries, outputs, gradients);
* ``saved MiB``: what is still allocated right after the forward (what the peer
  keeps for backward, plus the output).

``ratio`` is peer / bf16 (target for the peak: <= 1).

    python benchmarks/bench_memory.py [--shapes ...] [--recipes ...] [--mlp]
"""

from __future__ import annotations

import argparse
import gc
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_linear import add_peer_args, make_inputs, mlp_peers, parse_shape, shape_peers, split_list  # noqa: E402
from harness import append_rows, print_table  # noqa: E402


class _AfterForward:
    """on_forward hook: records what is allocated once the forward has returned."""

    def __init__(self):
        self.value = 0

    def __call__(self):
        torch.cuda.synchronize()
        self.value = torch.cuda.memory_allocated()


def step_memory_mib(step, probe, x, dy) -> tuple[float, float]:
    step(x, dy)  # warm-up: compiled code, cuBLAS workspaces, weight caches
    step.zero_grads()  # the step frees the previous gradients first: do it before measuring
    x.grad = None
    torch.cuda.synchronize()
    gc.collect()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step(x, dy)
    torch.cuda.synchronize()
    return ((torch.cuda.max_memory_allocated() - before) / 2**20,
            (probe.value - before) / 2**20)


def measure(bench, shape_str, peers, probe, x, dy):
    rows, base = [], None
    for name, step in peers:
        try:
            peak, saved = step_memory_mib(step, probe, x, dy)
        except Exception as e:  # noqa: BLE001
            print(f"{bench} {shape_str} {name}: FAILED {type(e).__name__}: {e}")
            continue
        base = (peak, saved) if base is None else base
        for metric, v, b in (("peak MiB", peak, base[0]), ("saved MiB", saved, base[1])):
            rows.append({"bench": f"{bench}_mem", "shape": shape_str, "recipe": name,
                         "metric": metric, "value": v, "baseline": "bf16",
                         "baseline_value": b, "ratio": v / b if b else float("nan")})
        print(f"  {bench:6s} {shape_str:18s} {name:22s} peak {peak:9.1f} MiB "
              f"(x{peak / base[0]:.3f})"
              f"  saved {saved:9.1f} MiB", flush=True)
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser()
    add_peer_args(ap)
    ap.add_argument("--no-csv", action="store_true")
    args = ap.parse_args(argv)
    recipes = split_list(args.recipes)
    rows = []
    if not args.no_linear:
        for s in args.shapes.split(","):
            m, k, n = parse_shape(s)
            x, dy = make_inputs(m, k, n, "cuda")[0]
            probe = _AfterForward()
            peers = shape_peers(args, m, k, n, fresh=True, on_forward=probe)
            rows += measure("linear", s, peers, probe, x, dy)
            del peers
            del x, dy
            gc.collect()
            torch.cuda.empty_cache()
    if args.mlp:
        m, h, f = parse_shape(args.mlp_shape)
        x, dy = make_inputs(m, h, h, "cuda")[0]
        probe = _AfterForward()
        peers = mlp_peers(m, h, f, recipes, fresh=True, on_forward=probe)
        rows += measure("mlp", args.mlp_shape, peers, probe, x, dy)
    if rows:
        print_table(rows, ["bench", "shape", "recipe", "metric", "value", "ratio"])
        bad = [r for r in rows if r["metric"] == "peak MiB" and r["ratio"] > 1.0]
        print("peak memory <= bf16:", "MET" if not bad else
              "NOT MET for " + ", ".join(f"{r['shape']} {r['recipe']} ({r['ratio']:.2f}x)"
                                         for r in bad))
        if not args.no_csv:
            append_rows(rows)
    return rows


if __name__ == "__main__":
    main()
