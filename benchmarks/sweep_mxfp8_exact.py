"""Tile sweep of the 1x32 MXFP8 quantize kernels (both usages) with and without the exact
bf16 operands.

Candidates: Triton (BM, BN, warps[, iters, stages[, K-fast grid]]) configs, ``BMxBNxW...``, and Gluon
(warps, rows a thread holds[, tiles a program, K-fast grid]) configs, ``gW.R[.I.KF]``. For each candidate and each request (no
records; rowwise record as for x; both records; both records and no codes, as for dY) the
outputs are checked bit for bit against the default Triton config's, then the GPU time of
one quantize (CUDA graph, ``harness.graph_ms``) is printed against a copy of the input.

    python benchmarks/sweep_mxfp8_exact.py [--shape 16384x4096] [--configs 32x64x1,g4.8]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import graph_ms, l2_rotation  # noqa: E402
from lowprec.formats.mxfp8 import launch  # noqa: E402
from lowprec.formats.mxfp8.quantizer import MXFP8Quantizer  # noqa: E402

REQUESTS = {"none": ((), True), "row": (("rowwise",), True),
            "both": (("rowwise", "columnwise"), True),
            "only": (("rowwise", "columnwise"), False)}


def outputs(qt):
    """Every tensor a quantize wrote, as bytes (ExactTensors hold only bf16 values)."""
    outs = [t.contiguous().view(torch.uint8) for t in qt.inner_tensors().values()
            if t is not None]
    return outs + [rec[2] for rec in (getattr(qt, "_exact_rowwise", None),
                                      getattr(qt, "_exact_columnwise", None)) if rec]


def use_config(cfg: str):
    """Point the launcher at one candidate."""
    launch.GLUON = cfg.startswith("g")
    if launch.GLUON:
        launch.GLUON_CONFIGS["both"] = tuple(int(v) for v in cfg[1:].split("."))
    else:
        launch.CONFIGS[(False, "both")] = tuple(int(v) for v in cfg.split("x"))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="16384x4096")
    ap.add_argument("--configs", default="32x64x1,32x128x2,64x64x4,g2.8,g4.8,g8.8,g2.4,"
                                         "g4.4,g8.4")
    args = ap.parse_args()
    m, k = (int(v) for v in args.shape.split("x"))
    gen = torch.Generator(device="cuda").manual_seed(0)
    inputs = l2_rotation(lambda: (torch.randn(m, k, device="cuda", generator=gen)
                                  .to(torch.bfloat16),), m * k * 2)
    dst = torch.empty_like(inputs[0][0])
    copy_ms = graph_ms(lambda x: dst.copy_(x), inputs)
    print(f"copy {copy_ms:.4f} ms ({4 * m * k / copy_ms / 1e6:.0f} GB/s)")
    q = MXFP8Quantizer()
    saved = launch.GLUON, dict(launch.GLUON_CONFIGS), dict(launch.CONFIGS)
    launch.GLUON = False
    want = {r: outputs(q.quantize_for_gemm(inputs[0][0], ex, codes=c))
            for r, (ex, c) in REQUESTS.items()}
    for cfg in args.configs.split(","):
        use_config(cfg)
        cells = []
        for r, (ex, c) in REQUESTS.items():
            got = outputs(q.quantize_for_gemm(inputs[0][0], ex, codes=c))
            same = len(got) == len(want[r]) and all(torch.equal(a, b)
                                                    for a, b in zip(got, want[r]))
            ms = graph_ms(lambda x: q.quantize_for_gemm(x, ex, codes=c), inputs)
            cells.append(f"{r} {ms:.4f} ms{'' if same else ' MISMATCH'}")
        print(f"{cfg:14} " + " | ".join(cells), flush=True)
    launch.GLUON, launch.GLUON_CONFIGS, launch.CONFIGS = saved


if __name__ == "__main__":
    main()
