"""Delayed-scaling state updates batched (``lowprec.state_batch``) against one per state, in
one process on a stack of Linear layers: the host time inside the update machinery (the
region's exit and each module's backward-state update; outermost calls timed) and the
host time of the whole step, alternating the two peers (the whole-step times of these
host-bound steps move by 10% between calls; the update time is the steady measure).

    python benchmarks/ab_state_updates.py [--stack 24x4096x1024] [--reps 16]
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from lowprec import state_batch  # noqa: E402
from lowprec.state import DelayedScalingState  # noqa: E402
from bench_linear import make_inputs, parse_shape, stack_peers  # noqa: E402

_acc = {"s": 0.0, "depth": 0}


def _timed(fn):
    """``fn`` with its time added to ``_acc`` unless called inside another timed call."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if _acc["depth"]:
            return fn(*args, **kwargs)
        _acc["depth"] += 1
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            _acc["s"] += time.perf_counter() - t0
            _acc["depth"] -= 1
    return wrapper


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--stack", default="24x4096x1024", help="LAYERSxMxK")
    ap.add_argument("--reps", type=int, default=16)
    ap.add_argument("--steps", type=int, default=10)
    args = ap.parse_args()
    # the region's exit (batched or not) and every single-state update (backward ones)
    # (``lowprec.autocast`` is the function; the module binds update_states at import)
    autocast_module = sys.modules["lowprec.autocast"]
    autocast_module.update_states = state_batch.update_states = _timed(state_batch.update_states)
    DelayedScalingState.update = _timed(DelayedScalingState.update)
    layers, m, k = parse_shape(args.stack)
    peers = dict(stack_peers(layers, m, k, ["delayed"], variants={"per_state": ["delayed"]}))
    names = ["lowprec/delayed", "lowprec/delayed/per_state"]
    inputs = make_inputs(m, k, k, "cuda")
    for name in names:
        for i in range(5):
            peers[name](*inputs[i % len(inputs)])
    torch.cuda.synchronize()
    update_us, step_ms = {n: [] for n in names}, {n: [] for n in names}
    for rep in range(args.reps):
        for name in (names if rep % 2 == 0 else names[::-1]):
            _acc["s"] = 0.0
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for i in range(args.steps):
                peers[name](*inputs[i % len(inputs)])
            t1 = time.perf_counter()
            torch.cuda.synchronize()
            update_us[name].append(_acc["s"] / args.steps * 1e6)
            step_ms[name].append((t1 - t0) / args.steps * 1e3)
    print(f"stack {args.stack}, {args.reps} alternations x {args.steps} steps, medians:")
    for name in names:
        print(f"  {name:28s} update machinery {statistics.median(update_us[name]):8.1f} us/step"
              f"  whole step (host) {statistics.median(step_ms[name]):7.2f} ms")


if __name__ == "__main__":
    main()
