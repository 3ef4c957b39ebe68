"""The ``@triton.jit`` helpers every FP8-based format's kernels share: fp32 bit patterns,
the current-scaling scale rule and its decode scale, the fp8 cast and its decode, the
transposed store and the tile ids of a 2-D quantize grid.

Numerics (bit for bit those of ``formats/casting.py``):

* amaxes are reduced on the *bit patterns* of ``|x|`` as int32: for non-negative floats the
  integer order is the float order, every NaN sorts above Inf, so a NaN anywhere propagates
  exactly as ``torch.amax`` does, with no float NaN semantics involved;
* the current-scaling scale is ``fp8_max / max(amax, eps)`` with a correctly rounded
  (``div.rn``) fp32 division, amax 0 -> 1, Inf -> fp32 max, optional power-of-two floor,
  non-finite amax -> NaN;
* the fp8 cast saturates to +-max (NaN kept) and rounds to nearest even: on the GPU one
  hardware conversion does both (``cvt.rn.satfinite``, what Triton emits on sm89+),
  elsewhere (``HW_CVT=False``, exact on any backend including the CPU interpreter) integer
  arithmetic on the bit pattern.

Only kernel modules import this file, so ``import lowprec`` never needs Triton.
"""

from __future__ import annotations

import triton
import triton.language as tl


# ---- shared jit helpers -------------------------------------------------------------------
# These helpers are also called from the Gluon kernels, where a
# tensor needs an explicit layout: constants are splatted with ``filled`` (no ``tl.full``).
@triton.jit
def filled(like, value):
    """A tensor of ``like``'s shape (and layout) holding ``value`` (folded to a constant)."""
    return tl.where(like == like, value, value)


@triton.jit
def abs_bits(x):
    """int32 bit patterns of |x| for fp32 x (ordered like the floats; NaN above Inf)."""
    return x.to(tl.int32, bitcast=True) & 0x7FFFFFFF


@triton.jit
def decode_scale(scale):
    """``1 / scale`` correctly rounded (``div.rn``, subnormals kept): bit for bit
    ``torch.reciprocal`` of the encode scale, which is what GEMMs multiply by."""
    return tl.math.div_rn(filled(scale, 1.0), scale)


@triton.jit
def current_scale(amax_bits, eps, FP8_MAX: tl.constexpr, POW2: tl.constexpr):
    """casting.scale_from_amax on int32 amax bit patterns (any shape); fp32 result."""
    finite = amax_bits < 0x7F800000
    amax = amax_bits.to(tl.float32, bitcast=True)
    clamped = tl.maximum(amax, eps)
    num = filled(clamped, FP8_MAX)
    scale = tl.math.div_rn(num, clamped)
    scale = tl.where(clamped == 0.0, 1.0, scale)
    sbits = scale.to(tl.int32, bitcast=True)
    sbits = tl.where(sbits == 0x7F800000, 0x7F7FFFFF, sbits)
    if POW2:
        sbits = sbits & 0x7F800000
    sbits = tl.where(finite, sbits, 0x7FC00000)
    return sbits.to(tl.float32, bitcast=True)


