"""The 1x128 block quantize on its Triton kernel against the Gluon kernel, in one run.

Variants (``formats/block/launch.py`` flags, set around each call):

* ``triton``: rowwise and columnwise as two Triton launches (two reads of the input);
* ``triton_both/BM.BN.W.I.S.KF``: both usages from one read, one Triton launch of that
  tile config (``launch.CONFIGS``; KF 1: grid axis 0 along K);
* ``gluon_col/R.T.W[.KF]``: the Triton rowwise launch, then the Gluon columnwise kernel;
* ``gluon_both/RB.R.T.W[.KF[.EV]]``: both usages in one Gluon launch (the input read from
  DRAM once, each 128x128 tile read again from L2 for the columnwise usage): rowwise
  chunks of RB rows, columnwise pieces of R rows and T threads along K per thread, W
  warps; EV 0 drops the L2 eviction hints.

A third ``/BM.BN.W.I.S.KF`` sets the Triton rowwise launch's tile config. Every variant's
outputs are checked bit for bit against the default launch's before it is timed.

Part 1 times the quantize of both usages (and the columnwise usage alone) of bf16 inputs
against a device-to-device copy in the same run: GPU time from a CUDA graph of several
quantizes (GB/s and ratio come from it), and the eager per-call time, which includes the
host's issue time where that is the longer. Part 2 (``--linear``) times a Linear
fwd+bwd step under ``Float8BlockScaling`` with each variant against bf16 ``nn.Linear``.
Rows go to results.csv.

    python benchmarks/ab_block_gluon.py [--shapes 16384x4096,...] [--linear 16384x4096x4096]
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import lowprec  # noqa: E402
from bench_linear import (linear_peers, make_inputs, parse_shape, run_peers,  # noqa: E402
                          split_list, within)
from harness import append_rows, graph_ms, l2_rotation, print_table, time_fn  # noqa: E402
from lowprec.formats.block import launch  # noqa: E402
from lowprec.formats.float8 import launch as f8_launch  # noqa: E402

E4M3 = torch.float8_e4m3fn
DEFAULT_VARIANTS = ("triton,gluon_col/8.8.4.1,gluon_both/32.8.8.4.1.1,gluon_both/32.8.8.4.1.0,"
                    "gluon_both/16.8.16.8.1.1")


@contextlib.contextmanager
def variant(name: str):
    """Set the launcher's flags for one variant, restoring them after. ``kind[/cfg[/row]]``:
    cfg is the Gluon config (``launch.GLUON_CONFIGS``) or, for ``triton_both``, the Triton
    tile config of one launch for both usages (``launch.CONFIGS``); row the Triton rowwise
    launch's tile config; both dot-separated."""
    saved = (launch.GLUON, launch.GLUON_BOTH, dict(launch.GLUON_CONFIGS), dict(launch.CONFIGS),
             dict(f8_launch.SPLIT_BOTH))
    kind, cfg, row = (name.split("/") + ["", ""])[:3]
    parse = lambda c: tuple(int(v) for v in c.split("."))  # noqa: E731
    if kind not in ("triton", "triton_both", "gluon_col", "gluon_both"):
        raise ValueError(f"unknown variant kind {kind!r} in {name!r}: expected triton, "
                         "triton_both, gluon_col or gluon_both")
    try:
        launch.GLUON = kind.startswith("gluon")
        launch.GLUON_BOTH = kind == "gluon_both"
        f8_launch.SPLIT_BOTH["block1"] = kind != "triton_both"
        if cfg and kind == "triton_both":
            launch.CONFIGS[(1, "both")] = parse(cfg)
        elif cfg:
            launch.GLUON_CONFIGS["both" if launch.GLUON_BOTH else "col"] = parse(cfg)
        if row:
            launch.CONFIGS[(1, "row")] = parse(row)
        yield
    finally:
        (launch.GLUON, launch.GLUON_BOTH, launch.GLUON_CONFIGS, launch.CONFIGS,
         f8_launch.SPLIT_BOTH) = saved


