"""Triton kernels for NVFP4 quantization and dequantization (launchers: :mod:`.launch`).

Bit-identical to :mod:`.reference` (the numerics definition). Every fp32
operation is the reference's, in its order; divisions use ``tl.math.div_rn``
(correctly rounded; Triton's ``/`` on fp32 may lower to an approximate
divide), E4M3 and E2M1 roundings are done with exact integer/compare
arithmetic (no reliance on the hardware fp8 conversion), and the kernels are
launched with FMA contraction off.

Two passes over the input:

1. ``_nvfp4_amax_kernel``: per (BM x BK) tile, the max of the finite ``|x|``
   and, when the columnwise side carries the RHT, the max of the finite
   ``|RHT(x^T)|``; combined across programs by int32 ``atomic_max`` on the
   fp32 bit patterns (all values are >= 0, so integer order is float order).
2. ``_nvfp4_quant_kernel``: per tile, computes the global encode scale(s)
   from the amax buffer (no host sync), then the rowwise blocks of the
   (BM, BK) tile and/or the columnwise blocks of its (BK, BM) transpose (RHT
   recomputed in registers), and stores packed codes and E4M3 scale bytes.

The RHT works on 16-element tiles along M: the (BK, BM) transposed tile is
viewed as (BK, BM/16, 16) and split into 16 slices, so the sign flips and
the four butterfly stages are plain elementwise fp32 ops in the reference's
order.
"""

import os

import triton
import triton.language as tl

FP32_MAX = tl.constexpr(3.4028234663852886e38)
E2M1_MAX = tl.constexpr(6.0)
E4M3_MAX = tl.constexpr(448.0)
GLOBAL_NUM = tl.constexpr(2688.0)  # 448 * 6
E4M3_NAN = tl.constexpr(0x7F)


# ---- small helpers ------------------------------------------------------------------------
if os.environ.get("TRITON_INTERPRET", "0") == "1":
    # The interpreter's tl.fma is an unfused multiply-add; emulate the fused one in fp64
    # (exact for the residuals computed with it, which are representable in fp32).
    @triton.jit
    def _fma(x, y, z):
        return (x.to(tl.float64) * y.to(tl.float64) + z.to(tl.float64)).to(tl.float32)
else:
    @triton.jit
    def _fma(x, y, z):
        return tl.fma(x, y, z)


@triton.jit
def _finite_abs(t):
    """|t| where finite, else 0 (NaN compares false)."""
    a = tl.abs(t)
    return tl.where(a <= FP32_MAX, a, 0.0)


@triton.jit
def _global_scale(amax):
    """S = 2688 / amax (fp32, correctly rounded); amax 0 -> 1; inf -> fp32 max."""
    s = tl.math.div_rn(GLOBAL_NUM, amax)
    s = tl.where(amax == 0.0, 1.0, s)
    s = tl.where(s > FP32_MAX, FP32_MAX, s)
    return s


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
def _e2m1_val(i):
    """E2M1 magnitude for a 3-bit index (int32 0..7): 0, .5, 1, 1.5, 2, 3, 4, 6."""
    return tl.where(i < 5, i.to(tl.float32) * 0.5,
                    tl.where(i == 5, 3.0, tl.where(i == 6, 4.0, 6.0)))


@triton.jit
def _e2m1_decode(c):
    """E2M1 code (int32, sign in bit 3) -> fp32, keeping the sign of zero."""
    mag = _e2m1_val(c & 7)
    return tl.where((c & 8) != 0, mag * -1.0, mag)


@triton.jit
def _e2m1_rne_codes(a, d):
    """E2M1 magnitude codes of RN(a / d), nearest-even and saturating, as
    casting.round_e2m1_codes, without dividing.

    For d an E4M3 value (<= 4 significant bits) and a threshold t of the
    rounding (<= 3 bits), t * d is exact and RN(a/d) > t <=> a > t*d,
    RN(a/d) >= t <=> a >= t*d (a/d cannot fall strictly between t and the
    rounding midpoint next to it; checked exhaustively for every E4M3 d).
    """
    return ((a > d * 0.25).to(tl.int32) + (a >= d * 0.75).to(tl.int32)
            + (a > d * 1.25).to(tl.int32) + (a >= d * 1.75).to(tl.int32)
            + (a > d * 2.5).to(tl.int32) + (a >= d * 3.5).to(tl.int32)
            + (a > d * 5.0).to(tl.int32))


