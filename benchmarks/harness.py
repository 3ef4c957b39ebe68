"""Shared timing and bookkeeping for the lowprec benchmarks.

* :func:`time_fn` times a callable with CUDA events: warm-up calls first, then
  ``iters`` timed calls, each between its own pair of events, and returns the
  median in milliseconds. The callable gets one of several input sets in
  turn, so repeated calls do not find their inputs in the L2 cache.
* :func:`compare` times a peer and its baseline in the same run, interleaved
  in rounds, so clock or thermal drift affects both alike.
* :func:`append_rows` appends result rows (GPU name, torch version, git commit,
  benchmark, shape, recipe, metric, value, baseline, ratio) to
  ``benchmarks/results.csv`` (or ``$LOWPREC_RESULTS``).
"""

from __future__ import annotations

import csv
import datetime
import os
import statistics
import subprocess
import time
from pathlib import Path
from typing import Callable, Sequence

import torch

HERE = Path(__file__).resolve().parent
RESULTS = Path(os.environ.get("LOWPREC_RESULTS", HERE / "results.csv"))
FIELDS = ["date", "gpu", "torch", "commit", "bench", "shape", "recipe", "metric", "value",
          "baseline", "baseline_value", "ratio", "note"]


def git_commit() -> str:
    """The repository's commit (``$LOWPREC_GIT_COMMIT`` when the tree travels without .git)."""
    env = os.environ.get("LOWPREC_GIT_COMMIT")
    if env:
        return env
    try:
        out = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=HERE, check=True,
                             capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=HERE, capture_output=True, text=True).stdout.strip()
        return out + ("+dirty" if dirty else "")
    except Exception:  # noqa: BLE001 - no git, not a checkout
        return "unknown"


def gpu_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def time_fn(fn: Callable, input_sets: Sequence[tuple], *, warmup: int = 5, iters: int = 30,
            sync_each: bool = False, warmup_s: float = 0.0) -> float:
    """Median time of ``fn(*input_sets[i % n])`` in ms, measured with CUDA events.

    ``warmup_s``: keep warming up until that many seconds of GPU work have run, so the
    timed calls see the clock the GPU settles at under this workload (its SM clock was seen
    between 1560 and 1815 MHz depending on the load of the previous second or two)."""
    n = len(input_sets)
    for i in range(warmup):
        fn(*input_sets[i % n])
    torch.cuda.synchronize()
    if warmup_s > 0:
        t0, i = time.perf_counter(), 0
        while time.perf_counter() - t0 < warmup_s:
            fn(*input_sets[i % n])
            i += 1
            if i % 4 == 0:
                torch.cuda.synchronize()
        torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for i in range(iters):
        args = input_sets[(i + warmup) % n]
        starts[i].record()
        fn(*args)
        ends[i].record()
        if sync_each:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))


