"""A/B of GroupedExperts' own kernels (SwiGLU, token sum) in a whole HF MoE model step:
``bench_moe.py --model`` once as the code is, once with both replaced by their torch ops
(the same bits), in one process, to tell their effect from run-to-run and host noise.

    python tools/ab_experts_kernels.py [--model qwen3] [--layers 4] [--modes eager]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import bench_moe  # noqa: E402

import lowprec.modules.experts as experts  # noqa: E402
from lowprec.kernels.swiglu import swiglu_torch  # noqa: E402
from lowprec.kernels.token_sum import token_sum_torch  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen3")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--modes", default="eager")
    args = ap.parse_args()
    modes = args.modes.split(",")
    for label in ("kernels", "torch ops", "kernels"):
        print(f"--- GroupedExperts with {label}")
        kernels = label == "kernels"
        experts.swiglu = experts.__dict__["_kernel_swiglu"] if kernels else swiglu_torch
        experts.token_sum = (experts.__dict__["_kernel_token_sum"] if kernels
                             else token_sum_torch)
        bench_moe.run_model(args.model, args.layers, 2, 4096, modes, 10, 3,
                            recipes=("current-e4m3",))


experts._kernel_swiglu, experts._kernel_token_sum = experts.swiglu, experts.token_sum

if __name__ == "__main__":
    main()
