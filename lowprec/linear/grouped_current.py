"""FP8 current scaling over the experts of a grouped linear: every group quantized on its
own rows (its own scale), one grouped GEMM per direction where the device has one.

Which grouped GEMM runs (:func:`gemm_backend`), on Hopper with bf16 activations:

* ``"triton"``: lowprec's kernel (:mod:`lowprec.gemm.fp8_grouped`), bit for bit one
  cuBLAS GEMM per expert, as :class:`lowprec.Linear` runs it; E4M3 and E5M2 operands (the
  HYBRID format's gradients too);
* ``"cutlass"``: ``torch._scaled_grouped_mm`` (E4M3 only; the same values to the last
  bits). Timed on an H100 (the six GEMMs of a layer): at 2,048 rows an expert it is
  8-10% faster than the Triton kernel (Mixtral's and Qwen3's shapes); at 1,024 it is 3%
  faster at Mixtral's 8 large experts and 2.2x slower at Qwen3's 128 small ones. It runs
  when the experts average ``gemm.table.CUTLASS_ROWS`` rows or more.

The GEMM table decides (``gemm.grouped_route``), from the device's description.

Without either (no Triton, not Hopper, other activations), each group's GEMM runs as
:func:`lowprec.gemm.gemm` runs it, the group sizes read on the host.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..formats.float8 import Float8CurrentScalingQuantizer, Float8Experts, Float8Tensor
from ..formats.float8 import grouped as fp8_grouped_quantize
from ..gemm import fp8_grouped, gemm, grouped_device, grouped_mm, grouped_route
from ..kernels.transpose import transpose_contiguous
from . import weight_cache
from .function import LinearQuantizers, _caching_weights
from .grouped_parts import fused, group_ids, hooked, host_sizes, stacked


def same_current(qs: Sequence[Float8CurrentScalingQuantizer | None]) -> bool:
    """Whether every quantizer is FP8 current scaling of one setting, none of them hooked."""
    first = qs[0]
    if type(first) is not Float8CurrentScalingQuantizer:
        return False
    if any(hooked(q) for q in qs):
        return False
    key = (first.fp8_dtype, first.force_pow_2_scales, first.amax_epsilon)
    return all(type(q) is Float8CurrentScalingQuantizer
               and (q.fp8_dtype, q.force_pow_2_scales, q.amax_epsilon) == key for q in qs)


def current_scaling_quantizers(qs: Sequence[LinearQuantizers]):
    """(input, weight, grad_output) quantizers when every group quantizes its three GEMM
    operands with FP8 current scaling of one setting each and nothing at its boundaries;
    else None."""
    if any(q.output is not None or q.grad_input is not None for q in qs):
        return None
    slots = ([q.input for q in qs], [q.weight for q in qs], [q.grad_output for q in qs])
    if not all(same_current(s) for s in slots):
        return None
    return tuple(s[0] for s in slots)


#: the GEMM table's grouped routes of FP8 current scaling, by the names the GEMM
#: helpers below take
_BACKENDS = {"fp8_grouped": "triton", "scaled_grouped_mm": "cutlass", "per_group": None}


def gemm_backend(x2d: torch.Tensor, n: int, num: int, *fp8_dtypes: torch.dtype) -> str | None:
    """``"triton"``, ``"cutlass"`` or None (one GEMM per group) for grouped GEMMs over
    ``x2d``'s rows, ``num`` experts of ``n`` outputs, operands of ``fp8_dtypes``: the
    GEMM table's grouped route (``gemm.grouped_route``)."""
    return _BACKENDS[grouped_route("current", x2d.dtype, fp8_dtypes, x2d.shape[0], n,
                                   x2d.shape[1], num, grouped_device(x2d))]


def _rows_by_experts(backend, a, dec_a, ids, b, dec_b, offs, out_dtype):
    if backend == "triton":
        return fp8_grouped.rows_by_experts(a, dec_a, b, dec_b, offs, out_dtype)
    return grouped_mm.fp8_rows_by_experts(a, dec_a[ids], b, dec_b, offs, out_dtype)


