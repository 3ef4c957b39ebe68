"""Whole-model training step: a Hugging Face ``LlamaForCausalLM`` built from a config.

One step is forward + backward + fused AdamW on ``tokens`` tokens (``--optim``: also
``lowprec.optim.AdamW`` with low-precision state, its step time and the state's bytes a
parameter in the last columns). Every Linear but ``lm_head`` (all of them with
``--lm-head``) runs through the peer under test. Peers, all in one process and run:

* ``bf16``: plain bf16, eager and ``torch.compile``;
* ``torchao-tensorwise`` / ``torchao-rowwise``: torchao float8 training, compiled
  (when torchao imports);
* ``lowprec-<recipe>``: ``lowprec.convert_model`` + ``lowprec.autocast``, eager and
  compiled.

Modes: ``eager``, ``compiled`` (``torch.compile(model)``), ``compiled-cpp`` (compiled with
inductor's C++ wrapper, its config ``cpp_wrapper`` held through every step as ``lowprec
compare --cpp-wrapper`` holds it: less host time a kernel),
``reduce-overhead`` (``torch.compile(model, mode="reduce-overhead")``: inductor's CUDA
graphs), ``eager-graphs`` (eager, each lowprec Linear call replayed from its CUDA graphs:
``lowprec.autocast(cuda_graphs=True)``) and ``graphed``
(the whole eager step captured in one CUDA graph and replayed: no host time at all, so the
step time is the GPU's; what a step costs once host overhead is out of the way).

Per peer it prints the step time (median of ``--steps`` steps timed with CUDA events,
after ``--warmup`` steps whose time is reported apart as warm-up/compile time),
tokens/s, the speedup over bf16 eager and over bf16 compiled, the peak memory of the
timed steps, the GPU kernel time of a step (``torch.profiler``: the sum of its kernels'
own times) and the host's share of the step (1 - GPU / wall: the time the GPU waited for
Python); rows go to ``results.csv``.

    python benchmarks/bench_model.py --model 1b
    python benchmarks/bench_model.py --model 8b-wide --recipes current,block
    python benchmarks/bench_model.py --modes graphed --torchao ''
    python benchmarks/bench_model.py --model tiny --device cpu   # smoke test of the script
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import append_rows, gpu_kernel_ms, host_ops, median_step_ms  # noqa: E402

import lowprec  # noqa: E402
from lowprec import recipe as R  # noqa: E402
from lowprec.compare.train import inductor_config  # noqa: E402
from lowprec.recipe import factories as F

#: hidden, ffn, layers, heads, kv heads, seq, batch
MODELS = {
    "1b": (2048, 8192, 8, 16, 8, 2048, 4),
    "8b-wide": (4096, 14336, 4, 32, 8, 4096, 2),
    "tiny": (256, 512, 2, 4, 2, 128, 2),
    # "1b"'s 8 layers (56 Linears) at tiny widths: what tracing costs, without the GPU time
    "tiny8": (256, 512, 8, 4, 2, 128, 2),
    # the shapes of compare's ``lowprec make-llama`` model (README), untied head
    "110m": (768, 2048, 12, 12, 12, 512, 16),
}

RECIPES = {
    "current": lambda: R.Float8CurrentScaling(),
    "delayed": lambda: R.DelayedScaling(),
    "block": lambda: R.Float8BlockScaling(),
    "mxfp8": lambda: R.MXFP8BlockScaling(),
    "nvfp4": lambda: R.NVFP4BlockScaling(),
    "fp8_row_mxfp8_col": lambda: R.CustomRecipe(F.fp8_row_mxfp8_col_factory),
    "mxfp8_fwd_nvfp4_bwd": lambda: R.CustomRecipe(F.mxfp8_fwd_nvfp4_bwd_factory),
    "nvfp4_fp8_head": lambda: R.CustomRecipe(F.NVFP4ExceptLayers()),
    "fp8_block_hybrid": lambda: R.CustomRecipe(F.fp8_block_hybrid_factory),
    "current_hp": lambda: R.Float8CurrentScaling(backward_mode="high_precision"),
    "current_dequantized": lambda: R.Float8CurrentScaling(backward_mode="dequantized"),
}


def build(model: str, device: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    hidden, ffn, layers, heads, kv, seq, _ = MODELS[model]
    cfg = LlamaConfig(hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv, vocab_size=32000,
                      max_position_embeddings=seq, attn_implementation="sdpa",
                      use_cache=False)
    torch.manual_seed(0)
    dtype = torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    with torch.device(device):  # initialized where it runs (seconds, not a minute on CPU)
        return LlamaForCausalLM(cfg).to(dtype=dtype)


def not_lm_head(module, name: str) -> bool:
    return "lm_head" not in name


def make_peer(peer: str, model: str, device: str, mode: str, head: bool = False):
    """(model, autocast context factory or None) for one peer; ``head``: the output head is
    converted too (as ``lowprec compare`` does)."""
    m = build(model, device)
    converted = None if head else not_lm_head
    ctx = None
    if peer.startswith("torchao-"):
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
        cfg = Float8LinearConfig.from_recipe_name(peer.split("-", 1)[1])
        convert_to_float8_training(m, config=cfg, module_filter_fn=converted)
    elif peer.startswith("lowprec-"):
        recipe = RECIPES[peer.split("-", 1)[1]]()
        lowprec.convert_model(m, module_filter_fn=converted)
        graphs = mode == "eager-graphs"
        ctx = lambda: lowprec.autocast(recipe=recipe, cuda_graphs=graphs)  # noqa: E731
    if mode == "checkpointed":  # eager, with Hugging Face's gradient checkpointing
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    elif mode == "compiled":
        m = torch.compile(m)
    elif mode == "reduce-overhead":
        m = torch.compile(m, mode="reduce-overhead")
    elif mode == "compiled-cpp":  # the C++ wrapper: see run_peer
        m = torch.compile(m)
    return m, ctx


def lm_loss(m, ctx, ids):
    """The causal-LM loss of ``m`` on ``ids``, under the peer's context when it has one."""
    with ctx() if ctx is not None else contextlib.nullcontext():
        return m(input_ids=ids, labels=ids).loss


