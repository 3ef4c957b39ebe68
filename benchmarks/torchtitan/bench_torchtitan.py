"""lowprec against bf16 and torchtitan's float8 converter, in torchtitan's own training
loop (``torchrun -m torchtitan.train``): FSDP2 over the GPUs, each block compiled.

Runs torchtitan 0.2.x (see ``lowprec_titan02.py`` for why not 0.3.0 on these machines).
Every peer trains the same Llama 3 flavor from the same seed on the same text: the Python
standard library's top-level sources, tokenized by a byte-level BPE tokenizer trained here
(no hub access). Per peer it reports torchtitan's own figures, read from its log:
tokens/s a GPU and MFU (medians over the steps after ``--skip``), peak reserved memory, and
the loss of every step (written to ``--out``/losses.csv). Rows go to
``benchmarks/results.csv`` (or ``$LOWPREC_RESULTS``).

    python benchmarks/torchtitan/bench_torchtitan.py --flavor 8B_wide4 --seq 8192 \\
        --peers bf16,float8,fp8_current,mxfp8,nvfp4 --steps 100 --out /tmp/titan
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE.parent.parent)]
STEP = re.compile(r"step:\s*(\d+)\s+loss:\s*([-\d.naninf]+).*?memory:\s*([\d.]+)GiB.*?"
                  r"tps:\s*([\d,]+).*?mfu:\s*([\d.]+)%")
#: what each peer adds to torchtitan's command line
PEERS = {
    "bf16": [],
    "float8": ["--model.converters", "quantize.linear.float8",
               "--quantize.linear.float8.enable_fsdp_float8_all_gather",
               "--quantize.linear.float8.precompute_float8_dynamic_scale_for_fsdp",
               "--quantize.linear.float8.filter_fqns", "output"],
}


def peer_args(peer: str) -> list[str]:
    if peer in PEERS:
        return PEERS[peer]
    return ["--model.converters", "lowprec", "--lowprec.recipe", peer]


def make_assets(root: Path, vocab: int) -> tuple[Path, Path]:
    """A tokenizer directory and a one-file JSON-lines dataset under ``root``."""
    from lowprec.compare.data import read_text, stdlib_files
    from lowprec.compare.make_llama import save_tokenizer, train_tokenizer
    tok_dir, data_dir = root / "tokenizer", root / "data"
    if (tok_dir / "tokenizer.json").exists() and (data_dir / "train.jsonl").exists():
        return tok_dir, data_dir
    texts = [t[1] for t in map(read_text, stdlib_files(max_bytes=1 << 40)) if t]
    save_tokenizer(train_tokenizer(texts[:200], vocab), str(tok_dir), 1 << 16)
    data_dir.mkdir(parents=True, exist_ok=True)
    with open(data_dir / "train.jsonl", "w") as f:
        for t in texts:
            f.write(json.dumps({"text": t}) + "\n")
    return tok_dir, data_dir


def run_peer(peer: str, args, tok: Path, data: Path, log: Path) -> list[tuple]:
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={args.gpus}",
           "--local-ranks-filter", "0", "--role", "rank", "--tee", "3",
           "-m", "torchtitan.train",
           "--job.custom_config_module", "lowprec_titan02",
           "--job.dump_folder", str(args.assets / f"dump_{peer}"),
           "--model.name", "llama3", "--model.flavor", args.flavor,
           "--model.hf_assets_path", str(tok),
           "--training.dataset", "c4_test", "--training.dataset_path", str(data),
           "--training.local_batch_size", str(args.batch),
           "--training.seq_len", str(args.seq), "--training.steps", str(args.steps),
           "--lr_scheduler.warmup_steps", str(args.warmup),
           "--parallelism.data_parallel_shard_degree", str(args.gpus),
           "--activation_checkpoint.mode", "none",
           "--compile.enable", "--compile.components", "model,loss",
           "--metrics.log_freq", "1", "--metrics.disable_color_printing",
           "--debug.seed", "42", *peer_args(peer)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(HERE), str(HERE.parent.parent), os.environ.get("PYTHONPATH", "")])}
    t0 = time.perf_counter()
    with open(log, "w") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env,
                            timeout=args.timeout).returncode
    steps = [(int(m[1]), float(m[2]), float(m[3]), int(m[4].replace(",", "")), float(m[5]))
             for m in STEP.finditer(log.read_text())]
    print(f"{peer}: rc {rc}, {len(steps)} steps logged in {time.perf_counter() - t0:.0f} s",
          flush=True)
    if rc != 0:
        print("\n".join(log.read_text().splitlines()[-40:]), flush=True)
    return steps


def summary(steps: list[tuple], skip: int) -> dict:
    timed = [s for s in steps if s[0] > skip] or steps
    return {"tps": statistics.median(s[3] for s in timed),
            "mfu": statistics.median(s[4] for s in timed),
            "peak": max(s[2] for s in steps),
            "loss": statistics.mean(s[1] for s in steps[-10:]), "steps": len(steps)}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--flavor", default="debugmodel")
    p.add_argument("--peers", default="bf16,float8,fp8_current,mxfp8,nvfp4")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--skip", type=int, default=10, help="steps left out of the medians")
    p.add_argument("--warmup", type=int, default=10, help="learning-rate warm-up steps")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--gpus", type=int, default=2)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--timeout", type=int, default=900, help="seconds a peer may run")
    p.add_argument("--out", type=Path, default=Path("/tmp/lowprec_titan"),
                   help="logs and losses.csv")
    p.add_argument("--assets", type=Path, default=Path("/tmp/lowprec_titan_assets"),
                   help="the tokenizer, the dataset and torchtitan's dump folders")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    tok, data = make_assets(args.assets, args.vocab)
    shape = f"llama3 {args.flavor}, {args.gpus} GPUs FSDP2, seq {args.seq} x {args.batch}"
    results, losses = {}, []
    for peer in args.peers.split(","):
        steps = run_peer(peer, args, tok, data, args.out / f"{args.flavor}_{peer}.log")
        if steps:
            results[peer] = summary(steps, args.skip)
            losses += [(args.flavor, peer, s[0], s[1]) for s in steps]
    with open(args.out / "losses.csv", "a", newline="") as f:
        csv.writer(f).writerows(losses)
    base = results.get("bf16")
    rows = []
    print(f"\n{shape}: peer, tokens/s a GPU, vs bf16, MFU %, peak reserved GiB, "
          f"mean loss of the last 10 steps")
    for peer, r in results.items():
        ratio = r["tps"] / base["tps"] if base else None
        print(f"{peer:14s} {r['tps']:10,.0f} {ratio or float('nan'):6.3f} {r['mfu']:6.2f} "
              f"{r['peak']:7.2f} {r['loss']:8.4f} ({r['steps']} steps)")
        note = f"{r['steps']} steps; mfu {r['mfu']:.2f}%; last-10 loss {r['loss']:.4f}"
        for metric, key in (("tokens/s a GPU", "tps"), ("peak reserved GiB", "peak")):
            rows.append({"bench": "torchtitan", "shape": shape, "recipe": peer,
                         "metric": metric, "value": r[key], "baseline": "bf16" if base else "",
                         "baseline_value": base[key] if base else "",
                         "ratio": r[key] / base[key] if base else None, "note": note})
    from harness import append_rows
    append_rows(rows)


if __name__ == "__main__":
    main()