def warm_on_side_stream(fn, input_sets: Sequence[tuple], calls: int = 1) -> None:
    """``calls`` eager calls of ``fn`` over the input sets on a side stream, as CUDA graph
    capture asks of what it captures (lazy initialization, compiles, workspaces)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for i in range(calls):
            fn(*input_sets[i % len(input_sets)])
    torch.cuda.current_stream().wait_stream(side)


def graph_ms(fn, inputs, reps: int = 8, iters: int = 20) -> float:
    """GPU time of one ``fn`` call (ms): ``reps`` calls over the input sets captured in a
    CUDA graph, the replay timed with events (median of ``iters``), so no host time counts."""
    warm_on_side_stream(fn, inputs)
    graph, keep = torch.cuda.CUDAGraph(), []
    with torch.cuda.graph(graph):
        for i in range(reps):
            keep.append(fn(*inputs[i % len(inputs)]))
    return time_fn(graph.replay, [()], warmup=3, iters=iters) / reps


def graphed_step(step: Callable, input_sets: Sequence[tuple], warmup: int = 3) -> Callable:
    """``step`` captured in one CUDA graph per input set (after ``warmup`` eager calls on a
    side stream, as capture requires), returned as a callable taking the same arguments
    that replays the graph captured for them (found by the first argument's address). The
    graphs share one memory pool and must replay one at a time, as the timing loops do.
    What the step leaves behind (gradients) lives in that pool, overwritten by each replay;
    ``zero_grads`` is carried over from ``step`` when it has one."""
    warm_on_side_stream(step, input_sets, warmup)
    graphs, pool = {}, None
    for args in input_sets:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            step(*args)
        pool = graph.pool()
        graphs[args[0].data_ptr()] = graph

    def replay(*args):
        graphs[args[0].data_ptr()].replay()
    if hasattr(step, "zero_grads"):
        replay.zero_grads = step.zero_grads
    return replay


def compare(peer: Callable, baseline: Callable, peer_inputs: Sequence[tuple],
            baseline_inputs: Sequence[tuple], *, rounds: int = 3, warmup: int = 5,
            iters: int = 20, warmup_s: float = 0.0) -> tuple[float, float]:
    """(peer ms, baseline ms): medians over ``rounds`` interleaved rounds of each (each
    round warmed up for ``warmup_s`` seconds first, see ``time_fn``)."""
    p, b = [], []
    for _ in range(rounds):
        b.append(time_fn(baseline, baseline_inputs, warmup=warmup, iters=iters,
                         warmup_s=warmup_s))
        p.append(time_fn(peer, peer_inputs, warmup=warmup, iters=iters, warmup_s=warmup_s))
    return statistics.median(p), statistics.median(b)


def compare_alternating(peer: Callable, baseline: Callable, peer_inputs: Sequence[tuple],
                        baseline_inputs: Sequence[tuple], *, warmup: int = 5,
                        iters: int = 40) -> tuple[float, float]:
    """(peer ms, baseline ms): medians of ``iters`` calls of each, baseline and peer
    alternating call by call (CUDA events around each call, no sync in between).

    The GPU's clock drifts with its power and thermal state over a run (the bf16 step was
    seen to slow from 2.06 to 2.26 ms within 30 back-to-back calls), so two peers timed in
    separate rounds can meet different clocks; alternating call by call puts both under the
    same conditions."""
    for i in range(warmup):
        baseline(*baseline_inputs[i % len(baseline_inputs)])
        peer(*peer_inputs[i % len(peer_inputs)])
    torch.cuda.synchronize()
    ev = [[torch.cuda.Event(enable_timing=True) for _ in range(4)] for _ in range(iters)]
    for i in range(iters):
        e = ev[i]
        e[0].record()
        baseline(*baseline_inputs[(i + warmup) % len(baseline_inputs)])
        e[1].record()
        e[2].record()
        peer(*peer_inputs[(i + warmup) % len(peer_inputs)])
        e[3].record()
    torch.cuda.synchronize()
    return (statistics.median(e[2].elapsed_time(e[3]) for e in ev),
            statistics.median(e[0].elapsed_time(e[1]) for e in ev))


def l2_rotation(make_inputs: Callable[[], tuple], bytes_per_set: int, *, min_sets: int = 2,
                max_sets: int = 6) -> list[tuple]:
    """Enough input sets that the ones not in use exceed the L2 cache (at least ``min_sets``)."""
    l2 = 64 << 20
    if torch.cuda.is_available():
        l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", l2) or l2
    n = max(min_sets, min(max_sets, 1 + (2 * l2) // max(bytes_per_set, 1)))
    return [make_inputs() for _ in range(n)]


def bf16_inputs_and_copy(m: int, k: int, seed: int = 0) -> tuple[list[tuple], float]:
    """Rotating (m, k) bf16 normal inputs on the GPU (``l2_rotation``) and the GPU time
    of a device-to-device copy of one (CUDA graph, ms), printed as the sweeps' first line."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    inputs = l2_rotation(lambda: (torch.randn(m, k, device="cuda", generator=gen)
                                  .to(torch.bfloat16),), m * k * 2)
    dst = torch.empty_like(inputs[0][0])
    copy_ms = graph_ms(lambda x: dst.copy_(x), inputs)
    print(f"{m}x{k} bf16: copy {copy_ms:.4f} ms ({4 * m * k / copy_ms / 1e6:.0f} GB/s)")
    return inputs, copy_ms


def sweep_setup(default_configs: str, argv=None):
    """The tile sweeps' command line (``--shape MxK``, ``--configs`` comma-separated) and
    their inputs: (config list, inputs, copy ms) from ``bf16_inputs_and_copy``."""
    import argparse
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="16384x4096")
    ap.add_argument("--configs", default=default_configs)
    args = ap.parse_args(argv)
    m, k = (int(v) for v in args.shape.split("x"))
    inputs, copy_ms = bf16_inputs_and_copy(m, k)
    return args.configs.split(","), inputs, copy_ms


def median_step_ms(run: Callable[[int], None], steps: int) -> tuple[float, float]:
    """(median ms, peak GiB) of ``run(i)`` for ``i < steps``, each step between its own
    pair of CUDA events; the peak memory is of these steps alone."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for i in range(steps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        run(i)
        b.record()
        times.append((a, b))
    torch.cuda.synchronize()
    ms = statistics.median(a.elapsed_time(b) for a, b in times)
    return ms, torch.cuda.max_memory_allocated() / 2**30


def gpu_kernel_ms(run: Callable[[int], None], steps: int = 3,
                  top: int = 0) -> tuple[float, float, list]:
    """(GPU kernel ms, kernels, heaviest) per call of ``run(i)``, from ``torch.profiler``:
    the sum of every CUDA kernel's (and memcpy/memset's) own time, whatever the host did
    between them. Against the wall time of the same step it gives the host's share
    (1 - GPU / wall). ``heaviest``: the ``top`` kernel names by GPU time per call and the
    ``top`` by launches (where a host-bound step's small kernels show), as (ms, launches,
    name), heaviest first."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(steps):
            run(i)
        torch.cuda.synchronize()
    evs = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    total_us = sum(e.device_time for e in evs)
    by_name: dict[str, list] = {}
    for e in evs:
        acc = by_name.setdefault(e.name, [0.0, 0])
        acc[0] += e.device_time
        acc[1] += 1
    rows = [(us / 1e3 / steps, n / steps, name) for name, (us, n) in by_name.items()]
    by_time = sorted(rows, reverse=True)[:top]
    by_launches = sorted(rows, key=lambda r: r[1], reverse=True)[:top]
    heaviest = sorted(set(by_time) | set(by_launches), reverse=True)
    return total_us / 1e3 / steps, len(evs) / steps, heaviest