@triton.jit
def _div_rn_e4m3(a, d, r):
    """RN(a / d) in fp32 for a >= 0 finite and d > 0 an E4M3 value, r = RN(1 / d).

    Exact whenever the quotient is a normal fp32 (>= 2**-126); below that it
    is some value in [0, 2**-126) (callers only need its sign there). Small
    operands (a < 2**-60) are scaled, with d, by 2**64 so that the residuals
    a - q*d are exact (FMA); q0 = a*r is corrected once (Markstein) and then
    moved by one ulp where the exact residual shows it is not the
    nearest-even quotient. d may be any value with <= 4 significant bits
    (6 included).
    """
    small = a < 8.673617379884035e-19                   # 2**-60
    a2 = a * tl.where(small, 18446744073709551616.0, 1.0)  # * 2**64, exact
    d2 = d * tl.where(small, 18446744073709551616.0, 1.0)
    r2 = r * tl.where(small, 5.421010862427522e-20, 1.0)   # * 2**-64, exact (r >= 1/448)
    q0 = a2 * r2
    q1 = _fma(_fma(q0 * -1.0, d2, a2), r2, q0)
    qb = q1.to(tl.int32, bitcast=True)
    e = qb >> 23
    ub = tl.where(e > 23, (e - 23) << 23, 1 << tl.maximum(e - 1, 0))
    u = ub.to(tl.float32, bitcast=True)                 # ulp(q1), q1 normal
    hu = (u * d2) * 0.5                                 # half an ulp above, in a-space
    hd = tl.where(((qb & 0x7FFFFF) == 0) & (e > 1), hu * 0.5, hu)  # half the gap below
    rho = _fma(q1 * -1.0, d2, a2)                       # exact
    odd = (qb & 1) == 1
    up = (rho > hu) | ((rho == hu) & odd)
    down = (rho < hd * -1.0) | ((rho == hd * -1.0) & odd)
    qb = qb + up.to(tl.int32) - down.to(tl.int32)
    return tl.where(e >= 1, qb.to(tl.float32, bitcast=True), q1)


@triton.jit
def _div6_rn(b):
    """RN(b / 6) in fp32 for finite b >= 0, subnormal results included."""
    q = _div_rn_e4m3(b, tl.full(b.shape, 6.0, tl.float32),
                     tl.full(b.shape, 0.1666666716337204, tl.float32))  # RN(1/6)
    # quotient below 2**-126: round b * 2**149 / 6 to an integer (b < 6 * 2**-126 here, so
    # b * 2**149 is an integer < 2**26) and scale back
    bs = tl.minimum(b, 7.052966104933725e-38)
    bi = ((bs * 1.2676506002282294e30) * 562949953421312.0).to(tl.int32)  # * 2**100 * 2**49
    qi = bi // 6
    rem = bi - qi * 6
    qi = qi + ((rem > 3) | ((rem == 3) & ((qi & 1) == 1))).to(tl.int32)
    # * 2**-149 in two exact steps (a subnormal literal would make Triton use fp64)
    qs = (qi.to(tl.float32) * 7.888609052210118e-31) * 1.7763568394002505e-15
    return tl.where(b < 7.052966104933725e-38, qs, q)  # b < 6 * 2**-126


