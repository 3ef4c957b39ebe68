"""Triton pieces of the fused norm/activation + quantize kernels.

``load_tile`` is the one tile-loading prologue every quantize kernel shares: it loads an
(BM, BN) tile of the kernel's logical input and, when ``PRO`` asks for it, computes that
input from the real one on the fly (a LayerNorm/RMSNorm with precomputed row statistics,
or an activation, gated ones reading both halves of the row). The norm or activation is
computed in fp32 and rounded once to the input's dtype, as the torch reference paths
(``lowprec.modules.norms``, ``lowprec.activations``) compute it; that rounding
makes a fused kernel quantize exactly the values the unfused ``apply_kernel`` writes.
Elements outside the tile's mask are 0.

Prologue codes (``PRO``): 0 none, 1 LayerNorm, 2 RMSNorm, 10 gelu (tanh), 11 relu,
12 silu, 13 srelu, 14 qgelu, 20 swiglu, 21 geglu (the ``code`` of each activation in
``lowprec.activations.REGISTRY``, which the callers pass). Pointer arguments ``p0..p3``: for the
norms mean (LayerNorm only), rstd, gamma, beta (LayerNorm only); unused otherwise.

Only the launchers (``prologue.py`` and each format's ``launch.py``) import this module.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra import libdevice


@triton.jit
def _rnd(v, x_ptr):
    """Round fp32 ``v`` to the input's dtype (and back to fp32), as the output is written."""
    return v.to(x_ptr.dtype.element_ty).to(tl.float32)


@triton.jit
def _sigmoid(x):
    return tl.math.div_rn(tl.full(x.shape, 1.0, tl.float32), 1.0 + libdevice.exp(-x))


@triton.jit
def _gelu(x):
    cube = x * x * x
    inner = 0.7978845608028654 * (x + 0.044715 * cube)
    return 0.5 * x * (1.0 + libdevice.tanh(inner))


@triton.jit
def _act(x, ACT: tl.constexpr):
    """One activation of fp32 ``x`` (holding input-dtype values), in fp32, not rounded."""
    if ACT == 10:
        y = _gelu(x)
    elif ACT == 11:
        y = tl.where(x != x, x, tl.maximum(x, 0.0))
    elif ACT == 12:
        y = tl.math.div_rn(x, 1.0 + libdevice.exp(-x))
    elif ACT == 13:
        r = tl.where(x != x, x, tl.maximum(x, 0.0))
        y = r * r
    else:  # 14: qgelu = x * sigmoid(1.702 x)
        y = x * _sigmoid(x * 1.702)
    return y


@triton.jit
def _norm(x, offs_m, offs_k, M, K, p0, p1, p2, p3, x_ptr, PRO: tl.constexpr):
    rmask = offs_m < M
    kmask = offs_k < K
    rstd = tl.load(p1 + offs_m, mask=rmask, other=0.0)
    g = tl.load(p2 + offs_k, mask=kmask, other=0.0).to(tl.float32)
    if PRO == 1:
        mean = tl.load(p0 + offs_m, mask=rmask, other=0.0)
        b = tl.load(p3 + offs_k, mask=kmask, other=0.0).to(tl.float32)
        y = g[None, :] * (rstd[:, None] * (x - mean[:, None])) + b[None, :]
    else:
        y = g[None, :] * (x * rstd[:, None])
    return _rnd(y, x_ptr)


@triton.jit
def load_tile(x_ptr, offs_m, offs_k, M, K, stride_xm, stride_xk, p0, p1, p2, p3,
              PRO: tl.constexpr):
    """fp32 (BM, BN) tile of the logical input at rows ``offs_m``, columns ``offs_k``
    (logical shape (M, K); a gated activation reads columns k and K + k of its input)."""
    mask = (offs_m < M)[:, None] & (offs_k < K)[None, :]
    rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
    x = tl.load(rows + offs_k[None, :] * stride_xk, mask=mask, other=0.0).to(tl.float32)
    if PRO == 1 or PRO == 2:
        x = tl.where(mask, _norm(x, offs_m, offs_k, M, K, p0, p1, p2, p3, x_ptr, PRO), 0.0)
    elif PRO >= 20:
        gate = tl.load(rows + (offs_k + K)[None, :] * stride_xk, mask=mask,
                       other=0.0).to(tl.float32)
        a = _act(x, 12 if PRO == 20 else 10)
        x = tl.where(mask, _rnd(a * gate, x_ptr), 0.0)
    elif PRO >= 10:
        x = tl.where(mask, _rnd(_act(x, PRO), x_ptr), 0.0)
    return x


