"""Host (issue) time of the pieces a quantized Linear step is made of, on tiny tensors so
the GPU never holds the host back: Triton launches, small torch ops, cuBLAS FP8 GEMMs,
custom-op wrappers. Tells which launches are worth fusing or caching.

    python tools/host_costs.py
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import lowprec  # noqa: E402
from lowprec.formats.float8 import launch as fl  # noqa: E402


def per_call_us(fn, n=2000) -> float:
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t = time.perf_counter() - t0
    torch.cuda.synchronize()
    return t / n * 1e6


def main():
    dev = "cuda"
    x = torch.randn(256, 256, device=dev, dtype=torch.bfloat16)
    s = torch.ones(1, device=dev)
    a = torch.zeros(1, device=dev)
    dq = lowprec.Float8Quantizer(s.clone(), a.clone())
    cq = lowprec.Float8CurrentScalingQuantizer()
    bq = lowprec.Float8BlockQuantizer(block_scaling_dim=1)
    bcq = lowprec.Float8BlockQuantizer(block_scaling_dim=1).set_usage(False, True)
    f8 = torch.randn(256, 256, device=dev).to(torch.float8_e4m3fn)
    rows = {
        "torch.empty(1)": lambda: torch.empty(1, device=dev),
        "torch.zeros(1)": lambda: torch.zeros(1, device=dev),
        "reciprocal(1)": lambda: torch.reciprocal(s),
        "fp8_amax launch": lambda: fl.fp8_amax(x),
        "delayed quantize both (2 launches)": lambda: dq.quantize(x),
        "delayed quantize rowwise": lambda: dq.copy().set_usage(columnwise=False).quantize(x),
        "current quantize both": lambda: cq.quantize(x),
        "block1 quantize both": lambda: bq.quantize(x),
        "block1 quantize col": lambda: bcq.quantize(x),
        "_scaled_mm 256^3": lambda: torch._scaled_mm(f8, f8.t(), s, s,
                                                     out_dtype=torch.bfloat16),
        "bf16 mm 256^3": lambda: x @ x,
    }
    for name, fn in rows.items():
        print(f"{name:40s} {per_call_us(fn):8.1f} us")
    lin = lowprec.Linear(256, 256, params_dtype=torch.bfloat16, device=dev)
    xg = x.clone().requires_grad_(True)
    dy = torch.randn(256, 256, device=dev, dtype=torch.bfloat16)
    for name, recipe in (("current", lowprec.Float8CurrentScaling()),
                         ("delayed", lowprec.DelayedScaling()),
                         ("block", lowprec.Float8BlockScaling())):
        def step():
            with lowprec.autocast(recipe=recipe):
                y = lin(xg)
            y.backward(dy)
        print(f"{'Linear step ' + name:40s} {per_call_us(step, 300):8.1f} us")


if __name__ == "__main__":
    main()
