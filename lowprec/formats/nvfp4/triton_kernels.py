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

import triton
import triton.language as tl

FP32_MAX: tl.constexpr = 3.4028234663852886e38
E2M1_MAX: tl.constexpr = 6.0
E4M3_MAX: tl.constexpr = 448.0
GLOBAL_NUM: tl.constexpr = 2688.0  # 448 * 6
E4M3_NAN: tl.constexpr = 0x7F


# ---- small helpers ------------------------------------------------------------------------
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
    v = tl.where((b & 0x80) != 0, -v, v)
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
    return tl.where((c & 8) != 0, -mag, mag)


@triton.jit
def _e2m1_rne_codes(v):
    """As casting.round_e2m1_codes: nearest-even, saturating; no sign."""
    a = tl.abs(v)
    return ((a > 0.25).to(tl.int32) + (a >= 0.75).to(tl.int32) + (a > 1.25).to(tl.int32)
            + (a >= 1.75).to(tl.int32) + (a > 2.5).to(tl.int32) + (a >= 3.5).to(tl.int32)
            + (a > 5.0).to(tl.int32))


@triton.jit
def _e2m1_sr_codes(v, rand):
    """As casting.stochastic_round_e2m1_codes: up when rand < (|v|-lo)/(hi-lo); no sign."""
    a = tl.minimum(tl.abs(v), E2M1_MAX)
    lo_i = ((a >= 0.5).to(tl.int32) + (a >= 1.0).to(tl.int32) + (a >= 1.5).to(tl.int32)
            + (a >= 2.0).to(tl.int32) + (a >= 3.0).to(tl.int32) + (a >= 4.0).to(tl.int32)
            + (a >= 6.0).to(tl.int32))
    hi_i = tl.minimum(lo_i + 1, 7)
    lo = _e2m1_val(lo_i)
    hi = _e2m1_val(hi_i)
    span = tl.where(hi > lo, hi - lo, 1.0)
    p_hi = tl.math.div_rn(a - lo, span)
    up = (rand < p_hi) & (hi > lo)
    code = tl.where(up, hi_i, lo_i)
    return tl.where(v != v, 0, code)


