"""Where one Linear fwd+bwd step spends its time: host (Python) and device (kernels).

For each recipe on one shape: the host time to issue a step (no sync), the GPU time of a
step (CUDA events), the top Python functions by own time (cProfile over ``--steps`` steps)
and the CUDA kernels of one step (torch.profiler), so launch overhead and slow kernels can
be told apart.

    python tools/profile_step.py [--shape 16384x4096x4096] [--recipes current,delayed]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

from bench_linear import RECIPES, lowprec_step, parse_shape, within  # noqa: E402

import lowprec  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="16384x4096x4096")
    ap.add_argument("--recipes", default="current,delayed,block,mxfp8,nvfp4")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--sort", default="tottime", help="cProfile order: tottime or cumtime")
    ap.add_argument("--only-lowprec", action="store_true",
                    help="list only functions of the lowprec package in the cProfile table")
    ap.add_argument("--no-kernels", action="store_true", help="skip the torch.profiler table")
    ap.add_argument("--sliced", action="store_true",
                    help="run the steps inside lowprec.linear.grad_split.sliced()")
    ap.add_argument("--host-ops", action="store_true",
                    help="also list the torch ops one step issues (count, host time): the ops "
                         "worth fusing away when the step is host-bound")
    args = ap.parse_args()
    m, k, n = parse_shape(args.shape)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16).requires_grad_(True)
    dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    for r in args.recipes.split(","):
        mod = lowprec.Linear(k, n, bias=False, params_dtype=torch.bfloat16, device="cuda")
        step = lowprec_step(mod, RECIPES[r]())
        if args.sliced:
            step = within(lowprec.linear.grad_split.sliced, step)
        for _ in range(5):
            step(x, dy)
        torch.cuda.synchronize()
        # host: issue time per step while the GPU queue is not full (sync each step)
        host = []
        for _ in range(args.steps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            step(x, dy)
            host.append(time.perf_counter() - t0)
        torch.cuda.synchronize()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(args.steps):
            step(x, dy)
        e.record()
        torch.cuda.synchronize()
        # Any op that waits for the GPU inside a step makes it look launch-bound: list them.
        import warnings
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode(1)
            step(x, dy)
            torch.cuda.set_sync_debug_mode(0)
        for w in caught[:5]:
            print(f"SYNC in {r}: {str(w.message)[:200]}")
        host.sort()
        print(f"\n##### {r}: host {1e3 * host[len(host) // 2]:.3f} ms/step, "
              f"GPU {s.elapsed_time(e) / args.steps:.3f} ms/step (back to back)")
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(args.steps):
            step(x, dy)
        pr.disable()
        torch.cuda.synchronize()
        buf = io.StringIO()
        stats = pstats.Stats(pr, stream=buf).sort_stats(args.sort)
        if args.only_lowprec:
            stats.print_stats("lowprec", args.top)
        else:
            stats.print_stats(args.top)
        print("\n".join(line[:160] for line in buf.getvalue().splitlines()[4:]))
        if args.host_ops:
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                for _ in range(3):
                    step(x, dy)
                torch.cuda.synchronize()
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40,
                                            max_name_column_width=60))
        if args.no_kernels:
            continue
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                step(x, dy)
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15,
                                        max_name_column_width=70))


if __name__ == "__main__":
    main()
