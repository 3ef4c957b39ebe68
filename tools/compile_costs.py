"""Where the first compiled steps of ``bench_model.py``'s Llama spend their time, per peer,
each peer in a fresh process with an empty inductor cache (the cold start a user meets).

Per peer it prints (and on a GPU appends to ``benchmarks/results.csv``) the seconds of the
first ``--steps`` steps, the graphs, captured calls
and generated kernels, dynamo's timed phases (``compilation_time_metrics``), and with
``--inlined N`` the N user functions dynamo spent most tracing time in, exclusive of the
functions they call (``--inclusive N``: the N with most time including their callees;
timed around dynamo's inlining of each call, so a function's time includes the
fake-tensor propagation of the ops it traces). With ``--classes N`` also the N classes
whose instantiation inside the trace cost dynamo most (inclusive seconds).

Without a GPU, ``--pretend`` traces the GPU code path on the CPU (no-op launches and GEMMs,
``benchmarks/harness.pretend_gpu``; the model in bf16), and ``--backend aot_eager`` times
dynamo and AOT autograd alone: dynamo's tracing time of lowprec's Python is the same on both
hosts.

    python tools/compile_costs.py --model 1b --peers bf16,torchao-tensorwise,lowprec-current
    python tools/compile_costs.py --model tiny8 --device cpu --pretend --backend aot_eager \
        --peers bf16,lowprec-current --steps 1 --inlined 12 --classes 8
"""

from __future__ import annotations

import argparse
import collections
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _profile_inlining():
    """Patch dynamo's inliner to time each inlined call; returns (exclusive seconds, calls)
    by function and (inclusive seconds, objects) by class instantiated."""
    import torch._dynamo.symbolic_convert as sc

    excl, incl = collections.Counter(), collections.Counter()
    calls, stack, active = collections.Counter(), [], collections.Counter()
    # dynamo builds a user class's object through one polyfill: the class, inclusive time
    made_s, made_n = collections.Counter(), collections.Counter()
    inline = sc.InliningInstructionTranslator.inline_call_

    def timed(self):
        code = self.f_code
        where = code.co_filename.split("site-packages/")[-1].replace(str(ROOT) + "/", "")
        key = f"{where}:{code.co_firstlineno}:{code.co_name}"
        made = None
        if code.co_name == "instantiate_user_defined_class_object":
            cls = getattr(self.symbolic_locals.get("cls"), "value", None)
            made = getattr(cls, "__qualname__", "?")
        t0 = time.perf_counter()
        stack.append(0.0)
        active[key] += 1
        try:
            return inline(self)
        finally:
            dt = time.perf_counter() - t0
            child = stack.pop()
            excl[key] += dt - child
            active[key] -= 1
            if not active[key]:  # a recursive call's time counts once
                incl[key] += dt
            calls[key] += 1
            if made is not None:
                made_s[made] += dt
                made_n[made] += 1
            if stack:
                stack[-1] += dt

    sc.InliningInstructionTranslator.inline_call_ = timed
    return excl, incl, calls, made_s, made_n


def one_peer(args) -> None:
    import torch

    sys.path.insert(0, str(ROOT / "benchmarks"))
    sys.path.insert(0, str(ROOT / "tools"))
    if args.pretend:
        from harness import pretend_gpu
        pretend_gpu()
    import bench_model as B
    from torch._dynamo.utils import compilation_time_metrics, counters
    from torch._inductor import metrics

    profiled = args.inlined or args.inclusive or args.classes
    excl, incl, calls, made_s, made_n = _profile_inlining() if profiled else (None,) * 5
    model, ctx = B.make_peer(args.peers, args.model, args.device, "eager")
    if args.pretend:
        model = model.to(torch.bfloat16)  # the dtype of the GPU runs
    model = torch.compile(model, backend=args.backend)
    opt = B.make_optimizer(model.parameters(), "torch", args.device, False)
    *_, seq, batch = B.MODELS[args.model]
    gen = torch.Generator(device=args.device).manual_seed(0)
    ids = torch.randint(0, 32000, (batch, seq), device=args.device, generator=gen)
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        B.lm_loss(model, ctx, ids).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        times.append(time.perf_counter() - t0)
    stats = counters["stats"]
    steps = ", ".join(f"{t:.1f}" for t in times)
    print(f"{args.peers}: first {args.steps} steps {sum(times):.1f} s "
          f"({steps}); {stats['unique_graphs']} graphs, "
          f"{stats['calls_captured']} calls captured, {metrics.generated_kernel_count} kernels, "
          f"{sum(counters['graph_break'].values())} graph breaks", flush=True)
    named = {k: sum(v) for k, v in compilation_time_metrics.items()}
    phases = sorted(((t, k) for k, t in named.items()), reverse=True)
    print("  phases: " + ", ".join(f"{k} {t:.1f}s" for t, k in phases[:args.phases]))
    if args.device == "cuda" and not args.pretend:  # a GPU measurement: a row of results.csv
        from harness import append_rows
        append_rows([dict(
            bench="compile", shape=f"{args.model} {seq * batch}tok", recipe=args.peers,
            metric=f"first{args.steps}_s", value=round(sum(times), 1),
            note=(f"fresh process, empty inductor and Triton caches (tools/compile_costs.py); "
                  f"steps {steps} s; "
                  f"{stats['unique_graphs']} graphs, {metrics.generated_kernel_count} kernels; "
                  + ", ".join(f"{k} {named[k]:.1f} s" for k in (
                      "compile_fx_inner", "compile_fx.<locals>.fw_compiler_base",
                      "compile_fx.<locals>.bw_compiler") if k in named)))])
    if args.inlined:
        print(f"  dynamo tracing, exclusive s / calls (top {args.inlined}):")
        for key, t in excl.most_common(args.inlined):
            print(f"    {t:7.3f} {calls[key]:6d}  {key}")
    if args.inclusive:
        print(f"  dynamo tracing, inclusive s / calls (top {args.inclusive}):")
        for key, t in incl.most_common(args.inclusive):
            print(f"    {t:7.3f} {calls[key]:6d}  {key}")
    if args.classes:
        print(f"  classes instantiated while tracing, inclusive s / objects "
              f"(top {args.classes}):")
        for name, t in made_s.most_common(args.classes):
            print(f"    {t:7.3f} {made_n[name]:6d}  {name}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="1b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--peers", default="bf16,torchao-tensorwise,lowprec-current",
                    help="bf16, torchao-<recipe>, lowprec-<bench_model recipe>")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--phases", type=int, default=24)
    ap.add_argument("--inlined", type=int, default=0)
    ap.add_argument("--inclusive", type=int, default=0)
    ap.add_argument("--classes", type=int, default=0)
    ap.add_argument("--backend", default="inductor", help="torch.compile backend")
    ap.add_argument("--pretend", action="store_true",
                    help="no GPU: the GPU code path on CPU tensors (see the module doc)")
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        return one_peer(args)
    for peer in args.peers.split(","):
        with tempfile.TemporaryDirectory() as cache:
            env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache,
                       TRITON_CACHE_DIR=os.path.join(cache, "triton"))
            cmd = [sys.executable, __file__, "--one", "--peers", peer,
                   *[f"--{k}" if v is True else f"--{k}={v}" for k, v in vars(args).items()
                     if k not in ("one", "peers") and v is not False]]
            subprocess.run(cmd, env=env, check=False)


if __name__ == "__main__":
    main()
