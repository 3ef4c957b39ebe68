"""Kernel-against-reference fuzzing of the FP8 / block-FP8 / MXFP8 quantize kernels, the
helpers of ``test_fuzz_kernels_fp8.py`` (a slow GPU test).

* :func:`run_group`: kernel path against the reference path (``lowprec.kernels.reference_only``)
  on the same CUDA input for one group of format settings x input dtype x shape (odd M, 3-D,
  transposed and sliced views) x value distribution (normal, wide, subnormal, zero blocks,
  NaN/Inf blocks, saturation, rounding ties) x usages; small cases also against the CPU
  reference. fp8 bytes, scales and recorded amaxes must be identical, except that a NaN may
  have any NaN bit pattern.
* :func:`run_diag`: every kernel with both usages under one transposed-store mode
  (``kernels.tuning.tuning.col_mode``) or as split launches, with detailed mismatches.
* :func:`run_compile`: ``torch.compile(fullgraph=True)`` of each launcher and of
  ``quantizer.quantize`` against eager, bit for bit.
* ``exhaustive_fp8.run_exhaustive``: the element rules on every fp32 / amax bit pattern.
"""

from __future__ import annotations

import os
import time
import traceback
import zlib

import torch
from exhaustive_fp8 import E4, E5, FP8_NAME

from lowprec.formats.block import launch as block_launch
from lowprec.formats.block.quantizer import Float8BlockQuantizer
from lowprec.formats.float8 import launch as f8_launch
from lowprec.formats.float8.quantizer import Float8CurrentScalingQuantizer, Float8Quantizer
from lowprec.formats.mxfp8 import launch as mx_launch
from lowprec.formats.mxfp8.quantizer import MXFP8Quantizer
from lowprec.kernels import reference_only
from lowprec.kernels.tuning import tuning

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


# ---- quantizer settings (grouped so that each test compiles few kernel variants) ---------
def quantizer_groups():
    g = {}
    for f in (E4, E5):
        n = FP8_NAME[f]
        g[f"current-{n}"] = [
            (f"current {n} pow2={p} eps={e}",
             (lambda f=f, p=p, e=e: Float8CurrentScalingQuantizer(f, force_pow_2_scales=p,
                                                                  amax_epsilon=e)))
            for p in (False, True) for e in (0.0, 1e-3)]
        g[f"delayed-{n}"] = [
            (f"delayed {n} scale={s}",
             (lambda f=f, s=s: Float8Quantizer(torch.tensor([s], device=DEV),
                                               torch.full((1,), -1.0, device=DEV), f)))
            for s in (1.0, 0.37, 2.0 ** 40, 2.0 ** -20)]
        for d in (1, 2):
            g[f"block{d}-{n}"] = [
                (f"block {n} dim={d} pow2={p}",
                 (lambda f=f, d=d, p=p: Float8BlockQuantizer(f, block_scaling_dim=d,
                                                             force_pow_2_scales=p)))
                for p in (True, False)]
        g[f"block-eps-{n}"] = [
            (f"block {n} dim={d} eps=1e-3",
             (lambda f=f, d=d: Float8BlockQuantizer(f, block_scaling_dim=d, amax_epsilon=1e-3)))
            for d in (1, 2)]
        g[f"mxfp8-{n}"] = [
            (f"mxfp8 {n} 2d={t}", (lambda f=f, t=t: MXFP8Quantizer(f, with_2d_quantization=t)))
            for t in (False, True)]
    return g


# (layout, shape): "c" contiguous, "t" transposed view, "s" column slice of a wider buffer.
# Breadth first: every setting x dtype x usage meets a tier before any meets the next one.
TIERS = [
    ([("c", (256, 384)), ("c", (100, 128))], ("normal", "nanblk")),
    ([("c", (3, 40, 256)), ("t", (256, 512)), ("c", (7, 32))], ("wide", "tiny", "zeroblk")),
    ([("c", (96, 256)), ("c", (128, 128)), ("s", (128, 256)), ("c", (33, 64)), ("c", (1, 256))],
     ("sat", "ties", "normal")),
    ([("c", (512, 1024)), ("c", (4, 64, 384)), ("c", (2048, 2048)), ("c", (4096, 160)),
      ("c", (130, 4096))], ("normal", "wide", "tiny", "zeroblk", "nanblk", "sat", "ties")),
]
DISTS = ("normal", "wide", "tiny", "zeroblk", "nanblk", "sat", "ties")


