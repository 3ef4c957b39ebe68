"""FSDP2 (or tensor-parallel) training step over several GPUs: bf16 against lowprec
recipes, with the weights all-gathered in high precision and quantized
(``lowprec.distributed.quantized_all_gather``, with and without
``precompute_gather_statistics``).

One process per GPU (NCCL). The model is ``bench_model.py``'s Hugging Face Llama config
(``--model``, default "8b-wide"), every Linear but ``lm_head`` converted with
``lowprec.convert_model``, ``fully_shard`` on each decoder layer and on the root, bf16
parameters, ``seq x batch`` tokens per rank, forward + backward + AdamW. Per peer, rank 0
prints the median step time (CUDA events, after warm-up), the bytes all-gathered in a step
(what a rank receives), the peak memory, and each as a ratio to bf16 FSDP in the same run;
rows go to ``results.csv``.

    python benchmarks/bench_distributed.py                    # 2 GPUs, every recipe
    python benchmarks/bench_distributed.py --recipes current --gathers quantized
    python benchmarks/bench_distributed.py --tp --recipes current,mxfp8
    python benchmarks/bench_distributed.py --compile --recipes current --torchao tensorwise

``--compile``: each decoder layer compiled and then sharded, the order torchtitan uses;
``--torchao``: torchao's Float8Linear beside lowprec, its FP8 all-gather as the peer of
lowprec's quantized gathers.

``--tp``: tensor parallelism with sequence parallelism instead, over all the GPUs: the
config's width in blocks of lowprec modules built with ``tp_group`` (a column-parallel
``LayerNormLinear`` and a row-parallel ``Linear`` where attention would be, then a
``LayerNormMLP`` with SwiGLU), sequence-first, ``seq x batch`` tokens split over the ranks.
The peers are bf16 (the same modules outside autocast) and each recipe, whose SP
all-gathers move quantized bytes where the format allows.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import gc
import os
import socket
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_model import MODELS, RECIPES, build, lm_loss, not_lm_head  # noqa: E402
from harness import append_rows, median_step_ms  # noqa: E402

import lowprec  # noqa: E402
from lowprec.distributed import precompute_gather_statistics, quantized_all_gather  # noqa: E402
from lowprec.distributed.diagnostics import count_all_gather_bytes  # noqa: E402


def make_peer(peer: str, model: str, device, compile: bool = False):
    """(FSDP model, autocast context factory or None). ``compile``: each decoder layer is
    compiled before it is sharded (torchtitan's order)."""
    from torch.distributed.fsdp import fully_shard
    m = build(model, device)
    ctx = None
    library, _, spec = peer.partition("-")  # "bf16", "lowprec-<recipe>+<gather>", "torchao-..."
    name, _, gather = spec.partition("+")
    if library == "torchao":
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
        cfg = Float8LinearConfig.from_recipe_name(name)
        if gather != "hp":
            cfg = dataclasses.replace(cfg, enable_fsdp_float8_all_gather=True)
        convert_to_float8_training(m, config=cfg, module_filter_fn=not_lm_head)
    elif library == "lowprec":
        recipe = RECIPES[name]()
        lowprec.convert_model(m, module_filter_fn=not_lm_head)
        if gather in ("quantized", "precomputed"):
            quantized_all_gather(m, recipe)
        ctx = lambda: lowprec.autocast(recipe=recipe)  # noqa: E731
    for layer in m.model.layers:
        if compile:
            layer.compile()
        fully_shard(layer)
    fully_shard(m)
    return m, ctx


class TPBlock(torch.nn.Module):
    """Where attention would be, a column- then a row-parallel GEMM; then the MLP."""

    def __init__(self, hidden: int, ffn: int, group, device):
        super().__init__()
        kw = dict(tp_group=group, sequence_parallel=True, params_dtype=torch.bfloat16,
                  device=device)
        self.qkv = lowprec.LayerNormLinear(hidden, hidden, bias=False, normalization="RMSNorm",
                                           parallel_mode="column", **kw)
        self.proj = lowprec.Linear(hidden, hidden, bias=False, parallel_mode="row", **kw)
        self.mlp = lowprec.LayerNormMLP(hidden, ffn, bias=False, normalization="RMSNorm",
                                        activation="swiglu", **kw)

    def forward(self, x):
        x = x + self.proj(self.qkv(x))
        return x + self.mlp(x)


def make_tp_peer(peer: str, model: str, device, compile: bool = False):
    """(TP model, autocast context factory or None, input shape of this rank)."""
    hidden, ffn, layers, *_, seq, batch = MODELS[model]
    group = dist.group.WORLD
    m = torch.nn.Sequential(*[TPBlock(hidden, ffn, group, device) for _ in range(layers)])
    if compile:
        for block in m:
            block.compile()
    ctx = None
    if peer != "bf16":
        recipe = RECIPES[peer[len("lowprec-"):]]()
        ctx = lambda: lowprec.autocast(recipe=recipe)  # noqa: E731
    return m, ctx, (seq // dist.get_world_size(), batch, hidden)


def after_step(peer: str, m):
    """What the peer runs after each optimizer step."""
    if not peer.endswith("+precomputed"):
        return
    if peer.startswith("torchao-"):
        from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp
        precompute_float8_dynamic_scale_for_fsdp(m)
    else:
        precompute_gather_statistics(m)


def run_peer(peer: str, model: str, rank: int, steps: int, warmup: int,
             profile_dir: str = "", tp: bool = False, compile: bool = False) -> tuple:
    """(median step ms, all-gathered bytes a step, peak GiB, graph breaks, graphs compiled)
    on this rank; with ``profile_dir``, rank 0 also profiles one more step (its kernel
    table and its trace). The graphs compiled count every recompile: per-layer compiled
    decoder layers of one shape should compile their code once."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    device = torch.device("cuda", rank)
    gen = torch.Generator(device=device).manual_seed(rank)
    if tp:
        m, ctx, shape = make_tp_peer(peer, model, device, compile)
        inputs = [torch.randn(shape, device=device, dtype=torch.bfloat16, generator=gen)
                  for _ in range(2)]

        def loss_of(i):
            with ctx() if ctx else contextlib.nullcontext():
                y = m(inputs[i % 2])
            return y.float().pow(2).mean()
    else:
        m, ctx = make_peer(peer, model, device, compile)
        *_, seq, batch = MODELS[model]
        ids = [torch.randint(0, 32000, (batch, seq), device=device, generator=gen)
               for _ in range(2)]

        def loss_of(i):
            return lm_loss(m, ctx, ids[i % 2])
    opt = torch.optim.AdamW(m.parameters(), lr=1e-4)

    def step(i):
        loss_of(i).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        after_step(peer, m)

    for i in range(warmup):
        step(i)
    with count_all_gather_bytes() as counter:
        step(0)
    ms, peak = median_step_ms(step, steps)
    if profile_dir:  # every rank runs the step (its collectives need them all)
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
                     ) if rank == 0 else contextlib.nullcontext() as prof:
            step(0)
            torch.cuda.synchronize()
        if rank == 0:
            table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=30)
            stem = Path(profile_dir, peer.replace("+", "_"))
            stem.with_suffix(".txt").write_text(table)
            # the step's timeline (chrome://tracing), gzipped by the profiler (".gz")
            prof.export_chrome_trace(f"{stem}.json.gz")
    counters = torch._dynamo.utils.counters
    return (ms, counter.bytes, peak, sum(counters["graph_break"].values()),
            counters["stats"]["unique_graphs"])


def worker(rank: int, world: int, port: int, args) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    recipes = [r for r in args.recipes.split(",") if r]
    gathers = [g for g in args.gathers.split(",") if g]
    peers = ["bf16"] + ([f"lowprec-{r}" for r in recipes] if args.tp else
                        [f"lowprec-{r}+{g}" for r in recipes for g in gathers])
    if not args.tp:
        peers += [f"torchao-{r}+{g}" for r in args.torchao.split(",") if r for g in gathers]
    results, lines = {}, []
    *_, seq, batch = MODELS[args.model]
    bench = ("tp_sp" if args.tp else "fsdp2") + ("_compiled" if args.compile else "")
    tokens = seq * batch // world if args.tp else seq * batch  # per rank
    header = (f"{'peer':28s} {'ms':>8s} {'vs bf16':>8s} {'gathered GB':>12s} {'vs bf16':>8s} "
              f"{'peak GiB':>9s} {'vs bf16':>8s} {'breaks':>6s} {'graphs':>6s}")
    if rank == 0:
        print(f"{args.model} {'TP+SP' if args.tp else 'FSDP2'} on {world} x "
              f"{torch.cuda.get_device_name()}, {tokens} tokens a rank, torch "
              f"{torch.__version__}\n{header}", flush=True)
    for peer in peers:
        try:
            res = run_peer(peer, args.model, rank, args.steps, args.warmup, args.profile,
                           args.tp, args.compile)
            gc.collect()
            torch.cuda.empty_cache()  # the peer's model and optimizer died with run_peer
        except Exception as exc:  # noqa: BLE001 - name the failed peer on every rank, then
            # stop: a rank that went on would wait in collectives the others never join
            print(f"rank {rank} {peer}: FAILED {type(exc).__name__}: {str(exc)[:400]}",
                  flush=True)
            raise
        # the slowest rank's time and the largest peak are the step's
        t = torch.tensor([res[0], res[2]], device="cuda")
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        ms, peak, gathered = t[0].item(), t[1].item(), res[1]
        breaks, graphs = res[3], res[4]
        results[peer] = (ms, gathered, peak)
        if rank != 0:
            continue
        base = results["bf16"]
        # (a compiled TP step's gathers are functional collectives in the graph, which the
        # byte counter does not see: no ratio then)
        r_ms, r_p = ms / base[0], peak / base[2]
        r_b = gathered / base[1] if base[1] else float("nan")
        line = (f"{peer:28s} {ms:8.2f} {r_ms:7.2f}x {gathered / 1e9:12.3f} {r_b:7.2f}x "
                f"{peak:9.2f} {r_p:7.2f}x {breaks:6d} {graphs:6d}")
        lines.append(line)
        print(line, flush=True)
        shape = f"{args.model} {tokens}tok/rank x{world}"
        baseline = f"bf16 {bench}"
        append_rows([
            dict(bench=bench, shape=shape, recipe=peer, metric="step_ms", value=round(ms, 3),
                 baseline=baseline, baseline_value=round(base[0], 3), ratio=round(r_ms, 4),
                 note=f"{tokens * world / ms * 1e3:.0f} tok/s; graph breaks {breaks}, "
                      f"graphs compiled {graphs} (rank 0)"),
            dict(bench=bench, shape=shape, recipe=peer, metric="all_gather_GB",
                 value=round(gathered / 1e9, 4), baseline=baseline,
                 baseline_value=round(base[1] / 1e9, 4), ratio=round(r_b, 4)),
            dict(bench=bench, shape=shape, recipe=peer, metric="peak_GiB",
                 value=round(peak, 3), baseline=baseline,
                 baseline_value=round(base[2], 3), ratio=round(r_p, 4)),
        ])
    if rank == 0:
        print(f"\n{header}\n" + "\n".join(lines), flush=True)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="8b-wide", choices=list(MODELS))
    ap.add_argument("--recipes", default="current,block,mxfp8,nvfp4")
    ap.add_argument("--gathers", default="hp,quantized,precomputed",
                    help="hp (gather bf16), quantized (quantized_all_gather), precomputed "
                         "(and precompute_gather_statistics after each step)")
    ap.add_argument("--gpus", type=int, default=2)
    ap.add_argument("--tp", action="store_true",
                    help="tensor + sequence parallelism over the GPUs instead of FSDP2")
    ap.add_argument("--compile", action="store_true",
                    help="compile each decoder layer, then shard it (torchtitan's order); "
                         "every peer, bf16 included")
    ap.add_argument("--torchao", default="",
                    help="torchao Float8Linear recipes to run beside lowprec's (FSDP2 only; "
                         "e.g. tensorwise), with the same --gathers: hp, quantized "
                         "(enable_fsdp_float8_all_gather), precomputed (and "
                         "precompute_float8_dynamic_scale_for_fsdp after each step)")
    ap.add_argument("--profile", default="",
                    help="directory for per-peer kernel tables and gzipped step traces "
                         "(rank 0)")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=3)
    args = ap.parse_args()
    if args.tp and args.torchao:
        ap.error("--torchao runs beside FSDP2 only, not with --tp")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(worker, args=(args.gpus, port, args), nprocs=args.gpus, join=True)


if __name__ == "__main__":
    main()
