"""Tile sweep of the NVFP4 rowwise and columnwise quantize kernels.

For each candidate (``row:KBxRB`` sets ``tuning.nvfp4_config["row"]``, ``col:KW`` sets
``tuning.nvfp4_config["col"]``, through ``lowprec.kernels.tuning.override``) and each
request, the outputs are checked bit for bit against the default config's, then the GPU time
of one quantize (CUDA graph, ``harness.graph_ms``) is printed against a copy of the input.
Requests: the plain quantizer (nearest-even, both usages), and RHT + stochastic rounding
with the exact bf16 operands of both directions (dY in a Linear step), each direction alone.

    python tools/sweep_nvfp4.py [--shape 16384x4096] [--configs row:8x16,col:4,...]
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

from harness import graph_ms, sweep_setup  # noqa: E402

from lowprec.formats.nvfp4.quantizer import NVFP4Quantizer  # noqa: E402
from lowprec.kernels.tuning import override, tuning  # noqa: E402

#: name -> (quantizer kwargs, usage, exact directions)
REQUESTS = {
    "rne_row": ({}, "row", ()),
    "rne_col": ({}, "col", ()),
    "rne_rht_col": (dict(with_rht=True), "col", ()),
    "sr_ex_row": (dict(with_rht=True, stochastic_rounding=True), "row", ("rowwise",)),
    "sr_ex_col": (dict(with_rht=True, stochastic_rounding=True), "col", ("columnwise",)),
}


def _outputs(qt):
    outs = [t for t in qt.inner_tensors().values() if t is not None]
    outs += [rec[2] for rec in (getattr(qt, "_exact_rowwise", None),
                                getattr(qt, "_exact_columnwise", None)) if rec]
    return [t.view(torch.uint8) if t.element_size() == 1 else t.view(torch.int16)
            if t.element_size() == 2 else t.view(torch.int32) for t in outs]


def _run(kwargs, usage, exact, x, seed=None):
    q = NVFP4Quantizer(**kwargs).set_usage(rowwise=usage == "row", columnwise=usage == "col")
    if seed is not None:  # the same draws for the bit-for-bit check (not inside a graph)
        torch.manual_seed(seed)
    return q.quantize_for_gemm(x, exact) if exact else q.quantize(x)


def _config(cfg: str) -> tuple[str, dict]:
    """The candidate's kind ("row" or "col") and ``tuning.nvfp4_config`` with it applied."""
    kind, _, val = cfg.partition(":")
    config = {key: dict(value) for key, value in tuning.nvfp4_config.items()}
    if kind == "row":
        kb, rb = (int(v) for v in val.split("x"))
        config["row"].update(KB=kb, RB=rb)
    elif kind == "col":
        config["col"].update(KW=int(val))
    else:
        raise ValueError(f"unknown config {cfg!r}: expected row:KBxRB or col:KW")
    return kind, config


def main():
    configs, inputs, _ = sweep_setup("row:8x16,row:4x32,row:16x8,row:8x8,row:4x16,"
                                     "col:4,col:2,col:8,col:1")
    want = {r: _outputs(_run(*req, inputs[0][0], 0)) for r, req in REQUESTS.items()}
    for cfg in configs:
        kind, config = _config(cfg)
        cells = []
        with override(nvfp4_config=config):
            for r, req in REQUESTS.items():
                if not r.endswith(kind):
                    continue
                same = all(torch.equal(a, b)
                           for a, b in zip(_outputs(_run(*req, inputs[0][0], 0)), want[r]))
                ms = graph_ms(lambda x, req=req: _run(*req, x), inputs)
                cells.append(f"{r} {ms:.4f} ms{'' if same else ' MISMATCH'}")
        print(f"{cfg:10} " + " | ".join(cells), flush=True)


if __name__ == "__main__":
    main()