DEADLINE = float(os.environ.get("CHECK_DEADLINE", "inf"))  # epoch seconds; checks stop there
DEV = os.environ.get("CHECK_DEVICE", "cuda")  # "cpu" only for dry runs of this script


def make_input(layout, shape, dtype, dist, gen):
    dev = DEV
    if layout == "t":
        base = torch.randn(shape[::-1], generator=gen, device=dev)
    elif layout == "s":
        base = torch.randn(*shape[:-1], shape[-1] + 128, generator=gen, device=dev)
    else:
        base = torch.randn(shape, generator=gen, device=dev)
    x = base
    if dist == "wide":
        span = 10 if dtype == torch.float16 else 60
        x = x * torch.exp2(torch.randint(-span, span, x.shape, generator=gen, device=dev).float())
    elif dist == "tiny":
        x = x * torch.finfo(dtype).tiny * 0.3  # mostly subnormal in the input dtype
    elif dist == "sat":
        x = x * (1e4 if dtype == torch.float16 else 1e30)
    elif dist == "ties":
        n = torch.randint(8, 16, x.shape, generator=gen, device=dev).float() + 0.5
        e = torch.randint(-10, 6, x.shape, generator=gen, device=dev).float()
        x = torch.sign(x) * n * torch.exp2(e)
    x = x.to(dtype)
    if dist in ("zeroblk", "nanblk"):
        x2 = x if x.dim() == 2 else x.view(-1, x.shape[-1]) if layout == "c" else x
        m, k = x2.shape[0], x2.shape[-1]
        if dist == "zeroblk":
            x2[: min(m, 32), : min(k, 64)] = 0
            if m >= 256 and k >= 256:
                x2[128:256, 128:256] = 0
        else:
            x2[min(m - 1, 5), min(k - 1, 7)] = float("nan")
            if m > 1 or k > 40:
                x2[m - 1, k - 1] = float("inf")
            if m > 70 and k > 40:
                x2[70, 40] = -float("inf")
    if layout == "t":
        x = x.t()
    elif layout == "s":
        x = x[..., : shape[-1]]
    return x


def same_bits(a, b, what):
    """Identical bits, except that NaN may be any NaN; returns an error string or None."""
    if (a is None) != (b is None):
        return f"{what}: held {a is not None} vs reference {b is not None}"
    if a is None:
        return None
    if a.dtype != b.dtype or a.shape != b.shape:
        return f"{what}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
    if not a.is_contiguous():
        return f"{what}: not contiguous"
    a, b = a.cpu(), b.cpu()
    if a.dtype == torch.uint8:
        return None if torch.equal(a, b) else f"{what}: {int((a != b).sum())} codes differ"
    nan_a, nan_b = torch.isnan(a.float()), torch.isnan(b.float())
    if not torch.equal(nan_a, nan_b):
        return f"{what}: NaN masks differ ({int(nan_a.sum())} vs {int(nan_b.sum())})"
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[a.element_size()]
    ia, ib = a.view(ints)[~nan_a], b.view(ints)[~nan_b]
    if not torch.equal(ia, ib):
        idx = int((ia != ib).nonzero()[0])
        return (f"{what}: {int((ia != ib).sum())} values differ, e.g. "
                f"{a[~nan_a][idx].item()!r} vs {b[~nan_b][idx].item()!r}")
    return None


def compare(qt, ref, what):
    errs = []
    for name, t in qt.inner_tensors().items():
        e = same_bits(t, ref.inner_tensors()[name], f"{what} {name}")
        if e:
            errs.append(e)
    if qt.metadata() != ref.metadata():
        errs.append(f"{what} metadata {qt.metadata()} vs {ref.metadata()}")
    return errs