@triton.jit
def _e2m1_sr_codes(a, d, r, rand):
    """Magnitude codes of casting.stochastic_round_e2m1_codes for v = RN(a / d).

    Grid position by exact comparisons (as _e2m1_rne_codes); round up when
    rand < (|v| - lo) / (hi - lo), evaluated exactly as rand * span < |v| - lo
    (span is a power of two, |v| - lo is exact by Sterbenz). Quotients below
    2**-126 only matter through v > 0, i.e. a > d * 2**-150.
    """
    lo_i = ((a >= d * 0.5).to(tl.int32) + (a >= d * 1.0).to(tl.int32)
            + (a >= d * 1.5).to(tl.int32) + (a >= d * 2.0).to(tl.int32)
            + (a >= d * 3.0).to(tl.int32) + (a >= d * 4.0).to(tl.int32)
            + (a >= d * 6.0).to(tl.int32))
    hi_i = tl.minimum(lo_i + 1, 7)
    lo = _e2m1_val(lo_i)
    hi = _e2m1_val(hi_i)
    span = tl.where(hi > lo, hi - lo, 1.0)
    v = _div_rn_e4m3(a, d, r)
    pos = (a * 1.2676506002282294e30) > (d * 8.881784197001252e-16)  # a*2**100 > d*2**-50
    tiny = tl.full(v.shape, 1, tl.int32).to(tl.float32, bitcast=True)  # 2**-149
    v = tl.where(pos, tl.maximum(v, tiny), 0.0)
    up = (rand * span < v - lo) & (hi > lo)
    return tl.where(up, hi_i, lo_i)


# ---- slices and the RHT ---------------------------------------------------------------------------
# A (BM, BK) = (16 G, 16 NB) tile of x at (m0, k0) is held as 16 "slices": slice i holds rows
# m0 + 16 g + i (g < G) as two (8, NB, G) tensors E and O indexed [j, kb, g]: E the even
# columns k0 + 16 kb + 2 j, O the odd ones (k + 1). Rowwise 1x16 blocks are reductions over
# axis 0 (E and O together); the columnwise 16x1 blocks along M and the RHT tiles run across
# the 16 slices, so they are elementwise. The tile is loaded once as a (8, NB, G, 2, 16) view:
# the dimension order makes Triton's coalescing put the column pair in-thread, lanes along
# the columns (a warp reads a contiguous row segment) and warps along g, leaving the 16
# slice rows in registers, where splitting them apart costs nothing.
@triton.jit
def _split_last16(t):
    """(A, B, C, D, 16) -> tuple of the 16 tensors t[..., i] (A, B, C, D)."""
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
def _join_last16(ts):
    """Inverse of _split_last16 for 16 tensors (A, B, C) -> (A, B, C, 16)."""
    A: tl.constexpr = ts[0].shape[0]
    B: tl.constexpr = ts[0].shape[1]
    C: tl.constexpr = ts[0].shape[2]
    s8 = ()
    for f in tl.static_range(8):
        # s16[2 f] = ts[rev(2 f)] = ts[rev(f) >> 1], s16[2 f + 1] = ts[(rev(f) >> 1) + 8]
        s8 = s8 + (tl.join(ts[(((f & 1) << 2) | (f & 2) | ((f & 4) >> 2))],
                           ts[(((f & 1) << 2) | (f & 2) | ((f & 4) >> 2)) + 8]),)
    s4 = ()
    for c in tl.static_range(4):
        s4 = s4 + (tl.reshape(tl.join(s8[2 * c], s8[2 * c + 1]), (A, B, C, 4)),)
    s2 = ()
    for a in tl.static_range(2):
        s2 = s2 + (tl.reshape(tl.join(s4[2 * a], s4[2 * a + 1]), (A, B, C, 8)),)
    return tl.reshape(tl.join(s2[0], s2[1]), (A, B, C, 16))


@triton.jit
def _tile_index(m0, k0, G: tl.constexpr, NB: tl.constexpr):
    """Row (1, 1, G, 1, 16) and column (8, NB, 1, 2, 1) indices of a tile's 5-D view."""
    j = tl.arange(0, 8)[:, None, None, None, None]
    kb = tl.arange(0, NB)[None, :, None, None, None]
    g = tl.arange(0, G)[None, None, :, None, None]
    p = tl.arange(0, 2)[None, None, None, :, None]
    i = tl.arange(0, 16)[None, None, None, None, :]
    return m0 + g * 16 + i, k0 + kb * 16 + j * 2 + p