# ---- 16-slice views and the RHT -----------------------------------------------------------
@triton.jit
def _halves(t):
    """(A, B, N) -> (t[..., 0::2], t[..., 1::2]), each (A, B, N/2)."""
    A: tl.constexpr = t.shape[0]
    B: tl.constexpr = t.shape[1]
    N: tl.constexpr = t.shape[2]
    return tl.split(tl.reshape(t, (A, B, N // 2, 2)))


@triton.jit
def _unhalves(e, o):
    """Inverse of _halves."""
    A: tl.constexpr = e.shape[0]
    B: tl.constexpr = e.shape[1]
    N: tl.constexpr = e.shape[2]
    return tl.reshape(tl.join(e, o), (A, B, 2 * N))


@triton.jit
def _split16(t):
    """(A, B, 16) -> 16 tensors (A, B): t[..., 0], ..., t[..., 15]."""
    e, o = _halves(t)          # i = 2j, 2j+1
    e0, e1 = _halves(e)        # 4j, 4j+2
    o0, o1 = _halves(o)        # 4j+1, 4j+3
    e00, e01 = _halves(e0)     # 8j, 8j+4
    e10, e11 = _halves(e1)     # 8j+2, 8j+6
    o00, o01 = _halves(o0)     # 8j+1, 8j+5
    o10, o11 = _halves(o1)     # 8j+3, 8j+7
    x0, x8 = tl.split(e00)
    x4, x12 = tl.split(e01)
    x2, x10 = tl.split(e10)
    x6, x14 = tl.split(e11)
    x1, x9 = tl.split(o00)
    x5, x13 = tl.split(o01)
    x3, x11 = tl.split(o10)
    x7, x15 = tl.split(o11)
    return x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15


@triton.jit
def _join16(x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15):
    """Inverse of _split16."""
    e00 = tl.join(x0, x8)
    e01 = tl.join(x4, x12)
    e10 = tl.join(x2, x10)
    e11 = tl.join(x6, x14)
    o00 = tl.join(x1, x9)
    o01 = tl.join(x5, x13)
    o10 = tl.join(x3, x11)
    o11 = tl.join(x7, x15)
    e0 = _unhalves(e00, e01)
    e1 = _unhalves(e10, e11)
    o0 = _unhalves(o00, o01)
    o1 = _unhalves(o10, o11)
    e = _unhalves(e0, e1)
    o = _unhalves(o0, o1)
    return _unhalves(e, o)


@triton.jit
def _bfly(a, b):
    return a + b, a - b


@triton.jit
def _rht16(x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15):
    """rht.rht_forward on 16 slices: sign flips (mask 0xD7E8), butterflies 8, 4, 2, 1, * 0.25."""
    x3 = -x3
    x5 = -x5
    x6 = -x6
    x7 = -x7
    x8 = -x8
    x9 = -x9
    x10 = -x10
    x12 = -x12
    x14 = -x14
    x15 = -x15
    # butterflies at stride 8
    x0, x8 = _bfly(x0, x8)
    x1, x9 = _bfly(x1, x9)
    x2, x10 = _bfly(x2, x10)
    x3, x11 = _bfly(x3, x11)
    x4, x12 = _bfly(x4, x12)
    x5, x13 = _bfly(x5, x13)
    x6, x14 = _bfly(x6, x14)
    x7, x15 = _bfly(x7, x15)
    # butterflies at stride 4
    x0, x4 = _bfly(x0, x4)
    x1, x5 = _bfly(x1, x5)
    x2, x6 = _bfly(x2, x6)
    x3, x7 = _bfly(x3, x7)
    x8, x12 = _bfly(x8, x12)
    x9, x13 = _bfly(x9, x13)
    x10, x14 = _bfly(x10, x14)
    x11, x15 = _bfly(x11, x15)
    # butterflies at stride 2
    x0, x2 = _bfly(x0, x2)
    x1, x3 = _bfly(x1, x3)
    x4, x6 = _bfly(x4, x6)
    x5, x7 = _bfly(x5, x7)
    x8, x10 = _bfly(x8, x10)
    x9, x11 = _bfly(x9, x11)
    x12, x14 = _bfly(x12, x14)
    x13, x15 = _bfly(x13, x15)
    # butterflies at stride 1
    x0, x1 = _bfly(x0, x1)
    x2, x3 = _bfly(x2, x3)
    x4, x5 = _bfly(x4, x5)
    x6, x7 = _bfly(x6, x7)
    x8, x9 = _bfly(x8, x9)
    x10, x11 = _bfly(x10, x11)
    x12, x13 = _bfly(x12, x13)
    x14, x15 = _bfly(x14, x15)
    return (x0 * 0.25, x1 * 0.25, x2 * 0.25, x3 * 0.25, x4 * 0.25, x5 * 0.25, x6 * 0.25,
            x7 * 0.25, x8 * 0.25, x9 * 0.25, x10 * 0.25, x11 * 0.25, x12 * 0.25, x13 * 0.25,
            x14 * 0.25, x15 * 0.25)


@triton.jit
def _rht_tile(t):
    """RHT of an (R, C) fp32 tile along C in 16-element tiles (C % 16 == 0)."""
    R: tl.constexpr = t.shape[0]
    C: tl.constexpr = t.shape[1]
    x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15 = _split16(
        tl.reshape(t, (R, C // 16, 16)))
    x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15 = _rht16(
        x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15)
    y = _join16(x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15)
    return tl.reshape(y, (R, C))


# ---- one tile of quantize_matrix ------------------------------------------------------------
@triton.jit
def _quant_tile(t, s, rand, TWO_D: tl.constexpr, SR: tl.constexpr):
    """reference.quantize_matrix on an (R, C) fp32 tile blocked along C (R, C % 16 == 0).

    Returns (packed codes (R, C/2) uint8, E4M3 scale bytes (R, C/16) or (R/16, C/16) uint8).
    """
    R: tl.constexpr = t.shape[0]
    C: tl.constexpr = t.shape[1]
    a = tl.abs(t)
    fin = a <= FP32_MAX
    af = tl.where(fin, a, 0.0)
    nf = tl.where(fin, 0, 1)
    if TWO_D:
        bamax = tl.max(tl.max(tl.reshape(af, (R // 16, 16, C // 16, 16)), axis=3), axis=1)
        bad = tl.max(tl.max(tl.reshape(nf, (R // 16, 16, C // 16, 16)), axis=3), axis=1)
    else:
        bamax = tl.max(tl.reshape(af, (R, C // 16, 16)), axis=2)
        bad = tl.max(tl.reshape(nf, (R, C // 16, 16)), axis=2)
    q = tl.math.div_rn(bamax, tl.full(bamax.shape, E2M1_MAX, tl.float32)) * s
    q = tl.minimum(q, E4M3_MAX)
    dcode, d = _e4m3_rne(q)
    dcode = tl.where(bad != 0, E4M3_NAN, dcode)
    d = tl.where(bad != 0, 0.0, d)  # NaN block: v forced to 0 below, as d = NaN does
    if TWO_D:
        dfull = tl.reshape(tl.broadcast_to(tl.reshape(d, (R // 16, 1, C // 16, 1)),
                                           (R // 16, 16, C // 16, 16)), (R, C))
    else:
        dfull = tl.reshape(tl.broadcast_to(tl.reshape(d, (R, C // 16, 1)), (R, C // 16, 16)),
                           (R, C))
    v = tl.math.div_rn(t * s, dfull)
    v = tl.where(dfull > 0.0, v, 0.0)
    if SR:
        code = _e2m1_sr_codes(v, rand)
    else:
        code = _e2m1_rne_codes(v)
    code = code | tl.where(v.to(tl.int32, bitcast=True) < 0, 8, 0)
    lo, hi = tl.split(tl.reshape(code, (R, C // 2, 2)))
    packed = (lo | (hi << 4)).to(tl.uint8)
    return packed, dcode.to(tl.uint8)


@triton.jit
def _load_tile(x_ptr, stride_xm, stride_xk, M, K, BM: tl.constexpr, BK: tl.constexpr, pid):
    nk = tl.cdiv(K, BK)
    pid_m = pid // nk
    pid_k = pid % nk
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_k = pid_k * BK + tl.arange(0, BK)
    mask = (offs_m < M)[:, None] & (offs_k < K)[None, :]
    ptrs = (x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
            + offs_k.to(tl.int64)[None, :] * stride_xk)
    x = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    return x, pid_m, pid_k, offs_m, offs_k


# ---- pass 1: global amax(es) ------------------------------------------------------------------
@triton.jit
def _nvfp4_amax_kernel(x_ptr, stride_xm, stride_xk, M, K, amax_ptr,
                       PLAIN: tl.constexpr, RHT: tl.constexpr,
                       BM: tl.constexpr, BK: tl.constexpr):
    """amax_ptr (int32[2], zeroed): [0] finite amax of x, [1] finite amax of RHT(x^T)."""
    pid = tl.program_id(0)
    x, pid_m, pid_k, offs_m, offs_k = _load_tile(x_ptr, stride_xm, stride_xk, M, K, BM, BK, pid)
    if PLAIN:
        am = tl.max(tl.max(_finite_abs(x), axis=1), axis=0)
        tl.atomic_max(amax_ptr, am.to(tl.int32, bitcast=True))
    if RHT:
        y = _rht_tile(tl.trans(x))
        am = tl.max(tl.max(_finite_abs(y), axis=1), axis=0)
        tl.atomic_max(amax_ptr + 1, am.to(tl.int32, bitcast=True))


# ---- pass 2: quantize --------------------------------------------------------------------------
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
    rrand (M, K) / crand (K, M): fp32 uniforms when SR.
    """
    pid = tl.program_id(0)
    x, pid_m, pid_k, offs_m, offs_k = _load_tile(x_ptr, stride_xm, stride_xk, M, K, BM, BK, pid)
    mm = offs_m < M
    mk = offs_k < K
    om = offs_m.to(tl.int64)
    ok = offs_k.to(tl.int64)
    amax_plain = tl.load(amax_ptr).to(tl.float32, bitcast=True)
    if ROW:
        s = _global_scale(amax_plain)
        if pid == 0:
            tl.store(rglob_ptr, s)
        rand = x
        if SR:
            rand = tl.load(rrand_ptr + om[:, None] * K + ok[None, :],
                           mask=mm[:, None] & mk[None, :], other=1.0)
        packed, sc = _quant_tile(x, s, rand, TWO_D, SR)
        K2 = K // 2
        oc2 = pid_k * (BK // 2) + tl.arange(0, BK // 2)
        tl.store(rdata_ptr + om[:, None] * K2 + oc2[None, :], packed,
                 mask=mm[:, None] & (oc2 < K2)[None, :])
        K16 = K // 16
        oc16 = pid_k * (BK // 16) + tl.arange(0, BK // 16)
        if TWO_D:
            orb = pid_m * (BM // 16) + tl.arange(0, BM // 16)
            tl.store(rscale_ptr + orb.to(tl.int64)[:, None] * K16 + oc16[None, :], sc,
                     mask=(orb < M // 16)[:, None] & (oc16 < K16)[None, :])
        else:
            tl.store(rscale_ptr + om[:, None] * K16 + oc16[None, :], sc,
                     mask=mm[:, None] & (oc16 < K16)[None, :])
    if COL:
        xt = tl.trans(x)  # (BK, BM)
        if RHT:
            xt = _rht_tile(xt)
            s = _global_scale(tl.load(amax_ptr + 1).to(tl.float32, bitcast=True))
        else:
            s = _global_scale(amax_plain)
        if pid == 0:
            tl.store(cglob_ptr, s)
        rand = xt
        if SR:
            rand = tl.load(crand_ptr + ok[:, None] * M + om[None, :],
                           mask=mk[:, None] & mm[None, :], other=1.0)
        packed, sc = _quant_tile(xt, s, rand, TWO_D, SR)
        M2 = M // 2
        om2 = pid_m * (BM // 2) + tl.arange(0, BM // 2)
        tl.store(cdata_ptr + ok[:, None] * M2 + om2[None, :], packed,
                 mask=mk[:, None] & (om2 < M2)[None, :])
        M16 = M // 16
        om16 = pid_m * (BM // 16) + tl.arange(0, BM // 16)
        if TWO_D:
            okb = pid_k * (BK // 16) + tl.arange(0, BK // 16)
            tl.store(cscale_ptr + okb.to(tl.int64)[:, None] * M16 + om16[None, :], sc,
                     mask=(okb < K // 16)[:, None] & (om16 < M16)[None, :])
        else:
            tl.store(cscale_ptr + ok[:, None] * M16 + om16[None, :], sc,
                     mask=mk[:, None] & (om16 < M16)[None, :])


# ---- dequantize to bf16 (q * d, no global scale) ------------------------------------------------
@triton.jit
def _nvfp4_dequant_unscaled_kernel(data_ptr, scale_ptr, out_ptr, R, C,
                                   TWO_D: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr):
    """out (R, C) bf16 = q * d (exact in bf16) from data (R, C/2) u8 and E4M3 scale bytes."""
    pid = tl.program_id(0)
    nc = tl.cdiv(C, BC)
    pid_r = pid // nc
    pid_c = pid % nc
    rows = pid_r * BR + tl.arange(0, BR)
    mr = rows < R
    r64 = rows.to(tl.int64)
    C2 = C // 2
    c2 = pid_c * (BC // 2) + tl.arange(0, BC // 2)
    b = tl.load(data_ptr + r64[:, None] * C2 + c2[None, :],
                mask=mr[:, None] & (c2 < C2)[None, :], other=0).to(tl.int32)
    codes = tl.reshape(tl.join(b & 15, b >> 4), (BR, BC))
    q = _e2m1_decode(codes)
    C16 = C // 16
    c16 = pid_c * (BC // 16) + tl.arange(0, BC // 16)
    if TWO_D:
        rb = pid_r * (BR // 16) + tl.arange(0, BR // 16)
        sb = tl.load(scale_ptr + rb.to(tl.int64)[:, None] * C16 + c16[None, :],
                     mask=(rb < R // 16)[:, None] & (c16 < C16)[None, :], other=0).to(tl.int32)
        d = _e4m3_decode(sb)
        val = tl.reshape(q, (BR // 16, 16, BC // 16, 16)) * tl.reshape(d, (BR // 16, 1, BC // 16, 1))
    else:
        sb = tl.load(scale_ptr + r64[:, None] * C16 + c16[None, :],
                     mask=mr[:, None] & (c16 < C16)[None, :], other=0).to(tl.int32)
        d = _e4m3_decode(sb)
        val = tl.reshape(q, (BR, BC // 16, 16)) * tl.reshape(d, (BR, BC // 16, 1))
    out = tl.reshape(val, (BR, BC)).to(tl.bfloat16)
    cols = pid_c * BC + tl.arange(0, BC)
    tl.store(out_ptr + r64[:, None] * C + cols[None, :], out,
             mask=mr[:, None] & (cols < C)[None, :])