#: ``--optim`` settings: torch's fused AdamW over the bf16 parameters (its state in their
#: dtype), or lowprec.optim.AdamW with the state compare's --optim-states names
OPTIMS = ("torch", "fp32", "bf16", "bf16-sr", "fp8-sr")


def make_optimizer(params, optim: str, device: str, graphed: bool):
    if optim == "torch":
        return torch.optim.AdamW(params, lr=1e-4, fused=device == "cuda", capturable=graphed)
    from lowprec.compare.recipes import OPTIM_STATES
    return lowprec.optim.AdamW(params, lr=1e-4, **OPTIM_STATES[optim][0])


def state_bytes_per_param(model, opt) -> float:
    """Bytes of persistent training state a parameter: the parameters and the optimizer's
    tensors (gradients not counted)."""
    params = list(model.parameters())
    n = sum(p.numel() for p in params)
    held = sum(p.numel() * p.element_size() for p in params)
    for st in opt.state.values():
        held += sum(t.numel() * t.element_size() for k, t in st.items()
                    if isinstance(t, torch.Tensor) and k != "step")
    return held / n


def _print_compile_times(peer: str, mode: str, top: int = 14) -> None:
    """Where the warm-up's compile time went: dynamo's timed phases (seconds, summed over
    the graphs), the ops dynamo captured and the graphs it made."""
    from torch._dynamo.utils import compilation_time_metrics, counters
    phases = sorted(((sum(v), k) for k, v in compilation_time_metrics.items()), reverse=True)
    from torch._inductor import metrics
    stats = counters["stats"]
    print(f"    {peer} {mode} compile: {stats['unique_graphs']} graphs, "
          f"{stats['calls_captured']} calls captured, {metrics.generated_kernel_count} "
          f"kernels generated; "
          + ", ".join(f"{k} {t:.1f}s" for t, k in phases[:top]), flush=True)
    compilation_time_metrics.clear()
    metrics.reset()


