"""Run the conformance matrix (``space.all_pairs`` over several seeds, and every plain
recipe) on one device in worker processes and write one CSV row per case.

    python -m tests.conformance.run_matrix --device cuda --seeds 0,1 --workers 8 --out m.csv
"""

from __future__ import annotations

import argparse
import csv
import multiprocessing as mp
import sys
import time


def _run(args):
    case, device = args
    import torch

    torch.set_num_threads(1)
    from .harness import check
    torch._dynamo.reset()
    t = time.perf_counter()
    try:
        got = check(case, device)
        failures, refusal = got.failures, got.refusal or ""
    except Exception as e:  # noqa: BLE001 - the harness itself broke on this case
        failures, refusal = [f"harness: {type(e).__name__}: {e}"], ""
    return case.id, refusal, failures, time.perf_counter() - t


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--seeds", default="0")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--limit", type=int, default=0, help="run only this many cases")
    p.add_argument("--match", default="",
                   help="run only the cases whose id holds this text (a kind, a module, a mode)")
    p.add_argument("--out", default="conformance.csv")
    a = p.parse_args(argv)
    from .space import all_pairs, plain_recipes
    cases, seen = [], set()
    for c in plain_recipes() + [c for s in a.seeds.split(",") for c in all_pairs(int(s))]:
        if c.id not in seen:
            seen.add(c.id)
            cases.append(c)
    cases = [c for c in cases if a.match in c.id]
    if a.limit:
        cases = cases[:a.limit]
    ctx = mp.get_context("spawn")
    failed = 0
    # on CUDA a few cases a process: a kernel fault poisons its process's context
    per_case = 4 if a.device == "cuda" else None
    with open(a.out, "w", newline="") as f, ctx.Pool(a.workers, maxtasksperchild=per_case) as pool:
        w = csv.writer(f)
        w.writerow(["case", "device", "status", "seconds", "detail"])
        for cid, refusal, failures, secs in pool.imap_unordered(
                _run, [(c, a.device) for c in cases]):
            status = "fail" if failures else ("refused" if refusal else "ok")
            failed += bool(failures)
            w.writerow([cid, a.device, status, f"{secs:.1f}", " | ".join(failures) or refusal])
            f.flush()
            print(f"{status:7s} {secs:5.1f}s {cid} {' | '.join(failures)[:400]}", flush=True)
    print(f"{len(cases)} cases, {failed} failing", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
