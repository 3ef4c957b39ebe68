"""Probe of the grouped block-scaled FP8 GEMM kernel (``gemm/_block_grouped_kernels.py``):
bit-identity against cuBLAS's block-scaled ``torch._scaled_mm``
(one group), and GPU time of tile configs at the MoE layer's shapes against bf16
``torch._grouped_mm`` and a per-expert cuBLAS loop. Needs a Hopper GPU."""

from __future__ import annotations

import argparse

import torch
import triton

from lowprec import Float8BlockQuantizer
from lowprec.gemm import block_grouped
from lowprec.gemm._block_grouped_kernels import block_grouped_gemm_kernel
from lowprec.gemm.dispatch import gemm
from lowprec.kernels import tuning


def launch(a, s_a, b, s_b, da, s_da, db, s_db, out, s_o, offs, m, n, k, g, group_k,
           a_rows, b_rows, cfg):
    bm, bn, warps, stages, gm = cfg
    gp = triton.next_power_of_2(max(g, 2))
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn), g if group_k else 1)
    block_grouped_gemm_kernel[grid](
        a, b, da, db, out, offs, m, n, k, g, *s_a, *s_b, *s_da, *s_db, *s_o,
        GROUP_K=group_k, A_ROWS=a_rows, B_ROWS=b_rows, BM=bm, BN=bn, BK=128, GP=gp,
        GROUP_M=gm, num_warps=warps, num_stages=stages)


def q1(x, **usage):
    q = Float8BlockQuantizer(block_scaling_dim=1)
    q.set_usage(**usage)
    return q.quantize(x)


def q2(w):
    return Float8BlockQuantizer(block_scaling_dim=2).quantize(w)


def bits_equal(a, b):
    return int((a.view(torch.int16) != b.view(torch.int16)).sum())


