"""Quantize throughput of every format, against a device-to-device copy measured in the same run.

Times are GPU time: each quantize (and the copy) runs several times inside a CUDA graph
whose replay is timed (``harness.graph_ms``), so the host's issue time, which at these
sizes can exceed the kernel's, is not counted. The eager per-call time (CUDA events around
each call, as a training step sees it when the host falls behind) is printed beside it.
A quantizer that cannot be captured (a host sync on its path) is timed eagerly and says so.

GB/s counts the fewest bytes a quantize must move: the high-precision input read
once plus every output buffer (data and scales of each direction) written once.
The copy moves the input once each way (read + write). ``ratio`` is quantize GB/s
over copy GB/s (1.0 = as fast as a copy per byte moved).

Each format is timed on its default path (Triton kernels where the format has them
and Triton is available) and, with ``--reference``, on the pure-torch reference too.

    python benchmarks/bench_quantize.py [--shape 16384x4096] [--dtype bf16] [--reference]
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import append_rows, graph_ms, l2_rotation, print_table, time_fn  # noqa: E402

import lowprec  # noqa: E402
from lowprec import (  # noqa: E402
    Float8BlockQuantizer,
    Float8CurrentScalingQuantizer,
    Float8Quantizer,
    MXFP8Quantizer,
    NVFP4Quantizer,
)

E4M3 = torch.float8_e4m3fn
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def quantizers(device):
    """(name, factory, rowwise, columnwise[, exact usages for quantize_for_gemm[, codes]])."""
    return [
        ("fp8_delayed", lambda: Float8Quantizer(torch.ones(1, device=device),
                                                torch.zeros(1, device=device), E4M3), True, True),
        ("fp8_current", lambda: Float8CurrentScalingQuantizer(E4M3), True, True),
        ("fp8_current_row", lambda: Float8CurrentScalingQuantizer(E4M3), True, False),
        ("block_1x128", lambda: Float8BlockQuantizer(E4M3, block_scaling_dim=1), True, True),
        ("block_128x128", lambda: Float8BlockQuantizer(E4M3, block_scaling_dim=2), True, True),
        ("mxfp8", lambda: MXFP8Quantizer(E4M3), True, True),
        ("mxfp8_row", lambda: MXFP8Quantizer(E4M3), True, False),
        ("mxfp8_2d", lambda: MXFP8Quantizer(E4M3, with_2d_quantization=True), True, True),
        ("nvfp4", lambda: NVFP4Quantizer(), True, True),
        ("nvfp4_2d", lambda: NVFP4Quantizer(with_2d_quantization=True), True, True),
        ("nvfp4_rht_sr", lambda: NVFP4Quantizer(with_rht=True, stochastic_rounding=True),
         True, True),
        # with the exact bf16 GEMM operands written too, as a Linear step asks for them
        # (x: rowwise; dY: both directions)
        ("mxfp8+exact_row", lambda: MXFP8Quantizer(E4M3), True, True, ("rowwise",)),
        ("mxfp8+exact", lambda: MXFP8Quantizer(E4M3), True, True, ("rowwise", "columnwise")),
        # dY in a Linear step: the exact values of both directions and nothing else
        ("mxfp8_exact_only", lambda: MXFP8Quantizer(E4M3), True, True,
         ("rowwise", "columnwise"), False),
        ("nvfp4_rht_sr+exact_row",
         lambda: NVFP4Quantizer(with_rht=True, stochastic_rounding=True), True, True,
         ("rowwise",)),
        ("nvfp4_rht_sr+exact",
         lambda: NVFP4Quantizer(with_rht=True, stochastic_rounding=True), True, True,
         ("rowwise", "columnwise")),
    ]


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="16384x4096")
    ap.add_argument("--dtype", default="bf16", choices=list(DTYPES))
    ap.add_argument("--reference", action="store_true", help="also time the torch reference")
    ap.add_argument("--only", default="", help="comma-separated format names")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--no-csv", action="store_true")
    args = ap.parse_args(argv)
    m, k = (int(v) for v in args.shape.lower().split("x"))
    dtype, dev = DTYPES[args.dtype], "cuda"
    nbytes = m * k * dtype.itemsize
    gen = torch.Generator(device=dev).manual_seed(0)
    inputs = l2_rotation(lambda: (torch.randn(m, k, device=dev, generator=gen).to(dtype),),
                         nbytes)
    dst = torch.empty(m, k, device=dev, dtype=dtype)
    copy_ms = graph_ms(lambda x: dst.copy_(x), inputs, iters=args.iters)
    copy_gbs = 2 * nbytes / copy_ms / 1e6
    rows = [{"bench": "quantize", "shape": f"{m}x{k}", "recipe": "d2d_copy", "metric": "GB/s",
             "value": copy_gbs, "baseline": "", "baseline_value": "", "ratio": 1.0,
             "note": f"GPU {copy_ms:.4f} ms (CUDA graph)"}]
    only = set(filter(None, args.only.split(",")))
    paths = [("default", None)] + ([("reference", lowprec.kernels.reference_only)]
                                   if args.reference else [])
    for name, make, row, col, *opts in quantizers(dev):
        if only and name not in only:
            continue
        q = make()
        q.set_usage(rowwise=row, columnwise=col)
        exact = opts[0] if opts else ()
        codes = opts[1] if len(opts) > 1 else True
        for path, ctx in paths:
            with (ctx() if ctx is not None else contextlib.nullcontext()):
                ms, how, eager_ms, ob = _time_one(q, exact, codes, inputs, args.iters)
            gbs = (nbytes + ob) / ms / 1e6
            rows.append({"bench": "quantize", "shape": f"{m}x{k}", "recipe": f"{name}/{path}",
                         "metric": "GB/s", "value": gbs, "baseline": "d2d_copy",
                         "baseline_value": copy_gbs, "ratio": gbs / copy_gbs,
                         "note": f"{how} {ms:.4f} ms; eager {eager_ms:.4f} ms; "
                                 f"{(nbytes + ob) / 1e6:.0f} MB, {args.dtype} in"})
    print_table(rows, ["recipe", "value", "ratio", "note"])
    if not args.no_csv:
        append_rows(rows)
    return rows


def _time_one(q, exact, codes, inputs, iters):
    """(time ms, "GPU" or "eager", eager ms, output bytes) of ``q.quantize_for_gemm(x,
    exact, codes=codes)`` (``q.quantize`` when ``exact`` is empty)."""
    def quantize(x):
        return q.quantize_for_gemm(x, exact, codes=codes)

    qt = quantize(inputs[0][0])
    ob = qt.held_bytes()  # every output: inner tensors and exact bf16 records
    del qt
    eager = time_fn(quantize, inputs, iters=iters)
    try:
        return graph_ms(quantize, inputs, iters=iters), "GPU", eager, ob
    except RuntimeError as e:  # capture refused (a host sync on the path): say so, time eagerly
        print(f"{q!r}: no CUDA graph ({str(e).splitlines()[0][:100]}); eager time only")
        torch.cuda.synchronize()
        return eager, "eager", eager, ob


if __name__ == "__main__":
    main()