@triton.jit
def _load_slices(ptr, stride_m, stride_k, M, K, m0, k0, other,
                 G: tl.constexpr, NB: tl.constexpr):
    """The 16 slices of the tile at (m0, k0) of an (M, K) matrix (element [m, k] at
    m * stride_m + k * stride_k), as fp32 tuples (E, O) of (8, NB, G) tensors."""
    rows, cols = _tile_index(m0, k0, G, NB)
    v = tl.load(ptr + rows.to(tl.int64) * stride_m + cols.to(tl.int64) * stride_k,
                mask=(rows < M) & (cols < K), other=other)
    sl = _split_last16(v.to(tl.float32))
    es = ()
    os_ = ()
    for a in tl.static_range(16):
        e, o = tl.split(sl[a])
        es = es + (e,)
        os_ = os_ + (o,)
    return es, os_


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
def _rht(xs):
    """rht.rht_forward across 16 slices: signs (mask 0xD7E8; multiply by -1 as the
    reference does -- Triton's unary minus is 0 - x, which loses -0), butterflies at
    strides 8, 4, 2, 1, then * 0.25."""
    t = ()
    for i in tl.static_range(16):
        if ((0xD7E8 >> i) & 1) == 1:
            t = t + (xs[i] * -1.0,)
        else:
            t = t + (xs[i],)
    t = _bfly_stage(t, 8)
    t = _bfly_stage(t, 4)
    t = _bfly_stage(t, 2)
    t = _bfly_stage(t, 1)
    out = ()
    for i in tl.static_range(16):
        out = out + (t[i] * 0.25,)
    return out


# ---- blocks and codes -------------------------------------------------------------------------------
@triton.jit
def _amax_bad(a):
    """(|a| with non-finite -> 0, 1 where non-finite else 0) for a = |x|."""
    fin = a <= FP32_MAX
    return tl.where(fin, a, 0.0), tl.where(fin, 0, 1)


@triton.jit
def _block_scale(bamax, bad, s):
    """E4M3 d = cast((bamax / 6) * S) (code int32, value fp32); NaN code and d = 0 for a
    block holding a non-finite element (its codes are then 0, as the reference's)."""
    q = tl.minimum(_div6_rn(bamax) * s, E4M3_MAX)
    code, d = _e4m3_rne(q)
    return tl.where(bad != 0, E4M3_NAN, code), tl.where(bad != 0, 0.0, d)


@triton.jit
def _recip(d, SR: tl.constexpr):
    if SR:
        # an approximate 1/d is enough: _div_rn_e4m3 corrects to the exact quotient
        return tl.math.fdiv(tl.full(d.shape, 1.0, tl.float32), tl.where(d > 0.0, d, 1.0))
    else:
        return d


@triton.jit
def _codes(t, s, d, r, rand, SR: tl.constexpr):
    """E2M1 codes (int32, sign in bit 3) of v = RN((t * S) / d), as the reference."""
    n = t * s
    a = tl.abs(n)
    if SR:
        code = _e2m1_sr_codes(a, d, r, rand)
    else:
        code = _e2m1_rne_codes(a, d)
    code = code | tl.where(n.to(tl.int32, bitcast=True) < 0, 8, 0)
    return tl.where(d > 0.0, code, 0)


@triton.jit
def _slices_amax(es, os_):
    """Elementwise max over the 16 slices of the finite |.| and of the non-finite flags."""
    m, b = _amax_bad(tl.abs(es[0]))
    for i in tl.static_range(16):
        a1, b1 = _amax_bad(tl.abs(es[i]))
        a2, b2 = _amax_bad(tl.abs(os_[i]))
        m = tl.maximum(m, tl.maximum(a1, a2))
        b = tl.maximum(b, tl.maximum(b1, b2))
    return m, b