def run_group(group, quick):
    torch.manual_seed(0)
    gen = torch.Generator(device=DEV).manual_seed(zlib.crc32(group.encode()))
    settings = quantizer_groups()[group]
    tiers = TIERS[:1] if quick else TIERS
    n, fails, skipped, cpu_checked, truncated = 0, [], 0, 0, False
    cases = [(label, make_q, dtype, layout, shape, dist)
             for shapes, dists in tiers for label, make_q in settings for dtype in DTYPES
             for layout, shape in shapes for dist in dists]
    for label, make_q, dtype, layout, shape, dist in cases:
        if time.time() > DEADLINE:
            truncated = True
            break
        x = make_input(layout, shape, dtype, dist, gen)
        for usage in ((True, True), (True, False), (False, True)):
            what = f"[{label} {dtype} {layout}{shape} {dist} usage={usage}]"
            qk, qr = make_q().set_usage(*usage), make_q().set_usage(*usage)
            try:
                with reference_only():
                    ref = qr.quantize(x)
            except ValueError:
                skipped += 1
                try:
                    qk.quantize(x)
                    fails.append(f"{what}: kernel path accepted a bad shape")
                except ValueError:
                    pass
                continue
            n += 1
            try:
                got = qk.quantize(x)
                errs = compare(got, ref, what)
                if hasattr(qk, "amax"):
                    e = same_bits(qk.amax, qr.amax, f"{what} recorded amax")
                    errs += [e] if e else []
                if x.numel() <= 1 << 16:
                    qc = make_q().set_usage(*usage)
                    if hasattr(qc, "amax"):
                        qc.scale, qc.amax = qc.scale.cpu(), qc.amax.cpu()
                    errs += compare(got, qc.quantize(x.cpu()), what + " vs CPU")
                    cpu_checked += 1
            except Exception as exc:  # noqa: BLE001
                errs = [f"{what}: {type(exc).__name__}: {exc}"
                        + traceback.format_exc()[-600:]]
            fails += errs
    if DEV == "cuda":
        torch.cuda.synchronize()
    return {"group": group, "cases": n, "skipped_bad_shape": skipped, "cpu_checked": cpu_checked,
            "failures": len(fails), "first_failures": fails[:8],
            "truncated_by_deadline": truncated}


# ---- per-col_mode diagnosis --------------------------------------------------------------
DIAG_KINDS = {
    "current": lambda: Float8CurrentScalingQuantizer(E4),
    "delayed": lambda: Float8Quantizer(torch.tensor([0.37], device=DEV),
                                       torch.zeros(1, device=DEV), E4),
    "block1": lambda: Float8BlockQuantizer(E4, block_scaling_dim=1),
    "block2": lambda: Float8BlockQuantizer(E4, block_scaling_dim=2),
    "mx1": lambda: MXFP8Quantizer(E4),
    "mx2": lambda: MXFP8Quantizer(E4, with_2d_quantization=True),
}


