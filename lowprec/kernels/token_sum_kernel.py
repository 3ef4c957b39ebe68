"""@triton.jit kernels of the routed rows' sum into their tokens (launchers:
:mod:`lowprec.kernels.token_sum`). The sum: each token's ``K`` rows added one at a time in
the given order, from zero, rounded to the rows' dtype after each add, as that many torch
adds of 16-bit tensors round (fp32 arithmetic, round to nearest even); with gates, each row
first multiplied by its gate and rounded, as ``(rows * gates[:, None]).to(rows.dtype)``.
Its backward: each row's gradient (its token's times its gate) and its gate's (the row's
products with its token's gradient summed over the features, in fp32).

Imported only when a launcher runs on CUDA with Triton available.
"""

import triton
import triton.language as tl


@triton.jit
def token_sum_kernel(rows_ptr, gate_ptr, idx_ptr, out_ptr, T, H, s_r, s_o,
                     K: tl.constexpr, HAS_GATE: tl.constexpr, BT: tl.constexpr,
                     BH: tl.constexpr):
    """``out[t] = (...((0 + v[idx[t, 0]]) + v[idx[t, 1]]) ...)`` for a (BT, BH) tile, ``v``
    the rows (times their gates with ``HAS_GATE``)."""
    tokens = tl.program_id(0) * BT + tl.arange(0, BT)
    cols = tl.program_id(1) * BH + tl.arange(0, BH)
    tmask = tokens < T
    mask = tmask[:, None] & (cols < H)[None, :]
    acc = tl.zeros((BT, BH), dtype=out_ptr.dtype.element_ty)
    for j in tl.static_range(K):
        row = tl.load(idx_ptr + tokens.to(tl.int64) * K + j, mask=tmask, other=0)
        v = tl.load(rows_ptr + row[:, None] * s_r + cols[None, :], mask=mask, other=0.0)
        if HAS_GATE:
            g = tl.load(gate_ptr + row, mask=tmask, other=0.0).to(tl.float32)
            v = (v.to(tl.float32) * g[:, None]).to(out_ptr.dtype.element_ty)
        acc = (acc.to(tl.float32) + v.to(tl.float32)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + tokens.to(tl.int64)[:, None] * s_o + cols[None, :], acc, mask=mask)


@triton.jit
def gated_rows_grad_kernel(grad_ptr, rows_ptr, gate_ptr, tok_ptr, drows_ptr, dgate_ptr,
                           R, T, H, s_g, s_r, s_d, ROUND_PRODUCT: tl.constexpr,
                           BR: tl.constexpr, BH: tl.constexpr):
    """For BR rows: ``drows = grad[tok] * gate`` (rounded to the rows' dtype) and ``dgate =
    sum_h grad[tok] * rows`` (each product rounded to the gates' dtype first where
    ``ROUND_PRODUCT``: a 16-bit gate, as torch's product of two 16-bit tensors); a row with
    ``tok >= T`` (padding) reads a zero gradient."""
    r = tl.program_id(0) * BR + tl.arange(0, BR)
    rmask = r < R
    tok = tl.load(tok_ptr + r, mask=rmask, other=0)
    live = rmask & (tok < T)
    gate = tl.load(gate_ptr + r, mask=rmask, other=0.0).to(tl.float32)
    dg = tl.zeros((BR,), dtype=tl.float32)
    for h0 in range(0, H, BH):
        cols = h0 + tl.arange(0, BH)
        cmask = cols < H
        gr = tl.load(grad_ptr + tok.to(tl.int64)[:, None] * s_g + cols[None, :],
                     mask=live[:, None] & cmask[None, :], other=0.0).to(tl.float32)
        o = tl.load(rows_ptr + r.to(tl.int64)[:, None] * s_r + cols[None, :],
                    mask=rmask[:, None] & cmask[None, :], other=0.0).to(tl.float32)
        d = (gr * gate[:, None]).to(drows_ptr.dtype.element_ty)
        tl.store(drows_ptr + r.to(tl.int64)[:, None] * s_d + cols[None, :], d,
                 mask=rmask[:, None] & cmask[None, :])
        p = gr * o
        if ROUND_PRODUCT:
            p = p.to(dgate_ptr.dtype.element_ty).to(tl.float32)
        dg += tl.sum(p, axis=1)
    tl.store(dgate_ptr + r, dg.to(dgate_ptr.dtype.element_ty), mask=rmask)
