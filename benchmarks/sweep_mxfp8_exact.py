"""Tile sweep of the 1x32 MXFP8 quantize kernel with and without the exact bf16 operands.

For each (BM, BN, warps[, iters, stages]) candidate and each request (no records, rowwise
record as for x, both records as for dY): the outputs are checked bit for bit against the
default config's, then the GPU time of one quantize (CUDA graph, ``harness.graph_ms``) is
printed against a copy of the input.

    python benchmarks/sweep_mxfp8_exact.py [--shape 16384x4096] [--configs 32x64x1,64x64x2]
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import graph_ms, sweep_setup  # noqa: E402
from lowprec.formats.mxfp8 import launch  # noqa: E402
from lowprec.formats.mxfp8.quantizer import MXFP8Quantizer  # noqa: E402

REQUESTS = {"none": (), "row": ("rowwise",), "both": ("rowwise", "columnwise")}


def outputs(qt):
    outs = [t.view(torch.uint8) for t in qt.inner_tensors().values() if t is not None]
    return outs + [rec[2] for rec in (qt._exact_rowwise, qt._exact_columnwise) if rec]


def main():
    configs, inputs, _ = sweep_setup("32x64x1,32x64x2,64x64x2,32x128x2,64x128x4,"
                                     "32x64x1x2x2,64x64x4")
    q = MXFP8Quantizer()
    default = launch.CONFIGS[(False, "both")]
    want = {r: outputs(q.quantize_for_gemm(inputs[0][0], ex)) for r, ex in REQUESTS.items()}
    for cfg in configs:
        launch.CONFIGS[(False, "both")] = tuple(int(v) for v in cfg.split("x"))
        cells = []
        for r, ex in REQUESTS.items():
            got = outputs(q.quantize_for_gemm(inputs[0][0], ex))
            same = all(torch.equal(a, b) for a, b in zip(got, want[r]))
            ms = graph_ms(lambda x: q.quantize_for_gemm(x, ex), inputs)
            cells.append(f"{r} {ms:.4f} ms{'' if same else ' MISMATCH'}")
        print(f"{cfg:14} " + " | ".join(cells))
    launch.CONFIGS[(False, "both")] = default


if __name__ == "__main__":
    main()
