"""Kernel-against-reference checks of the NVFP4 Triton kernels, the helpers of
``test_fuzz_kernels_nvfp4.py`` (a slow GPU test).

Every case (:func:`build_cases`) quantizes one input twice on the GPU, through the kernels
and through the pure-torch reference (``lowprec.kernels.reference_only``), with the same
``torch.manual_seed`` before each, so stochastic rounding draws the same uniforms. All inner
tensors are compared byte for byte (codes, E4M3 scale bytes, fp32 global scales); outputs
land in memory poisoned beforehand. ``dequantize_unscaled_bf16`` is checked against its
torch fallback, and ``(q*d)/S`` against ``dequantize_stored``. Cases cover bf16/fp16/fp32,
1x16 and 16x16 blocks, RHT, stochastic rounding, each usage alone, M not a multiple of 16
(rowwise only), K not a multiple of 16 (columnwise only), 3-D and non-contiguous inputs,
zero / NaN / Inf / signed-zero blocks, tiny, subnormal and saturating values, and every
tile config (bit-exactness must not depend on it). :func:`compile_checks`:
``torch.compile(fullgraph=True)`` through the custom op, and ``torch.library.opcheck``.
"""

from __future__ import annotations

import time
import traceback

import torch

ROW_CONFIGS = [(8, 16), (8, 32), (16, 16)]     # (KB, RB)
COL_CONFIGS = [4, 2, 8]                         # KW
FLAT_CONFIGS = [4096, 8192, 16384]              # amax elements per program
BIG = (16384, 4096)


def apply_config(cfg):
    """Set one NVFP4 tile config (``tuning.nvfp4_config``), in place: callers restore it
    (``tuning.override``)."""
    from lowprec.kernels.tuning import tuning
    if cfg is None:
        return
    kind, val = cfg
    if kind == "row":
        tuning.nvfp4_config["row"].update(KB=val[0], RB=val[1])
    elif kind == "col":
        tuning.nvfp4_config["col"].update(KW=val)
    elif kind == "flat":
        tuning.nvfp4_config["amax"].update(FLAT=val)


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


def variant_key(c):
    return (c["dtype"], c["row"], c["col"], c["rht"], c["two_d"], c["sr"], c.get("config"),
            c.get("layout"))


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
