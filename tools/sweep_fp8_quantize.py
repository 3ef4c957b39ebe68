"""Tile sweep of the FP8 / block-FP8 / MXFP8 quantize kernels, then the bandwidth of each.

On a 16384x4096 bf16 input: for each kernel and usage (``fp8_configs``, ``block_configs``
and ``mxfp8_configs`` of ``lowprec.kernels.tuning.tuning``) every candidate tile config is
timed (``triton.testing.do_bench``, median) and the fastest printed; then, on those, both
usages from one fused launch against two launches per format, the integer-rounding cast
against the hardware cvt, and the GB/s of every quantizer (bytes that must move: input read
once + every output written once) against a device-to-device copy. ``--col-modes 0,3`` also
picks the transposed-store mode first. Nothing is written back (the sweep runs inside
``tuning.override``, which restores every setting after): put a winner into
``lowprec/kernels/tuning.py`` by hand, then check it bit for bit with
``pytest -m slow tests/slow/test_fuzz_kernels_fp8.py``.

    python tools/sweep_fp8_quantize.py [--no-sweep] [--col-modes 0,3]
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lowprec.formats.block.quantizer import Float8BlockQuantizer  # noqa: E402
from lowprec.formats.float8.quantizer import Float8CurrentScalingQuantizer, Float8Quantizer  # noqa: E402
from lowprec.formats.mxfp8.quantizer import MXFP8Quantizer  # noqa: E402
from lowprec.kernels.tuning import override, tuning  # noqa: E402

E4 = torch.float8_e4m3fn


# ---- bandwidth ------------------------------------------------------------------------------
def run_bench(sweep, col_modes=(0,), fused_ok=True):
    """Time every kernel on 16384x4096 bf16; with ``sweep``, first pick tile configs (and the
    fastest of the verified ``col_modes``) per kernel by timing. The picks apply to the
    bandwidth table; ``tuning`` is restored on return."""
    with override(col_mode=tuning.col_mode, hw_cvt=tuning.hw_cvt,
                  split_both=dict(tuning.split_both), fp8_configs=dict(tuning.fp8_configs),
                  block_configs=dict(tuning.block_configs),
                  mxfp8_configs=dict(tuning.mxfp8_configs)):
        return _run_bench(sweep, col_modes, fused_ok)


def _run_bench(sweep, col_modes, fused_ok):
    """``run_bench`` on copies of the settings it changes (in place)."""
    from triton.testing import do_bench

    m, k = 16384, 4096
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    n = m * k

    def bench(fn):
        fn()
        torch.cuda.synchronize()
        return do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e-3

    dst = torch.empty_like(x)
    t_copy = bench(lambda: dst.copy_(x))
    copy_gbs = 2 * n * 2 / t_copy / 1e9
    rows = [("torch copy (bf16 -> bf16)", t_copy, 4 * n, copy_gbs, "")]
    ones = lambda: torch.ones(1, device="cuda")  # noqa: E731
    zeros = lambda: torch.zeros(1, device="cuda")  # noqa: E731
    sweep_rows = []
    if sweep:
        # (``tuning`` config dict's name, key, candidates (BM, BN, num_warps), quantizer
        # factory)
        # Candidates: (BM, BN, num_warps[, tiles per program, pipeline stages[, grid axis 0
        # along K]]); the register counts of each are in tools/kernel_resources.py.
        plan = [
            ("fp8_configs", "cast_both", [(64, 64, 4), (64, 128, 4), (32, 64, 4),
                                              (32, 64, 4, 4, 3), (32, 128, 4, 4, 2),
                                              (64, 64, 2), (32, 128, 2)],
             lambda: Float8Quantizer(ones(), zeros(), E4)),
            ("fp8_configs", "cast_row", [(32, 256, 8), (16, 512, 4), (32, 256, 8, 4, 2),
                                             (32, 128, 4, 4, 3)],
             lambda: Float8Quantizer(ones(), zeros(), E4).set_usage(True, False)),
            ("fp8_configs", "amax", [(64, 256, 8), (32, 256, 8), (32, 512, 8)],
             lambda: Float8CurrentScalingQuantizer(E4).set_usage(True, False)),
            ("block_configs", (1, "both"), [(128, 128, 4), (128, 128, 8)],
             lambda: Float8BlockQuantizer(E4, block_scaling_dim=1)),
            ("block_configs", (1, "row"), [
                (32, 256, 8), (32, 128, 4), (32, 128, 4, 4, 3), (32, 128, 2), (64, 128, 4),
                (32, 256, 4), (32, 256, 4, 1, 1, 1), (32, 128, 2, 1, 1, 1), (32, 128, 4, 1, 1, 1)],
             lambda: Float8BlockQuantizer(E4, block_scaling_dim=1).set_usage(True, False)),
            ("block_configs", (2, "both"), [(128, 128, 4), (128, 128, 8), (128, 128, 16),
                                                 (128, 128, 16, 2, 2), (128, 128, 8, 1, 1, 1)],
             lambda: Float8BlockQuantizer(E4, block_scaling_dim=2)),
            ("mxfp8_configs", (False, "both"), [
                (32, 64, 2), (32, 64, 1), (32, 256, 4), (32, 128, 2), (32, 32, 1),
                (32, 128, 2, 1, 1, 1), (32, 64, 1, 1, 1, 1), (64, 64, 4, 1, 1, 1),
                (32, 128, 4, 1, 1, 1)],
             lambda: MXFP8Quantizer(E4)),
            ("mxfp8_configs", (False, "row"), [(32, 128, 4, 4, 3), (32, 128, 2),
                                                 (64, 128, 4), (32, 64, 1), (32, 128, 2, 4, 3),
                                                 (32, 128, 2, 1, 1, 1), (32, 256, 4, 1, 1, 1)],
             lambda: MXFP8Quantizer(E4).set_usage(True, False)),
            ("mxfp8_configs", (True, "both"), [(64, 128, 4), (32, 64, 4), (32, 64, 4, 4, 3),
                                                 (64, 64, 4, 2, 2), (64, 128, 4, 1, 1, 1),
                                                 (32, 64, 4, 1, 1, 1)],
             lambda: MXFP8Quantizer(E4, with_2d_quantization=True)),
            ("fp8_configs", "cast_col", [(64, 128, 8), (64, 64, 4), (32, 128, 4, 4, 3),
                                             (64, 64, 4, 4, 2)],
             lambda: Float8Quantizer(ones(), zeros(), E4).set_usage(False, True)),
            ("block_configs", (1, "col"), [(128, 32, 4), (128, 64, 4), (128, 32, 2),
                                                (128, 32, 1), (128, 64, 2)],
             lambda: Float8BlockQuantizer(E4, block_scaling_dim=1).set_usage(False, True)),
            ("mxfp8_configs", (False, "col"), [
                (32, 64, 2), (32, 128, 1), (32, 64, 1), (32, 128, 2), (32, 64, 1, 1, 1, 1),
                (32, 128, 2, 1, 1, 1)],
             lambda: MXFP8Quantizer(E4).set_usage(False, True)),
        ]
        # the transposed-store mode first, on the current default configs
        if len(col_modes) > 1:
            timing = {}
            for mode in col_modes:
                tuning.col_mode = mode
                tot = 0.0
                for _, key, _, make_q in plan:
                    if "both" in str(key):
                        q = make_q()
                        t = bench(lambda: q.quantize(x))
                        sweep_rows.append((f"col_mode={mode} {key}", "", t * 1e6))
                        tot += t
                timing[mode] = tot
            tuning.col_mode = min(timing, key=timing.get)
            print(f"col_mode timings {timing}; using {tuning.col_mode}", flush=True)
        for name, key, options, make_q in plan:
            q = make_q()
            best = None
            for opt in options:
                with override(**{name: {**getattr(tuning, name), key: opt}}):
                    try:
                        t = bench(lambda: q.quantize(x))
                    except Exception as exc:  # noqa: BLE001
                        t = math.inf
                        print("sweep failure", key, opt, type(exc).__name__, str(exc)[:200])
                sweep_rows.append((str(key), opt, t * 1e6))
                if best is None or t < best[1]:
                    best = (opt, t)
            getattr(tuning, name)[key] = best[0]
            print(f"sweep {key}: best {best[0]} {best[1] * 1e6:.1f} us", flush=True)
        # fused one-pass kernel vs two launches (rowwise-only + columnwise-only), per format
        if fused_ok:
            split_plan = [("pertensor", plan[0][3]), ("block1", plan[3][3]), ("block2", plan[5][3]),
                          ("mx1", plan[6][3]), ("mx2", plan[8][3])]
            for key, make_q in split_plan:
                q = make_q()
                tuning.split_both[key] = False
                t_fused = bench(lambda: q.quantize(x))
                tuning.split_both[key] = True
                t_split = bench(lambda: q.quantize(x))
                tuning.split_both[key] = t_split < 0.97 * t_fused
                sweep_rows.append((f"{key} both: fused / split", "",
                                   f"{t_fused * 1e6:.1f} / {t_split * 1e6:.1f} -> "
                                   f"{'split' if tuning.split_both[key] else 'fused'}"))
        # integer-rounding cast vs hardware cvt, on the chosen configs
        for label, make_q in (("per-tensor both", plan[0][3]), ("mx1 both", plan[6][3]),
                              ("block1 both", plan[3][3])):
            q = make_q()
            tuning.hw_cvt = False
            t_sw = bench(lambda: q.quantize(x))
            tuning.hw_cvt = True
            t_hw = bench(lambda: q.quantize(x))
            sweep_rows.append((f"{label}: int-cast / hw-cvt", "", f"{t_sw * 1e6:.1f} / "
                               f"{t_hw * 1e6:.1f}"))

    def case(label, q, out_bytes, extra_read=0):
        t = bench(lambda: q.quantize(x))
        useful = 2 * n + out_bytes
        print(f"bench {label}: {t * 1e6:.1f} us", flush=True)
        rows.append((label, t, useful, useful / t / 1e9,
                     f"moves {(useful + extra_read) / 1e6:.0f} MB: "
                     f"{(useful + extra_read) / t / 1e9:.0f} GB/s" if extra_read else ""))

    for u, tag in (((True, True), "both"), ((True, False), "row")):
        nd = 2 if tag == "both" else 1
        case(f"fp8 current   {tag}", Float8CurrentScalingQuantizer(E4).set_usage(*u),
             nd * n + 4, 2 * n)
        case(f"fp8 delayed   {tag}", Float8Quantizer(ones(), zeros(), E4).set_usage(*u),
             nd * n + 8)
        case(f"block 1x128   {tag}", Float8BlockQuantizer(E4, block_scaling_dim=1).set_usage(*u),
             nd * (n + n // 128 * 4))
        case(f"block 128x128 {tag}", Float8BlockQuantizer(E4, block_scaling_dim=2).set_usage(*u),
             nd * (n + n // 16384 * 4))
        case(f"mxfp8 1x32    {tag}", MXFP8Quantizer(E4).set_usage(*u), nd * (n + n // 32))
        case(f"mxfp8 32x32   {tag}",
             MXFP8Quantizer(E4, with_2d_quantization=True).set_usage(*u), nd * (n + n // 1024))
    return rows, sweep_rows, copy_gbs, {
        "col_mode": tuning.col_mode, "split_both": dict(tuning.split_both),
        "f8": dict(tuning.fp8_configs),
        "block": {str(k): v for k, v in tuning.block_configs.items()},
        "mx": {str(k): v for k, v in tuning.mxfp8_configs.items()}}




def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--no-sweep", action="store_true", help="only the bandwidth table")
    ap.add_argument("--col-modes", default="0",
                    help="transposed-store modes (tuning.col_mode) to choose from")
    args = ap.parse_args(argv)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    rows, sweep_rows, copy_gbs, chosen = run_bench(
        not args.no_sweep, tuple(int(v) for v in args.col_modes.split(",")))
    if sweep_rows:
        print("\n==== config sweep (us) ====")
        for key, opt, t in sweep_rows:
            print(f"{key:26s} {opt} {t if isinstance(t, str) else round(t, 1)}")
        print("chosen:", chosen)
    print("\n==== 16384x4096 bf16, E4M3 (GB/s = bytes that must move / time) ====")
    print(f"{'kernel':28s} {'us':>8s} {'MB':>7s} {'GB/s':>7s} {'% copy':>7s}")
    for label, t, nbytes, gbs, note in rows:
        print(f"{label:28s} {t * 1e6:8.1f} {nbytes / 1e6:7.0f} {gbs:7.0f} "
              f"{100 * gbs / copy_gbs:6.0f}%  {note}")


if __name__ == "__main__":
    main()