def run_peer(peer: str, model: str, device: str, mode: str, steps: int, warmup: int,
             top_kernels: int = 0, optim: str = "torch", losses: list | None = None,
             compile_times: bool = False, head: bool = False, top_host: int = 0):
    """(median step ms, warm-up seconds, peak GiB, graph breaks, GPU kernel ms, kernels,
    median forward host ms, median optimizer-step ms, state bytes a parameter); with
    ``top_kernels``, prints that many of the step's heaviest kernels, with ``top_host``
    that many of its host ops by their own CPU time.

    The forward host ms is how long the forward call keeps the host when it starts on an
    idle GPU (steps run after the timed ones, each after a synchronize; NaN for graph
    replays). transformers' Llama synchronizes with the GPU at the start of each forward
    (its mask code), so that time is exposed in full: a step takes about max(forward
    host, forward GPU) + the backward's GPU time. ``losses``: a list that receives every
    step's loss in order (fp32), read once the run is over (no sync a step)."""
    # the C++ wrapper held for the whole run, as compare holds it (inductor_config says why)
    with inductor_config(mode == "compiled-cpp"):
        return _run_peer(peer, model, device, mode, steps, warmup, top_kernels, optim, losses,
                         compile_times, head, top_host)


def _run_peer(peer, model, device, mode, steps, warmup, top_kernels, optim, losses,
              compile_times, head, top_host):
    torch._dynamo.utils.counters.clear()
    mode, _, every = mode.partition("-rec")  # "eager-rec100": lowprec.debug.Recorder on
    m, ctx = make_peer(peer, model, device, mode, head)
    recorder = lowprec.debug.Recorder(m, every=int(every)) if every else None
    graphed = mode == "graphed"
    if graphed and optim != "torch":
        raise ValueError(f"--optim {optim} is not captured in a CUDA graph here; use torch")
    opt = make_optimizer(m.parameters(), optim, device, graphed)
    opt_times = []
    *_, seq, batch = MODELS[model]
    gen = torch.Generator(device=device).manual_seed(0)
    ids = [torch.randint(0, 32000, (batch, seq), device=device, generator=gen) for _ in range(2)]

    fwd_host = []

    def step(i):
        x = ids[i % 2]
        if graphed:
            opt.zero_grad(set_to_none=False)  # the captured step zeroes its static grads
        t0 = time.perf_counter()
        loss = lm_loss(m, ctx, x)
        fwd_host.append(time.perf_counter() - t0)
        if losses is not None and not graphed:
            losses.append(loss.detach().float())
        loss.backward()
        if device == "cuda" and not graphed:
            ev = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            ev[0].record()
            opt.step()
            ev[1].record()
            opt_times.append(ev)
        else:
            t1 = time.perf_counter()
            opt.step()
            opt_times.append((time.perf_counter() - t1) * 1e3)
        if not graphed:
            opt.zero_grad(set_to_none=True)
        if recorder is not None:
            recorder.step()

    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    t0 = time.perf_counter()
    if graphed:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for i in range(warmup):
                step(i)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step(0)
        run = lambda i: graph.replay()  # noqa: E731
    else:
        for i in range(warmup):
            step(i)
        run = step
    sync()
    warm_s = time.perf_counter() - t0
    if compile_times and mode != "eager":
        _print_compile_times(peer, mode)
    breaks = sum(torch._dynamo.utils.counters["graph_break"].values())
    if device == "cuda":
        ms, peak = median_step_ms(run, steps)
        gpu_ms, kernels, heaviest = gpu_kernel_ms(run, top=top_kernels)
        fwd_host.clear()
        for i in range(0 if graphed else 5):
            sync()
            step(i)
        fwd_ms = statistics.median(fwd_host) * 1e3 if fwd_host else float("nan")
        for k_ms, k_n, name in heaviest:
            print(f"    {peer} {mode}: {k_ms:7.3f} ms {k_n:5.0f}x  {name[:110]}")
    else:
        t = []
        for i in range(steps):
            t1 = time.perf_counter()
            run(i)
            t.append((time.perf_counter() - t1) * 1e3)
        ms, peak = statistics.median(t), 0.0
        gpu_ms, kernels = float("nan"), 0
        fwd_ms = statistics.median(fwd_host[-steps:]) * 1e3
    if top_host and not graphed:
        for h_ms, h_n, name in host_ops(run, top_host):
            print(f"    {peer} {mode} host: {h_ms:7.3f} ms {h_n:5.0f}x  {name[:110]}")
    sync()
    done = [t if isinstance(t, float) else t[0].elapsed_time(t[1]) for t in opt_times[-steps:]]
    opt_ms = statistics.median(done) if done and not graphed else float("nan")
    return ms, warm_s, peak, breaks, gpu_ms, kernels, fwd_ms, opt_ms, \
        state_bytes_per_param(m, opt)


