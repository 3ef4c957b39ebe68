"""Tile sweep of the 1x32 MXFP8 quantize of both usages with and without the exact bf16
operands, on the Triton kernel and the Gluon one.

Candidates: ``BMxBNxWARPS[xITERSxSTAGES[xKFAST]]`` (the Triton kernel,
``tuning.mxfp8_configs[(False, "both")]``) or ``gluon:RB.WARPS.KFAST.EVICT``
(``tuning.mxfp8_gluon_config``), each set with ``kernels.tuning.override``. For each
candidate and each request (no records, rowwise record as for x, both records as for dY) the
outputs are checked bit for bit against the Triton kernel at its default config, then the
GPU time of one quantize (CUDA graph, ``harness.graph_ms``) is printed against a copy of the
input.

    python tools/sweep_mxfp8_exact.py [--shape 16384x4096] [--configs 32x64x1,gluon:32.4.1.1]
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

from harness import graph_ms, sweep_setup  # noqa: E402

from lowprec.formats.mxfp8.quantizer import MXFP8Quantizer  # noqa: E402
from lowprec.kernels.tuning import override, tuning  # noqa: E402

REQUESTS = {"none": (), "row": ("rowwise",), "both": ("rowwise", "columnwise")}


def outputs(qt):
    outs = [t.view(torch.uint8) for t in qt.inner_tensors().values() if t is not None]
    return outs + [rec[2] for rec in (qt._exact_rowwise, qt._exact_columnwise) if rec]


def _settings(cfg: str) -> dict:
    """The ``tuning`` settings (for ``override``) that point the launcher at one candidate."""
    if cfg.startswith("gluon:"):
        return {"mxfp8_gluon": True, "mxfp8_gluon_config":
                tuple(int(v) for v in cfg.removeprefix("gluon:").split("."))}
    return {"mxfp8_gluon": False, "mxfp8_configs": {
        **tuning.mxfp8_configs, (False, "both"): tuple(int(v) for v in cfg.split("x"))}}


def main():
    configs, inputs, _ = sweep_setup("32x128x2x1x1x1,gluon:32.4.1.1,gluon:16.4.1.1,"
                                     "gluon:32.4.1.0,gluon:32.2.1.1,gluon:32.8.1.1")
    q = MXFP8Quantizer()
    with override(mxfp8_gluon=False):
        want = {r: outputs(q.quantize_for_gemm(inputs[0][0], ex)) for r, ex in REQUESTS.items()}
    for cfg in configs:
        cells = []
        with override(**_settings(cfg)):
            for r, ex in REQUESTS.items():
                got = outputs(q.quantize_for_gemm(inputs[0][0], ex))
                same = all(torch.equal(a, b) for a, b in zip(got, want[r]))
                ms = graph_ms(lambda x: q.quantize_for_gemm(x, ex), inputs)
                cells.append(f"{r} {ms:.4f} ms{'' if same else ' MISMATCH'}")
        print(f"{cfg:16} " + " | ".join(cells), flush=True)


if __name__ == "__main__":
    main()
