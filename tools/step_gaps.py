"""Is a Linear step GPU-bound? Kernel busy time against the step's span, in steady state.

For bf16 ``nn.Linear`` and each recipe on one shape: warm up under the step's own load
(``--warmup-seconds``), time back-to-back steps with CUDA events (median, as
``bench_linear.py``), then trace ``--steps`` back-to-back steps with the CUDA profiler and
report, per step, the summed kernel time (busy), the idle time between kernels (gaps) and
the largest gaps with the kernels around them. Gaps that remain in steady state mean the
host does not stay ahead of the GPU somewhere inside the step.

    python tools/step_gaps.py [--shape 16384x4096x4096] [--recipes block,current]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

from bench_linear import RECIPES, lowprec_step, parse_shape, plain_step  # noqa: E402
from harness import time_fn  # noqa: E402

import lowprec  # noqa: E402


def kernel_intervals(prof) -> list[tuple[float, float, str]]:
    """(start us, end us, name) of every GPU kernel and memset/memcpy in a profile."""
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    out = [(e["ts"], e["ts"] + e["dur"], e.get("name", "?")) for e in events
           if e.get("cat") in ("kernel", "gpu_memset", "gpu_memcpy") and "dur" in e]
    return sorted(out)


def report(name: str, step, x, dy, steps: int, warmup_s: float, top: int):
    ms = time_fn(step, [(x, dy)], warmup=3, iters=20, warmup_s=warmup_s)
    torch.cuda.synchronize()
    for _ in range(8):  # a queue ahead of the GPU before tracing, as in a timed run
        step(x, dy)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step(x, dy)
        torch.cuda.synchronize()
    ks = kernel_intervals(prof)
    # the first steps' kernels may have run before tracing began: keep the last ``steps``
    # steps' worth of span by dropping the first fifth
    ks = ks[len(ks) // 5:]
    span = ks[-1][1] - ks[0][0]
    busy = sum(e - s for s, e, _ in ks)
    gaps = sorted(((ks[i + 1][0] - ks[i][1], ks[i][2][:40], ks[i + 1][2][:40])
                   for i in range(len(ks) - 1)), reverse=True)
    n = steps * 4 / 5
    print(f"{name:10} event median {ms:.3f} ms | traced per step: span {span / n / 1e3:.3f} ms, "
          f"busy {busy / n / 1e3:.3f} ms, idle {(span - busy) / n / 1e3:.3f} ms "
          f"({100 * (span - busy) / span:.1f}%)")
    by_name: dict[str, float] = {}
    for s, e, kname in ks:
        by_name[kname[:50]] = by_name.get(kname[:50], 0.0) + (e - s)
    for kname, t in sorted(by_name.items(), key=lambda kv: -kv[1])[:top]:
        print(f"    {t / n:8.1f} us/step  {kname}")
    for g, a, b in gaps[:top]:
        print(f"    gap {g:7.1f} us after {a} before {b}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="16384x4096x4096")
    ap.add_argument("--recipes", default="current,delayed,block")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup-seconds", type=float, default=1.0)
    ap.add_argument("--top", type=int, default=6)
    args = ap.parse_args()
    m, k, n = parse_shape(args.shape)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16).requires_grad_(True)
    dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    torch.manual_seed(0)
    base = nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
    report("bf16", plain_step(base), x, dy, args.steps, args.warmup_seconds, args.top)
    for r in filter(None, args.recipes.split(",")):
        mod = lowprec.Linear(k, n, bias=False, params_dtype=torch.bfloat16, device="cuda")
        report(r, lowprec_step(mod, RECIPES[r]()), x, dy, args.steps, args.warmup_seconds,
               args.top)


if __name__ == "__main__":
    main()
