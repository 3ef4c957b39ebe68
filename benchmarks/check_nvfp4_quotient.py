"""GPU check of the fp32 quotient behind NVFP4 stochastic rounding (``_quotient``, ``_sr_codes``).

The SR kernels need ``v = RN32(a / d)`` for ``a >= 0`` and every E4M3 decode scale ``d``,
without a divide: ``q0 = RN(a r)`` with ``r = RN(1/d)``, the FMA remainder, one FMA
correction. This script runs that code on the GPU for every 24-bit significand of ``a``
in several binades (subnormal ones included) against every positive finite E4M3 ``d``:

* where ``a/d >= 2**-100`` the result must equal ``RN32(a/d)`` bit for bit (the reference
  is an fp64 division rounded to fp32: a quotient of a 24-bit by a <= 4-bit number is never
  close enough to an fp32 rounding midpoint for the double rounding to matter);
* everywhere, the positivity test ``a * 2**64 > d * 2**-86`` must equal ``RN32(a/d) > 0``.

    python benchmarks/check_nvfp4_quotient.py
"""

from __future__ import annotations

import os
import sys
import time

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from lowprec.formats.nvfp4.triton_kernels import TWO_M86, TWO_P64, _quotient  # noqa: E402

#: exponents of the binades of a checked (all 2**23 significands each)
EXPONENTS = (-149, -140, -130, -126, -120, -110, -101, -100, -90, -60, -30, -20, -9, -3, 0,
             1, 2, 3, 6, 8, 11)
BLOCK = 1024


@triton.jit
def _probe(out_ptr, pos_ptr, base_bits, n, d, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = i < n
    a = (base_bits + i).to(tl.float32, bitcast=True)
    dv = tl.full([BLOCK], d, tl.float32)
    r = tl.math.div_rn(tl.full([BLOCK], 1.0, tl.float32), dv)
    v = _quotient(a, r, dv)
    tl.store(out_ptr + i, v.to(tl.int32, bitcast=True), mask=mask)
    tl.store(pos_ptr + i, (a * TWO_P64 > dv * TWO_M86).to(tl.int8), mask=mask)


def e4m3_positive_values() -> list[float]:
    codes = torch.arange(1, 0x7F, dtype=torch.uint8)  # 0x7F is NaN
    return codes.view(torch.float8_e4m3fn).float().tolist()


def binade(exponent: int) -> tuple[int, int]:
    """(first fp32 bit pattern, count) of the binade 2**exponent (the subnormals for -149)."""
    if exponent <= -127:
        return 1, (1 << 23) - 1
    return (exponent + 127) << 23, 1 << 23


def main() -> int:
    t0 = time.time()
    ds = e4m3_positive_values()
    bad_v = bad_pos = checked = 0
    out = torch.empty(1 << 23, dtype=torch.int32, device="cuda")
    pos = torch.empty(1 << 23, dtype=torch.int8, device="cuda")
    for e in EXPONENTS:
        base, n = binade(e)
        a = (torch.arange(n, dtype=torch.int32, device="cuda") + base).view(torch.float32)
        for d in ds:
            _probe[(triton.cdiv(n, BLOCK),)](out, pos, base, n, d, BLOCK=BLOCK,
                                             enable_fp_fusion=False)
            ref = (a.double() / d).float()
            exact_range = (a.double() / d) >= 2.0 ** -100
            got = out[:n]
            bad_v += int(((got != ref.view(torch.int32)) & exact_range).sum())
            bad_pos += int(((pos[:n] != 0) != (ref > 0)).sum())
            checked += n
    print(f"quotient check: {checked} (a, d) pairs over {len(EXPONENTS)} binades x {len(ds)} "
          f"E4M3 values: {bad_v} wrong quotients, {bad_pos} wrong positivity tests "
          f"({time.time() - t0:.0f}s)")
    return 1 if bad_v or bad_pos else 0


if __name__ == "__main__":
    raise SystemExit(main())
