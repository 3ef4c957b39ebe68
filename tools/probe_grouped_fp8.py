"""Probe of the grouped GEMMs at the MoE layer's shapes: TFLOP/s of bf16
``torch._grouped_mm`` against FP8 ``torch._scaled_grouped_mm`` with and without fast
accumulation, per direction (forward, dgrad, wgrad), and whether the two FP8 modes give
the same bits. Needs a Hopper GPU."""

from __future__ import annotations

import argparse

import torch

SHAPES = {"mixtral": (4096, 8, 2, 14336), "qwen3": (2048, 128, 8, 768)}


def timed(fn, iters=20):
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(iters):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def problem(rows, experts, n, k):
    counts = torch.bincount(torch.randint(0, experts, (rows,), device="cuda"),
                            minlength=experts)
    counts = (counts + 15) // 16 * 16  # group starts at multiples of 16 (wgrad's rule)
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    m = int(offs[-1])
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(experts, n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    return a, w, dy, offs


def fp8(t):
    return t.to(torch.float8_e4m3fn)


def run(name, tokens):
    hidden, experts, topk, ffn = SHAPES[name]
    rows = tokens * topk
    for label, n, k in (("gate/up", 2 * ffn, hidden), ("down", hidden, ffn)):
        a, w, dy, offs = problem(rows, experts, n, k)
        m = a.shape[0]
        flop = 2 * m * n * k
        a8, w8, dy8 = fp8(a), fp8(w), fp8(dy)
        w8_t = fp8(w.transpose(1, 2).contiguous())  # (G, K, N): dgrad's second operand
        ones_m, ones_gn, ones_gk = (torch.ones(m, device="cuda"),
                                    torch.ones(experts * n, device="cuda"),
                                    torch.ones(experts * k, device="cuda"))
        a8_t, dy8_t = a8.t().contiguous(), dy8.t().contiguous()

        def fwd(fast):
            return torch._scaled_grouped_mm(a8, w8.transpose(1, 2), ones_m,
                                            ones_gn.view(experts, n), offs=offs,
                                            out_dtype=torch.bfloat16, use_fast_accum=fast)

        def dgrad(fast):
            return torch._scaled_grouped_mm(dy8, w8_t.transpose(1, 2), ones_m,
                                            ones_gk.view(experts, k), offs=offs,
                                            out_dtype=torch.bfloat16, use_fast_accum=fast)

        def wgrad(fast):
            return torch._scaled_grouped_mm(dy8_t, a8_t.t(), ones_gn, ones_gk, offs=offs,
                                            out_dtype=torch.bfloat16, use_fast_accum=fast)

        bf16 = {"fwd": lambda: torch._grouped_mm(a, w.transpose(1, 2), offs=offs),
                "dgrad": lambda: torch._grouped_mm(dy, w, offs=offs),
                "wgrad": lambda: torch._grouped_mm(dy.t(), a, offs=offs)}
        for direction, f in (("fwd", fwd), ("dgrad", dgrad), ("wgrad", wgrad)):
            t_bf = timed(bf16[direction])
            t_slow, t_fast = timed(lambda: f(False)), timed(lambda: f(True))
            same = torch.equal(f(False).view(torch.int16), f(True).view(torch.int16))
            print(f"{name:8s} {label:8s} {direction:6s} m={m:7d} bf16 {flop / t_bf / 1e9:6.0f} "
                  f"fp8 {flop / t_slow / 1e9:6.0f} fp8-fast {flop / t_fast / 1e9:6.0f} TFLOP/s"
                  f"  (ms {t_bf:.3f} / {t_slow:.3f} / {t_fast:.3f}) same bits: {same}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="mixtral,qwen3")
    ap.add_argument("--tokens", type=int, default=16384)
    args = ap.parse_args()
    torch.manual_seed(0)
    for name in args.shapes.split(","):
        run(name, args.tokens)


if __name__ == "__main__":
    main()
