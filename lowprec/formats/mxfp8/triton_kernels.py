"""The MXFP8 scale rule in Triton; the quantize kernel is the block-scaled FP8 one
(``block/triton_kernels.py`` with ``E8M0=True``, ``BLK=32``).

Numerics are those of ``mxfp8/reference.py``: ``e`` = exponent of the smallest power of two
>= fp32(amax / fp8_max) (correctly rounded division), clamped to [-127, 127], zero -> -127,
non-finite -> code 255 with data cast at scale 1.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def e8m0_scale(amax_bits, FP8_MAX: tl.constexpr, ALT: tl.constexpr = False):
    """(uint8 E8M0 code, fp32 multiplier 2**-e) for int32 amax bit patterns (any shape).

    ``ALT`` computes the code with other (equivalent) ops, so that a second copy stays a
    chain of its own (see ``float8.triton_kernels.cast_kernel``)."""
    finite = amax_bits < 0x7F800000
    amax = amax_bits.to(tl.float32, bitcast=True)
    v = tl.math.div_rn(amax, tl.zeros_like(amax) + FP8_MAX)
    vb = v.to(tl.int32, bitcast=True)
    ex = vb >> 23
    mant = vb & 0x7FFFFF
    # Smallest power of two >= v: normal v rounds its exponent up unless v is a power of two;
    # a subnormal v (< 2**-126) needs 2**-126 when above 2**-127, else 2**-127 (and zero).
    e = tl.where(ex == 0, tl.where(mant > 0x400000, -126, -127),
                 ex - 127 + (mant != 0).to(tl.int32))
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
