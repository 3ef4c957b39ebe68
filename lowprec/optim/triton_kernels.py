"""The fused AdamW step as one Triton kernel over many tensors (launcher: :mod:`.launch`).

Bit-identical to the reference step (``adamw._step_batch`` with ``fp8_state`` and
``rounding``) run with torch's CUDA ops, whatever the state's precision:

* The fp32 arithmetic is the reference's, op for op, with its roundings: the kernel
  launches with FMA contraction off and writes the three products that torch's CUDA
  kernels fuse (``lerp``'s ``self + w * (end - self)``, ``addcmul``'s and ``addcdiv``'s
  ``self + value * t``) as explicit ``fma``; divisions and the square root are the
  correctly rounded ones (``div_rn``, ``sqrt_rn``), as CUDA's default ``/`` and ``sqrt``.
* The random bits are the reference's hash of the element's index in the whole tensor
  (uint32 arithmetic wraps as the reference's masked int64 does), so stochastic
  roundings round the same way.
* FP8 blocks: the power-of-two scale comes from the block maximum's exponent and
  mantissa bits (what ``torch.frexp`` reads), and the E4M3 grid point from bit fields, so
  nothing depends on the hardware's fp8 conversion but the final exact cast.

Work is split in blocks of 128 elements along a row (one FP8 scale each), ``BLOCKS`` of
them a program; a program table maps each program to (tensor, first block), and a tensor
table holds each tensor's addresses, sizes and random-stream keys, so one launch steps
every parameter of a dtype and state layout.
"""

import triton
import triton.language as tl

#: int64 fields per row of the tensor table (``launch.FIELDS``)
FIELDS = tl.constexpr(12)
E4M3_MAX = tl.constexpr(448.0)

# moment storage kinds
FP32 = tl.constexpr(0)
BF16 = tl.constexpr(1)
FP8 = tl.constexpr(2)


@triton.jit
def _mix32(h):
    """``rounding.mix32`` on uint32 values."""
    h = h ^ (h >> 16)
    h = h * 0x7FEB352D
    h = h ^ (h >> 15)
    h = h * 0x5BD1E995
    return h ^ (h >> 16)


@triton.jit
def _bits(index, key):
    """``rounding.random_bits`` of the elements at ``index`` (int64) under ``key``."""
    return _mix32(_mix32(index.to(tl.uint32)) ^ key)


@triton.jit
def _bf16_stochastic(x, bits):
    """``rounding.round_to_bf16_stochastic``: x's bits plus 16 random ones, truncated."""
    raw = x.to(tl.uint32, bitcast=True)
    up = ((raw + (bits & 0xFFFF)) >> 16).to(tl.uint16)
    out = up.to(tl.bfloat16, bitcast=True)
    return tl.where(x != x, x.to(tl.bfloat16), out)


