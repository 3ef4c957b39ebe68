"""Host (issue) time of one mixture-of-experts layer step split into its pieces: the layer
of ``benchmarks/bench_moe.py`` with its experts as ``lowprec.GroupedExperts`` under one
recipe, on few tokens so that the GPU never holds the host back, with inclusive
``perf_counter`` timers wrapped around GroupedExperts' forward, the routing, the grouped
Linears, their quantizes and GEMM calls, the Triton launches and the backward. A piece's
time includes the pieces it calls; the timers add about a microsecond each.

    python tools/moe_host_parts.py [--shape qwen3] [--tokens 256] [--recipe current-e4m3]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_moe  # noqa: E402
from host_breakdown import Timers  # noqa: E402

#: (owner as "module" or "module:Class", attribute) of every piece timed
TARGETS = [
    ("lowprec.modules.experts:GroupedExperts", "forward"),
    *(("lowprec.modules.experts", a) for a in ("grouped_linear", "swiglu", "route",
                                                "_check_expert_ids")),
    *((f"lowprec.modules.experts:{c}", m) for c in ("_GatedSumIntoTokens", "_RoutedRows")
      for m in ("forward", "backward")),
    ("lowprec.linear.grouped", "_route"),
    ("lowprec.linear.grouped", "_sizes_tensor"),
    *(("lowprec.linear.grouped_current:GroupedCurrent", m) for m in ("forward", "backward")),
    *(("lowprec.linear.grouped_current", a) for a in ("_quantized_experts", "_rows_by_experts",
                                                      "_wgrad", "group_ids", "gemm_backend")),
    *(("lowprec.formats.float8.grouped", a) for a in ("quantize_groups", "quantize_groups_both",
                                                      "quantize_experts", "group_amax",
                                                      "scales_and_decodes", "expert_amax")),
    # the block FP8 path's pieces
    *(("lowprec.linear.grouped_block_fp8:GroupedBlockFP8", m) for m in ("forward", "backward")),
    *(("lowprec.linear.grouped_block_fp8:_BlockGemms", m)
      for m in ("forward", "dgrad", "wgrad")),
    ("lowprec.linear.grouped_exact:ExactGemms", "dgrad"),
    *(("lowprec.linear.grouped_blocks", a) for a in ("quantize_operand", "_quantized_weights",
                                                     "padded_input", "padded_like")),
    *(("lowprec.gemm.block_grouped", a) for a in ("_launch_gluon", "_tma_2d")),
    ("lowprec.formats.block.tensor", "dequantize_bf16"),
    ("lowprec.kernels.launch", "launch"),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="qwen3", choices=sorted(bench_moe.SHAPES))
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--recipe", default="current-e4m3")
    ap.add_argument("--steps", type=int, default=50)
    args = ap.parse_args()
    timers = Timers()
    for owner, attr in TARGETS:
        timers.wrap(owner, attr)
    hidden, num_experts, topk, ffn = bench_moe.SHAPES[args.shape]
    torch.manual_seed(0)
    x = torch.randn(args.tokens, hidden, device="cuda", dtype=torch.bfloat16,
                    requires_grad=True)
    dy = torch.randn_like(x)
    layer = bench_moe.MoE(hidden, num_experts, topk, ffn, None).to("cuda", torch.bfloat16)
    peer = bench_moe.ExpertsModule(args.recipe)
    layer.experts_fn = peer
    peer.bind(layer)

    def step():
        layer.zero_grad(set_to_none=True)
        x.grad = None
        y = layer(x)
        start = time.perf_counter()
        y.backward(dy)
        timers.total["backward (the whole step's)"] += time.perf_counter() - start

    for _ in range(10):
        step()
    torch.cuda.synchronize()
    timers.total.clear()
    timers.calls.clear()
    start = time.perf_counter()
    for _ in range(args.steps):
        step()
    host = (time.perf_counter() - start) / args.steps
    torch.cuda.synchronize()
    print(f"{args.shape}, {args.tokens} tokens, {args.recipe}: {host * 1e3:.2f} ms of host a "
          f"step (timers included)")
    for name, seconds in sorted(timers.total.items(), key=lambda kv: -kv[1]):
        print(f"{name:40s} {seconds / args.steps * 1e3:7.3f} ms a step  "
              f"{timers.calls[name] / args.steps:5.1f} calls")


if __name__ == "__main__":
    main()
