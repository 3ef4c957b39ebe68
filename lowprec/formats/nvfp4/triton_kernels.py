"""Triton kernels for NVFP4 quantization and dequantization (launchers: :mod:`.launch`).

Bit-identical to :mod:`.reference` (the numerics definition); every fp32 result is the
reference's, however it is computed:

* E2M1 codes without dividing: for an E4M3 decode scale d (<= 4 significant bits) and a
  rounding threshold t of the E2M1 grid (<= 3 bits), t*d is exact and
  ``RN(a/d) > t  <=>  a > t*d`` (likewise for >=): a/d cannot land strictly between t and
  the rounding midpoint next to it (checked exhaustively for every E4M3 d). Nearest-even
  codes are therefore three comparisons against per-block thresholds (a binary search),
  each a saturated fma (see ``_step``).
* Where the exact quotient ``v = RN(a/d)`` itself is needed (stochastic rounding adds the
  draw to v's bits), it is ``RN32(a * r)`` in fp64, r a ~2**-43-accurate
  reciprocal of d: a quotient of a 24-bit by a <=4-bit number is either representable or at
  least 2**-30 (relative) away from every fp32 rounding midpoint. ``block_amax / 6`` is
  ``RN32(b * RN64(1/6))`` in fp64 by the same argument (checked on ~10**8 values,
  subnormals included). The global scale ``2688 / amax`` uses a correctly rounded divide.
* The per-element work is written for the FMA pipe (fp32 fmas, integer multiplies and
  high words) wherever it can be: Nsight Compute shows these kernels bound by the
  integer/logic pipe (compares, selects, shifts, logic), which issues at half the rate.
* E4M3 rounding of the block scale is integer arithmetic (no reliance on the fp8
  conversion), and kernels launch with FMA contraction off.
* Signs are flipped by multiplying by -1 (Triton's unary minus is ``0 - x``, which turns
  -0 into +0, and the sign of zero reaches the E2M1 sign bit).

Passes over memory (x is the (M, K) input, rows contiguous; the amax pass needs it whole
and contiguous, the quantize passes take a row stride, so a column slice is read in place):

1. ``_nvfp4_amax_kernel``: the max of the finite ``|x|`` and, when the columnwise side
   carries the RHT, of the finite ``|RHT(x^T)|``, grid-stride over tiles, combined across
   programs by int32 ``atomic_max`` on the fp32 bit patterns (all >= 0). The last
   program to finish (atomic ticket) turns them into the global encode scales, on device,
   no host sync.
2. ``_nvfp4_row_kernel``: rowwise codes/scales; each thread owns whole 1x16 blocks (16
   contiguous elements, vector loads), or one row of a 16x16 block (2D).
3. ``_nvfp4_col_kernel``: columnwise codes/scales of the transpose; each thread owns two
   adjacent columns over 16 rows (one 16x1 block each, RHT tile included), so blocks and
   butterflies are in-register; it writes 8 contiguous code bytes per column.

Layouts are steered through Triton's coalescing pass: a pointer tensor's contiguous axis
is vectorized in-thread and the remaining axes get lanes, then warps, in increasing axis
order, so the axes that must stay in registers (the 16 rows of a column block, the
halves of a row block) come last.
"""

import triton
import triton.language as tl

FP32_MAX = tl.constexpr(3.4028234663852886e38)
FP32_HALF_MAX = tl.constexpr(1.7014117331926443e38)  # exact in fp32
E4M3_MAX = tl.constexpr(448.0)
GLOBAL_NUM = tl.constexpr(2688.0)  # 448 * 6
E4M3_NAN = tl.constexpr(0x7F)
ONE_SIXTH = tl.constexpr(0.16666666666666666)    # RN64(1/6), used as an fp64 constant


# ---- scalar helpers -----------------------------------------------------------------------------
@triton.jit
def _global_scale(amax):
    """S = 2688 / amax (fp32, correctly rounded); amax 0 -> 1; inf -> fp32 max."""
    s = tl.math.div_rn(GLOBAL_NUM, amax)
    s = tl.where(amax == 0.0, 1.0, s)
    return tl.where(s > FP32_MAX, FP32_MAX, s)


@triton.jit
def _max_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _finite_max(a):
    """0 where |a| is not finite (a >= 0 or NaN)."""
    return tl.where(a <= FP32_MAX, a, 0.0)


@triton.jit
def _e4m3_rne(q):
    """Round fp32 q in [0, 448] to E4M3 (nearest even). Returns (code int32, value fp32)."""
    bits = q.to(tl.int32, bitcast=True)
    # normal range (q >= 2**-6, biased fp32 exponent >= 121): keep 3 mantissa bits, RNE
    top = (bits + 0x7FFFF + ((bits >> 20) & 1)) >> 20
    n_code = top - 960  # (e - 120) << 3 | m
    n_val = (top << 20).to(tl.float32, bitcast=True)
    # subnormal range: multiples of 2**-9, RNE on q * 512 (exact)
    y = q * 512.0
    n = y.to(tl.int32)
    f = y - n.to(tl.float32)
    n = n + ((f > 0.5) | ((f == 0.5) & ((n & 1) == 1))).to(tl.int32)
    s_val = n.to(tl.float32) * 0.001953125
    normal = bits >= (121 << 23)
    return tl.where(normal, n_code, n), tl.where(normal, n_val, s_val)


