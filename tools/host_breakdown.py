"""Where the host (issue) time of one quantized Linear step goes, in native time.

cProfile inflates small Python functions several-fold, so this wraps a fixed list of
functions (lowprec's step pieces, Triton's launch, the small torch ops) with inclusive
``perf_counter`` timers instead (about 0.3 us each), runs many steps on tiny tensors (the
GPU never holds the host back) and prints microseconds per step for each piece, with the
unwrapped step's time beside it.

    python tools/host_breakdown.py [--shape 512x512x512] [--recipes current,delayed]
"""

from __future__ import annotations

import argparse
import functools
import gc
import importlib
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

from bench_linear import RECIPES, lowprec_step, parse_shape, plain_step  # noqa: E402

import lowprec  # noqa: E402

#: (owner as "module" or "module:Class", attribute) of every piece timed.
TARGETS = [
    ("lowprec.modules.base:LowprecModule", "gemm_quantizers"),
    ("lowprec.linear.function:EagerLinearFunction", "forward"),
    ("lowprec.linear.function:EagerLinearFunction", "backward"),
    ("lowprec.linear.function", "quantize_operand"),
    ("lowprec.linear.function", "check_linear_args"),
    ("lowprec.linear.function", "gemm"),
    ("lowprec.linear.function", "plan_for"),
    ("lowprec.linear.grad_split", "sliced_backward"),
    # the traced plan, which eager calls run (lowprec.linear.traced.eager_plan)
    ("lowprec.linear.traced", "eager_plan"),
    ("lowprec.linear.traced", "run_plan"),
    ("lowprec.linear.traced:TracedLinear", "forward"),
    ("lowprec.linear.traced:TracedLinear", "backward"),
    ("lowprec.linear.traced", "traced_gemm"),
    ("lowprec.linear.shared_input", "shared_form"),
    ("lowprec.formats.float8.graph:Tensorwise", "_quantize"),
    ("lowprec.formats.float8.graph:Tensorwise", "_cast_columnwise"),
    ("lowprec.formats.float8.graph:Delayed", "state_quantize"),
    ("lowprec.formats.base:Quantizer", "quantize"),
    ("lowprec.formats.float8.quantizer:_PerTensorFloat8", "quantize_usage_like"),
    ("lowprec.formats.base:QuantizedTensor", "__new__"),
    ("lowprec.recipe.state:DelayedScalingState", "update"),
    ("lowprec.gemm.dispatch", "select_backend"),
    ("triton.runtime.jit:JITFunction", "run"),
    # every launch, cached or not (lowprec.kernels.launch), under one key per module
    ("lowprec.formats.float8.launch", "launch"),
    ("lowprec.formats.block.launch", "launch"),
    ("lowprec.formats.nvfp4.launch", "launch"),
    ("lowprec.gemm.kernels", "launch"),
    ("lowprec.fused.prologue", "launch"),
    ("torch", "zeros"),
    ("torch", "empty"),
    ("torch", "reciprocal"),
    ("torch", "_scaled_mm"),
    ("torch:Tensor", "new_empty"),
]


class Timers:
    def __init__(self):
        self.total = defaultdict(float)
        self.calls = defaultdict(int)
        self.restore = []

    def wrap(self, owner_path: str, attr: str) -> None:
        mod_name, _, cls_name = owner_path.partition(":")
        owner = importlib.import_module(mod_name)
        if cls_name:
            owner = getattr(owner, cls_name)
        raw = owner.__dict__.get(attr, None) if isinstance(owner, type) else None
        fn = getattr(owner, attr, None)
        if fn is None:
            print(f"(no {owner_path}.{attr} here)")
            return
        key = f"{owner_path.split('.')[-1]}.{attr}"
        total, calls = self.total, self.calls

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                total[key] += time.perf_counter() - t0
                calls[key] += 1
        if isinstance(raw, staticmethod):
            new = staticmethod(functools.wraps(fn)(timed))
        elif isinstance(raw, classmethod):
            raise TypeError(f"{key}: classmethods are not wrapped")
        else:
            new = functools.wraps(fn)(timed) if not isinstance(fn, type(len)) else timed
        setattr(owner, attr, new)
        # an inherited method (Tensor.new_empty) is restored by deleting the shadowing copy
        own = attr in owner.__dict__ if isinstance(owner, type) else True
        self.restore.append((owner, attr, raw if raw is not None else fn, own))

    def unwrap(self):
        for owner, attr, old, own in reversed(self.restore):
            if own:
                setattr(owner, attr, old)
            else:
                delattr(owner, attr)
        self.restore.clear()


