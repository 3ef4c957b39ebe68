"""GPU check of the NVFP4 Triton kernels: bit-exactness against the reference, then bandwidth.

    python benchmarks/check_kernels_nvfp4.py [--jobs 12] [--no-sweep] [--out DIR]

1. Bit-exactness. Every case quantizes one input twice on the GPU, through the kernels and
   through the pure-torch reference (``lowprec.kernels.reference_only``), with the same
   ``torch.manual_seed`` before each, so stochastic rounding draws the same uniforms. All
   inner tensors are compared byte for byte (codes, E4M3 scale bytes, fp32 global scales);
   outputs land in memory poisoned beforehand. ``dequantize_unscaled_bf16`` is checked
   against its torch fallback, and ``(q*d)/S`` against ``dequantize_stored``. Cases cover
   bf16/fp16/fp32, 1x16 and 16x16 blocks, RHT, stochastic rounding, each usage alone,
   M not a multiple of 16 (rowwise only), K not a multiple of 16 (columnwise only), 3-D and
   non-contiguous inputs, zero / NaN / Inf / signed-zero blocks, tiny, subnormal and
   saturating values. Cases run in parallel worker processes (compilation dominates).
2. torch.compile(fullgraph=True) through the custom op, and torch.library.opcheck.
3. Bandwidth for a 16384x4096 bf16 input: kernel time (amax pass + quantize pass, SR keys
   given) for several settings, the full ``quantize()`` with its key draws, the
   reference path, the bf16 dequantization, against a device-to-device copy. Useful bytes =
   input read once + outputs written (the SR uniforms are computed in registers); "moved" counts what the passes read
   (the amax pass, the rowwise and the columnwise kernel each read the input).

The last lines printed are a compact summary table.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

ROW_CONFIGS = [(8, 16), (8, 32), (16, 16)]     # (KB, RB)
COL_CONFIGS = [4, 2, 8]                         # KW
FLAT_CONFIGS = [4096, 8192, 16384]              # amax elements per program
BIG = (16384, 4096)


def apply_config(cfg):
    from lowprec.formats.nvfp4 import launch
    if cfg is None:
        return
    kind, val = cfg
    if kind == "row":
        launch.CONFIG["row"].update(KB=val[0], RB=val[1])
    elif kind == "col":
        launch.CONFIG["col"].update(KW=val)
    elif kind == "flat":
        launch.CONFIG["amax"].update(FLAT=val)


# ---- inputs ---------------------------------------------------------------------------------
def make_input(dist: str, shape, dtype, seed: int) -> torch.Tensor:
    g = torch.Generator(device="cpu").manual_seed(seed)
    n = 1
    for s in shape:
        n *= s
    k = shape[-1]
    m = n // k
    x = torch.randn(m, k, generator=g, dtype=torch.float64)
    if dist == "wide":
        x = x * torch.exp(torch.randn(m, k, generator=g, dtype=torch.float64) * 4)
    elif dist == "tiny":
        x = x * 1e-30
    elif dist == "subnormal":  # fp32 only: subnormal values and tiny blocks
        x = x * 1e-39
        x[: m // 2] *= 1e-4
        x[:, :16] *= 1e5
    elif dist == "saturate":
        big = {torch.float32: 3e38, torch.bfloat16: 3e38, torch.float16: 6e4}[dtype]
        x = x * big / 3   # some elements overflow to inf in the input dtype
    elif dist == "special":
        x = x * 10
        x[0, :16] = 0.0                                  # zero 1x16 block
        if m >= 32 and k >= 32:
            x[16:32, 16:32] = 0.0                        # zero 16x16 block
        if m >= 48 and k >= 48:
            z = torch.zeros(16, 3, dtype=torch.float64)  # signed zeros in a nonzero 16x16 block
            z[torch.rand(16, 3, generator=g) < 0.5] = -0.0
            x[32:48, 33:36] = z
            x[32:48, 40:48] = -0.0
        x[min(2, m - 1), min(5, k - 1)] = float("nan")
        x[min(5, m - 1), min(20, k - 1)] = float("inf")
        x[min(17, m - 1), min(40, k - 1)] = -float("inf")
        x[min(3, m - 1), :] = -0.0
        x[min(4, m - 1), ::3] = 1e-45
    return x.to(dtype).reshape(shape).cuda()


def poison():
    """Fill freed allocator blocks with 0xAB so unwritten outputs show up as mismatches."""
    bufs = [torch.empty(1 << 19, dtype=torch.uint8, device="cuda").fill_(0xAB) for _ in range(32)]
    big = torch.empty(256 << 20, dtype=torch.uint8, device="cuda").fill_(0xAB)
    del bufs, big


# ---- one case ---------------------------------------------------------------------------------
def _bytes(t):
    if t is None:
        return None
    return t.view(torch.uint8) if t.element_size() == 1 else t.view(torch.int32)


def compare(qk, qr) -> tuple[bool, bool, str]:
    """(exact, nan_aware_ok, detail)."""
    exact, lenient, detail = True, True, []
    for name in qr._inner:
        a, b = getattr(qk, name), getattr(qr, name)
        if (a is None) != (b is None):
            return False, False, f"{name}: presence differs"
        if a is None:
            continue
        if a.shape != b.shape or a.dtype != b.dtype:
            return False, False, f"{name}: {a.shape}/{a.dtype} vs {b.shape}/{b.dtype}"
        ua, ub = _bytes(a), _bytes(b)
        if not torch.equal(ua, ub):
            exact = False
            bad = (ua != ub)
            if name.endswith("_data"):
                # NaN blocks may legitimately differ inside (their scale says NaN)
                usage = name.split("_")[0]
                sc = getattr(qr, f"{usage}_scale").view(torch.uint8)
                nanb = (sc & 0x7F) == 0x7F
                if qr.with_2d_quantization:
                    nanb = nanb.repeat_interleave(16, 0)
                nanb = nanb.repeat_interleave(8, 1)[: bad.shape[0], : bad.shape[1]]
                nbad = int((bad & ~nanb).sum())
            else:
                nbad = int(bad.sum())
            if nbad:
                lenient = False
            idx = bad.nonzero()[0].tolist()
            detail.append(f"{name}: {int(bad.sum())} differ ({nbad} outside NaN blocks), first "
                          f"{idx}: {ua[tuple(idx)].item()} vs {ub[tuple(idx)].item()}")
    return exact, lenient, "; ".join(detail)


def check_dequant(qt) -> tuple[bool, str]:
    from lowprec.formats.nvfp4 import launch
    ok, msg = True, []
    for usage in ("rowwise", "columnwise"):
        if not qt.has_usage(usage):
            continue
        out, s = launch.dequantize_unscaled_bf16(qt, usage)
        ref = launch._dequantize_unscaled_torch(getattr(qt, f"{usage}_data"),
                                                getattr(qt, f"{usage}_scale"),
                                                qt.with_2d_quantization)
        nan_o, nan_r = torch.isnan(out), torch.isnan(ref)
        same = torch.equal(nan_o, nan_r) and torch.equal(
            out.view(torch.int16)[~nan_o], ref.view(torch.int16)[~nan_r])
        full = qt.dequantize_stored(usage)
        nf = torch.isnan(full)
        same2 = torch.equal(nf, nan_o) and torch.equal((out.float() / s)[~nf], full[~nf])
        if not (same and same2):
            ok = False
            msg.append(f"dequant {usage}: bf16 {same} scaled {same2}")
    return ok, "; ".join(msg)


def run_case(case: dict) -> dict:
    from lowprec.formats.nvfp4 import NVFP4Quantizer
    from lowprec.kernels import reference_only
    t0 = time.time()
    res = dict(case)
    try:
        apply_config(case.get("config"))
        x = make_input(case["dist"], case["shape"], getattr(torch, case["dtype"]), case["seed"])
        if case.get("layout") == "transposed":
            x = x.reshape(-1, x.shape[-1]).t().contiguous().t()     # stride (1, M)
        elif case.get("layout") == "rowslice":
            x = torch.cat([x, x], dim=-1)[..., : case["shape"][-1]]  # row stride 2K
        q = NVFP4Quantizer(with_rht=case["rht"], with_2d_quantization=case["two_d"],
                           stochastic_rounding=case["sr"])
        q.set_usage(rowwise=case["row"], columnwise=case["col"])
        poison()
        torch.manual_seed(case["seed"] + 1)
        qk = q.quantize(x)
        with reference_only():
            torch.manual_seed(case["seed"] + 1)
            qr = q.quantize(x)
        torch.cuda.synchronize()
        res["exact"], res["nan_ok"], res["detail"] = compare(qk, qr)
        res["dequant_ok"], dmsg = check_dequant(qk)
        if dmsg:
            res["detail"] = (res["detail"] + "; " + dmsg).strip("; ")
    except Exception as e:  # noqa: BLE001
        res["exact"] = res["nan_ok"] = res["dequant_ok"] = False
        res["detail"] = f"EXCEPTION {type(e).__name__}: {e}\n{traceback.format_exc()[-1500:]}"
    res["secs"] = round(time.time() - t0, 1)
    return res


def run_group(cases):
    return [run_case(c) for c in cases]


# ---- the case list ----------------------------------------------------------------------------
def build_cases(quick: bool) -> list[dict]:
    cases = []
    seed = [1000]

    def add(shape, dtype, dist, row=True, col=True, rht=False, two_d=False, sr=False, **kw):
        seed[0] += 1
        cases.append(dict(shape=tuple(shape), dtype=dtype, dist=dist, row=row, col=col, rht=rht,
                          two_d=two_d, sr=sr, seed=seed[0], **kw))

    flags8 = [(r, t, s) for r in (False, True) for t in (False, True) for s in (False, True)]
    shapes = [(256, 512), (3, 80, 144), (1040, 272)]
    for rht, two_d, sr in flags8:
        for shape in shapes[: 2 if quick else 3]:
            for dist in ("normal", "wide", "special"):
                add(shape, "bfloat16", dist, rht=rht, two_d=two_d, sr=sr)
    for dtype, dists, flags in (
            ("float32", ("normal", "special", "tiny", "subnormal", "saturate"),
             [(True, False, False), (False, True, True), (True, True, True),
              (False, False, False)]),
            ("float16", ("normal", "special", "saturate"),
             [(True, False, False), (False, False, True), (False, True, False)]),
            ("bfloat16", ("tiny", "saturate"), [(True, False, True), (False, True, False)])):
        for rht, two_d, sr in flags:
            for shape in ((256, 512), (48, 96)):
                for dist in dists:
                    add(shape, dtype, dist, rht=rht, two_d=two_d, sr=sr)
    # one usage alone; M % 16 != 0 (rowwise only), K % 16 != 0 (columnwise only)
    for shape in ((7, 32), (33, 48), (1000, 80), (5, 3, 64)):
        for rht, sr in ((False, False), (True, True), (False, True)):
            add(shape, "bfloat16", "special", col=False, rht=rht, sr=sr)
    for shape in ((48, 40), (96, 10), (1024, 100), (2, 64, 24)):
        for rht, sr in ((True, False), (True, True), (False, False)):
            add(shape, "bfloat16", "special", row=False, rht=rht, sr=sr)
    add((256, 512), "bfloat16", "normal", row=False, two_d=True, rht=True, sr=True)
    add((256, 512), "float32", "special", col=False, two_d=True, sr=True)
    # non-contiguous inputs
    for layout in ("transposed", "rowslice"):
        add((512, 256), "bfloat16", "special", rht=True, sr=True, layout=layout)
        add((512, 256), "float32", "normal", two_d=True, layout=layout)
    # multi-tile sizes (atomics across many programs, int64 offsets path)
    add((4096, 4096), "bfloat16", "wide", rht=True, sr=True)
    add((4096, 4096), "bfloat16", "normal", two_d=True)
    add((2048, 6144), "float32", "special", rht=True)
    if not quick:
        add(BIG, "bfloat16", "normal", rht=True, sr=True)
        # every tile config (bit-exactness must not depend on it)
        for cfg in [("row", c) for c in ROW_CONFIGS[1:]] + [("col", c) for c in COL_CONFIGS[1:]] \
                + [("flat", c) for c in FLAT_CONFIGS[1:]]:
            add((1040, 272), "bfloat16", "special", rht=True, sr=True, config=cfg)
            add((1040, 272), "bfloat16", "special", two_d=True, config=cfg)
            add((1000, 80), "float32", "wide", col=False, sr=True, config=cfg)
    return cases


TIMING_VARIANTS = [  # (row, col, rht, two_d, sr)
    (True, True, False, False, False),
    (True, True, True, False, False),
    (True, True, True, False, True),
    (True, True, False, True, False),
    (True, False, False, False, False),
    (False, True, False, False, False),
    (False, True, True, False, True),
]


def variant_key(c):
    return (c["dtype"], c["row"], c["col"], c["rht"], c["two_d"], c["sr"], c.get("config"),
            c.get("layout"))


# ---- timing -------------------------------------------------------------------------------------
def bench(fn, reps=50):
    import triton.testing
    return triton.testing.do_bench(fn, warmup=10, rep=reps, return_mode="median")


def timing(args, out: dict):
    from lowprec.formats.nvfp4 import NVFP4Quantizer, launch
    from lowprec.kernels import reference_only
    m, k = BIG
    n = m * k
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    y = torch.empty_like(x)
    t_copy = bench(lambda: y.copy_(x))
    copy_gbs = 2 * x.numel() * 2 / t_copy / 1e6
    rows = [("device copy (bf16 read + write)", t_copy, 4 * n, 4 * n, copy_gbs)]
    out["_rows"] = rows          # partial results survive a failure further down
    out["copy_gbs"] = copy_gbs
    kr = torch.tensor([11, 12], device="cuda")
    kc = torch.tensor([13, 14], device="cuda")

    def useful(row, col, sr, moved=False):
        # moved: the amax pass, the row and the column kernel each read x
        b = 2 * n * ((1 + int(row) + int(col)) if moved else 1)
        per_dir = n // 2 + n // 16 + 4
        return b + per_dir * (int(row) + int(col))

    def run_variant(v):
        row, col, rht, two_d, sr = v
        return lambda: launch.quantize_2d(x, rowwise=row, columnwise=col, with_rht=rht,
                                          two_d=two_d, key_row=kr if sr and row else None,
                                          key_col=kc if sr and col else None)

    sweep = {}
    if args.sweep:
        row_v = [(True, False, False, False, False), (True, False, False, False, True)]
        col_v = [(False, True, True, False, False), (False, True, True, False, True)]
        for c in ROW_CONFIGS:
            apply_config(("row", c))
            sweep[("row", c)] = [bench(run_variant(v)) for v in row_v]
        best_r = min(ROW_CONFIGS, key=lambda c: sum(sweep[("row", c)]))
        apply_config(("row", best_r))
        for c in COL_CONFIGS:
            apply_config(("col", c))
            sweep[("col", c)] = [bench(run_variant(v)) for v in col_v]
        best_c = min(COL_CONFIGS, key=lambda c: sum(sweep[("col", c)]))
        apply_config(("col", best_c))
        for c in FLAT_CONFIGS:
            apply_config(("flat", c))
            sweep[("flat", c)] = [bench(run_variant(row_v[0]))]
        best_f = min(FLAT_CONFIGS, key=lambda c: sum(sweep[("flat", c)]))
        apply_config(("flat", best_f))
        out["sweep"] = {str(kk): v for kk, v in sweep.items()}
        out["best"] = {"row": best_r, "col": best_c, "flat": best_f}
    names = {TIMING_VARIANTS[0]: "both usages, RNE",
             TIMING_VARIANTS[1]: "both usages, RHT",
             TIMING_VARIANTS[2]: "both usages, RHT + SR",
             TIMING_VARIANTS[3]: "both usages, 16x16 (2D)",
             TIMING_VARIANTS[4]: "rowwise only, RNE",
             TIMING_VARIANTS[5]: "columnwise only, RNE",
             TIMING_VARIANTS[6]: "columnwise only, RHT + SR"}
    for v in TIMING_VARIANTS:
        t = bench(run_variant(v))
        row, col, rht, two_d, sr = v
        rows.append((f"kernels: {names[v]}", t, useful(row, col, sr), useful(row, col, sr, True),
                     useful(row, col, sr) / t / 1e6))
        out.setdefault("moved_gbs", {})[names[v]] = useful(row, col, sr, True) / t / 1e6
    # the amax pass alone (flat; RHT tiles), for the split of the time
    ws = torch.zeros(3, dtype=torch.int32, device="cuda")
    g1 = torch.empty(1, device="cuda")
    g2 = torch.empty(1, device="cuda")
    ca = launch.CONFIG["amax"]
    kern = launch._kernels()._nvfp4_amax_kernel
    for rht in (False, True):
        grid, warps, even = launch.amax_launch(m, k, rht, x.device)

        def amax_only():
            ws.zero_()
            kern[grid](x, m, k, ws, g1, g2, ROW=True, COL=True, RHT=rht, KW=ca["KW"],
                       FLAT=ca["FLAT"], EVEN=even, IDX64=launch._idx64(m, k),
                       num_warps=warps, **launch._LAUNCH_OPTS)
        t = bench(amax_only)
        rows.append((f"amax pass alone ({'plain + RHT' if rht else 'plain'}, incl. memset)", t,
                     2 * n, 2 * n, 2 * n / t / 1e6))
    # full quantize() with its key draws
    q = NVFP4Quantizer(with_rht=True, stochastic_rounding=True)
    t = bench(lambda: q.quantize(x))
    rows.append(("quantize() RHT + SR incl. key draws", t, useful(True, True, True),
                 useful(True, True, True, True), useful(True, True, True) / t / 1e6))
    with reference_only():
        t_ref = bench(lambda: q.quantize(x), reps=20)
    rows.append(("reference path (torch) RHT + SR", t_ref, useful(True, True, True), 0,
                 useful(True, True, True) / t_ref / 1e6))
    qt = NVFP4Quantizer().quantize(x)
    t = bench(lambda: launch.dequantize_unscaled_bf16(qt, "rowwise"))
    b = n // 2 + n // 16 + 2 * n
    rows.append(("dequantize_unscaled_bf16 (rowwise)", t, b, b, b / t / 1e6))
    out["timing"] = [dict(name=r[0], ms=r[1], useful_bytes=r[2], moved_bytes=r[3], gbs=r[4])
                     for r in rows]
    out["copy_gbs"] = copy_gbs
    return rows, copy_gbs


def compile_checks(out: dict) -> list[str]:
    from lowprec.formats.nvfp4 import launch
    msgs = []
    x = torch.randn(256, 128, device="cuda", dtype=torch.bfloat16)

    def f(t):
        return launch.quantize_2d(t, rowwise=True, columnwise=True, with_rht=True, two_d=False)
    try:
        eager = f(x)
        comp = torch.compile(f, fullgraph=True)(x)
        ok = all(torch.equal(_bytes(eager[kk]), _bytes(comp[kk])) for kk in eager)
        msgs.append(f"torch.compile(fullgraph=True) quantize: {'OK' if ok else 'MISMATCH'}")
        out["compile_ok"] = ok
    except Exception as e:  # noqa: BLE001
        msgs.append(f"torch.compile quantize FAILED: {type(e).__name__}: {str(e)[:300]}")
        out["compile_ok"] = False
    try:
        torch.library.opcheck(torch.ops.lowprec.nvfp4_quantize.default,
                              (x, None, None, True, True, True, False))
        torch.library.opcheck(torch.ops.lowprec.nvfp4_quantize.default,
                              (x, torch.tensor([1, 2], device="cuda"), None, True, False, False,
                               True))
        qt = launch.quantize_2d(x, rowwise=True, columnwise=False, with_rht=False, two_d=False)
        torch.library.opcheck(torch.ops.lowprec.nvfp4_dequantize_unscaled_bf16.default,
                              (qt["rowwise_data"], qt["rowwise_scale"].view(torch.uint8), False))
        msgs.append("opcheck: OK")
        out["opcheck_ok"] = True
    except Exception as e:  # noqa: BLE001
        msgs.append(f"opcheck FAILED: {type(e).__name__}: {str(e)[:300]}")
        out["opcheck_ok"] = False
    return msgs


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--jobs", type=int, default=12)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-sweep", dest="sweep", action="store_false")
    ap.add_argument("--no-timing", dest="timing", action="store_false")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--budget", type=float, default=400.0, help="seconds")
    args = ap.parse_args()
    t_start = time.time()
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    import triton
    out["triton"] = triton.__version__
    print(f"device {out['device']}, torch {out['torch']}, triton {out['triton']}", flush=True)

    cases = build_cases(args.quick)
    groups: dict = {}
    for c in cases:
        groups.setdefault(variant_key(c), []).append(c)
    glist = sorted(groups.values(), key=len, reverse=True)
    ctx = mp.get_context("spawn")
    results = []
    with ctx.Pool(args.jobs) as pool:
        for part in pool.imap_unordered(run_group, glist):
            results.extend(part)
    t_checks = time.time() - t_start
    bad = [r for r in results if not (r["exact"] and r["dequant_ok"])]
    out["cases"] = len(results)
    out["exact"] = sum(r["exact"] for r in results)
    out["nan_ok"] = sum(r["nan_ok"] for r in results)
    out["dequant_ok"] = sum(r["dequant_ok"] for r in results)
    out["failures"] = bad
    for r in bad[:25]:
        print("FAIL", {k: r[k] for k in ("shape", "dtype", "dist", "row", "col", "rht", "two_d",
                                         "sr", "secs")}, r.get("config"), r.get("layout"),
              r["detail"][:600], flush=True)
    print(f"checks: {len(results)} cases in {t_checks:.0f}s", flush=True)

    with open(os.path.join(args.out, "check_kernels_nvfp4.json"), "w") as fh:
        json.dump(out, fh, indent=1, default=str)
    if time.time() - t_start > args.budget * 0.55:
        args.sweep = False     # keep inside the time budget
    if time.time() - t_start < args.budget * 0.7:
        msgs = compile_checks(out)
    else:
        msgs = ["compile checks skipped (time)"]
    for mline in msgs:
        print(mline, flush=True)

    rows, copy_gbs = ([], None)
    if args.timing:
        try:
            rows, copy_gbs = timing(args, out)
        except Exception:  # noqa: BLE001
            out["timing_error"] = traceback.format_exc()
            print("TIMING FAILED\n" + out["timing_error"], flush=True)
            rows = out.get("_rows", [])
            copy_gbs = out.get("copy_gbs") or 1.0
    out.pop("_rows", None)
    with open(os.path.join(args.out, "check_kernels_nvfp4.json"), "w") as fh:
        json.dump(out, fh, indent=1, default=str)

    # ---- summary ----
    print()
    print("=" * 100)
    print(f"NVFP4 kernels on {out['device']} (torch {out['torch']}, triton {out['triton']})")
    print(f"bit-exact: {out['exact']}/{out['cases']} cases exact, {out['nan_ok']} exact outside "
          f"NaN blocks, dequant {out['dequant_ok']}/{out['cases']}; "
          + "; ".join(msgs))
    if "sweep" in out:
        print("tile sweep (ms): " + ", ".join(f"{kk}: {'/'.join(f'{t:.3f}' for t in v)}"
                                              for kk, v in out["sweep"].items())
              + f" | chosen {out['best']}")
    if rows:
        print(f"{'16384x4096 bf16':46s} {'ms':>7s} {'useful MB':>9s} {'GB/s':>6s} {'%copy':>5s}"
              f" {'moved MB':>8s} {'GB/s':>6s} {'%copy':>5s}")
        for name, t, ub, mb, gbs in rows:
            mg = mb / t / 1e6
            print(f"{name:46s} {t:7.3f} {ub / 1e6:9.1f} {gbs:6.0f} {100 * gbs / copy_gbs:4.0f}%"
                  f" {mb / 1e6:8.1f} {mg:6.0f} {100 * mg / copy_gbs:4.0f}%")
    print(f"total {time.time() - t_start:.0f}s")


if __name__ == "__main__":
    main()
