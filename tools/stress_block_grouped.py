"""Repeats the grouped block-scaled FP8 GEMM (``gemm/block_grouped.py``) of each kernel
config on the same seeded data many times and counts the runs whose output differs from
cuBLAS's per-group block-scaled GEMM: a race shows as a run-to-run difference that one
test run may miss. ``--kernels`` takes names of ``KERNELS`` or configs BN/STAGES/OVERLAP/
GROUP_M/warps (one the launcher refuses raises). Needs a Hopper GPU."""

from __future__ import annotations

import argparse

import torch

import lowprec
from lowprec.gemm import block_grouped
from lowprec.kernels import tuning

E4M3 = torch.float8_e4m3fn
KERNELS = {"triton": None, "gluon_small": (128, 2, False, 8, 4),
           "gluon_large": (128, 4, True, 8, 8), "gluon_ws": (128, 3, 2, 8, 4)}


def outputs(q, x, w, dy, sizes, w_dim, out_dtype):
    num, n, k = w.shape
    offs = torch.tensor(sizes, device="cuda").cumsum(0).to(torch.int32)
    xq, dyq = q[0].quantize(x), q[2].quantize(dy)
    wq = q[1].quantize(w.reshape(-1, k))
    if w_dim == 2:
        w_dec = wq.decode_scale("rowwise").view(num, n // 128, k // 128)
        w_tdec = wq.decode_scale("columnwise").view(k // 128, num, n // 128).permute(1, 0, 2)
        rows = 128
    else:
        w_dec = wq.decode_scale("rowwise").t().reshape(num, n, k // 128)
        w_tdec = wq.decode_scale("columnwise").t().reshape(k, num, n // 128).permute(1, 0, 2)
        rows = 1
    y = block_grouped.rows_by_experts(xq.rowwise_data, xq.decode_scale("rowwise").t(),
                                      wq.rowwise_data.view(num, n, k), w_dec, offs, 1, rows,
                                      out_dtype)
    dx = block_grouped.rows_by_experts(dyq.rowwise_data, dyq.decode_scale("rowwise").t(),
                                       wq.columnwise_data.view(k, num, n).permute(1, 0, 2),
                                       w_tdec, offs, 1, rows, out_dtype)
    dw = block_grouped.wgrad(dyq.columnwise_data, dyq.decode_scale("columnwise").t(),
                             xq.columnwise_data, xq.decode_scale("columnwise").t(), offs,
                             out_dtype)
    return {"y": y, "dx": dx, "dw": dw}


def reference(q, x, w, dy, sizes, out_dtype):
    ys, dxs, dws, start = [], [], [], 0
    for g, m in enumerate(sizes):
        wg = q[1].quantize(w[g])
        xg, dyg = q[0].quantize(x[start:start + m]), q[2].quantize(dy[start:start + m])
        if m:
            ys.append(lowprec.gemm.gemm(xg, "rowwise", wg, "rowwise", out_dtype=out_dtype))
            dxs.append(lowprec.gemm.gemm(dyg, "rowwise", wg, "columnwise", out_dtype=out_dtype))
            dws.append(lowprec.gemm.gemm(dyg, "columnwise", xg, "columnwise",
                                         out_dtype=out_dtype))
        else:
            dws.append(torch.zeros(w.shape[1:], dtype=out_dtype, device="cuda"))
        start += m
    return {"y": torch.cat(ys), "dx": torch.cat(dxs), "dw": torch.stack(dws)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--kernels", default=",".join(KERNELS))
    args = ap.parse_args()
    shapes = [((384, 0, 128, 640, 256), 512, 512), ((2048, 1536, 0, 3072, 768), 2048, 1536)]
    for w_dim in (1, 2):
        q = [lowprec.Float8BlockQuantizer(E4M3, block_scaling_dim=d) for d in (1, w_dim, 1)]
        for sizes, k, n in shapes:
            gen = torch.Generator().manual_seed(0)
            m = sum(sizes)
            x = torch.randn(m, k, generator=gen).bfloat16().cuda()
            w = (torch.randn(len(sizes), n, k, generator=gen) * 0.05).bfloat16().cuda()
            dy = torch.randn(m, n, generator=gen).bfloat16().cuda()
            for out_dtype in (torch.float32, torch.bfloat16):
                ref = reference(q, x, w, dy, sizes, out_dtype)
                for name in args.kernels.split(","):
                    cfg = KERNELS[name] if name in KERNELS else tuple(
                        int(v) for v in name.split("/"))
                    every = dict.fromkeys(tuning.tuning.block_grouped_gluon_configs, cfg)
                    bad = {key: 0 for key in ref}
                    worst = {key: 0 for key in ref}
                    with tuning.override(block_grouped_gluon=cfg is not None,
                                         block_grouped_gluon_configs=every):
                        for _ in range(args.reps):
                            got = outputs(q, x, w, dy, sizes, w_dim, out_dtype)
                            for key in ref:
                                off = int((got[key] != ref[key]).sum())
                                bad[key] += off > 0
                                worst[key] = max(worst[key], off)
                    print(f"w_dim {w_dim} sizes {sizes} K {k} N {n} {str(out_dtype)[6:]:8s} "
                          f"{name:15s} runs off (of {args.reps}): " + ", ".join(
                              f"{key} {bad[key]} (worst {worst[key]} elements)" for key in ref),
                          flush=True)


if __name__ == "__main__":
    main()
