"""Probe of the grouped GEMMs at the MoE layer's shapes, per direction (forward, dgrad,
wgrad): TFLOP/s of bf16 ``torch._grouped_mm`` against FP8 ``torch._scaled_grouped_mm`` with
and without fast accumulation (and whether the two give the same bits); with ``--triton``,
lowprec's grouped FP8 kernel (``gemm/_fp8_grouped_kernels.py``): its bits against one
cuBLAS ``torch._scaled_mm`` per group and the TFLOP/s of tile configs; with ``--bf16``, the
same kernel over bf16 operands (the NVFP4 experts' GEMMs) in each config against bf16
``torch._grouped_mm`` in the same run. Needs a Hopper GPU."""

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


def launch(a, b, da, db, offs, out, group_k, s_b, s_o, cfg):
    from lowprec.gemm._fp8_grouped_kernels import (
        fp8_grouped_gemm_kernel,
        fp8_grouped_gemm_persistent_kernel,
    )
    bm, bn, warps, stages, band, *rest = cfg
    bk = rest[0] if rest else 128
    fp8_ops = a.element_size() == 1
    g = offs.shape[0]
    m, n, k = a.shape[0], out.shape[-1], a.shape[1]
    if len(rest) > 1:  # (..., BK, programs per SM): the persistent kernel
        programs = rest[1] * torch.cuda.get_device_properties(a.device).multi_processor_count
        fp8_grouped_gemm_persistent_kernel[(programs,)](
            a, b, da, db, out, offs, m, n, k, g, *a.stride(), *s_b, *s_o,
            GROUP_K=group_k, BM=bm, BN=bn, BK=bk, GP=max(2, 1 << (g - 1).bit_length()),
            GROUP_M=band, MASK_K=group_k or k % bk != 0, FP8=fp8_ops, PROGRAMS=programs,
            num_warps=warps, num_stages=stages)
        return out
    m_tiles = -(-m // bm) + (0 if group_k else g)
    grid = (m_tiles * -(-n // bn), g if group_k else 1)
    fp8_grouped_gemm_kernel[grid](
        a, b, da, db, out, offs, m, n, k, g, *a.stride(), *s_b, *s_o,
        GROUP_K=group_k, BM=bm, BN=bn, BK=bk, GP=max(2, 1 << (g - 1).bit_length()),
        GROUP_M=band, MASK_K=group_k or k % bk != 0, FP8=fp8_ops, num_warps=warps,
        num_stages=stages)
    return out


def bits_off(x, y):
    return int((x.view(torch.int16) != y.view(torch.int16)).sum())


def triton_run(name, tokens, configs):
    """The Triton kernel: bits against one cuBLAS ``torch._scaled_mm`` per group (groups of
    any size, some empty), then TFLOP/s of each config at the layer's shapes."""
    hidden, experts, topk, ffn = SHAPES[name]
    rows = tokens * topk
    for label, n, k in (("gate/up", 2 * ffn, hidden), ("down", hidden, ffn)):
        a, w, dy, offs = problem(rows, experts, n, k)
        m = a.shape[0]
        a8, w8, dy8 = fp8(a), fp8(w), fp8(dy)
        w8_t = w8.permute(2, 0, 1).reshape(k, experts * n).contiguous()  # (K, G*N)
        a8_t, dy8_t = a8.t().contiguous(), dy8.t().contiguous()
        da = torch.rand(experts, device="cuda") * 0.01 + 1e-3
        db = torch.rand(experts, device="cuda") * 0.01 + 1e-3
        outs = {"fwd": lambda: torch.empty(m, n, device="cuda", dtype=torch.bfloat16),
                "dgrad": lambda: torch.empty(m, k, device="cuda", dtype=torch.bfloat16),
                "wgrad": lambda: torch.empty(experts, n, k, device="cuda",
                                             dtype=torch.bfloat16)}

        def call(direction, cfg):
            out = outs[direction]()
            if direction == "fwd":
                return launch(a8, w8, da, db, offs, out, False, w8.stride(), (0, *out.stride()),
                              cfg)
            if direction == "dgrad":
                return launch(dy8, w8_t, da, db, offs, out, False, (n, experts * n, 1),
                              (0, *out.stride()), cfg)
            return launch(dy8_t, a8_t, da, db, offs, out, True, (0, *a8_t.stride()),
                          out.stride(), cfg)

        def reference(direction):
            out, start = outs[direction](), 0
            for g, end in enumerate(offs.tolist()):
                sa, sb = da[g].clone(), db[g].clone()  # cuBLAS wants aligned scale pointers
                if direction == "fwd" and end > start:
                    out[start:end] = torch._scaled_mm(a8[start:end], w8[g].t(), sa, sb,
                                                      out_dtype=torch.bfloat16)
                elif direction == "dgrad" and end > start:
                    out[start:end] = torch._scaled_mm(dy8[start:end],
                                                      w8_t[:, g * n:(g + 1) * n].t(), sa, sb,
                                                      out_dtype=torch.bfloat16)
                elif direction == "wgrad":
                    out[g] = (torch._scaled_mm(dy8_t[:, start:end], a8_t[:, start:end].t(),
                                               sa, sb, out_dtype=torch.bfloat16)
                              if end > start else 0)
                start = end
            return out

        flop = 2 * m * n * k
        for direction in ("fwd", "dgrad", "wgrad"):
            ref = reference(direction)
            for cfg in configs:
                try:
                    t = timed(lambda: call(direction, cfg))
                except Exception as exc:  # noqa: BLE001 - a config that does not compile
                    print(f"{name:8s} {label:8s} {direction:6s} cfg {cfg}: failed "
                          f"{type(exc).__name__}: {str(exc)[:150]}")
                    continue
                print(f"{name:8s} {label:8s} {direction:6s} cfg {cfg}: "
                      f"{flop / t / 1e9:6.0f} TFLOP/s ({t:.3f} ms), bits off vs cuBLAS "
                      f"{bits_off(call(direction, cfg), ref)} of {ref.numel()}")


#: (BM, BN, warps, stages, bands[, BK]); the first is the launcher's
CONFIGS = [(128, 128, 8, 4, 8), (128, 128, 8, 3, 8), (64, 128, 4, 4, 8), (64, 128, 4, 3, 8),
           (64, 128, 4, 5, 8), (128, 64, 4, 4, 8), (64, 256, 8, 3, 8), (64, 256, 8, 4, 8),
           (64, 128, 4, 4, 4), (64, 128, 8, 4, 8)]
#: ``--persistent``: the non-persistent kernel's config, then the persistent kernel's (BM,
#: BN, warps, stages, bands, BK, programs per SM)
PERSISTENT = [(128, 128, 8, 4, 8), (128, 128, 8, 4, 8, 128, 1), (128, 128, 8, 3, 8, 128, 1),
              (64, 128, 4, 4, 8, 128, 2), (128, 128, 8, 4, 4, 128, 1)]
#: the same for ``--bf16`` (BK 64); the first is the launcher's
BF16_CONFIGS = [(128, 256, 8, 3, 8, 64), (128, 128, 8, 4, 8, 64), (128, 256, 8, 4, 8, 64),
                (128, 128, 4, 4, 8, 64), (128, 128, 8, 3, 8, 128), (64, 256, 4, 4, 8, 64),
                (128, 128, 8, 5, 8, 64)]


def bf16_run(name, tokens, configs):
    """The kernel over bf16 operands (one factor a group) in each config, against bf16
    ``torch._grouped_mm``, per direction: ms and TFLOP/s."""
    hidden, experts, topk, ffn = SHAPES[name]
    for label, n, k in (("gate/up", 2 * ffn, hidden), ("down", hidden, ffn)):
        a, w, dy, offs = problem(tokens * topk, experts, n, k)
        m = a.shape[0]
        w_t = w.permute(2, 0, 1).reshape(k, experts * n).contiguous()  # (K, G*N)
        a_t, dy_t = a.t().contiguous(), dy.t().contiguous()
        ones = torch.ones(experts, device="cuda")
        flop = 2 * m * n * k

        def call(direction, cfg):
            if direction == "fwd":
                out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
                return launch(a, w, ones, ones, offs, out, False, w.stride(),
                              (0, *out.stride()), cfg)
            if direction == "dgrad":
                out = torch.empty(m, k, device="cuda", dtype=torch.bfloat16)
                return launch(dy, w_t, ones, ones, offs, out, False, (n, experts * n, 1),
                              (0, *out.stride()), cfg)
            out = torch.empty(experts, n, k, device="cuda", dtype=torch.bfloat16)
            return launch(dy_t, a_t, ones, ones, offs, out, True, (0, *a_t.stride()),
                          out.stride(), cfg)

        torch_calls = {"fwd": lambda: torch._grouped_mm(a, w.transpose(1, 2), offs=offs),
                       "dgrad": lambda: torch._grouped_mm(dy, w, offs=offs),
                       "wgrad": lambda: torch._grouped_mm(dy_t, a, offs=offs)}
        for direction in ("fwd", "dgrad", "wgrad"):
            t = timed(torch_calls[direction])
            print(f"{name:8s} {label:8s} {direction:6s} torch._grouped_mm: "
                  f"{flop / t / 1e9:6.0f} TFLOP/s ({t:.3f} ms)")
            for cfg in configs:
                t = timed(lambda: call(direction, cfg))
                print(f"{name:8s} {label:8s} {direction:6s} cfg {cfg}: "
                      f"{flop / t / 1e9:6.0f} TFLOP/s ({t:.3f} ms)")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="mixtral,qwen3")
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--triton", action="store_true", help="probe lowprec's Triton kernel")
    ap.add_argument("--bf16", action="store_true",
                    help="the kernel over bf16 operands against torch._grouped_mm")
    ap.add_argument("--persistent", action="store_true",
                    help="lowprec's kernel against its persistent form in several configs")
    ap.add_argument("--both", action="store_true",
                    help="torch's grouped GEMMs, then lowprec's kernel in its one config")
    args = ap.parse_args()
    torch.manual_seed(0)
    for name in args.shapes.split(","):
        if args.bf16:
            bf16_run(name, args.tokens, BF16_CONFIGS)
            continue
        if args.persistent:
            triton_run(name, args.tokens, PERSISTENT)
            continue
        if args.triton or args.both:
            triton_run(name, args.tokens, CONFIGS[:1] if args.both else CONFIGS)
        if not args.triton:
            run(name, args.tokens)


if __name__ == "__main__":
    main()