@triton.jit
def _pow2(e):
    """2**e as fp32 for int32 e in [-126, 127] (a normal number, exact)."""
    return ((e + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _fp8_decode(codes_ptr, scale_ptr, idx, sidx, mask):
    codes = tl.load(codes_ptr + idx, mask=mask, other=0.0).to(tl.float32)
    scale = tl.load(scale_ptr + sidx, mask=sidx >= 0, other=1.0)
    return codes * scale[:, None]


@triton.jit
def _fp8_encode(codes_ptr, scale_ptr, x, idx, sidx, mask, bmask, bits):
    """``fp8_state.encode_`` of one [blocks, 128] tile (masked lanes hold 0)."""
    amax = tl.max(tl.abs(x), axis=1)
    raw = amax.to(tl.uint32, bitcast=True)
    # frexp: amax = mant * 2**ex, mant in [0.5, 1); ex = field - 126, mant > 0.875 when the
    # mantissa field exceeds 0.75 * 2**23; subnormal maxima clamp to the smallest scale
    field = ((raw >> 23) & 0xFF).to(tl.int32)
    over = ((raw & 0x7FFFFF) > 0x600000).to(tl.int32)
    e = tl.maximum(field - 135 + over, -126)
    # dividing by a power of two is multiplying by its (exact) reciprocal: the same one
    # rounding of the same exact quotient
    positive = amax > 0
    scale = tl.where(positive, _pow2(e), 1.0)
    y = x * tl.where(positive, _pow2(-e), 1.0)[:, None]
    mag = tl.minimum(tl.abs(y), E4M3_MAX)
    ex = tl.maximum((mag.to(tl.int32, bitcast=True) >> 23) - 127, -6)
    spacing = _pow2(ex - 3)
    per_spacing = _pow2(3 - ex)
    down = tl.floor(mag * per_spacing) * spacing
    frac = (mag - down) * per_spacing
    u = (bits >> 8).to(tl.float32) * 5.9604644775390625e-08  # 2**-24
    q = tl.minimum(tl.where(u < frac, down + spacing, down), E4M3_MAX)
    sign = y.to(tl.uint32, bitcast=True) & 0x80000000
    signed = (q.to(tl.uint32, bitcast=True) | sign).to(tl.float32, bitcast=True)
    tl.store(codes_ptr + idx, signed.to(tl.float8e4nv), mask=mask)
    tl.store(scale_ptr + sidx, scale, mask=bmask)


@triton.jit
def _ptr(address, TYPE: tl.constexpr, ALIGNED: tl.constexpr):
    """The int64 ``address`` as a pointer to ``TYPE`` (16-byte aligned where ``ALIGNED``,
    which lets loads and stores vectorize)."""
    ptr = address.to(tl.pointer_type(TYPE))
    if ALIGNED:
        ptr = tl.multiple_of(ptr, 16)
    return ptr


@triton.jit
def _load_moment(address, scale_address, idx, sidx, mask, KIND: tl.constexpr,
                 ROOT: tl.constexpr, ALIGNED: tl.constexpr):
    """fp32 values of a moment (``adamw._moment``); ``ROOT``: FP8 holds the square root."""
    if KIND == FP8:
        val = _fp8_decode(_ptr(address, tl.float8e4nv, ALIGNED),
                          _ptr(scale_address, tl.float32, False), idx, sidx, mask)
        if ROOT:
            val = val * val
    elif KIND == BF16:
        val = tl.load(_ptr(address, tl.bfloat16, ALIGNED) + idx, mask=mask,
                      other=0.0).to(tl.float32)
    else:
        val = tl.load(_ptr(address, tl.float32, ALIGNED) + idx, mask=mask, other=0.0)
    return val


@triton.jit
def _store_moment(address, scale_address, val, idx, sidx, mask, bmask, index, key,
                  KIND: tl.constexpr, ROOT: tl.constexpr, ALIGNED: tl.constexpr):
    """Store fp32 ``val`` as the state keeps it (``adamw._keep_moment``); ``index``: the
    elements' indices in the whole tensor, for the random bits under ``key``."""
    if KIND == FP8:
        if ROOT:
            val = tl.sqrt_rn(val)
        _fp8_encode(_ptr(address, tl.float8e4nv, ALIGNED),
                    _ptr(scale_address, tl.float32, False),
                    tl.where(mask, val, 0.0), idx, sidx, mask, bmask, _bits(index, key))
    elif KIND == BF16:
        tl.store(_ptr(address, tl.bfloat16, ALIGNED) + idx,
                 _bf16_stochastic(val, _bits(index, key)), mask=mask)
    else:
        tl.store(_ptr(address, tl.float32, ALIGNED) + idx, val, mask=mask)


@triton.jit
def adamw_kernel(tensors, programs, decay, w1, beta2, w2, eps, bc2_sqrt, step_size,
                 P_TYPE: tl.constexpr, MASTER: tl.constexpr, STOCHASTIC_W: tl.constexpr,
                 M_KIND: tl.constexpr, V_KIND: tl.constexpr, MAXIMIZE: tl.constexpr,
                 SMALL_W1: tl.constexpr, ALIGNED: tl.constexpr, BLOCKS: tl.constexpr):
    """One program: ``BLOCKS`` blocks of 128 elements of one tensor (see module doc).

    Tensor table row: param, grad, exp_avg, exp_avg_sq, master, exp_avg scales,
    exp_avg_sq scales (addresses; 0 where absent), row length K, block count, element
    offset in the whole tensor, the id of its first random stream (exp_avg's; then
    exp_avg_sq's and the weight's) and what their keys derive from
    (``rounding.stream_base`` of the seed and step: in the table rather than an argument,
    which Triton would specialize on). ``ALIGNED``: every address is 16-byte aligned and
    every row length a multiple of 16."""
    pid = tl.program_id(0)
    t = tl.load(programs + 2 * pid).to(tl.int64)
    first = tl.load(programs + 2 * pid + 1).to(tl.int64)
    row = tensors + t * FIELDS
    k = tl.load(row + 7)
    if ALIGNED:  # a mask constant over 16 lanes: loads and stores of 16 bytes
        k = tl.multiple_of(k, 16)
    n_blocks = tl.load(row + 8)
    offset = tl.load(row + 9)
    # rounding.stream_key of the tensor's three streams
    stream = tl.load(row + 10).to(tl.uint32)
    base = tl.load(row + 11).to(tl.uint32)
    key_m = _mix32(base ^ stream)
    key_v = _mix32(base ^ (stream + 1))
    key_w = _mix32(base ^ (stream + 2))
    per_row = (k + 127) // 128
    b = first + tl.arange(0, BLOCKS)
    bmask = b < n_blocks
    r = b // per_row
    col0 = (b - r * per_row) * 128
    start = r * k + col0
    if ALIGNED:
        start = tl.multiple_of(start, 16)
    lane = tl.arange(0, 128)[None, :]
    mask = bmask[:, None] & (col0[:, None] + lane < k)
    idx = start[:, None] + lane
    sidx = tl.where(bmask, b, -1)
    index = offset + idx

    p_ptr = _ptr(tl.load(row), P_TYPE, ALIGNED)
    g = tl.load(_ptr(tl.load(row + 1), P_TYPE, ALIGNED) + idx, mask=mask,
                other=0.0).to(tl.float32)
    if MAXIMIZE:
        g = -g
    if MASTER:
        w_ptr = _ptr(tl.load(row + 4), tl.float32, ALIGNED)
        w = tl.load(w_ptr + idx, mask=mask, other=0.0)
    else:
        w = tl.load(p_ptr + idx, mask=mask, other=0.0).to(tl.float32)
    m = _load_moment(tl.load(row + 2), tl.load(row + 5), idx, sidx, mask, M_KIND, False,
                     ALIGNED)
    v = _load_moment(tl.load(row + 3), tl.load(row + 6), idx, sidx, mask, V_KIND, True,
                     ALIGNED)

    w = w * decay
    if SMALL_W1:  # torch's lerp: self + w * (end - self) for |w| < 0.5
        m = tl.fma(w1, g - m, m)
    else:  # end - (end - self) * (1 - w)
        m = tl.fma(g - m, w1 - 1.0, g)
    v = v * beta2
    v = tl.fma(w2, g * g, v)
    denom = tl.div_rn(tl.sqrt_rn(v), bc2_sqrt) + eps
    w = tl.fma(step_size, tl.div_rn(m, denom), w)

    _store_moment(tl.load(row + 2), tl.load(row + 5), m, idx, sidx, mask, bmask, index, key_m,
                  M_KIND, False, ALIGNED)
    _store_moment(tl.load(row + 3), tl.load(row + 6), v, idx, sidx, mask, bmask, index, key_v,
                  V_KIND, True, ALIGNED)
    if MASTER:
        tl.store(w_ptr + idx, w, mask=mask)
        tl.store(p_ptr + idx, w.to(P_TYPE), mask=mask)
    elif STOCHASTIC_W:
        tl.store(p_ptr + idx, _bf16_stochastic(w, _bits(index, key_w)), mask=mask)
    else:
        tl.store(p_ptr + idx, w.to(P_TYPE), mask=mask)