def identity(cfg):
    torch.manual_seed(0)
    m, k, n = 1024, 2048, 1536
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16) * 1e-3
    xq, wq, dyq = q1(x), q2(w), q1(dy)
    offs = torch.tensor([m], dtype=torch.int32, device="cuda")
    ref = gemm(xq, "rowwise", wq, "rowwise", out_dtype=torch.bfloat16)
    ref_d = gemm(dyq, "rowwise", wq, "columnwise", out_dtype=torch.bfloat16)
    ref_w = gemm(dyq, "columnwise", xq, "columnwise", out_dtype=torch.bfloat16)
    exact = (xq.dequantize().float() @ wq.dequantize().float().t())
    out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    da, db = xq.decode_scale("rowwise"), wq.decode_scale("rowwise")
    launch(xq.rowwise_data, (k, 1), wq.rowwise_data, (0, k, 1), da, (1, m),
           db, (0, k // 128, 1), out, (0, n, 1), offs, m, n, k, 1, False, 1, 128, cfg)
    outd = torch.empty(m, k, device="cuda", dtype=torch.bfloat16)
    dda, ddb = dyq.decode_scale("rowwise"), wq.decode_scale("columnwise")
    launch(dyq.rowwise_data, (n, 1), wq.columnwise_data, (0, n, 1), dda, (1, m),
           ddb, (0, n // 128, 1), outd, (0, k, 1), offs, m, k, n, 1, False, 1, 128, cfg)
    outw = torch.empty(1, n, k, device="cuda", dtype=torch.bfloat16)
    wda, wdb = dyq.decode_scale("columnwise"), xq.decode_scale("columnwise")
    launch(dyq.columnwise_data, (m, 1), xq.columnwise_data, (0, m, 1), wda, (1, n),
           wdb, (0, 1, k), outw, (n * k, k, 1), offs, n, k, m, 1, True, 1, 1, cfg)
    err = float((out.float() - exact).abs().max())
    print(f"differing bf16 elements against cuBLAS: fwd {bits_equal(out, ref)} / {m * n}, "
          f"dgrad {bits_equal(outd, ref_d)} / {m * k}, wgrad {bits_equal(outw[0], ref_w)} / "
          f"{n * k}; max |triton - fp32 exact| {err:.3e}, "
          f"cublas {float((ref.float() - exact).abs().max()):.3e}", flush=True)


def timed(fn, reps=20):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        ts.append(s.elapsed_time(e))
    return sorted(ts)[len(ts) // 2]


def speed(name, tokens, topk, g, hidden, ffn, configs):
    torch.manual_seed(0)
    logits = torch.randn(tokens, g, device="cuda")
    sel = logits.topk(topk, dim=1).indices.flatten()
    sizes = torch.bincount(sel, minlength=g)
    padded = (sizes + 127) // 128 * 128
    mp = int(padded.sum())
    offs = torch.cumsum(padded, 0).to(torch.int32)
    for what, k, n in (("gate_up", hidden, 2 * ffn), ("down", ffn, hidden)):
        x = torch.randn(mp, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(g * n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        dy = torch.randn(mp, n, device="cuda", dtype=torch.bfloat16) * 1e-3
        xq, wq, dyq = q1(x), q2(w), q1(dy)
        w3 = w.view(g, n, k)
        flops = 2 * mp * n * k
        t_bf = timed(lambda: torch._grouped_mm(x, w3.transpose(1, 2), offs=offs))
        t_bfw = timed(lambda: torch._grouped_mm(dy.t(), x, offs=offs))
        host = padded.tolist()
        xs = [q1(t) for t in torch.split(x, host)]
        wsq = [q2(w3[i]) for i in range(g)]
        dys = [q1(t) for t in torch.split(dy, host)]
        t_loop = timed(lambda: [gemm(a, "rowwise", b, "rowwise", out_dtype=torch.bfloat16)
                                for a, b in zip(xs, wsq)], reps=5)
        t_loopw = timed(lambda: [gemm(d, "columnwise", a, "columnwise", out_dtype=torch.bfloat16)
                                 for d, a in zip(dys, xs)], reps=5)
        print(f"{name} {what} (padded rows {mp}, K {k}, N {n}): bf16 grouped fwd {t_bf:.3f} ms "
              f"({flops / t_bf / 1e9:.0f} TFLOP/s), wgrad {t_bfw:.3f}; cuBLAS per-expert loop "
              f"fwd {t_loop:.3f}, wgrad {t_loopw:.3f}", flush=True)
        da, db = xq.decode_scale("rowwise"), wq.decode_scale("rowwise")
        dda, ddb = dyq.decode_scale("rowwise"), wq.decode_scale("columnwise")
        wda, wdb = dyq.decode_scale("columnwise"), xq.decode_scale("columnwise")
        out = torch.empty(mp, n, device="cuda", dtype=torch.bfloat16)
        outd = torch.empty(mp, k, device="cuda", dtype=torch.bfloat16)
        outw = torch.empty(g, n, k, device="cuda", dtype=torch.bfloat16)
        for cfg in configs:
            try:
                f = timed(lambda: launch(xq.rowwise_data, (k, 1), wq.rowwise_data, (n * k, k, 1),
                                         da, (1, mp), db, ((n // 128) * (k // 128), k // 128, 1),
                                         out, (0, n, 1), offs, mp, n, k, g, False, 1, 128, cfg))
                d = timed(lambda: launch(dyq.rowwise_data, (n, 1), wq.columnwise_data,
                                         (n, g * n, 1), dda, (1, mp), ddb,
                                         (n // 128, g * n // 128, 1), outd, (0, k, 1), offs,
                                         mp, k, n, g, False, 1, 128, cfg))
                wg = timed(lambda: launch(dyq.columnwise_data, (mp, 1), xq.columnwise_data,
                                          (0, mp, 1), wda, (1, n), wdb, (0, 1, k), outw,
                                          (n * k, k, 1), offs, n, k, mp, g, True, 1, 1, cfg))
            except Exception as exc:  # noqa: BLE001 - a config that does not fit
                print(f"  cfg {cfg}: {type(exc).__name__} {str(exc)[:120]}")
                continue
            print(f"  cfg {cfg}: fwd {f:.3f} ms ({flops / f / 1e9:.0f}), dgrad {d:.3f} "
                  f"({flops / d / 1e9:.0f}), wgrad {wg:.3f} ({flops / wg / 1e9:.0f}); "
                  f"vs bf16 fwd {t_bf / f:.2f}x, wgrad {t_bfw / wg:.2f}x", flush=True)


def gluon_speed(name, tokens, topk, g, hidden, ffn, configs):
    """The Gluon kernel's configs through the launcher (``block_grouped``'s ops, as the
    grouped block path calls them) against the Triton kernel: differing output bits and
    GPU time of forward, dgrad and wgrad."""
    torch.manual_seed(0)
    sel = torch.randn(tokens, g, device="cuda").topk(topk, dim=1).indices.flatten()
    sizes = torch.bincount(sel, minlength=g)
    sizes[0] = 0  # an empty expert
    padded = (sizes + 127) // 128 * 128
    mp = int(padded.sum())
    offs = torch.cumsum(padded, 0).to(torch.int32)  # group ends at multiples of 128
    bf = torch.bfloat16
    for what, k, n in (("gate_up", hidden, 2 * ffn), ("down", ffn, hidden)):
        x = torch.randn(mp, k, device="cuda", dtype=bf)
        w = torch.randn(g * n, k, device="cuda", dtype=bf) * 0.02
        dy = torch.randn(mp, n, device="cuda", dtype=bf) * 1e-3
        xq, wq, dyq = q1(x), q2(w), q1(dy)
        flops = 2 * mp * n * k
        w_dec = wq.decode_scale("rowwise").view(g, n // 128, k // 128)
        w_t = wq.columnwise_data.view(k, g, n).permute(1, 0, 2)
        w_tdec = wq.decode_scale("columnwise").view(k // 128, g, n // 128).permute(1, 0, 2)
        calls = {
            "fwd": lambda: block_grouped.rows_by_experts(
                xq.rowwise_data, xq.decode_scale("rowwise").t(), wq.rowwise_data.view(g, n, k),
                w_dec, offs, 1, 128, bf),
            "dgrad": lambda: block_grouped.rows_by_experts(
                dyq.rowwise_data, dyq.decode_scale("rowwise").t(), w_t, w_tdec, offs, 1, 128,
                bf),
            "wgrad": lambda: block_grouped.wgrad(
                dyq.columnwise_data, dyq.decode_scale("columnwise").t(), xq.columnwise_data,
                xq.decode_scale("columnwise").t(), offs, bf),
        }
        with tuning.override(block_grouped_gluon=False):
            ref = {key: fn() for key, fn in calls.items()}
            t_ref = {key: timed(fn) for key, fn in calls.items()}
        print(f"{name} {what} (padded rows {mp}, K {k}, N {n}): triton "
              + ", ".join(f"{key} {t:.3f} ms ({flops / t / 1e9:.0f})"
                          for key, t in t_ref.items()), flush=True)
        for cfg in configs:
            try:
                every = dict.fromkeys(tuning.tuning.block_grouped_gluon_configs, cfg)
                with tuning.override(block_grouped_gluon=True,
                                     block_grouped_gluon_configs=every):
                    got = {key: fn() for key, fn in calls.items()}
                    t = {key: timed(fn) for key, fn in calls.items()}
            except Exception as exc:  # noqa: BLE001 - a config that does not fit
                print(f"  gluon {cfg}: {type(exc).__name__} {str(exc)[:300]}", flush=True)
                continue
            diff = {key: bits_equal(got[key], ref[key]) for key in calls}
            print(f"  gluon {cfg}: " + ", ".join(
                f"{key} {t[key]:.3f} ms ({flops / t[key] / 1e9:.0f}, {t_ref[key] / t[key]:.2f}x"
                f", {diff[key]} bits off)" for key in calls), flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--skip-speed", action="store_true")
    ap.add_argument("--gluon", action="store_true",
                    help="the Gluon kernel's configs against the Triton kernel only")
    ap.add_argument("--configs", type=lambda v: tuple(int(x) for x in v.split(",")),
                    nargs="*", help="Gluon configs to time, each BN,STAGES,OVERLAP,GROUP_M,"
                    "warps (ints); OVERLAP 2 runs the warp-specialized kernel")
    args = ap.parse_args()
    print(torch.cuda.get_device_name(), torch.__version__, triton.__version__)
    if args.gluon:
        configs = [tuple(c) for c in args.configs] if args.configs else [
            (128, 2, False, 8, 4), (128, 3, False, 8, 8), (128, 4, False, 8, 8),
            (128, 5, False, 8, 8), (128, 4, False, 16, 8), (128, 3, True, 8, 8),
            (128, 4, True, 8, 8)]
        gluon_speed("qwen3", 16384, 8, 128, 2048, 768, configs)
        gluon_speed("mixtral", 16384, 2, 8, 4096, 14336, configs)
        return
    identity((128, 128, 8, 3, 8))
    if args.skip_speed:
        return
    configs = [(128, 128, 8, 3, 8), (128, 128, 8, 4, 8), (64, 128, 4, 4, 8),
               (128, 64, 4, 4, 8)]
    speed("qwen3", 16384, 8, 128, 2048, 768, configs)
    speed("mixtral", 16384, 2, 8, 4096, 14336, configs)


if __name__ == "__main__":
    main()