def _wgrad(backend, *args):
    return (fp8_grouped.wgrad if backend == "triton" else grouped_mm.fp8_wgrad)(*args)


def _group_tensor(data, scale, shape, dtype, fp8_dtype, usage="rowwise"):
    # one group's rows as the Float8Tensor its own quantize makes, in the direction used
    if usage == "rowwise":
        return Float8Tensor(shape, dtype, rowwise_data=data, columnwise_data=None,
                            shared_scale=scale, fp8_dtype=fp8_dtype)
    return Float8Tensor(shape, dtype, rowwise_data=None, columnwise_data=data.t().contiguous(),
                        shared_scale=scale, fp8_dtype=fp8_dtype)


def _quantized_experts(weights: Sequence[torch.Tensor], q_w, transposed: bool):
    """(fp8 experts (G, N, K), their transpose (K, G * N) or None, encode and decode scales
    (G,)) of one (G, N, K) weight or G (N, K) ones, the transpose (``transposed``) from the
    same pass; under ``lowprec.autocast(cache_weights=True)`` made once, both layouts, while the
    weights are unchanged (gradient accumulation: once per optimizer step). A
    :class:`Float8Experts` weight (gathered quantized) brings its codes and scales."""
    if isinstance(weights[0], Float8Experts):
        w = weights[0]
        if w.fp8_dtype != q_w.fp8_dtype:
            raise ValueError(f"grouped_linear: the experts were gathered as {w.fp8_dtype}, the "
                             f"recipe's weight quantizer is {q_w.fp8_dtype}")
        g, n, k = w.codes.shape
        codes_t = transpose_contiguous(w.codes.view(g * n, k)) if transposed else None
        return w.codes, codes_t, w.scales, torch.reciprocal(w.scales)

    def make(transposed=transposed):
        out = fp8_grouped_quantize.quantize_experts(stacked(weights).detach().contiguous(),
                                                    q_w, transposed, with_decode=True)
        return out if transposed else (out[0], None, *out[1:])
    if _caching_weights() and not torch.compiler.is_compiling():
        return weight_cache.cached_value(weights, q_w, lambda: make(True))
    return make()


