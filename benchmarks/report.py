"""Markdown tables of the newest run in results.csv (the rows of its latest commit and GPU).

    python benchmarks/report.py [benchmarks/results.csv] [--date-prefix 2026-11-21T08]
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path

HERE = Path(__file__).resolve().parent


def load(path, date_prefix=""):
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    if date_prefix:
        rows = [r for r in rows if r["date"].startswith(date_prefix)]
    latest = {}
    for r in rows:  # later rows win
        latest[(r["bench"], r["shape"], r["recipe"], r["metric"])] = r
    return list(latest.values())


def table(rows, bench, cols, fmt):
    sel = [r for r in rows if r["bench"] == bench]
    if not sel:
        return ""
    out = ["| " + " | ".join(c for c, _ in cols) + " |", "|" + "---|" * len(cols)]
    for r in sel:
        out.append("| " + " | ".join(fmt(r, key) for _, key in cols) + " |")
    return "\n".join(out)


def f(r, key):
    v = r.get(key, "")
    if key == "speedup":
        try:
            return f"{float(r['baseline_value']) / float(r['value']):.2f}x"
        except (ValueError, ZeroDivisionError):
            return ""
    try:
        x = float(v)
        return f"{x:.3f}" if abs(x) < 100 else f"{x:.0f}"
    except ValueError:
        return v


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("path", nargs="?", default=str(HERE / "results.csv"))
    ap.add_argument("--date-prefix", default="")
    args = ap.parse_args(argv)
    rows = load(args.path, args.date_prefix)
    meta = rows[-1] if rows else {}
    print(f"GPU {meta.get('gpu')}, torch {meta.get('torch')}, commit {meta.get('commit')}, "
          f"{meta.get('date')}\n")
    print("### Linear / LayerNormMLP forward+backward (ms; speedup = bf16 time / peer time)\n")
    print(table(rows, "linear", [("shape", "shape"), ("peer", "recipe"), ("ms", "value"),
                                 ("bf16 ms", "baseline_value"), ("speedup", "speedup"),
                                 ("note", "note")], f))
    print()
    print(table(rows, "mlp", [("shape", "shape"), ("peer", "recipe"), ("ms", "value"),
                              ("bf16 ms", "baseline_value"), ("speedup", "speedup")], f))
    print("\n### Peak memory of the same step (MiB above what existed before it)\n")
    for b in ("linear_mem", "mlp_mem"):
        print(table(rows, b, [("shape", "shape"), ("peer", "recipe"), ("metric", "metric"),
                              ("MiB", "value"), ("bf16 MiB", "baseline_value"),
                              ("ratio", "ratio")], f))
        print()
    print("### Quantize (GB/s counting input read + outputs written; ratio vs d2d copy)\n")
    print(table(rows, "quantize", [("shape", "shape"), ("format/path", "recipe"),
                                   ("GB/s", "value"), ("vs copy", "ratio"), ("note", "note")], f))
    print("\n### Single fprop GEMM per backend (ms; ratio = time / bf16 mm)\n")
    print(table(rows, "gemm", [("shape", "shape"), ("case", "recipe"), ("ms", "value"),
                               ("ratio", "ratio"), ("note", "note")], f))


if __name__ == "__main__":
    main()