@triton.jit
def apply_kernel(x_ptr, out_ptr, amax_ptr, M, K, stride_xm, stride_xk, p0, p1, p2, p3,
                 PRO: tl.constexpr, WANT_AMAX: tl.constexpr, BM: tl.constexpr,
                 BN: tl.constexpr):
    """Write the logical input (M, K) in the input's dtype: the unfused form of a prologue;
    with ``WANT_AMAX`` also record its amax (int32 bits, atomic max into ``amax_ptr``)."""
    offs_m = tl.program_id(0) * BM + tl.arange(0, BM)
    offs_k = tl.program_id(1) * BN + tl.arange(0, BN)
    y = load_tile(x_ptr, offs_m, offs_k, M, K, stride_xm, stride_xk, p0, p1, p2, p3, PRO)
    mask = (offs_m < M)[:, None] & (offs_k < K)[None, :]
    tl.store(out_ptr + offs_m.to(tl.int64)[:, None] * K + offs_k[None, :],
             y.to(out_ptr.dtype.element_ty), mask=mask)
    if WANT_AMAX:
        bits = tl.max(tl.max(y.to(tl.int32, bitcast=True) & 0x7FFFFFFF, 1), 0)
        tl.atomic_max(amax_ptr, bits, sem="relaxed")


@triton.jit
def norm_stats_kernel(x_ptr, mean_ptr, rstd_ptr, g_ptr, b_ptr, amax_ptr, M, K, stride_xm, eps,
                      RMS: tl.constexpr, WANT_AMAX: tl.constexpr, BR: tl.constexpr,
                      BK: tl.constexpr):
    """Per-row mean (LayerNorm) and rstd in fp32, two passes over each row (mean, then the
    centred sum of squares); with ``WANT_AMAX`` a third pass records the amax of the
    normalized output (rounded to the input dtype) into the int32 ``amax_ptr``."""
    offs_m = tl.program_id(0) * BR + tl.arange(0, BR)
    rmask = offs_m < M
    rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
    mean = tl.zeros([BR], dtype=tl.float32)
    if not RMS:
        acc = tl.zeros([BR, BK], dtype=tl.float32)
        for k0 in range(0, K, BK):
            offs_k = k0 + tl.arange(0, BK)
            mask = rmask[:, None] & (offs_k < K)[None, :]
            acc += tl.load(rows + offs_k[None, :], mask=mask, other=0.0).to(tl.float32)
        mean = tl.math.div_rn(tl.sum(acc, 1), tl.zeros_like(mean) + K)
    acc = tl.zeros([BR, BK], dtype=tl.float32)
    for k0 in range(0, K, BK):
        offs_k = k0 + tl.arange(0, BK)
        mask = rmask[:, None] & (offs_k < K)[None, :]
        d = tl.load(rows + offs_k[None, :], mask=mask, other=0.0).to(tl.float32) - mean[:, None]
        d = tl.where(mask, d, 0.0)
        acc += d * d
    var = tl.math.div_rn(tl.sum(acc, 1), tl.zeros_like(mean) + K)
    rstd = libdevice.rsqrt(var + eps)
    if not RMS:
        tl.store(mean_ptr + offs_m, mean, mask=rmask)
    tl.store(rstd_ptr + offs_m, rstd, mask=rmask)
    if WANT_AMAX:
        # The stats just stored are read back through the same prologue the quantize
        # kernel uses, so the amax is that of exactly the values it will cast.
        tl.debug_barrier()
        amax = tl.zeros([BR, BK], dtype=tl.int32)
        for k0 in range(0, K, BK):
            offs_k = k0 + tl.arange(0, BK)
            y = load_tile(x_ptr, offs_m, offs_k, M, K, stride_xm, 1, mean_ptr, rstd_ptr, g_ptr,
                          b_ptr, 2 if RMS else 1)
            amax = tl.maximum(amax, y.to(tl.int32, bitcast=True) & 0x7FFFFFFF)
        tl.atomic_max(amax_ptr, tl.max(tl.max(amax, 1), 0), sem="relaxed")