def run_diag(mode):
    """Every kernel with both/columnwise usages under one ``tuning.col_mode`` ("split": two
    launches for both usages); detailed mismatches. Changes ``tuning`` and leaves it
    changed: callers restore it (``tuning.override``)."""
    if mode == "split":
        for key in tuning.split_both:
            tuning.split_both[key] = True
    else:
        tuning.col_mode = int(mode)
    gen = torch.Generator(device=DEV).manual_seed(5)
    out = {"cases": 0, "bad": 0, "details": []}
    for kind, make_q in DIAG_KINDS.items():
        for dtype in (torch.float32, torch.bfloat16):
            for usage in ((True, True), (False, True)):
                for shape in ((256, 384), (128, 256)):
                    for dist in ("normal", "wide", "nanblk"):
                        x = make_input("c", shape, dtype, dist, gen)
                        qk, qr = make_q().set_usage(*usage), make_q().set_usage(*usage)
                        out["cases"] += 1
                        try:
                            got = qk.quantize(x)
                            with reference_only():
                                ref = qr.quantize(x)
                            errs = compare(got, ref, "")
                        except Exception as exc:  # noqa: BLE001
                            errs = [f"{type(exc).__name__}: {str(exc)[:300]}"]
                        if errs:
                            out["bad"] += 1
                            if len(out["details"]) < 12:
                                extra = ""
                                try:
                                    cd, rd = got.columnwise_data, ref.columnwise_data
                                    d = (cd.view(torch.uint8) != rd.view(torch.uint8)).nonzero()
                                    if len(d):
                                        i, j = d[0].tolist()
                                        extra = (f" first col mismatch at {i},{j}: got "
                                                 f"{cd[i, j].float().item()} ref "
                                                 f"{rd[i, j].float().item()}; x[{j},{i}]="
                                                 f"{x.reshape(-1, x.shape[-1])[j, i].item()}")
                                        if got.rowwise_data is not None:
                                            extra += (" col==row.t(): " + str(bool(torch.equal(
                                                cd.view(torch.uint8),
                                                got.rowwise_data.view(torch.uint8).t()))))
                                except Exception as exc:  # noqa: BLE001
                                    extra = f" ({exc})"
                                out["details"].append(
                                    f"{kind} {dtype} usage={usage} {shape} {dist}: "
                                    + "; ".join(e[:160] for e in errs) + extra)
    return out


# ---- torch.compile --------------------------------------------------------------------------
def run_compile():
    """torch.compile(fullgraph=True): (a) each launcher (the custom ops) and (b) the whole
    ``quantizer.quantize`` returning its inner tensors, against eager, bit for bit."""
    res = {}
    x = torch.randn(256, 512, device="cuda", dtype=torch.bfloat16)
    x[3, 4] = 1e-30
    cases = {
        "current": (lambda: Float8CurrentScalingQuantizer(E4), f8_launch.quantize_current),
        "delayed": (lambda: Float8Quantizer(torch.tensor([0.5], device="cuda"),
                                            torch.zeros(1, device="cuda"), E5),
                    f8_launch.quantize_delayed),
        "block1x128": (lambda: Float8BlockQuantizer(E4, block_scaling_dim=1),
                       block_launch.quantize_block),
        "block128x128": (lambda: Float8BlockQuantizer(E4, block_scaling_dim=2),
                         block_launch.quantize_block),
        "mxfp8": (lambda: MXFP8Quantizer(E4), mx_launch.quantize_mxfp8),
        "mxfp8_2d": (lambda: MXFP8Quantizer(E5, with_2d_quantization=True),
                     mx_launch.quantize_mxfp8),
    }
    for name, (make_q, launcher) in cases.items():
        for level in ("launcher", "quantize"):
            try:
                torch._dynamo.reset()
                names = None

                def fn(t, q, level=level, launcher=launcher):
                    if level == "launcher":
                        d = launcher(q, t)
                        return tuple(v for v in d.values() if isinstance(v, torch.Tensor))
                    qt = q.quantize(t)
                    return tuple(getattr(qt, n) for n in type(qt)._inner
                                 if getattr(qt, n) is not None)

                q_e, q_c = make_q(), make_q()
                eager = fn(x, q_e)
                comp = torch.compile(fn, fullgraph=True)(x, q_c)
                errs = [same_bits(a.contiguous(), b, name) for a, b in zip(comp, eager)]
                if hasattr(q_e, "amax"):
                    errs.append(same_bits(q_c.amax, q_e.amax, "amax"))
                errs = [e for e in errs if e]
                ok = not errs and len(comp) == len(eager)
                res[f"{name} {level}"] = "ok" if ok else f"MISMATCH {errs}"
                del names
            except Exception as exc:  # noqa: BLE001
                res[f"{name} {level}"] = f"{type(exc).__name__}: {str(exc)[:400]}"
    return res
