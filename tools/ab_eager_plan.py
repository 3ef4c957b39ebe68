"""A/B of eager recipes on the "1b" model (``bench_model.run_peer``): the traced plan run
eagerly against the eager Function (``traced.eager_plans_off``), or against the plan with
every ``BoundCalls`` launcher launching unbound (``--against unbound``), alternating in one
process after bf16 eager (the host's speed varies between processes).

    python tools/ab_eager_plan.py [--model 1b] [--rounds 2] [--recipes current,mxfp8]
        [--mode eager|checkpointed] [--against function|unbound]
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import bench_model as bm  # noqa: E402

from lowprec.kernels import launch  # noqa: E402
from lowprec.linear import traced  # noqa: E402


def report(label: str, res) -> None:
    print(f"{label:28s} ms {res[0]:7.2f}  GPU {res[4]:7.2f}  forward host {res[6]:6.2f}  "
          f"peak {res[2]:.2f} GiB", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="1b")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--recipes", default="current", help="bench_model.RECIPES names")
    ap.add_argument("--mode", default="eager", choices=["eager", "checkpointed"],
                    help="checkpointed: Hugging Face's gradient checkpointing")
    ap.add_argument("--against", default="function", choices=["function", "unbound"])
    args = ap.parse_args()
    other = traced.eager_plans_off if args.against == "function" else launch.unbound_calls
    report("bf16", bm.run_peer("bf16", args.model, "cuda", args.mode, 10, 3))
    bm.release()
    for recipe in args.recipes.split(","):
        for _ in range(args.rounds):
            for label, off in (("plan", False), (args.against, True)):
                with other() if off else contextlib.nullcontext():
                    res = bm.run_peer(f"lowprec-{recipe}", args.model, "cuda",
                                      args.mode, 10, 3)
                bm.release()
                report(f"{recipe} {label}", res)


if __name__ == "__main__":
    main()
