"""GPU time of the NVFP4 amax pass alone per launch config (CUDA graphs, no host time).

The pass reads x once (the RHT variant in 64 x 16 KW column tiles, the plain one flat) and
folds tiles grid-stride in at most PROGS_PER_SM programs an SM
(``tuning.nvfp4_config["amax"]``, each candidate set with ``kernels.tuning.override``).
Prints each config's time and its read bandwidth against a device-to-device copy of the same
tensor measured in the same run.

    python tools/sweep_nvfp4_amax.py [--shapes 16384x4096,4096x4096]
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

from harness import graph_ms  # noqa: E402

from lowprec.formats.nvfp4 import launch  # noqa: E402
from lowprec.kernels.tuning import override, tuning  # noqa: E402


def amax_ms(x: torch.Tensor, rht: bool) -> float:
    m, k = x.shape
    ws = torch.zeros(3, dtype=torch.int32, device=x.device)
    g1, g2 = torch.empty(1, device=x.device), torch.empty(1, device=x.device)
    ca = tuning.nvfp4_config["amax"]
    grid, warps, even = launch.amax_launch(m, k, rht, x.device)
    kern = launch._kernels()._nvfp4_amax_kernel

    def one(t):
        ws.zero_()
        kern[grid](t, m, k, ws, g1, g2, ROW=True, COL=True, RHT=rht, KW=ca["KW"],
                   FLAT=ca["FLAT"], EVEN=even, IDX64=launch._idx64(m, k), num_warps=warps,
                   **launch._LAUNCH_OPTS)
        return ws
    return graph_ms(one, [(x,)])


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="16384x4096,4096x4096")
    ap.add_argument("--progs", default="4,8,16,32")
    ap.add_argument("--kw", default="2,4,8")
    ap.add_argument("--flat", default="2048,4096,8192")
    args = ap.parse_args(argv)
    saved = dict(tuning.nvfp4_config["amax"])
    for shape in args.shapes.split(","):
        m, k = map(int, shape.split("x"))
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        copy = graph_ms(lambda t: t.clone(), [(x,)])
        read_gbs = x.numel() * 2 / 1e6
        print(f"{shape}: copy {copy:.4f} ms (read+write {2 * read_gbs / copy:.0f} GB/s)")
        for rht in (True, False):
            sizes = [int(v) for v in (args.kw if rht else args.flat).split(",")]
            for progs, size in itertools.product(map(int, args.progs.split(",")), sizes):
                amax = dict(saved, PROGS_PER_SM=progs,
                            **({"KW": size} if rht else {"FLAT": size}))
                try:
                    with override(nvfp4_config={**tuning.nvfp4_config, "amax": amax}):
                        t = amax_ms(x, rht)
                except Exception as e:  # noqa: BLE001 - a config that does not compile
                    print(f"  {'rht' if rht else 'flat'} progs/SM {progs:3d} "
                          f"{'KW' if rht else 'FLAT'} {size:5d}: failed ({type(e).__name__})")
                    continue
                print(f"  {'rht' if rht else 'flat'} progs/SM {progs:3d} "
                      f"{'KW' if rht else 'FLAT'} {size:5d}: {t:.4f} ms, read "
                      f"{read_gbs / t:.0f} GB/s ({read_gbs / t / (2 * read_gbs / copy):.2f} "
                      f"of copy)", flush=True)


if __name__ == "__main__":
    main()
