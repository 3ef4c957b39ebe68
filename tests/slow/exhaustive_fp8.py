"""Exhaustive GPU checks of the element rules the FP8 / block-FP8 / MXFP8 quantize kernels
share, run by ``test_fuzz_kernels_fp8.py::test_element_rules_exhaustive``: the fp8
cast helper (hardware cvt and integer paths) on all 2**32 fp32 bit patterns, and the
current-scaling scale and MXFP8 E8M0 rules on all 2**31 non-negative amax bit patterns,
against ``casting.py`` / ``mxfp8/reference.py`` run by torch on the GPU (plus a
CPU-vs-GPU reference spot check).
"""

from __future__ import annotations

import torch

from lowprec.kernels.fp8_args import FP8_PARAMS

E4, E5 = torch.float8_e4m3fn, torch.float8_e5m2
FP8_NAME = {E4: "e4m3", E5: "e5m2"}


# ---- exhaustive checks of the element rules -----------------------------------------------
def run_exhaustive(quick):
    import triton
    import triton.language as tl

    from lowprec.formats.casting import cast_fp8, scale_from_amax
    from lowprec.formats.mxfp8.reference import block_exponents
    from lowprec.kernels.e8m0 import e8m0_scale
    from lowprec.kernels.fp8_cast import current_scale, fp8_codes

    @triton.jit
    def cast_probe(x_ptr, hw_ptr, sw_ptr, N, MBITS: tl.constexpr, BIAS: tl.constexpr,
                   MAX_BITS: tl.constexpr, BLOCK: tl.constexpr, ALT: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < N
        x = tl.load(x_ptr + offs, mask=mask, other=0.0)
        tl.store(hw_ptr + offs, fp8_codes(x, MBITS, BIAS, MAX_BITS, True, ALT), mask=mask)
        tl.store(sw_ptr + offs, fp8_codes(x, MBITS, BIAS, MAX_BITS, False, ALT), mask=mask)

    @triton.jit
    def scale_probe(a_ptr, s_ptr, code_ptr, mult_ptr, N, eps, FP8_MAX: tl.constexpr,
                    POW2: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < N
        a = tl.load(a_ptr + offs, mask=mask, other=0)
        tl.store(s_ptr + offs, current_scale(a, eps, FP8_MAX, POW2), mask=mask)
        code, mult = e8m0_scale(a, FP8_MAX)
        tl.store(code_ptr + offs, code, mask=mask)
        tl.store(mult_ptr + offs, mult, mask=mask)

    out = {}
    chunk = 1 << 27
    block = 4096
    total = 1 << 32
    step = 8 if quick else 1  # quick: every 8th chunk
    for f, alt in ((E4, False), (E5, False), (E4, True), (E5, True)):
        mbits, bias, max_bits, fmax = FP8_PARAMS[f]
        bad_hw = bad_sw = checked = 0
        hw = torch.empty(chunk, dtype=torch.uint8, device="cuda")
        sw = torch.empty_like(hw)
        for c in range(0, total // chunk, step):
            start = -(1 << 31) + c * chunk
            bits = torch.arange(start, start + chunk, dtype=torch.int64, device="cuda").to(
                torch.int32)
            x = bits.view(torch.float32)
            cast_probe[(chunk // block,)](x, hw, sw, chunk, MBITS=mbits, BIAS=bias,
                                          MAX_BITS=max_bits, BLOCK=block, ALT=alt)
            ref = cast_fp8(x, f).view(torch.uint8)
            nan_in = torch.isnan(x)
            for name, got in (("hw", hw), ("sw", sw)):
                wrong = (got != ref) & ~nan_in
                wrong |= nan_in & ~torch.isnan(got.view(f).float())
                cnt = int(wrong.sum())
                if name == "hw":
                    bad_hw += cnt
                else:
                    bad_sw += cnt
            checked += chunk
            del bits, x, ref, nan_in
        out[f"cast {FP8_NAME[f]}{' alt' if alt else ''}"] = {"checked": checked,
                                                              "hw_mismatch": bad_hw,
                                                              "int_mismatch": bad_sw}
    # scale rules on every non-negative amax bit pattern
    for f in (E4, E5):
        fmax = FP8_PARAMS[f][3]
        for pow2 in (False, True):
            for eps in ((0.0, 1e-3) if not pow2 else (0.0,)):
                bad_s = bad_e = checked = 0
                for c in range(0, (1 << 31) // chunk, step):
                    bits = torch.arange(c * chunk, (c + 1) * chunk, dtype=torch.int32,
                                        device="cuda")
                    amax = bits.view(torch.float32)
                    s = torch.empty(chunk, dtype=torch.float32, device="cuda")
                    code = torch.empty(chunk, dtype=torch.uint8, device="cuda")
                    mult = torch.empty(chunk, dtype=torch.float32, device="cuda")
                    scale_probe[(chunk // block,)](bits, s, code, mult, chunk, eps,
                                                   FP8_MAX=fmax, POW2=pow2, BLOCK=block)
                    rs = scale_from_amax(amax, fmax, eps=eps, pow2=pow2)
                    ns, nr = torch.isnan(s), torch.isnan(rs)
                    bad_s += int(((s.view(torch.int32) != rs.view(torch.int32)) & ~nr).sum()
                                 + (ns != nr).sum())
                    if not pow2 and eps == 0.0:
                        e, rc = block_exponents(amax, f)
                        rm = torch.ldexp(torch.ones_like(amax), -e)
                        bad_e += int((code != rc).sum()
                                     + (mult.view(torch.int32) != rm.view(torch.int32)).sum())
                    checked += chunk
                    del bits, amax, s, code, mult, rs
                key = f"scale {FP8_NAME[f]} pow2={pow2} eps={eps}"
                out[key] = {"checked": checked, "mismatch": bad_s}
                if not pow2 and eps == 0.0:
                    out[f"e8m0 {FP8_NAME[f]}"] = {"checked": checked, "mismatch": bad_e}
    # CPU spot check: the GPU reference equals the CPU reference on random bit patterns
    g = torch.Generator().manual_seed(1)
    bits = torch.randint(-(1 << 31), (1 << 31) - 1, (1 << 22,), generator=g, dtype=torch.int64
                         ).to(torch.int32)
    x = bits.view(torch.float32)
    bad = 0
    for f in (E4, E5):
        a = cast_fp8(x, f).view(torch.uint8)
        b = cast_fp8(x.cuda(), f).view(torch.uint8).cpu()
        bad += int(((a != b) & ~torch.isnan(x)).sum())
        ax = x.abs()
        for p in (False, True):
            s1 = scale_from_amax(ax, FP8_PARAMS[f][3], pow2=p)
            s2 = scale_from_amax(ax.cuda(), FP8_PARAMS[f][3], pow2=p).cpu()
            bad += int(((s1.view(torch.int32) != s2.view(torch.int32))
                        & ~torch.isnan(s1)).sum())
        bad += int((block_exponents(ax, f)[1] != block_exponents(ax.cuda(), f)[1].cpu()).sum())
    out["gpu reference == cpu reference"] = {"checked": 4 * (1 << 22), "mismatch": bad}
    torch.cuda.synchronize()
    return out
