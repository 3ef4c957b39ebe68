"""Where an eager whole-model step waits for the host: per phase (forward, backward,
optimizer) of ``benchmarks/bench_model.py``'s step, the host's time in the phase, the GPU's
busy time on the kernels the phase launched, and the idle time the GPU spent waiting for
a launch (a kernel whose launch came after the previous kernel had ended), with the
Python functions that keep the host longest in the forward and the backward (cProfile,
own time).

    python tools/eager_phases.py [--model 1b] [--peers bf16,lowprec-current] [--json out.json]

A peer named ``<peer>:function`` runs its eager calls on the eager Function
(``traced.eager_plans_off``) rather than the traced plan.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import json
import os
import pstats
import sys
import tempfile
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

from bench_model import MODELS, lm_loss, make_optimizer, make_peer  # noqa: E402

from lowprec.linear import traced  # noqa: E402

PHASES = ("forward", "backward", "optimizer")


def _step(m, ctx, opt, ids):
    with record_function("phase:forward"):
        loss = lm_loss(m, ctx, ids)
    with record_function("phase:backward"):
        loss.backward()
    with record_function("phase:optimizer"):
        opt.step()
        opt.zero_grad(set_to_none=True)


def _analyse(trace: dict, steps: int) -> dict:
    evs = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    phases = sorted(((e["ts"], e["ts"] + e["dur"], e["name"].split(":", 1)[1])
                     for e in evs if e.get("cat") == "user_annotation"
                     and e["name"].startswith("phase:")))
    launches = {e["args"]["correlation"]: e["ts"] for e in evs
                if e.get("cat") in ("cuda_runtime", "cuda_driver")
                and "correlation" in e.get("args", {})}
    kernels = sorted((e["ts"], e["ts"] + e["dur"], launches.get(e["args"].get("correlation")),
                      e["name"]) for e in evs
                     if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"))
    out = {p: {"host_ms": 0.0, "gpu_busy_ms": 0.0, "launch_wait_ms": 0.0, "kernels": 0,
               "cpu_ops": {}} for p in PHASES}
    for start, end, name in phases:
        out[name]["host_ms"] += (end - start) / 1e3

    def phase_of(t):
        for start, end, name in phases:
            if start <= t <= end:
                return name
        return None

    for e in evs:  # host time of each top-level op a phase runs (inclusive)
        if e.get("cat") == "cpu_op":
            p = phase_of(e["ts"])
            if p is not None:
                acc = out[p]["cpu_ops"].setdefault(e["name"], [0.0, 0])
                acc[0] += e["dur"] / 1e3 / steps
                acc[1] += 1 / steps
    for p in PHASES:
        out[p]["cpu_ops"] = sorted(((round(ms, 3), round(n), name)
                                    for name, (ms, n) in out[p]["cpu_ops"].items()),
                                   reverse=True)[:25]
    prev_end = None
    for start, end, launched, name in kernels:
        p = phase_of(launched) if launched is not None else None
        if p is not None:
            out[p]["gpu_busy_ms"] += (end - start) / 1e3
            out[p]["kernels"] += 1
            if prev_end is not None and start > prev_end and launched > prev_end:
                gap = (start - prev_end) / 1e3
                out[p]["launch_wait_ms"] += gap
        prev_end = end if prev_end is None else max(prev_end, end)
    for p in PHASES:
        for k in ("host_ms", "gpu_busy_ms", "launch_wait_ms"):
            out[p][k] = round(out[p][k] / steps, 3)
        out[p]["kernels"] = out[p]["kernels"] // steps
    first = min(s for s, _, _ in phases)
    last = max(e for _, e, _ in phases)
    gpu_last = max(e for _, e, _, _ in kernels)
    out["step_ms"] = round((max(last, gpu_last) - first) / 1e3 / steps, 3)
    out["gpu_busy_ms"] = round(sum(e - s for s, e, _, _ in kernels) / 1e3 / steps, 3)
    return out


def run(peer: str, model: str, steps: int, top: int, mode: str = "eager") -> dict:
    m, ctx = make_peer(peer, model, "cuda", mode)
    opt = make_optimizer(m.parameters(), "torch", "cuda", False)
    *_, seq, batch = MODELS[model]
    gen = torch.Generator(device="cuda").manual_seed(0)
    ids = torch.randint(0, 32000, (batch, seq), device="cuda", generator=gen)
    for _ in range(4):
        _step(m, ctx, opt, ids)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            _step(m, ctx, opt, ids)
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            res = _analyse(json.load(f), steps)
    # the forward's and the backward's Python, own time (the forward starts on an idle
    # GPU: transformers syncs)
    fwd, bwd = cProfile.Profile(), cProfile.Profile()
    for _ in range(steps):
        torch.cuda.synchronize()
        fwd.enable()
        loss = lm_loss(m, ctx, ids)
        fwd.disable()
        bwd.enable()
        loss.backward()
        bwd.disable()
        opt.zero_grad(set_to_none=True)
    for name, pr in (("forward_profile", fwd), ("backward_profile", bwd)):
        s = io.StringIO()
        pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(top)
        res[name] = s.getvalue()
    del m, opt
    torch.cuda.empty_cache()
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="1b", choices=list(MODELS))
    ap.add_argument("--peers", default="bf16,lowprec-current")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--json", default="")
    ap.add_argument("--mode", default="eager", choices=["eager", "checkpointed"],
                    help="checkpointed: Hugging Face's gradient checkpointing")
    args = ap.parse_args()
    results = {}
    for peer in args.peers.split(","):
        name, _, engine = peer.partition(":")
        with traced.eager_plans_off() if engine == "function" else contextlib.nullcontext():
            res = run(name, args.model, args.steps, args.top, args.mode)
        results[peer] = res
        print(f"== {peer}: step {res['step_ms']} ms, GPU busy {res['gpu_busy_ms']} ms")
        for p in PHASES:
            r = res[p]
            print(f"   {p:9s} host {r['host_ms']:8.2f} ms  GPU busy {r['gpu_busy_ms']:8.2f} ms  "
                  f"waiting for launches {r['launch_wait_ms']:7.2f} ms  {r['kernels']} kernels")
        for p in PHASES[:2]:
            print(f"   {p}'s ops by host ms (inclusive, nested ops counted in each):")
            for ms, n, name in res[p]["cpu_ops"]:
                print(f"     {ms:8.3f} ms {n:5d}x {name}")
        print(res["forward_profile"])
        print(res["backward_profile"])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