# ---- pass 1: global amax(es) --------------------------------------------------------------------------
@triton.jit
def _nvfp4_amax_kernel(x_ptr, stride_xm, stride_xk, M, K, amax_ptr,
                       PLAIN: tl.constexpr, RHT: tl.constexpr,
                       BM: tl.constexpr, BK: tl.constexpr):
    """amax_ptr (int32[2], zeroed): [0] finite amax of x, [1] finite amax of RHT(x^T)."""
    G: tl.constexpr = BM // 16
    NB: tl.constexpr = BK // 16
    pid = tl.program_id(0)
    nk = tl.cdiv(K, BK)
    m0 = (pid // nk) * BM
    k0 = (pid % nk) * BK
    es, os_ = _load_slices(x_ptr, stride_xm, stride_xk, M, K, m0, k0, 0.0, G, NB)
    if PLAIN:
        m = _slices_amax(es, os_)[0]
        tl.atomic_max(amax_ptr, tl.max(tl.max(tl.max(m, axis=2), axis=1), axis=0)
                      .to(tl.int32, bitcast=True))
    if RHT:
        m = _slices_amax(_rht(es), _rht(os_))[0]
        tl.atomic_max(amax_ptr + 1, tl.max(tl.max(tl.max(m, axis=2), axis=1), axis=0)
                      .to(tl.int32, bitcast=True))


# ---- pass 2: quantize -----------------------------------------------------------------------------------
@triton.jit
def _nvfp4_quant_kernel(x_ptr, stride_xm, stride_xk, M, K, amax_ptr,
                        rdata_ptr, rscale_ptr, rglob_ptr, rrand_ptr,
                        cdata_ptr, cscale_ptr, cglob_ptr, crand_ptr,
                        ROW: tl.constexpr, COL: tl.constexpr, RHT: tl.constexpr,
                        TWO_D: tl.constexpr, SR: tl.constexpr,
                        BM: tl.constexpr, BK: tl.constexpr):
    """Rowwise (M, K) and/or columnwise (K, M) NVFP4 of one (BM, BK) tile of x.

    rowwise: rdata (M, K/2) u8, rscale (M, K/16) or (M/16, K/16) u8 (E4M3 bytes), rglob (1,)
    columnwise: cdata (K, M/2), cscale (K, M/16) or (K/16, M/16), cglob (1,).
    rrand (M, K) / crand (K, M): contiguous fp32 uniforms when SR.
    """
    G: tl.constexpr = BM // 16
    NB: tl.constexpr = BK // 16
    pid = tl.program_id(0)
    nk = tl.cdiv(K, BK)
    m0 = (pid // nk) * BM
    k0 = (pid % nk) * BK
    es, os_ = _load_slices(x_ptr, stride_xm, stride_xk, M, K, m0, k0, 0.0, G, NB)
    # index helpers: [j, kb, g] and [kb, g]
    j3 = tl.arange(0, 8)[:, None, None]
    kb3 = tl.arange(0, NB)[None, :, None]
    g3 = tl.arange(0, G)[None, None, :]
    kb2 = tl.arange(0, NB)[:, None]
    g2 = tl.arange(0, G)[None, :]
    amax_plain = tl.load(amax_ptr).to(tl.float32, bitcast=True)

    if ROW:
        s = _global_scale(amax_plain)
        if pid == 0:
            tl.store(rglob_ptr, s)
        if SR:
            res, ros = _load_slices(rrand_ptr, K, 1, M, K, m0, k0, 1.0, G, NB)
        else:
            res, ros = es, os_
        K2 = K // 2
        K16 = K // 16
        if TWO_D:
            bm = tl.zeros((NB, G), tl.float32)
            bb = tl.zeros((NB, G), tl.int32)
            for i in tl.static_range(16):
                ae, be = _amax_bad(tl.abs(es[i]))
                ao, bo = _amax_bad(tl.abs(os_[i]))
                bm = tl.maximum(bm, tl.max(tl.maximum(ae, ao), axis=0))
                bb = tl.maximum(bb, tl.max(tl.maximum(be, bo), axis=0))
            sc2, d2 = _block_scale(bm, bb, s)
            dd = d2[None, :, :]
            rr = _recip(dd, SR)
            srow = m0 // 16 + g2
            scol = k0 // 16 + kb2
            tl.store(rscale_ptr + srow.to(tl.int64) * K16 + scol, sc2.to(tl.uint8),
                     mask=(srow < M // 16) & (scol < K16))
        packed = ()
        scales = ()
        for i in tl.static_range(16):
            if not TWO_D:
                ae, be = _amax_bad(tl.abs(es[i]))
                ao, bo = _amax_bad(tl.abs(os_[i]))
                sc1, d1 = _block_scale(tl.max(tl.maximum(ae, ao), axis=0),
                                       tl.max(tl.maximum(be, bo), axis=0), s)
                scales = scales + (sc1[None, :, :],)
                dd = d1[None, :, :]
                rr = _recip(dd, SR)
            ce = _codes(es[i], s, dd, rr, res[i], SR)
            co = _codes(os_[i], s, dd, rr, ros[i], SR)
            packed = packed + (ce | (co << 4),)
        # (8, NB, G, 16): byte k0/2 + 8 kb + j of row m0 + 16 g + i
        r4 = m0 + g3[:, :, :, None] * 16 + tl.arange(0, 16)[None, None, None, :]
        c4 = k0 // 2 + kb3[:, :, :, None] * 8 + j3[:, :, :, None]
        tl.store(rdata_ptr + r4.to(tl.int64) * K2 + c4, _join_last16(packed).to(tl.uint8),
                 mask=(r4 < M) & (c4 < K2))
        if not TWO_D:
            # (1, NB, G, 16): scale k0/16 + kb of row m0 + 16 g + i
            c4s = k0 // 16 + kb3[:, :, :, None]
            tl.store(rscale_ptr + r4.to(tl.int64) * K16 + c4s,
                     _join_last16(scales).to(tl.uint8), mask=(r4 < M) & (c4s < K16))

    if COL:
        if RHT:
            ys = _rht(es)
            yo = _rht(os_)
            s = _global_scale(tl.load(amax_ptr + 1).to(tl.float32, bitcast=True))
        else:
            ys = es
            yo = os_
            s = _global_scale(amax_plain)
        if pid == 0:
            tl.store(cglob_ptr, s)
        if SR:
            res, ros = _load_slices(crand_ptr, 1, M, M, K, m0, k0, 1.0, G, NB)
        else:
            res, ros = ys, yo
        M2 = M // 2
        M16 = M // 16
        # block amaxes across the 16 slices (per column k: a 16x1 block along M)
        me, be = _slices_amax(ys, ys)
        mo, bo = _slices_amax(yo, yo)
        kcol = k0 + kb3 * 16 + j3 * 2          # even column of each pair, (8, NB, 1)
        if TWO_D:
            sc2, d2 = _block_scale(tl.max(tl.maximum(me, mo), axis=0),
                                   tl.max(tl.maximum(be, bo), axis=0), s)
            de = d2[None, :, :]
            do = de
            srow = k0 // 16 + kb2
            scol = m0 // 16 + g2
            tl.store(cscale_ptr + srow.to(tl.int64) * M16 + scol, sc2.to(tl.uint8),
                     mask=(srow < K // 16) & (scol < M16))
        else:
            sce, de = _block_scale(me, be, s)
            sco, do = _block_scale(mo, bo, s)
            # (8, NB, G, 2): scale m0/16 + g of column kcol + p
            k4 = kcol[:, :, :, None] + tl.arange(0, 2)[None, None, None, :]
            c4 = m0 // 16 + g3[:, :, :, None]
            tl.store(cscale_ptr + k4.to(tl.int64) * M16 + c4, tl.join(sce, sco).to(tl.uint8),
                     mask=(k4 < K) & (c4 < M16))
        re_ = _recip(de, SR)
        ro_ = _recip(do, SR)
        ce = ()
        co = ()
        for i in tl.static_range(16):
            ce = ce + (_codes(ys[i], s, de, re_, res[i], SR),)
            co = co + (_codes(yo[i], s, do, ro_, ros[i], SR),)
        # byte (k, m0/2 + 8 g + jj) = code(i = 2 jj) | code(i = 2 jj + 1) << 4
        pe = ()
        po = ()
        for jj in tl.static_range(8):
            pe = pe + (ce[2 * jj] | (ce[2 * jj + 1] << 4),)
            po = po + (co[2 * jj] | (co[2 * jj + 1] << 4),)
        # stack jj as a new axis (nested joins index it 4 c0 + 2 c1 + c2), then p
        we = tl.reshape(tl.join(tl.join(tl.join(pe[0], pe[4]), tl.join(pe[2], pe[6])),
                                tl.join(tl.join(pe[1], pe[5]), tl.join(pe[3], pe[7]))),
                        (8, NB, G, 8))
        wo = tl.reshape(tl.join(tl.join(tl.join(po[0], po[4]), tl.join(po[2], po[6])),
                                tl.join(tl.join(po[1], po[5]), tl.join(po[3], po[7]))),
                        (8, NB, G, 8))
        w = tl.join(we, wo).to(tl.uint8)                     # (8 j, NB, G, 8 jj, 2 p)
        k5 = kcol[:, :, :, None, None] + tl.arange(0, 2)[None, None, None, None, :]
        c5 = m0 // 2 + g3[:, :, :, None, None] * 8 + tl.arange(0, 8)[None, None, None, :, None]
        tl.store(cdata_ptr + k5.to(tl.int64) * M2 + c5, w, mask=(k5 < K) & (c5 < M2))


# ---- dequantize to bf16 (q * d, no global scale) ----------------------------------------------------------
@triton.jit
def _nvfp4_dequant_unscaled_kernel(data_ptr, scale_ptr, out_ptr, R, C,
                                   TWO_D: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr):
    """out (R, C) bf16 = q * d (exact in bf16) from data (R, C/2) u8 and E4M3 scale bytes."""
    NB: tl.constexpr = BC // 16
    pid = tl.program_id(0)
    nc = tl.cdiv(C, BC)
    r0 = (pid // nc) * BR
    kb0 = (pid % nc) * NB
    gi = tl.arange(0, BR // 16)[:, None, None, None]
    ii = tl.arange(0, 16)[None, :, None, None]
    kb = (kb0 + tl.arange(0, NB))[None, None, :, None]
    j = tl.arange(0, 8)[None, None, None, :]
    rows = r0 + gi * 16 + ii                                  # (BR/16, 16, 1, 1)
    rmask = rows < R
    r64 = rows.to(tl.int64)
    C16 = C // 16
    b = tl.load(data_ptr + r64 * (C // 2) + kb * 8 + j, mask=rmask & (kb < C16),
                other=0).to(tl.int32)
    if TWO_D:
        srow = r0 // 16 + gi
        sb = tl.load(scale_ptr + srow.to(tl.int64) * C16 + kb, mask=(srow < R // 16) & (kb < C16),
                     other=0).to(tl.int32)
    else:
        sb = tl.load(scale_ptr + r64 * C16 + kb, mask=rmask & (kb < C16), other=0).to(tl.int32)
    d = _e4m3_decode(sb)
    lo = (_e2m1_decode(b & 15) * d).to(tl.bfloat16)
    hi = (_e2m1_decode(b >> 4) * d).to(tl.bfloat16)
    out = tl.join(lo, hi)                                     # (BR/16, 16, NB, 8, 2)
    cols = (kb[:, :, :, :, None] * 16 + j[:, :, :, :, None] * 2
            + tl.arange(0, 2)[None, None, None, None, :])
    tl.store(out_ptr + r64[:, :, :, :, None] * C + cols, out,
             mask=rmask[:, :, :, :, None] & (cols < C))
