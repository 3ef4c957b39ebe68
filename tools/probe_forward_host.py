"""Host time of a training forward through a chain of Linears, the way a model's forward
issues them (one autocast region, each Linear on the previous one's output, gradients
on): bf16 ``nn.Linear`` against lowprec's current scaling through the traced plan
(``lowprec.linear.traced.eager_plan``) and through the eager Function
(``traced.eager_plans_off``). Microseconds a Linear; ``--profile`` adds cProfile's
cumulative view of the plan's forward.

    python tools/probe_forward_host.py [--layers 56] [--tokens 1024] [--profile]
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from probe_eager_plan import profile  # noqa: E402 - this folder's probe of one Linear

import lowprec  # noqa: E402
from lowprec import Float8CurrentScaling  # noqa: E402
from lowprec.linear import traced  # noqa: E402


def per_linear_us(forward, n_linears: int, reps: int = 20) -> float:
    for _ in range(3):
        forward()
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        forward()
        times.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    return sorted(times)[reps // 2] / n_linears * 1e6


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=56)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--profile", action="store_true")
    a = ap.parse_args()
    d = a.width
    x = torch.randn(a.tokens, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    plain = [torch.nn.Linear(d, d, bias=False, device="cuda", dtype=torch.bfloat16)
             for _ in range(a.layers)]
    low = [lowprec.Linear(d, d, bias=False, params_dtype=torch.bfloat16, device="cuda")
           for _ in range(a.layers)]
    recipe = Float8CurrentScaling()

    def bf16():
        y = x
        for m in plain:
            y = m(y)
        return y

    def lp(off: bool):
        def run():
            with traced.eager_plans_off() if off else contextlib.nullcontext():
                with lowprec.autocast(recipe=recipe):
                    y = x
                    for m in low:
                        y = m(y)
            return y
        return run

    print(f"{a.layers} Linears {d}x{d}, {a.tokens} tokens, forward host us a Linear: "
          f"bf16 {per_linear_us(bf16, a.layers):.1f}, "
          f"plan {per_linear_us(lp(False), a.layers):.1f}, "
          f"Function {per_linear_us(lp(True), a.layers):.1f}", flush=True)
    for label, off in (("plan", False), ("Function", True)) if a.profile else ():
        profile(lp(off), label, calls=10, sort="cumulative", rows=32, chars=7000)


if __name__ == "__main__":
    main()