def _raw_outputs(qt):
    """The quantized tensor's inner tensors, 1-byte ones as uint8 (for torch.equal)."""
    return [t.view(torch.uint8) if t.dtype.itemsize == 1 else t
            for t in qt.inner_tensors().values() if t is not None]


def quantize_rows(shape: str, variants, iters: int):
    m, k = (int(v) for v in shape.split("x"))
    nbytes = m * k * 2
    gen = torch.Generator(device="cuda").manual_seed(0)
    inputs = l2_rotation(lambda: (torch.randn(m, k, device="cuda", generator=gen)
                                  .to(torch.bfloat16),), nbytes)
    dst = torch.empty(m, k, device="cuda", dtype=torch.bfloat16)
    copy_gbs = 2 * nbytes / time_fn(lambda x: dst.copy_(x), inputs, iters=iters) / 1e6
    rows = [{"bench": "quantize", "shape": shape, "recipe": "d2d_copy", "metric": "GB/s",
             "value": copy_gbs, "baseline": "", "baseline_value": "", "ratio": 1.0, "note": ""}]
    for usage, flags in (("both", (True, True)), ("col", (False, True))):
        q = lowprec.Float8BlockQuantizer(E4M3, block_scaling_dim=1).set_usage(*flags)
        want = _raw_outputs(q.quantize(inputs[0][0]))
        for name in variants:
            if usage == "col" and name.startswith(("gluon_both", "triton_both")):
                continue  # the same kernel as gluon_col / triton with the same config
            with variant(name):
                qt = q.quantize(inputs[0][0])
                got = _raw_outputs(qt)
                if len(got) != len(want) or not all(torch.equal(a, b)
                                                    for a, b in zip(got, want)):
                    raise AssertionError(f"{name} ({usage}): outputs differ from the default")
                moved = nbytes + sum(t.numel() * t.element_size()
                                     for t in qt.inner_tensors().values() if t is not None)
                del qt
                ms = time_fn(lambda x: q.quantize(x), inputs, iters=iters, warmup_s=0.3)
                gpu = graph_ms(lambda x: q.quantize(x), inputs)
            gbs = moved / gpu / 1e6
            rows.append({"bench": "quantize", "shape": shape,
                         "recipe": f"block_1x128_{usage}/{name}", "metric": "GB/s",
                         "value": gbs, "baseline": "d2d_copy", "baseline_value": copy_gbs,
                         "ratio": gbs / copy_gbs,
                         "note": f"GPU {gpu:.4f} ms (CUDA graph); eager {ms:.4f} ms"})
            print(f"  {shape} {usage:4s} {name:24s} GPU {gpu:.4f} ms  eager {ms:.4f} ms  "
                  f"{gbs / copy_gbs:.3f} of copy", flush=True)
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="16384x4096,16384x14336")
    ap.add_argument("--variants", default=DEFAULT_VARIANTS)
    ap.add_argument("--iters", type=int, default=40)
    ap.add_argument("--linear", default="", help="Linear shapes MxKxN, comma-separated")
    ap.add_argument("--linear-variants", default="triton,gluon_col,gluon_both")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--warmup-seconds", type=float, default=1.0)
    ap.add_argument("--no-csv", action="store_true")
    args = ap.parse_args(argv)
    rows = []
    for s in split_list(args.shapes):
        rows += quantize_rows(s, split_list(args.variants), args.iters)
    for s in split_list(args.linear):
        m, k, n = parse_shape(s)
        base, block = linear_peers(m, k, n, ["block"], [])
        peers = [base] + [(f"lowprec/block/{v}", within(lambda v=v: variant(v), block[1]))
                          for v in split_list(args.linear_variants)]
        inputs = make_inputs(m, k, n, "cuda")
        # run_peers' timing options: 10 steps a round, rounds interleaved with bf16
        timing = argparse.Namespace(**vars(args), alternate=False)
        timing.iters = 10
        rows += run_peers("linear", s, peers, inputs, timing)
        del inputs
        torch.cuda.empty_cache()
    print_table(rows, ["bench", "shape", "recipe", "value", "ratio", "note"])
    if not args.no_csv:
        append_rows(rows)


if __name__ == "__main__":
    main()