class _Current:
    """FP8 current scaling's scheme (``grouped_engine``): every group its own scales;
    grouped GEMMs where the device has them (the plan's ``backend``, from
    :func:`gemm_backend`), else each group's GEMM as the per-expert Linear runs it."""

    name = "current"

    @staticmethod
    def align(quantizers) -> int:
        return grouped_mm.ALIGN  # wgrad reads the transposed codes of 16-row groups

    @staticmethod
    def forward(plan, x2d, sizes, aligned, weights, need_dx, need_dw):
        q_x, q_w, q_dy = plan.quantizers
        backend = plan.backend
        rows = x2d.shape[0]
        n = weights[0].shape[-2]
        num = weights[0].shape[0] if weights[0].dim() == 3 else len(weights)
        bwd_backend = backend and gemm_backend(x2d, n, num, q_dy.fp8_dtype, q_w.fp8_dtype,
                                               q_x.fp8_dtype)
        # dgrad's columnwise copy (K, G * N) is written by the weights' cast itself
        wq, wq_t, sw, dec_w = _quantized_experts(weights, q_w, bwd_backend is not None and need_dx)
        w_dtype = weights[0].dtype
        ids = group_ids(sizes, rows)
        # groups the caller laid out at multiples of 16 rows: wgrad reads the transposed
        # codes as they are, written by the cast itself
        transposed = bwd_backend is not None and aligned
        xq_t = None
        if transposed and need_dw:
            xq, xq_t, sx, dec_x = fp8_grouped_quantize.quantize_groups_both(x2d, ids, num, q_x,
                                                                            with_decode=True)
        else:
            xq, sx, dec_x = fp8_grouped_quantize.quantize_groups(x2d, ids, num, q_x,
                                                                 with_decode=True)
        host = None if backend else host_sizes(sizes)
        offs = grouped_mm.end_offsets(sizes) if backend else None
        if backend:
            y = _rows_by_experts(backend, xq, dec_x, ids, wq, dec_w, offs, x2d.dtype)
        else:
            y = torch.cat([gemm(_group_tensor(xg, sx[g:g + 1], xg.shape, x2d.dtype, q_x.fp8_dtype),
                                "rowwise", _group_tensor(wq[g], sw[g:g + 1], wq[g].shape,
                                                         w_dtype, q_w.fp8_dtype),
                                "rowwise", out_dtype=x2d.dtype)
                           for g, xg in enumerate(torch.split(xq, host))])
        saved_x = (xq_t if transposed else xq) if need_dw else None
        saved_w = (wq_t if bwd_backend else wq) if need_dx else None
        state = (bwd_backend, transposed, host, wq.shape, x2d.dtype, w_dtype)
        return y, (saved_x, sx, dec_x, saved_w, sw, dec_w, sizes, ids, offs), state

    @staticmethod
    def backward(plan, state, saved, dy, need_dx, need_dw):
        xq, sx, dec_x, wq, sw, dec_w, sizes, ids, offs = saved
        backend, transposed, host, w_shape, x_dtype, w_dtype = state
        q_x, q_w, q_dy = plan.quantizers
        x_fp8, w_fp8 = q_x.fp8_dtype, q_w.fp8_dtype
        num = sw.shape[0]
        quantize = fp8_grouped_quantize
        if transposed and need_dw:
            dyq, dyq_t, sdy, dec_dy = quantize.quantize_groups_both(dy, ids, num, q_dy,
                                                                    with_decode=True)
        else:
            dyq, sdy, dec_dy = quantize.quantize_groups(dy, ids, num, q_dy, with_decode=True)
        dy_fp8 = q_dy.fp8_dtype
        dx = dw = None
        if backend:
            if need_dw:
                if transposed:  # the saved input is already (K, M)
                    dy_t, x_t, w_offs = dyq_t, xq, offs
                else:
                    src, valid, w_offs, _, _ = grouped_mm.padded_layout(sizes, ids,
                                                                        dyq.shape[0])
                    pad = fused(grouped_mm.padded_rows, dyq)
                    dy_t = transpose_contiguous(pad(dyq, src, valid))
                    x_t = transpose_contiguous(pad(xq, src, valid))
                dw = _wgrad(backend, dy_t, dec_dy, x_t, dec_x, w_offs, w_dtype)
            if need_dx:
                # the saved (K, G * N) codes: expert g's (K, N) are the columns g*N...
                _, n, k = w_shape
                w_t = wq.view(k, num, n).permute(1, 0, 2)
                dx = _rows_by_experts(backend, dyq, dec_dy, ids, w_t, dec_w, offs, x_dtype)
            return dx, dw
        # no grouped kernel for these operands: one GEMM per group, the sizes read on the
        # host (one sync per backward on the GPU)
        host = host if host is not None else host_sizes(sizes)
        dys = torch.split(dyq, host)
        if need_dw:
            xs = torch.split(xq, host)
            dw = torch.stack([
                gemm(_group_tensor(d, sdy[g:g + 1], d.shape, x_dtype, dy_fp8, "columnwise"),
                     "columnwise",
                     _group_tensor(xs[g], sx[g:g + 1], xs[g].shape, x_dtype, x_fp8, "columnwise"),
                     "columnwise", out_dtype=w_dtype) for g, d in enumerate(dys)])
        if need_dx:
            dx = torch.cat([
                gemm(_group_tensor(d, sdy[g:g + 1], d.shape, x_dtype, dy_fp8), "rowwise",
                     _group_tensor(wq[g], sw[g:g + 1], wq[g].shape, w_dtype, w_fp8, "columnwise"),
                     "columnwise", out_dtype=x_dtype) for g, d in enumerate(dys)])
        return dx, dw


#: FP8 current scaling's scheme
CURRENT = _Current()