def release() -> None:
    """Free what the last peer left (its model and optimizer died with ``run_peer``)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    torch._dynamo.reset()


def _row(model, tokens, peer, mode, res, results, head=False):
    ms, warm, peak, breaks, gpu_ms, kernels, fwd_ms, opt_ms, state_b = res
    host = 1 - gpu_ms / ms
    base_e, base_c = results.get(("bf16", "eager")), results.get(("bf16", "compiled"))
    same = results.get(("bf16", mode))
    se = base_e[0] / ms if base_e else float("nan")
    sc = base_c[0] / ms if base_c else float("nan")
    pk = peak / same[2] if same and same[2] else float("nan")
    line = (f"{peer:24s} {mode:8s} {ms:9.2f} {tokens / ms * 1e3:10.0f} {se:13.2f}x "
            f"{sc:13.2f}x {peak:9.2f} {pk:11.2f}x {breaks:6d} {gpu_ms:8.2f} {host:6.1%} "
            f"{kernels:8.0f} {fwd_ms:8.2f} {opt_ms:7.2f} {state_b:6.2f}")
    shape = f"{model} {tokens}tok" + (" +head" if head else "")
    row = dict(bench="model", shape=shape, recipe=f"{peer} {mode}",
               metric="step_ms", value=round(ms, 3), baseline="bf16 eager",
               baseline_value=round(base_e[0], 3) if base_e else "",
               ratio=round(se, 4) if base_e else "",
               note=f"{tokens / ms * 1e3:.0f} tok/s; peak {peak:.2f} GiB ({pk:.2f}x bf16 "
                    f"{mode}); warm-up {warm:.0f} s; vs bf16 compiled {sc:.2f}x; graph "
                    f"breaks {breaks}; GPU kernels {gpu_ms:.2f} ms ({kernels:.0f}), host share "
                    f"{host:.1%}; forward host {fwd_ms:.2f} ms; optimizer step {opt_ms:.2f} "
                    f"ms, state {state_b:.2f} bytes/param")
    return line, row


HEADER = (f"{'peer':24s} {'mode':8s} {'ms':>9s} {'tok/s':>10s} {'vs bf16 eager':>14s} "
          f"{'vs bf16 comp.':>14s} {'peak GiB':>9s} {'vs bf16 peak':>12s} {'breaks':>6s} "
          f"{'GPU ms':>8s} {'host':>6s} {'kernels':>8s} {'fwd host':>8s} {'opt ms':>7s} "
          f"{'B/par':>6s}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="1b", choices=list(MODELS))
    ap.add_argument("--recipes", default="current,delayed,block,mxfp8,nvfp4")
    ap.add_argument("--modes", default="eager,compiled",
                    help="eager,eager-graphs,compiled,reduce-overhead,graphed,checkpointed "
                         "(eager with Hugging Face's gradient checkpointing)")
    ap.add_argument("--torchao", default="tensorwise,rowwise",
                    help="torchao recipes, '' for none")
    ap.add_argument("--torchao-modes", default="compiled",
                    help="modes of the torchao peers (compiled, reduce-overhead)")
    ap.add_argument("--bf16", default="", help="bf16 modes to run (default: --modes)")
    ap.add_argument("--optim", default="torch",
                    help=f"optimizer settings, comma-separated, each a run of every peer: "
                         f"{', '.join(OPTIMS)} (torch: fused AdamW over the bf16 parameters; "
                         f"the others lowprec.optim.AdamW, as compare's --optim-states)")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--record-every", default="",
                    help="also run each eager lowprec peer with lowprec.debug.Recorder "
                         "recording every N steps (comma-separated Ns)")
    ap.add_argument("--losses", type=int, default=0,
                    help="print the first N steps' losses of each peer (same data and init "
                         "for every peer: eager and compiled runs of a recipe should agree "
                         "bit for bit)")
    ap.add_argument("--compile-times", action="store_true",
                    help="print where each compiled peer's warm-up went (dynamo's phases)")
    ap.add_argument("--top-kernels", type=int, default=0,
                    help="print each peer's N heaviest kernels (GPU ms a step)")
    ap.add_argument("--host-ops", type=int, default=0,
                    help="print each peer's N heaviest host ops (own CPU ms a step, under "
                         "torch.profiler): where a host-bound step's time goes")
    ap.add_argument("--lm-head", action="store_true",
                    help="quantize the output head too (as lowprec compare does)")
    args = ap.parse_args()
    modes = [m for m in args.modes.split(",") if m]
    bf16_modes = [m for m in (args.bf16 or args.modes).split(",") if m]
    peers = [("bf16", m) for m in ("eager", "checkpointed", "compiled", "compiled-cpp",
                                   "reduce-overhead", "graphed") if m in bf16_modes]
    if args.torchao:
        try:
            import torchao.float8  # noqa: F401
            peers += [(f"torchao-{r}", m) for r in args.torchao.split(",")
                      for m in args.torchao_modes.split(",")]
        except ImportError as exc:
            print(f"torchao not importable ({exc}); its peers are left out")
    peers += [(f"lowprec-{r}", m) for r in args.recipes.split(",") if r for m in modes]
    peers += [(f"lowprec-{r}", f"eager-rec{n}") for r in args.recipes.split(",") if r
              for n in args.record_every.split(",") if n and "eager" in modes]
    *_, seq, batch = MODELS[args.model]
    tokens = seq * batch
    gpu = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(f"{args.model}: {MODELS[args.model][:3]} hidden/ffn/layers, {tokens} tokens a step, "
          f"{gpu}, torch {torch.__version__}\n{HEADER}", flush=True)
    optims = [o for o in args.optim.split(",") if o]
    bad = [o for o in optims if o not in OPTIMS]
    if bad:
        raise SystemExit(f"--optim {','.join(bad)}: use names from {', '.join(OPTIMS)}")
    peers = [(p if o == "torch" else f"{p}+{o}", m, o) for o in optims for p, m in peers]
    results, lines = {}, []
    for peer, mode, optim in peers:
        losses = [] if args.losses else None
        try:
            results[(peer, mode)] = run_peer(peer.partition("+")[0], args.model, args.device,
                                             mode, args.steps, args.warmup, args.top_kernels,
                                             optim, losses, args.compile_times, args.lm_head,
                                             args.host_ops)
        except Exception as exc:  # noqa: BLE001 - report the peer as failed, go on
            print(f"{peer:24s} {mode:8s} FAILED: {type(exc).__name__}: {str(exc)[:300]}",
                  flush=True)
            continue
        finally:
            release()
        if losses:
            shown = " ".join(f"{v:.6f}" for v in torch.stack(losses[:args.losses]).tolist())
            print(f"    {peer} {mode} losses: {shown}", flush=True)
        if mode == "eager-graphs":  # what the Linear calls did: captured, replayed, eager
            from lowprec.linear import graphed
            print(f"    {peer} {mode} Linear calls: {dict(graphed.counts)}", flush=True)
            graphed.counts.clear()
        line, row = _row(args.model, tokens, peer, mode, results[(peer, mode)], results,
                          args.lm_head)
        lines.append(line)
        print(line, flush=True)
        if args.device == "cuda":
            append_rows([row])  # as each peer finishes: a run cut short keeps its rows
    print(f"\n{HEADER}\n" + "\n".join(lines))


if __name__ == "__main__":
    main()