def _sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def per_call_us(fn, device, n=500):
    """Host microseconds per ``fn()`` over ``n`` calls after 20 warm-up calls."""
    for _ in range(20):
        fn()
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t = time.perf_counter() - t0
    _sync(device)
    return t / n * 1e6


def steps_us(step, x, dy, n):
    return per_call_us(lambda: step(x, dy), x.device.type, n)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="512x512x512")
    ap.add_argument("--recipes", default="current,delayed,block")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--device", default="cuda", help="cpu: a smoke test of the script only")
    ap.add_argument("--extra", default="",
                    help="more pieces to time, as module[:Class].attr, comma-separated")
    ap.add_argument("--slow-launches", action="store_true",
                    help="every Triton launch through JITFunction.run (the path before "
                         "lowprec.kernels.launch), for an A/B")
    args = ap.parse_args()
    if args.slow_launches:
        import lowprec.kernels.launch
        with lowprec.kernels.launch.slow_launches():
            return run(args)
    return run(args)


def run(args):
    dev = args.device
    m, k, n = parse_shape(args.shape)
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16).requires_grad_(True)
    dy = torch.randn(m, n, device=dev, dtype=torch.bfloat16)
    ref = torch.nn.Linear(k, n, bias=False, device=dev, dtype=torch.bfloat16)
    print(f"{'bf16 nn.Linear step':44s} {steps_us(plain_step(ref), x, dy, args.steps):8.1f} us")
    plain = lowprec.Linear(k, n, bias=False, params_dtype=torch.bfloat16, device=dev)
    print(f"{'lowprec.Linear step outside autocast':44s} "
          f"{steps_us(plain_step(plain), x, dy, args.steps):8.1f} us")
    for r in args.recipes.split(","):
        mod = lowprec.Linear(k, n, bias=False, params_dtype=torch.bfloat16, device=dev)
        step = lowprec_step(mod, RECIPES[r]())
        bare = steps_us(step, x, dy, args.steps)
        timers = Timers()
        extra = [tuple(t.rsplit(".", 1)) for t in args.extra.split(",") if t]
        for owner, attr in TARGETS + extra:
            timers.wrap(owner, attr)
        try:
            wrapped = steps_us(step, x, dy, args.steps)
        finally:
            timers.unwrap()
        gc_time, gc_runs = [0.0], [0, 0, 0]

        def on_gc(phase, info, t0=[0.0]):
            if phase == "start":
                t0[0] = time.perf_counter()
            else:
                gc_time[0] += time.perf_counter() - t0[0]
                gc_runs[info["generation"]] += 1
        gc.callbacks.append(on_gc)
        try:
            bare = steps_us(step, x, dy, args.steps)
        finally:
            gc.callbacks.remove(on_gc)
        gc.disable()
        try:
            no_gc = steps_us(step, x, dy, args.steps)
        finally:
            gc.enable()
        per = args.steps + 20
        print(f"\n##### {r}: step {bare:.1f} us unwrapped, {wrapped:.1f} us wrapped, "
              f"{no_gc:.1f} us with gc disabled; gc {gc_time[0] / per * 1e6:.1f} us per step, "
              f"collections per gen {gc_runs}")
        with lowprec.autocast(recipe=RECIPES[r]()):
            lq = mod.gemm_quantizers(x.device)[0][0]
        iq = lq.input.copy().set_usage(rowwise=True, columnwise=True)
        xd = x.detach()
        one = per_call_us(lambda: iq.quantize(xd), x.device.type)
        print(f"  the input quantize (both usages) alone, in a loop: {one:.1f} us a call")
        # the warm-up steps were timed too: per step = total / (warm-up + timed steps)
        for key in sorted(timers.total, key=timers.total.get, reverse=True):
            print(f"  {key:44s} {timers.total[key] / per * 1e6:8.1f} us "
                  f"{timers.calls[key] / per:5.1f} calls")


if __name__ == "__main__":
    main()
