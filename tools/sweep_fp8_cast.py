"""GPU time of the per-tensor FP8 cast pass per tile config, each config checked bit for bit.

Delayed scaling's quantize is one pass (read x, write rowwise and/or columnwise codes,
record the amax); current scaling is an amax pass plus the same cast pass (or, with
``tuning.one_launch_current``, both in one cooperative launch: the "current_one" key
turns it on for its candidates). Both take their
tile config from ``lowprec.kernels.tuning.tuning.fp8_configs`` ("cast_both", "cast_row", "cast_col":
(BM, BN, warps[, tiles per program, pipeline stages[, K-fast grid[, bottom-up]]])),
and current scaling's one-launch kernel from "current_one" (BM, BN, warps, programs per SM).
Current scaling's cast follows its amax pass, so an order that first reads the rows the
amax pass read last takes them from L2. For each candidate this prints the
GPU time (CUDA graphs) of delayed and current scaling and their ratio to a device-to-device
copy of the same input measured in the same run (bytes read + written, as
``bench_quantize.py``), after checking the codes, scales and recorded amax against the
configured default on the benchmark shape and against the CPU reference on odd shapes.

    python tools/sweep_fp8_cast.py [--shape 16384x4096] [--keys cast_both,cast_row]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

from harness import bf16_inputs_and_copy, graph_ms  # noqa: E402

from lowprec.formats import Float8CurrentScalingQuantizer, Float8Quantizer  # noqa: E402
from lowprec.kernels import tuning  # noqa: E402

E4M3 = torch.float8_e4m3fn
USAGES = {"cast_both": (True, True), "cast_row": (True, False), "cast_col": (False, True),
          "current_one": (True, True)}
CANDIDATES = {
    "cast_both": [(32, 128, 2), (32, 128, 2, 8, 1), (32, 128, 2, 16, 1), (32, 128, 4, 8, 2),
                  (64, 128, 4, 4, 1), (64, 128, 4, 8, 2), (128, 128, 8), (128, 128, 8, 2, 2),
                  (64, 64, 2, 8, 1), (64, 64, 4, 8, 2),
                  # tile orders (6th, 7th items): K-fast grid, row tiles from the last up
                  (128, 128, 8, 1, 1, 1, 0), (128, 128, 8, 1, 1, 0, 1), (128, 128, 8, 1, 1, 1, 1),
                  (64, 128, 4, 4, 1, 1, 1)],
    "cast_row": [(16, 512, 4), (16, 512, 4, 8, 1), (32, 256, 8, 4, 2), (32, 512, 8, 4, 1),
                 (16, 512, 4, 1, 1, 1, 1), (16, 512, 4, 1, 1, 0, 1), (32, 512, 8, 4, 1, 1, 1)],
    # current scaling in one cooperative launch: (BM, BN, warps, programs per SM at most)
    "current_one": [(128, 128, 8, 1), (128, 128, 8, 2), (64, 128, 4, 4), (64, 128, 8, 2),
                    (128, 128, 16, 1), (32, 256, 4, 4), (64, 256, 8, 2)],
    "cast_col": [(64, 128, 8), (64, 128, 8, 4, 1), (64, 128, 4, 8, 2), (128, 128, 8, 2, 1),
                 (64, 128, 8, 1, 1, 1, 1), (64, 128, 8, 1, 1, 0, 1)],
}
ODD_SHAPES = [(1000, 520), (257, 4096), (4096, 136)]


def make(kind: str, usage: tuple[bool, bool]):
    if kind == "delayed":
        q = Float8Quantizer(torch.full((1,), 0.5, device="cuda"), torch.zeros(1, device="cuda"),
                            E4M3)
    else:
        q = Float8CurrentScalingQuantizer(E4M3)
    return q.set_usage(*usage)


def codes(qt, q) -> list:
    """Every output as exact bytes (fp8 viewed as uint8)."""
    out = [qt.rowwise_data, qt.columnwise_data, qt.shared_scale]
    if isinstance(q, Float8Quantizer):
        out.append(q.amax.clone())
    return [None if t is None else (t.view(torch.uint8) if t.dtype == E4M3 else t).cpu()
            for t in out]


def check(key: str, x: torch.Tensor, default_out: dict) -> str | None:
    """None when the config under test matches the default config on ``x`` and the CPU
    reference on the odd shapes, else what differs."""
    for kind in ("delayed", "current"):
        q = make(kind, USAGES[key])
        got = codes(q.quantize(x), q)
        for a, b, what in zip(got, default_out[kind], ("row", "col", "scale", "amax")):
            if (a is None) != (b is None) or (a is not None and not torch.equal(a, b)):
                return f"{kind} {what} differs from the default config"
        for m, k in ODD_SHAPES:
            xo = torch.randn(m, k, device="cuda", dtype=torch.bfloat16) * 7
            qg, qc = make(kind, USAGES[key]), make(kind, USAGES[key])
            if kind == "delayed":
                qc = Float8Quantizer(qc.scale.cpu(), qc.amax.cpu(), E4M3).set_usage(
                    *USAGES[key])
            got, ref = codes(qg.quantize(xo), qg), codes(qc.quantize(xo.cpu()), qc)
            for a, b, what in zip(got, ref, ("row", "col", "scale", "amax")):
                if (a is None) != (b is None) or (a is not None and not torch.equal(a, b)):
                    return f"{kind} {what} differs from the reference on {m}x{k}"
    return None


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="16384x4096")
    ap.add_argument("--keys", default="cast_both,cast_row")
    args = ap.parse_args(argv)
    m, k = (int(v) for v in args.shape.split("x"))
    nbytes = m * k * 2
    inputs, copy_ms = bf16_inputs_and_copy(m, k)
    x = inputs[0][0]
    for key in args.keys.split(","):
        saved = tuning.tuning.fp8_configs[key]
        usage = USAGES[key]
        out_bytes = m * k * sum(usage)
        default_out = {kind: codes((q := make(kind, usage)).quantize(x), q)
                       for kind in ("delayed", "current")}
        for cfg in [saved] + [c for c in CANDIDATES[key] if c != saved]:
            with tuning.override(fp8_configs={**tuning.tuning.fp8_configs, key: cfg},
                                 one_launch_current=key == "current_one"):
                try:
                    bad = check(key, x, default_out)
                    times = {}
                    for kind in ("delayed", "current"):
                        q = make(kind, usage)
                        times[kind] = graph_ms(lambda t: q.quantize(t), inputs)
                except Exception as e:  # noqa: BLE001 (a config that fails to compile: report it)
                    print(f"{key} {cfg}: FAILED {type(e).__name__}: {str(e)[:200]}")
                    continue
            ratio = {kd: (nbytes + out_bytes) / t / (2 * nbytes / copy_ms)
                     for kd, t in times.items()}
            mark = " (default)" if cfg == saved else ""
            print(f"{key} {cfg}{mark}: delayed {times['delayed']:.4f} ms "
                  f"({ratio['delayed']:.2f} of copy), current {times['current']:.4f} ms "
                  f"({ratio['current']:.2f}){'' if bad is None else ' MISMATCH: ' + bad}",
                  flush=True)

if __name__ == "__main__":
    main()