@triton.jit
def fp8_codes(y, MBITS: tl.constexpr, BIAS: tl.constexpr, MAX_BITS: tl.constexpr,
              HW_CVT: tl.constexpr, ALT: tl.constexpr = False):
    """uint8 fp8 codes of fp32 ``y``: saturate to +-max (NaN stays NaN), round to nearest even.

    MBITS/BIAS: 3/7 for E4M3 (fn), 2/15 for E5M2; MAX_BITS: fp32 bits of the max finite value.
    ``ALT`` makes a second conversion of the same values a chain of ops of its own (same
    results): an opaque copy of ``y`` before the hardware cast, a differently written
    saturation in the integer path. See the compiler pitfall in the module docstring.
    """
    if HW_CVT:
        if ALT:
            y = tl.inline_asm_elementwise("mov.b32 $0, $1;", "=f,f", [y], dtype=tl.float32,
                                          is_pure=True, pack=1)
        # Triton lowers these casts to cvt.rn.satfinite on sm89+: finite overflow and +-Inf
        # saturate to +-max and NaN stays NaN, so the instruction is the whole cast.
        if MBITS == 3:
            code = y.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
        else:
            code = y.to(tl.float8e5).to(tl.uint8, bitcast=True)
    else:
        b = y.to(tl.int32, bitcast=True)
        a = b & 0x7FFFFFFF
        is_nan = a > 0x7F800000
        if ALT:
            a = tl.where((a > MAX_BITS) & (a <= 0x7F800000), MAX_BITS, a)
        else:
            a = tl.where(is_nan, a, tl.minimum(a, MAX_BITS))
        e = a >> 23
        mant = (a & 0x7FFFFF) | tl.where(e > 0, 0x800000, 0)
        n = tl.maximum(e, 1) - (128 - BIAS)  # 0 at the smallest fp8 normal
        shift = tl.minimum((23 - MBITS) + tl.maximum(-n, 0), 31)
        q = mant >> shift
        rem = mant & ((1 << shift) - 1)
        half = 1 << (shift - 1)
        up = (rem > half) | ((rem == half) & ((q & 1) == 1))
        c = (tl.maximum(n, 0) << MBITS) + q + up.to(tl.int32)
        c = tl.where(is_nan, 0x7F, c)
        code = (c | ((b >> 24) & 0x80)).to(tl.uint8)
    return code


@triton.jit
def fp8_value(code, MBITS: tl.constexpr, BIAS: tl.constexpr, HW_CVT: tl.constexpr):
    """fp32 value of uint8 fp8 codes (exact): the inverse of ``fp8_codes``.

    E4M3 (fn) codes 0x7F/0xFF are NaN; E5M2 exponent 31 is Inf or NaN. ``HW_CVT``: the
    hardware conversion; otherwise the bit arithmetic below (any backend)."""
    if HW_CVT:
        if MBITS == 3:
            v = code.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        else:
            v = code.to(tl.float8e5, bitcast=True).to(tl.float32)
    else:
        c = code.to(tl.int32)
        a = c & 0x7F
        e = a >> MBITS
        m = a & ((1 << MBITS) - 1)
        normal = (((e + (127 - BIAS)) << 23) | (m << (23 - MBITS))).to(tl.float32, bitcast=True)
        # subnormal: m * 2**(1 - BIAS - MBITS), a power-of-two multiple (exact)
        sub = m.to(tl.float32) * filled(m, (128 - BIAS - MBITS) << 23).to(tl.float32,
                                                                        bitcast=True)
        v = tl.where(e == 0, sub, normal)
        if MBITS == 3:
            special = a == 0x7F
            v = tl.where(special, float("nan"), v)
        else:
            special = e == 31
            v = tl.where(special, tl.where(m == 0, float("inf"), float("nan")), v)
        v = tl.where((c & 0x80) != 0, -v, v)
    return v


@triton.jit
def store_t(ptr, offs_r, offs_c, n_r, n_c, ld, v, MODE: tl.constexpr):
    """Store the transpose of the (R, C) tile ``v``: element [r, c] goes to ptr[c * ld + r],
    for ``offs_r < n_r`` and ``offs_c < n_c``.

    The mask is built in the stored orientation (no transposed copy of a mask the caller
    also uses). MODE 3: no transpose op, the pointers are transposed and the compiler
    arranges the coalesced store; otherwise ``tl.trans`` of the tile.
    """
    if MODE == 3:
        tl.store(ptr + offs_c.to(tl.int64)[None, :] * ld + offs_r[:, None], v,
                 mask=(offs_r < n_r)[:, None] & (offs_c < n_c)[None, :])
    else:
        tl.store(ptr + offs_c.to(tl.int64)[:, None] * ld + offs_r[None, :], tl.trans(v),
                 mask=(offs_c < n_c)[:, None] & (offs_r < n_r)[None, :])


@triton.jit
def tile_ids(K_FAST: tl.constexpr):
    """(program down M, program along K, programs down M) of a 2-D quantize grid, whose
    axis 0 runs along K with ``K_FAST`` (programs launched together read neighbouring
    columns of the same rows), else along M (see ``launch.order_axes``)."""
    if K_FAST:
        return tl.program_id(1), tl.program_id(0), tl.num_programs(1)
    return tl.program_id(0), tl.program_id(1), tl.num_programs(0)