@triton.jit
def _block_scale(bmax, s):
    """E4M3 decode scale of a block from its NaN-propagating max |x| (inf/NaN: bad block).

    Returns (code int32: E4M3 byte, 0x7F for a bad block; d fp32: 0 for a bad block, so its
    codes are 0 as the reference's d = NaN gives)."""
    bad = ~(bmax <= FP32_MAX)
    b = tl.where(bad, 0.0, bmax)
    sixth = tl.full(b.shape, ONE_SIXTH, tl.float64)
    q = tl.minimum((b.to(tl.float64) * sixth).to(tl.float32) * s, E4M3_MAX)  # RN(b/6) * S
    code, d = _e4m3_rne(q)
    return tl.where(bad, E4M3_NAN, code), tl.where(bad, 0.0, d)


# The E2M1 searches compare a = |x S| (>= 0) with thresholds t d (t a multiple of 0.25, d
# an E4M3 scale >= 2**-9) by the sign of fma(a, 2**40, -t d 2**40): a * 2**40 is exact and
# the fma rounds once, so the sign is exact and the result is 0 only for a == t d. Where a
# is within a factor 2 of t d, both are multiples of 2**-35, so a nonzero result is at
# least 2**5 and saturating it to [0, 1] gives exactly 1.0 (a > t d) or 0.0 (NaN too: a
# dead block's thresholds are NaN). ``a >= t d`` is ``a > pred(t d)``, the next fp32 below,
# which is RN(t d (1 - 2**-24)) for normal t d. All of it runs on the FMA pipe: the
# integer and logic pipe, at half its rate, is what bounds these kernels.
RNE_K = tl.constexpr(1099511627776.0)          # 2**40
RNE_KP = tl.constexpr(-1099511562240.0)        # -(1 - 2**-24) * 2**40, exact in fp32


@triton.jit
def _step(a, c):
    """1.0 where a * 2**40 + c > 0, else 0.0 (one fma, saturated)."""
    return tl.minimum(tl.maximum(tl.fma(a, RNE_K, c), 0.0), 1.0)


@triton.jit
def _rne_thresholds(d):
    """Per-block constants of the nearest-even search (all NaN for a dead block, so that
    every step is 0, even for an infinite element): -pred(1.75 d) 2**40; 0.75 d and
    2.75 d (b1's threshold before scaling); -d 2**40 times 0.25, 1, 1.5 and 2.25 (b0's)."""
    dl = tl.where(d > 0.0, d, float("nan"))
    dk = dl * -RNE_K
    return (dl * 1.75 * RNE_KP, dl * 0.75, dl * 2.75, dk * 0.25, dk, dk * 1.5, dk * 2.25)


@triton.jit
def _rne_codes(a, th):
    """casting.round_e2m1_codes of RN(a/d) (magnitude) as a binary search over the exact
    thresholds t d (see the comparisons above):

    b2 = a >= 1.75 d; b1 = a >= (b2 ? 3.5 : 0.75) d; b0 = a > t d with t = 0.25, 1.25, 2.5
    or 5 as (b2, b1) pick it; code = 4 b2 + 2 b1 + b0. Every threshold is formed exactly
    by fmas of the 0/1 steps with per-block constants.

    Returns int32 bits whose low 3 bits are the code; the bits from 24 up are not zero
    (0x4B000000 + code, the fp32 bits of 2**23 + code), which the callers' uses ignore:
    the byte packing keeps the low 8 bits and ``code << 22`` drops them."""
    b2 = _step(a, th[0])
    b1 = _step(a, tl.fma(b2, th[2], th[1]) * RNE_KP)
    b0 = _step(a, tl.fma(b1, tl.fma(b2, th[5], th[4]), tl.fma(b2, th[6], th[3])))
    code = tl.fma(b2, 4.0, tl.fma(b1, 2.0, b0))
    return (code + 8388608.0).to(tl.int32, bitcast=True)


@triton.jit
def _sr_prep(d):
    """Per-block values for stochastic rounding: a fp64 reciprocal of d good to ~2**-43 (0
    for a dead block) and the saturation bound 6 d (0 for a dead block, so that every
    element, inf and NaN included, is clamped to v = 0 there)."""
    live = d > 0.0
    ds = tl.where(live, d, 1.0)
    r0 = tl.math.fdiv(tl.full(d.shape, 1.0, tl.float32), ds)   # approximate
    d64 = ds.to(tl.float64)
    r = r0.to(tl.float64)
    r = r + r * (1.0 - d64 * r)                                 # one Newton step in fp64
    return tl.where(live, r, 0.0), tl.where(live, d * 6.0, 0.0)