def host_ops(run: Callable[[int], None], top: int, steps: int = 1) -> list:
    """The ``top`` host ops by their own CPU time per call of ``run(i)``, as (ms, calls,
    name), from ``torch.profiler``: where a host-bound step's time goes. The inductor
    wrapper's own Python shows as its ``## Call CompiledFxGraph`` frame, a custom op as its
    ``lowprec::`` name, each ``aten::`` call apart. Times are under the profiler, which
    adds a few microseconds an op."""
    from torch.profiler import ProfilerActivity, profile

    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for i in range(steps):
            run(i)
        sync()
    return sorted(((e.self_cpu_time_total / 1e3 / steps, e.count / steps, e.key)
                   for e in prof.key_averages()), reverse=True)[:top]


def append_rows(rows: list[dict], path: Path | str | None = None) -> Path:
    path = Path(path or RESULTS)
    new = not path.exists()
    path.parent.mkdir(parents=True, exist_ok=True)
    base = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%MZ"),
            "gpu": gpu_name(), "torch": torch.__version__, "commit": git_commit()}
    with path.open("a", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS)
        if new:
            w.writeheader()
        for r in rows:
            w.writerow({k: _fmt(v) for k, v in {**base, **r}.items() if k in FIELDS})
    return path


def _fmt(v):
    return f"{v:.4g}" if isinstance(v, float) else v


def print_table(rows: list[dict], cols: Sequence[str]) -> None:
    widths = [max(len(c), *(len(str(_fmt(r.get(c, "")))) for r in rows)) for c in cols]
    print("  ".join(c.ljust(w) for c, w in zip(cols, widths)))
    for r in rows:
        print("  ".join(str(_fmt(r.get(c, ""))).ljust(w) for c, w in zip(cols, widths)))


def pretend_gpu() -> None:
    """Take lowprec's GPU code path on a machine without one (``tools/compile_costs.py
    --pretend``, ``tools/backward_speculation.py``): CPU tensors stand in for CUDA ones, the
    kernel switch says yes, each Triton launch is a no-op, ``torch._scaled_mm`` returns an
    empty result and the traced plans pick CUDA's GEMM routes, so what dynamo and AOT
    autograd trace is what they trace on a GPU (delayed scaling: from its second step,
    every slot seeded). For the process's rest: it patches lowprec
    and torch in place."""
    import lowprec.kernels as kernels
    from lowprec.kernels import launch as kernel_launch

    def use_kernels(t):
        return True
    kernels.use_kernels.__code__ = use_kernels.__code__
    kernels._triton_found = None

    def launch(kernel, grid, *args, **kwargs):
        return None
    kernel_launch.launch.__code__ = launch.__code__

    def bind(kernel, grid, n, *args, **kwargs):
        return lambda *tensors: None

    def fast_launches():
        return True
    kernel_launch.bind.__code__ = bind.__code__
    kernel_launch.fast_launches.__code__ = fast_launches.__code__

    class _NoKernel:  # what BoundCalls binds: a launcher that launches nothing
        function = packed_metadata = None

        @staticmethod
        def run(*args):
            return None

    def bound_values(kernel, grid, args, kwargs):
        return _NoKernel, [None] * len(kernel.arg_names), 0
    kernel_launch._bound_values = bound_values
    torch.cuda.current_device = lambda: 0
    torch._C._cuda_getCurrentRawStream = lambda index: 0
    torch.cuda.is_current_stream_capturing = lambda: False

    def scaled_mm(a, b, scale_a=None, scale_b=None, bias=None, out_dtype=None, **kw):
        return torch.empty(a.shape[0], b.shape[1], dtype=out_dtype or a.dtype)
    torch._scaled_mm = scaled_mm
    from lowprec.gemm import cublas_fp8
    cublas_fp8._on_cuda = lambda ad, bd: True  # both per-tensor and block backends ask it
    from lowprec.linear import traced
    gpu_route = traced.route
    # the traced plan's GEMM table as on CUDA (cuBLAS FP8, not the fp32 emulation)
    traced.route = lambda a, b, m, n, k, out, bias, cuda: gpu_route(a, b, m, n, k, out, bias,
                                                                    True)
    # No launch records an amax, so no delayed-scaling slot would ever get a scale, and its
    # calls would stay opaque: trace them as CUDA does from its second step, every slot
    # seeded (no seeding in the graph, so nothing keeps a call opaque)
    from lowprec.formats.float8 import Float8Quantizer
    Float8Quantizer.graph_first_margin = lambda self, kernel: None
