"""The MXFP8 scale rule in Triton; the quantize kernel is the block-scaled FP8 one
(``block_scaled.py`` with ``E8M0=True``, ``BLK=32``).

Numerics are those of ``mxfp8/reference.py``: ``e`` = exponent of the smallest power of two
>= fp32(amax / fp8_max) (correctly rounded division), clamped to [-127, 127], zero -> -127,
non-finite -> code 255 with data cast at scale 1.

The kernels get ``e`` without dividing. Both fp8 maxima are 1.75 * 2**P (E4M3 448, P = 8;
E5M2 57344, P = 15), and no fp32 lies strictly between 1.75 * 2**k and the bound where
``RN(amax / fp8_max)`` would round above 2**(k - P), so for an amax with biased exponent
E and mantissa bits m the rule is ``e = E - 127 - P + (m > 0x600000)``, save one pattern
where the quotient is subnormal and rounds down to 2**-127 (E == P, m == 0x600001, one
less). Checked against the reference on every finite non-negative fp32 for both formats
(the exhaustive test in tests/slow/test_fuzz_kernels_fp8.py). A division took about 12
instructions a block.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def e8m0_scale(amax_bits, FP8_MAX: tl.constexpr, ALT: tl.constexpr = False):
    """(uint8 E8M0 code, fp32 multiplier 2**-e) for int32 amax bit patterns (any shape).

    ``ALT`` computes the code with other (equivalent) ops, so that a second copy stays a
    chain of its own (see ``float8.triton_kernels.cast_kernel``)."""
    tl.static_assert((FP8_MAX == 448.0) or (FP8_MAX == 57344.0), "E4M3 or E5M2 maximum")
    if FP8_MAX == 448.0:
        P: tl.constexpr = 8
    else:
        P: tl.constexpr = 15
    finite = amax_bits < 0x7F800000
    ex = amax_bits >> 23
    mant = amax_bits & 0x7FFFFF
    e = ex - (127 + P) + (mant > 0x600000).to(tl.int32) \
        - ((ex == P) & (mant == 0x600001)).to(tl.int32)
    e = tl.minimum(tl.maximum(e, -127), 127)
    e = tl.where(finite, e, 0)
    if ALT:
        code = (tl.where(finite, e, 128) + 127).to(tl.uint8)
    else:
        code = tl.where(finite, e + 127, 255).to(tl.uint8)
    neg = -e
    mult = tl.where(neg >= -126, (neg + 127) << 23, 0x400000).to(tl.float32, bitcast=True)
    return code, mult


@triton.jit
def e8m0_factor(code):
    """fp32 ``2**(code - 127)`` of E8M0 codes (any int shape); 255 -> NaN.

    Built from bits: a code >= 1 is the normal float ``code << 23``; code 0 is the
    subnormal ``2**-127``. Every value is exact in fp32."""
    s = code.to(tl.int32)
    f = tl.where(s == 0, 0x00400000, s << 23).to(tl.float32, bitcast=True)
    return tl.where(s == 255, float("nan"), f)