@triton.jit
def _mul_rz(a, b):
    """fp32 a * b rounded toward zero, subnormal results kept (no flush to zero)."""
    return tl.inline_asm_elementwise("mul.rz.f32 $0, $1, $2;", "=r,r,r", [a, b],
                                     dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def _mix32(h):
    """draws.mix32 on uint32 (wrapping multiplies, logical shifts)."""
    h = h ^ (h >> 16)
    h = h * 0x7FEB352D
    h = h ^ (h >> 15)
    h = h * 0x846CA68B
    return h ^ (h >> 16)


@triton.jit
def _sr_hash(key_ptr, idx, IDX64: tl.constexpr, FLIP: tl.constexpr = False):
    """The uint32 hash h behind draws.uniforms_at of the row-major element indices ``idx``
    (int64 when IDX64, else non-negative int32) under the (2,) int64 key at ``key_ptr``;
    ``FLIP``: its complement ``~h`` (the last xor takes ``~k1``, no extra instruction)."""
    k0 = tl.load(key_ptr).to(tl.uint32)
    k1 = tl.load(key_ptr + 1).to(tl.uint32)
    if FLIP:
        k1 = k1 ^ 0xFFFFFFFF
    if IDX64:
        lo = idx.to(tl.uint32)
        hi = (idx >> 32).to(tl.uint32)
        return _mix32(lo * 0x9E3779B9 + hi * 0x85EBCA6B + k0) ^ k1
    else:
        return _mix32(idx.to(tl.uint32, bitcast=True) * 0x9E3779B9 + k0) ^ k1


@triton.jit
def _sr_uniform(key_ptr, idx, IDX64: tl.constexpr):
    """draws.uniforms_at: fp32 uniforms ``(h >> 10) * 2**-22`` of the indices ``idx``."""
    return (_sr_hash(key_ptr, idx, IDX64) >> 10).to(tl.float32) * 2.384185791015625e-07


@triton.jit
def _sr_bits(key_ptr, idx, IDX64: tl.constexpr):
    """The 22 random bits _sr_codes adds: ``(~h) >> 10 = 2**22 - 1 - (h >> 10)``."""
    return tl.umulhi(_sr_hash(key_ptr, idx, IDX64, True), 4194304)                # >> 10


@triton.jit
def _sr_codes(a, p, r):
    """casting.stochastic_round_e2m1_codes of v = RN(a/d) (magnitude), where ``r`` (uint32)
    is the kernel-side draw ``(~h) >> 10`` of the element's hash h (_sr_bits).

    v comes from fp64 (exact, see the module doc), clamped to 6 first (a <= 6 d; NaN and
    inf too, and a dead block, whose bound is 0, gives v = 0). Scaled by 2**-126 and
    rounded toward zero, v lands where the E2M1 grid is every fp32 bit pattern with the low
    22 bits clear: 0.5 is the subnormal 2**-127, 1 the smallest normal, and from there the
    grid is 2 significant bits. The low 22 bits of z are ``(v_t - lo) / span`` as a 22-bit
    fraction (v_t: v cut to a multiple of 2**-23, which is v itself from 1 up), so adding
    the 22 random bits r carries into bit 22 exactly when the draw ``u = (h >> 10) 2**-22
    < (v_t - lo) / span``, and the code is bits 22 up of the sum. All of it runs on the
    FMA and fp64 pipes but the clamp."""
    v = (tl.minimum(a, p[1]).to(tl.float64) * p[0]).to(tl.float32)
    z = _mul_rz(v, 1.1754943508222875e-38).to(tl.uint32, bitcast=True)  # * 2**-126
    return tl.umulhi(z + r, 1024).to(tl.int32)                          # >> 22


@triton.jit
def _live2(d):
    """The _sign_bit multiplier of a block: 2 where its decode scale d is live, else 0."""
    return tl.where(d > 0.0, 2, 0).to(tl.uint32)


@triton.jit
def _sign_bit(n, live2):
    """1 where n's sign bit is set and its block is live (live2 = 2), else 0 (live2 = 0):
    the high word of the 64-bit product, on the FMA pipe."""
    return tl.umulhi(n.to(tl.uint32, bitcast=True), live2).to(tl.int32)


@triton.jit
def _exact_value(c, sgn, d):
    """fp32 ``e2m1(code) * d`` with the code's sign (the dequantize kernel's product, exact
    in bf16): the code shifted to bits 22 up is the E2M1 value times 2**-126 (0.5 the
    subnormal 2**-127, see _sr_codes), the sign goes to bit 31. ``c``: bits 0-2 the code,
    bits from 10 up ignored."""
    word = (sgn << 31) + (c << 22)
    return (word.to(tl.float32, bitcast=True) * 8.507059173023462e37) * d  # * 2**126


@triton.jit
def _e4m3_decode(b):
    """E4M3 byte (int32 0..255) -> fp32 (exact; 0x7F/0xFF -> NaN)."""
    e = (b >> 3) & 15
    m = b & 7
    normal = (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
    sub = m.to(tl.float32) * 0.001953125
    v = tl.where(e == 0, sub, normal)
    v = tl.where((b & 0x80) != 0, v * -1.0, v)
    nan = tl.full(v.shape, 0x7FC00000, tl.int32).to(tl.float32, bitcast=True)
    return tl.where((b & 0x7F) == 0x7F, nan, v)


@triton.jit
def _e2m1_decode(c):
    """E2M1 code (int32, sign in bit 3) -> fp32, keeping the sign of zero.

    Built from bits: magnitudes 0 and 0.5 (the subnormals) are ``i * 0x3F000000``; for
    i >= 2 the value 2**((i >> 1) - 1) * (1 + (i & 1) / 2) has the fp32 bits
    ``(i + 252) << 22`` (exponent and mantissa bit side by side)."""
    i = c & 7
    bits = tl.where(i < 2, i * 0x3F000000, (i + 252) << 22)
    return (bits | ((c & 8) << 28)).to(tl.float32, bitcast=True)


# ---- memory helpers: mask-free when the tile divides the tensor (EVEN), 32-bit offsets
# when every offset fits (not IDX64) -----------------------------------------------------------
@triton.jit
def _ld(ptr, mask, other, EVEN: tl.constexpr):
    if EVEN:
        return tl.load(ptr)
    else:
        return tl.load(ptr, mask=mask, other=other)


@triton.jit
def _st(ptr, val, mask, EVEN: tl.constexpr):
    if EVEN:
        tl.store(ptr, val)
    else:
        tl.store(ptr, val, mask=mask)


@triton.jit
def _wide(i, IDX64: tl.constexpr):
    if IDX64:
        return i.to(tl.int64)
    else:
        return i


# ---- 16 slices and the RHT ----------------------------------------------------------------------
@triton.jit
def _split_last16(t):
    """(A, B, C, D, 16) -> tuple of the 16 tensors t[..., i] (A, B, C, D) (in-register)."""
    A: tl.constexpr = t.shape[0]
    B: tl.constexpr = t.shape[1]
    C: tl.constexpr = t.shape[2]
    D: tl.constexpr = t.shape[3]
    s2 = tl.split(tl.reshape(t, (A, B, C, D, 8, 2)))
    s4 = ()
    for a in tl.static_range(2):
        s4 = s4 + tl.split(tl.reshape(s2[a], (A, B, C, D, 4, 2)))
    s8 = ()
    for a in tl.static_range(4):
        s8 = s8 + tl.split(tl.reshape(s4[a], (A, B, C, D, 2, 2)))
    s16 = ()
    for a in tl.static_range(8):
        s16 = s16 + tl.split(s8[a])
    # s2[a] holds i = 2 n + a, s4[2 a + b] holds i = 4 n + 2 b + a, ...: s16 is indexed by
    # i with its 4 bits reversed
    out = ()
    for i in tl.static_range(16):
        out = out + (s16[((i & 1) << 3) | ((i & 2) << 1) | ((i & 4) >> 1) | ((i & 8) >> 3)],)
    return out


@triton.jit
def _stack4(a, b, c, d):
    """(A, B, C, D, 4) holding a, b, c, d along the new last axis."""
    A: tl.constexpr = a.shape[0]
    B: tl.constexpr = a.shape[1]
    C: tl.constexpr = a.shape[2]
    D: tl.constexpr = a.shape[3]
    # join(x, y)[..., i, j] is (x, y)[j][..., i]: flattened, element 2 i + j
    return tl.reshape(tl.join(tl.join(a, c), tl.join(b, d)), (A, B, C, D, 4))


@triton.jit
def _join_last16(ts):
    """Tuple of 16 tensors (A, B, C, D) -> (A, B, C, D, 16) with [..., i] = ts[i] (the
    inverse of _split_last16): element 2 i + j of a join of two stacks is stack j's i."""
    A: tl.constexpr = ts[0].shape[0]
    B: tl.constexpr = ts[0].shape[1]
    C: tl.constexpr = ts[0].shape[2]
    D: tl.constexpr = ts[0].shape[3]
    even = tl.reshape(tl.join(_stack4(ts[0], ts[4], ts[8], ts[12]),
                              _stack4(ts[2], ts[6], ts[10], ts[14])), (A, B, C, D, 8))
    odd = tl.reshape(tl.join(_stack4(ts[1], ts[5], ts[9], ts[13]),
                             _stack4(ts[3], ts[7], ts[11], ts[15])), (A, B, C, D, 8))
    return tl.reshape(tl.join(even, odd), (A, B, C, D, 16))


@triton.jit
def _bfly_stage(t, h: tl.constexpr):
    out = ()
    for i in tl.static_range(16):
        if (i & h) == 0:
            out = out + (t[i] + t[i + h],)
        else:
            out = out + (t[i - h] - t[i],)
    return out


@triton.jit
def _rht_half(xs):
    """Half of rht.rht_forward across 16 slices (all of it but the final * 2): x * s / 8 as
    one multiply by +-0.125 (sign mask 0xD7E8), then butterflies at strides 8, 4, 2, 1."""
    t = ()
    for i in tl.static_range(16):
        if ((0xD7E8 >> i) & 1) == 1:
            t = t + (xs[i] * -0.125,)
        else:
            t = t + (xs[i] * 0.125,)
    t = _bfly_stage(t, 8)
    t = _bfly_stage(t, 4)
    t = _bfly_stage(t, 2)
    return _bfly_stage(t, 1)


@triton.jit
def _rht(xs):
    """rht.rht_forward across 16 slices: _rht_half, then * 2."""
    t = _rht_half(xs)
    out = ()
    for i in tl.static_range(16):
        out = out + (t[i] * 2.0,)
    return out


@triton.jit
def _col_tile_index(m0, k0, KW: tl.constexpr):
    """Row (1, 4, 1, 1, 16) and column (8, 1, KW, 2, 1) indices of a column tile: 64 rows
    (4 groups g of 16 rows i) by 16 KW columns (k = k0 + 16 kw + 2 kp + p). Lanes go to
    (kp, g), warps to kw; the column pair p and the 16 rows i stay in each thread."""
    kp = tl.arange(0, 8)[:, None, None, None, None]
    g = tl.arange(0, 4)[None, :, None, None, None]
    kw = tl.arange(0, KW)[None, None, :, None, None]
    p = tl.arange(0, 2)[None, None, None, :, None]
    i = tl.arange(0, 16)[None, None, None, None, :]
    return m0 + g * 16 + i, k0 + kw * 16 + kp * 2 + p


@triton.jit
def _load_col_tile(x_ptr, M, K, SX, m0, k0, KW: tl.constexpr, EVEN: tl.constexpr,
                   IDX64: tl.constexpr):
    """The 16 row slices (8, 4, KW, 2) fp32 of a column tile of the (M, K) x (rows SX
    elements apart)."""
    rows, cols = _col_tile_index(m0, k0, KW)
    v = _ld(x_ptr + _wide(rows, IDX64) * SX + cols, (rows < M) & (cols < K), 0.0, EVEN)
    return _split_last16(v.to(tl.float32))


@triton.jit
def _tile_max(m):
    """Max of all elements of a tile (order is irrelevant for a max)."""
    n: tl.constexpr = m.numel
    return tl.max(tl.reshape(m, (n,), can_reorder=True), axis=0)


# ---- pass 1: global amax(es) and the global scales ----------------------------------------------
@triton.jit
def _nvfp4_amax_kernel(x_ptr, M, K, ws_ptr, rglob_ptr, cglob_ptr,
                       ROW: tl.constexpr, COL: tl.constexpr, RHT: tl.constexpr,
                       KW: tl.constexpr, FLAT: tl.constexpr, EVEN: tl.constexpr,
                       IDX64: tl.constexpr):
    """ws_ptr int32[3] zeroed: [0] finite amax of x, [1] finite amax of RHT(x^T) (fp32
    bits), [2] ticket counter. The last program writes S into rglob / cglob.

    Grid-stride: each program folds many tiles into register maxima and makes one atomic
    per amax (same-address atomics from one program per tile serialized in L2). Without
    the RHT a tile is FLAT elements of the flat array; with it a column tile (64 x 16 KW)."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    if RHT:
        nk = tl.cdiv(K, 16 * KW)
        m_plain = tl.zeros((8, 4, KW, 2), dtype=tl.float32)
        m_rht = tl.zeros((8, 4, KW, 2), dtype=tl.float32)
        for t in range(pid, tl.cdiv(M, 64) * nk, nprog):
            sl = _load_col_tile(x_ptr, M, K, K, (t // nk) * 64, (t % nk) * 16 * KW, KW, EVEN,
                                IDX64)
            if ROW:
                for i in tl.static_range(16):
                    m_plain = tl.maximum(m_plain, _finite_max(tl.abs(sl[i])))
            # max over the butterflies before their * 2, which is exact and finite exactly
            # for |z| <= FP32_MAX / 2: the finite max of the results is twice that of z
            z = _rht_half(sl)
            for i in tl.static_range(16):
                az = tl.abs(z[i])
                m_rht = tl.maximum(m_rht, tl.where(az <= FP32_HALF_MAX, az, 0.0))
        if ROW:
            tl.atomic_max(ws_ptr, _tile_max(m_plain).to(tl.int32, bitcast=True))
        tl.atomic_max(ws_ptr + 1, (_tile_max(m_rht) * 2.0).to(tl.int32, bitcast=True))
    else:
        am = tl.zeros((FLAT,), dtype=tl.float32)
        n = _wide(M, IDX64) * K
        for t in range(pid, tl.cdiv(n, FLAT), nprog):
            offs = _wide(t, IDX64) * FLAT + tl.arange(0, FLAT)
            v = _ld(x_ptr + offs, offs < n, 0.0, EVEN).to(tl.float32)
            am = tl.maximum(am, _finite_max(tl.abs(v)))
        tl.atomic_max(ws_ptr, tl.max(am, axis=0).to(tl.int32, bitcast=True))
    ticket = tl.atomic_add(ws_ptr + 2, 1)
    if ticket == tl.num_programs(0) - 1:
        # every program's atomic_max precedes its ticket (acq_rel): the maxima are final
        a_plain = tl.atomic_max(ws_ptr, 0).to(tl.float32, bitcast=True)
        a_rht = tl.atomic_max(ws_ptr + 1, 0).to(tl.float32, bitcast=True)
        if ROW:
            tl.store(rglob_ptr, _global_scale(a_plain))
        if COL:
            if RHT:
                tl.store(cglob_ptr, _global_scale(a_rht))
            else:
                tl.store(cglob_ptr, _global_scale(a_plain))


@triton.jit
def _nvfp4_group_amax_kernel(x_ptr, M, K, bgroup_ptr, ws_ptr, RHT: tl.constexpr,
                             KW: tl.constexpr, EVEN: tl.constexpr, IDX64: tl.constexpr):
    """Per-group amaxes of x (M, K), M a multiple of 16, each 16-row block in the group
    ``bgroup[block]`` (int32): ws_ptr int32 (G, 2) zeroed gets, as fp32 bits, each group's
    finite amax of x ([g, 0]) and, when RHT, of RHT(x^T) ([g, 1]), as
    :func:`_nvfp4_amax_kernel` computes them for one tensor.

    One program a band of 64 rows (4 blocks), looping over the columns; then one atomic
    max per block and amax."""
    pid = tl.program_id(0)
    m0 = pid * 64
    m_plain = tl.zeros((8, 4, KW, 2), dtype=tl.float32)
    m_rht = tl.zeros((8, 4, KW, 2), dtype=tl.float32)
    for k0 in range(0, K, 16 * KW):
        sl = _load_col_tile(x_ptr, M, K, K, m0, k0, KW, EVEN, IDX64)
        for i in tl.static_range(16):
            m_plain = tl.maximum(m_plain, _finite_max(tl.abs(sl[i])))
        if RHT:
            z = _rht_half(sl)  # max before the exact * 2, as _nvfp4_amax_kernel
            for i in tl.static_range(16):
                az = tl.abs(z[i])
                m_rht = tl.maximum(m_rht, tl.where(az <= FP32_HALF_MAX, az, 0.0))
    blk = m0 // 16 + tl.arange(0, 4)
    live = blk < M // 16
    gid = tl.load(bgroup_ptr + blk, mask=live, other=0)
    plain = tl.max(tl.max(tl.max(m_plain, axis=3), axis=2), axis=0)            # (4,)
    tl.atomic_max(ws_ptr + gid * 2, plain.to(tl.int32, bitcast=True), mask=live)
    if RHT:
        rht = tl.max(tl.max(tl.max(m_rht, axis=3), axis=2), axis=0) * 2.0
        tl.atomic_max(ws_ptr + gid * 2 + 1, rht.to(tl.int32, bitcast=True), mask=live)


# ---- pass 2a: rowwise ---------------------------------------------------------------------------
@triton.jit
def _nvfp4_row_kernel(x_ptr, M, K, SX, data_ptr, scale_ptr, glob_ptr, key_ptr, IDX0,
                      exact_ptr, TWO_D: tl.constexpr, SR: tl.constexpr, VEC: tl.constexpr,
                      KB: tl.constexpr, RB: tl.constexpr, EVEN: tl.constexpr,
                      IDX64: tl.constexpr, EXACT: tl.constexpr, CODES: tl.constexpr,
                      GROUPED: tl.constexpr = False):
    """Rowwise NVFP4 of x (M, K), rows SX elements apart: data (M, K/2) u8, scales (M, K/16)
    or (M/16, K/16) u8 (E4M3 bytes), S read from glob (GROUPED: glob holds one S per
    16-row block, the S of row r at glob[r // 16]); key (2,) int64 the
    stochastic-rounding key when SR, the element at (r, c) drawing index IDX0 + r K + c
    (a slice of a larger matrix draws the whole matrix's uniforms).

    Tile: RB rows x KB blocks of 16 columns; each thread owns one 1x16 block as H x VEC
    (H = 16 / VEC) elements, VEC contiguous per vector load. 1D: lanes over blocks, then
    rows; 2D: lanes over the 16 rows of a 16x16 block (RB = 16), then blocks.

    EXACT: also writes the exact bf16 ``q * d`` (M, K) to exact_ptr (the dequantize
    kernel's values, bit for bit); CODES=False: only those (no data or scales)."""
    H: tl.constexpr = 16 // VEC
    pid = tl.program_id(0)
    nkb = tl.cdiv(K // 16, KB)
    m0 = (pid // nkb) * RB
    kb0 = (pid % nkb) * KB
    K2 = K // 2
    K16 = K // 16
    # index tensors (X, Y, ...): (blocks, rows) for 1D, (rows, blocks) for 2D
    if TWO_D:
        r3 = m0 + tl.arange(0, RB)[:, None, None]
        b3 = kb0 + tl.arange(0, KB)[None, :, None]
    else:
        b3 = kb0 + tl.arange(0, KB)[:, None, None]
        r3 = m0 + tl.arange(0, RB)[None, :, None]
    r4 = r3[:, :, :, None]
    b4 = b3[:, :, :, None]
    h4 = tl.arange(0, H)[None, None, :, None]
    c4 = tl.arange(0, VEC)[None, None, None, :]
    mask4 = (r4 < M) & (b4 < K16)
    x = _ld(x_ptr + _wide(r4, IDX64) * SX + b4 * 16 + h4 * VEC + c4, mask4, 0.0,
            EVEN).to(tl.float32)
    # block max |x|, NaN-propagating (inf/NaN mark a bad block)
    bm = tl.reduce(tl.reduce(tl.abs(x), 3, _max_nan), 2, _max_nan)        # (X, Y)
    if TWO_D:
        bm = tl.reduce(bm, 0, _max_nan)                                     # (KB,)
        s = tl.load(glob_ptr + m0 // 16) if GROUPED else tl.load(glob_ptr)
        s4 = s
        sc, d = _block_scale(bm, s)
        srow = m0 // 16
        if CODES:
            _st(scale_ptr + _wide(srow, IDX64) * K16 + kb0 + tl.arange(0, KB),
                sc.to(tl.uint8), (srow < M // 16) & (kb0 + tl.arange(0, KB) < K16), EVEN)
        dd = d[None, :, None, None]
        sc4 = sc[None, :, None, None]
    else:
        r2 = m0 + tl.arange(0, RB)[None, :]
        b2 = kb0 + tl.arange(0, KB)[:, None]
        if GROUPED:
            s = tl.load(glob_ptr + r2 // 16, mask=r2 < M, other=1.0)           # (1, RB)
            s4 = s[:, :, None, None]
        else:
            s = tl.load(glob_ptr)
            s4 = s
        sc, d = _block_scale(bm, s)
        if CODES:
            _st(scale_ptr + _wide(r2, IDX64) * K16 + b2, sc.to(tl.uint8),
                (r2 < M) & (b2 < K16), EVEN)
        dd = d[:, :, None, None]
        sc4 = sc[:, :, None, None]
    n = x * s4
    a = tl.abs(n)
    if SR:
        rnd = _sr_bits(key_ptr, IDX0 + _wide(r4, IDX64) * K + b4 * 16 + h4 * VEC + c4, IDX64)
        code = _sr_codes(a, _sr_prep(dd), rnd)
    else:
        code = _rne_codes(a, _rne_thresholds(dd))
    sgn = _sign_bit(n, _live2(dd))
    if EXACT:
        # the scale decoded from the stored byte, as the dequantize kernel does
        ex = _exact_value(code, sgn, _e4m3_decode(sc4 & 0xFF)).to(tl.bfloat16)
        _st(exact_ptr + _wide(r4, IDX64) * K + b4 * 16 + h4 * VEC + c4, ex, mask4, EVEN)
    if CODES:
        X: tl.constexpr = x.shape[0]
        Y: tl.constexpr = x.shape[1]
        lo, hi = tl.split(tl.reshape(code + sgn * 8, (X, Y, 8, 2)))
        packed = (lo + hi * 16).to(tl.uint8)                                # (X, Y, 8)
        j3 = tl.arange(0, 8)[None, None, :]
        _st(data_ptr + _wide(r3, IDX64) * K2 + b3 * 8 + j3, packed, (r3 < M) & (b3 < K16),
            EVEN)


# ---- pass 2b: columnwise ------------------------------------------------------------------------
@triton.jit
def _nvfp4_col_kernel(x_ptr, M, K, SX, data_ptr, scale_ptr, glob_ptr, key_ptr, IDX0,
                      exact_ptr, RHT: tl.constexpr, TWO_D: tl.constexpr, SR: tl.constexpr,
                      KW: tl.constexpr, EVEN: tl.constexpr, IDX64: tl.constexpr,
                      EXACT: tl.constexpr, CODES: tl.constexpr, GROUPED: tl.constexpr = False):
    """Columnwise NVFP4 of x (M, K), rows SX elements apart: the rowwise quantization of
    x^T (RHT'd along M when RHT). data (K, M/2) u8, scales (K, M/16) or (K/16, M/16) u8, S
    from glob (GROUPED: one S per 16-row block of x, the S of a block of x^T's row at
    glob[m // 16]); key (2,) int64 the stochastic-rounding key when SR, element (k, m) of x^T
    drawing index IDX0 + k M + m. Tile: 64 rows x 16 KW columns (see _col_tile_index); each
    thread owns the 16x1 blocks of two adjacent columns in one 16-row group. EXACT: also
    writes the exact bf16 ``q * d`` (K, M) to exact_ptr (32 contiguous bytes a column a
    thread); CODES=False: only those (no data or scales)."""
    pid = tl.program_id(0)
    nk = tl.cdiv(K, 16 * KW)
    m0 = (pid // nk) * 64
    k0 = (pid % nk) * 16 * KW
    M2 = M // 2
    M16 = M // 16
    ys = _load_col_tile(x_ptr, M, K, SX, m0, k0, KW, EVEN, IDX64)
    if RHT:
        ys = _rht(ys)
    # per-column block max (NaN-propagating) across the 16 rows
    bm = tl.abs(ys[0])
    for i in tl.static_range(1, 16):
        bm = _max_nan(bm, tl.abs(ys[i]))                                     # (8, 4, KW, 2)
    kp = tl.arange(0, 8)[:, None, None, None]
    g = tl.arange(0, 4)[None, :, None, None]
    kw = tl.arange(0, KW)[None, None, :, None]
    p = tl.arange(0, 2)[None, None, None, :]
    col = k0 + kw * 16 + kp * 2 + p                                          # (8, 1, KW, 2)
    grp = m0 // 16 + g                                                       # (1, 4, 1, 1)
    if GROUPED:
        s = tl.load(glob_ptr + grp, mask=grp < M16, other=1.0)                # (1, 4, 1, 1)
    else:
        s = tl.load(glob_ptr)
    if TWO_D:
        bm2 = tl.reduce(tl.reduce(bm, 3, _max_nan), 0, _max_nan)            # (4, KW)
        sc, d = _block_scale(bm2, tl.reshape(s, (4, 1)) if GROUPED else s)
        okb = k0 // 16 + tl.arange(0, KW)[None, :]
        og = m0 // 16 + tl.arange(0, 4)[:, None]
        if CODES:
            _st(scale_ptr + _wide(okb, IDX64) * M16 + og, sc.to(tl.uint8),
                (okb < K // 16) & (og < M16), EVEN)
        dd = d[None, :, :, None]
        sc4 = sc[None, :, :, None]
    else:
        sc, dd = _block_scale(bm, s)
        sc4 = sc
        if CODES:
            _st(scale_ptr + _wide(col, IDX64) * M16 + grp, sc.to(tl.uint8),
                (col < K) & (grp < M16), EVEN)
    if SR:
        # hashes of (K, M) elements, one row slice at a time in the slices' own layout
        first = IDX0 + _wide(col, IDX64) * M + grp * 16                     # (8, 4, KW, 2)
        prep = _sr_prep(dd)
    else:
        th = _rne_thresholds(dd)
    live2 = _live2(dd)
    if EXACT:
        d_st = _e4m3_decode(sc4 & 0xFF)  # decoded from the stored bytes, as dequantize does
    codes = ()
    ex = ()
    for i in tl.static_range(16):
        n = ys[i] * s
        if SR:
            c = _sr_codes(tl.abs(n), prep, _sr_bits(key_ptr, first + i, IDX64))
        else:
            c = _rne_codes(tl.abs(n), th)
        sgn = _sign_bit(n, live2)
        codes = codes + (c + sgn * 8,)
        if EXACT:
            ex = ex + (_exact_value(c, sgn, d_st).to(tl.bfloat16),)
    if EXACT:
        col5e = col[:, :, :, :, None]
        grp5e = grp[:, :, :, :, None]
        i5 = tl.arange(0, 16)[None, None, None, None, :]
        _st(exact_ptr + _wide(col5e, IDX64) * M + grp5e * 16 + i5, _join_last16(ex),
            (col5e < K) & (grp5e < M16), EVEN)
    # byte jj of column k = code(row 2 jj) | code(row 2 jj + 1) << 4; stack jj last
    if CODES:
        pk = ()
        for jj in tl.static_range(8):
            pk = pk + (codes[2 * jj] + codes[2 * jj + 1] * 16,)
        w = tl.reshape(tl.join(tl.join(tl.join(pk[0], pk[4]), tl.join(pk[2], pk[6])),
                               tl.join(tl.join(pk[1], pk[5]), tl.join(pk[3], pk[7]))),
                       (8, 4, KW, 2, 8)).to(tl.uint8)   # nested joins index 4 c0 + 2 c1 + c2
        jj5 = tl.arange(0, 8)[None, None, None, None, :]
        col5 = col[:, :, :, :, None]
        _st(data_ptr + _wide(col5, IDX64) * M2 + grp[:, :, :, :, None] * 8 + jj5, w,
            (col5 < K) & (grp[:, :, :, :, None] < M16), EVEN)


# ---- dequantize to bf16 (q * d, no global scale) ------------------------------------------------
@triton.jit
def _nvfp4_dequant_unscaled_kernel(data_ptr, scale_ptr, out_ptr, R, C,
                                   TWO_D: tl.constexpr, KB: tl.constexpr, RB: tl.constexpr,
                                   EVEN: tl.constexpr, IDX64: tl.constexpr):
    """out (R, C) bf16 = q * d (exact in bf16) from data (R, C/2) u8 and E4M3 scale bytes.
    Each thread owns one 1x16 block: 8 bytes in, two 16-byte vectors out."""
    pid = tl.program_id(0)
    nkb = tl.cdiv(C // 16, KB)
    r0 = (pid // nkb) * RB
    kb0 = (pid % nkb) * KB
    C16 = C // 16
    b3 = kb0 + tl.arange(0, KB)[:, None, None]
    r3 = r0 + tl.arange(0, RB)[None, :, None]
    j3 = tl.arange(0, 8)[None, None, :]
    m3 = (r3 < R) & (b3 < C16)
    byte = _ld(data_ptr + _wide(r3, IDX64) * (C // 2) + b3 * 8 + j3, m3, 0,
               EVEN).to(tl.int32)                                           # (KB, RB, 8)
    if TWO_D:
        sb = _ld(scale_ptr + _wide(r3 // 16, IDX64) * C16 + b3, m3, 0, EVEN)
    else:
        sb = _ld(scale_ptr + _wide(r3, IDX64) * C16 + b3, m3, 0, EVEN)
    d = _e4m3_decode(sb.to(tl.int32))
    lo = (_e2m1_decode(byte & 15) * d).to(tl.bfloat16)
    hi = (_e2m1_decode(byte >> 4) * d).to(tl.bfloat16)
    out = tl.reshape(tl.join(lo, hi), (KB, RB, 2, 8))                       # element 2j + p
    b4 = b3[:, :, :, None]
    r4 = r3[:, :, :, None]
    h4 = tl.arange(0, 2)[None, None, :, None]
    c4 = tl.arange(0, 8)[None, None, None, :]
    _st(out_ptr + _wide(r4, IDX64) * C + b4 * 16 + h4 * 8 + c4, out, (r4 < R) & (b4 < C16),
        EVEN)
