"""Grouped linear: the experts of a mixture-of-experts layer over their routed rows.

``grouped_linear(x, weight, group_sizes)`` runs rows ``x[s_g : s_g + n_g]`` through expert
``g``'s weight. Each group is quantized on its own rows, as one :class:`lowprec.Linear`
per expert would quantize it, so the result is the per-expert one.

How it runs is decided by the quantizers and the device:

* high precision on Hopper: one ``torch._grouped_mm`` per direction;
* FP8 current scaling on Hopper, bf16 activations: per-group amaxes (torch ops fused by
  inductor) and one Triton cast pass (group sizes read on the device, no host sync), one
  ``torch._scaled_grouped_mm`` per direction. That
  kernel takes E4M3 operands only: with E5M2 gradients (``Format.HYBRID``) dgrad and wgrad
  run one GEMM per group, the sizes read on the host once per backward; with
  ``Format.E4M3`` nothing waits for the host;
* FP8 current scaling elsewhere: the same quantize, then each group's GEMM as
  :func:`lowprec.gemm.gemm` runs it;
* MXFP8 (block formats emulated on bf16 GEMMs) on Hopper, bf16 activations: one quantize
  of the padded rows, of the stacked weights and of dY, one ``torch._grouped_mm`` per
  direction over their exact values (:mod:`.grouped_exact`), nothing read on the host;
* block-scaled FP8 (1x128 activations and gradients) on Hopper, bf16 activations, E4M3:
  the same layout and quantizes, one launch of lowprec's grouped block-scaled FP8 GEMM
  per direction, bit for bit the per-expert cuBLAS GEMMs (:mod:`.grouped_block_fp8`),
  nothing read on the host;
* every other recipe, a bias, quantized weights or boundary quantizers: one
  :func:`quantized_linear` per group. This reads ``group_sizes`` on the host (a device
  tensor costs one synchronization a call).
"""

from __future__ import annotations

import warnings
from typing import Sequence

import torch

from ..backends import block_grouped, grouped_mm
from ..formats.base import QuantizedTensor
from ..formats.float8 import grouped as fp8_grouped
from ..formats.float8.quantizer import Float8CurrentScalingQuantizer
from ..formats.float8.tensor import Float8Tensor
from ..gemm import gemm
from ..kernels.transpose import transpose_contiguous
from . import grouped_block_fp8, grouped_exact, weight_cache
from .function import LinearQuantizers, _caching_weights, quantized_linear
from .grouped_parts import fused, group_ids, layout, stacked, weight_grads


def _check_sizes_tensor(group_sizes: torch.Tensor, num_groups: int) -> None:
    if group_sizes.dim() != 1 or group_sizes.shape[0] != num_groups or (
            group_sizes.is_floating_point() or group_sizes.is_complex()
            or group_sizes.dtype == torch.bool):
        raise ValueError(f"group sizes must be a 1-D integer tensor of {num_groups} sizes, "
                         f"got {group_sizes.dtype} of shape {tuple(group_sizes.shape)}")


def _sizes_tensor(group_sizes, num_groups: int, rows: int, device,
                  alignment: int = 1) -> torch.Tensor:
    if isinstance(group_sizes, torch.Tensor):
        _check_sizes_tensor(group_sizes, num_groups)
        sizes = group_sizes.to(device=device, dtype=torch.int64)
        if sizes.is_cuda:
            # checked on the device: a bad count stops the stream, the host never waits
            torch._assert_async(torch.all(sizes >= 0) & (sizes.sum() == rows)
                                & torch.all(sizes % alignment == 0),
                                "group sizes must be non-negative multiples of group_alignment "
                                "and sum to the row count")
        else:
            _check_sizes(sizes.tolist(), num_groups, rows, alignment)
        return sizes
    sizes = [int(m) for m in group_sizes]
    _check_sizes(sizes, num_groups, rows, alignment)
    return torch.tensor(sizes, dtype=torch.int64, device=device)


def _check_sizes(sizes: list, num_groups: int, rows: int, alignment: int = 1) -> None:
    if len(sizes) != num_groups or any(m < 0 for m in sizes):
        raise ValueError(f"m_splits={sizes} must have {num_groups} non-negative sizes")
    if sum(sizes) != rows:
        raise ValueError(f"m_splits sum to {sum(sizes)} but the input has {rows} rows")
    if any(m % alignment for m in sizes):
        raise ValueError(f"m_splits={sizes} must be multiples of group_alignment={alignment}")


def _host_sizes(group_sizes) -> list[int]:
    if isinstance(group_sizes, torch.Tensor):
        return [int(m) for m in group_sizes.tolist()]
    return [int(m) for m in group_sizes]


def _same_current(qs: Sequence[Float8CurrentScalingQuantizer | None]) -> bool:
    first = qs[0]
    if type(first) is not Float8CurrentScalingQuantizer:
        return False
    if any("quantize" in q.__dict__ for q in qs):
        # hooked (lowprec.debug, compare's SQNR probe): each group quantized through its
        # quantizer's own quantize, so the hooks see every expert's tensors (same values)
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
    if not all(_same_current(s) for s in slots):
        return None
    return tuple(s[0] for s in slots)


def group_alignment_for(quantizers: LinearQuantizers | Sequence[LinearQuantizers] | None,
                        n: int, k: int) -> int:
    """The row multiple the grouped path of ``quantizers`` (one set, or one per group) pads
    each group to, for experts of ``n`` out and ``k`` in features; 1 where it pads nothing.
    A caller that lays its routed rows out in groups of that multiple, zero rows after each
    group (as :class:`lowprec.GroupedExperts` does), passes it as ``group_alignment`` and
    spares the grouped path its copies."""
    if quantizers is None:
        return 1
    qs = [quantizers] if isinstance(quantizers, LinearQuantizers) else list(quantizers)
    if current_scaling_quantizers(qs) is not None:
        return grouped_mm.ALIGN  # wgrad's FP8 grouped kernel
    if grouped_block_fp8.block_fp8_quantizers(qs, n, k) is not None:
        return block_grouped.ALIGN
    exact = grouped_exact.exact_quantizers(qs, n, k)
    return grouped_exact.row_align(exact) if exact is not None else 1


class _GroupedPlain(torch.autograd.Function):
    """High precision, one ``torch._grouped_mm`` per direction."""

    @staticmethod
    def forward(ctx, x2d, w3d, sizes):
        offs = grouped_mm.end_offsets(sizes)
        ctx.save_for_backward(x2d, w3d, offs)
        return grouped_mm.plain_rows_by_experts(x2d, w3d, offs)

    @staticmethod
    def backward(ctx, dy):
        x2d, w3d, offs = ctx.saved_tensors
        dy = dy.contiguous()
        dx = dw = None
        if ctx.needs_input_grad[1]:
            dw = grouped_mm.plain_wgrad(dy, x2d, offs)
        if ctx.needs_input_grad[0]:
            dx = grouped_mm.plain_rows_by_experts(dy, w3d.transpose(1, 2), offs)
        return dx, dw, None


def _group_tensor(data, scale, shape, dtype, fp8_dtype, usage="rowwise"):
    # one group's rows as the Float8Tensor its own quantize makes, in the direction used
    if usage == "rowwise":
        return Float8Tensor(shape, dtype, rowwise_data=data, columnwise_data=None,
                            shared_scale=scale, fp8_dtype=fp8_dtype)
    return Float8Tensor(shape, dtype, rowwise_data=None, columnwise_data=data.t().contiguous(),
                        shared_scale=scale, fp8_dtype=fp8_dtype)


def _quantized_experts(weights: Sequence[torch.Tensor], q_w, transposed: bool):
    """(fp8 experts (G, N, K), their transpose (K, G * N) or None, scales (G,)) of one
    (G, N, K) weight or G (N, K) ones, the transpose (``transposed``) from the same pass;
    under ``lowprec.autocast(cache_weights=True)`` made once, both layouts, while the
    weights are unchanged (gradient accumulation: once per optimizer step)."""
    def make(transposed=transposed):
        out = fp8_grouped.quantize_experts(stacked(weights).detach().contiguous(), q_w,
                                           transposed)
        return out if transposed else (out[0], None, out[1])
    if _caching_weights() and not torch.compiler.is_compiling():
        return weight_cache.cached_value(weights, q_w, lambda: make(True))
    return make()


class _GroupedCurrent(torch.autograd.Function):
    """FP8 current scaling, every group its own scales; grouped GEMMs where the device has
    them, else each group's GEMM as the per-expert Linear runs it. The weights are one
    (G, N, K) tensor or G (N, K) ones (each gets its own gradient: no stacked copy)."""

    @staticmethod
    def forward(ctx, x2d, sizes, quantizers, grad_enabled, grouped, aligned, *weights):
        q_x, q_w, q_dy = quantizers
        rows = x2d.shape[0]
        need_dx = grad_enabled and ctx.needs_input_grad[0]
        need_dw = grad_enabled and any(ctx.needs_input_grad[6:])
        ctx.grouped = grouped and _grouped_backward(x2d, weights[0].shape[-2], q_dy)
        # dgrad's columnwise copy (K, G * N) is written by the weights' cast itself
        wq, wq_t, sw = _quantized_experts(weights, q_w, ctx.grouped and need_dx)
        num, w_dtype = wq.shape[0], weights[0].dtype
        ids = group_ids(sizes, rows)
        # groups the caller laid out at multiples of 16 rows: wgrad reads the transposed
        # codes as they are, written by the cast itself
        ctx.transposed = ctx.grouped and aligned
        xq_t = None
        if ctx.transposed and need_dw:
            xq, xq_t, sx = fused(fp8_grouped.quantize_groups_both, x2d)(x2d, ids, num, q_x)
        else:
            xq, sx = fused(fp8_grouped.quantize_groups, x2d)(x2d, ids, num, q_x)
        host = None if grouped else _host_sizes(sizes)
        if grouped:
            offs = grouped_mm.end_offsets(sizes)
            y = grouped_mm.fp8_rows_by_experts(xq, torch.reciprocal(sx)[ids], wq,
                                               torch.reciprocal(sw), offs, x2d.dtype)
        else:
            y = torch.cat([gemm(_group_tensor(xg, sx[g:g + 1], xg.shape, x2d.dtype, q_x.fp8_dtype),
                                "rowwise", _group_tensor(wq[g], sw[g:g + 1], wq[g].shape,
                                                         w_dtype, q_w.fp8_dtype),
                                "rowwise", out_dtype=x2d.dtype)
                           for g, xg in enumerate(torch.split(xq, host))])
        saved_x = (xq_t if ctx.transposed else xq) if need_dw else None
        saved_w = (wq_t if ctx.grouped else wq) if need_dx else None
        ctx.save_for_backward(saved_x, sx, saved_w, sw, sizes, ids)
        ctx.w_shape = wq.shape
        ctx.q_dy, ctx.host = q_dy, host
        ctx.weights = layout(weights)
        ctx.dtypes = (x2d.dtype, w_dtype, q_x.fp8_dtype, q_w.fp8_dtype)
        return y

    @staticmethod
    def backward(ctx, dy):
        xq, sx, wq, sw, sizes, ids = ctx.saved_tensors
        x_dtype, w_dtype, x_fp8, w_fp8 = ctx.dtypes
        need_dx, need_dw = ctx.needs_input_grad[0], any(ctx.needs_input_grad[6:])
        num = sw.shape[0]
        dy = dy.contiguous()
        if ctx.transposed and need_dw:
            dyq, dyq_t, sdy = fused(fp8_grouped.quantize_groups_both, dy)(dy, ids, num, ctx.q_dy)
        else:
            dyq, sdy = fused(fp8_grouped.quantize_groups, dy)(dy, ids, num, ctx.q_dy)
        dy_fp8 = ctx.q_dy.fp8_dtype
        dx = dw = None
        if ctx.grouped:
            dec_dy = torch.reciprocal(sdy)
            if need_dw:
                if ctx.transposed:  # the saved input is already (K, M)
                    dy_t, x_t, offs = dyq_t, xq, grouped_mm.end_offsets(sizes)
                else:
                    src, valid, offs, _, _ = grouped_mm.padded_layout(sizes, ids, dyq.shape[0])
                    pad = fused(grouped_mm.padded_rows, dyq)
                    dy_t = transpose_contiguous(pad(dyq, src, valid))
                    x_t = transpose_contiguous(pad(xq, src, valid))
                dw = grouped_mm.fp8_wgrad(dy_t, dec_dy, x_t, torch.reciprocal(sx), offs, w_dtype)
            if need_dx:
                # the saved (K, G * N) codes: expert g's (K, N) are the columns g*N...
                _, n, k = ctx.w_shape
                w_t = wq.view(k, num, n).permute(1, 0, 2)
                dx = grouped_mm.fp8_rows_by_experts(dyq, dec_dy[ids], w_t, torch.reciprocal(sw),
                                                    grouped_mm.end_offsets(sizes), x_dtype)
            return dx, None, None, None, None, None, *weight_grads(dw, ctx.weights)
        # E5M2 gradients (the HYBRID format) have no grouped kernel: one GEMM per group,
        # the sizes read on the host (one sync per backward on the GPU)
        host = ctx.host if ctx.host is not None else _host_sizes(sizes)
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
        return dx, None, None, None, None, None, *weight_grads(dw, ctx.weights)


def _grouped_forward(x2d: torch.Tensor, n: int, q_x, q_w) -> bool:
    return (x2d.dtype == torch.bfloat16
            and grouped_mm.fp8_available(x2d, x2d.shape[1], n, q_x.fp8_dtype, q_w.fp8_dtype))


def _grouped_backward(x2d: torch.Tensor, n: int, q_dy) -> bool:
    return grouped_mm.fp8_available(x2d, x2d.shape[1], n, q_dy.fp8_dtype)


def grouped_linear(x: torch.Tensor, weight, group_sizes, bias=None, *,
                   quantizers: LinearQuantizers | Sequence[LinearQuantizers] | None = None,
                   backward_mode: str = "default", on_backward_done=None,
                   group_alignment: int = 1) -> torch.Tensor:
    """Each group of consecutive rows of ``x`` through its own expert: ``(..., K) ->
    (..., N)``.

    ``weight``: a (G, N, K) tensor or G (N, K) tensors. ``group_sizes``: the G row counts,
    as a 1-D integer tensor (on the device: nothing waits for the host where the recipe
    has a grouped path, see the module docstring) or a list; zeros are allowed.
    ``bias``: None, a (G, N) tensor or G (N,) tensors. ``quantizers``: None (high
    precision), one :class:`LinearQuantizers` for every group, or one per group.
    ``backward_mode`` and ``on_backward_done`` as :func:`quantized_linear`'s.
    ``group_alignment``: every group size is a multiple of it (the caller spread the rows
    with zero rows after each group, as :func:`group_alignment_for` asks): a grouped path
    that pads each group to whole blocks itself then uses the rows as they are. Zero rows
    change no scale and give zero products, so the result on the real rows is the same.
    Checked (on the device for a device tensor).
    """
    if not isinstance(group_alignment, int) or group_alignment < 1:
        raise ValueError(f"group_alignment must be a positive int, got {group_alignment!r}")
    weights = list(weight) if not isinstance(weight, torch.Tensor) else None
    num = len(weights) if weights is not None else weight.shape[0]
    if weights is None and weight.dim() != 3:
        raise ValueError(f"grouped_linear weight must be (G, N, K) or a list of (N, K) tensors, "
                         f"got shape {tuple(weight.shape)}")
    if num < 1:
        raise ValueError("grouped_linear needs at least one group")
    k = x.shape[-1]
    x2d = x.reshape(-1, k)
    qs = ([quantizers] * num if isinstance(quantizers, LinearQuantizers) else quantizers)
    if qs is not None and len(qs) != num:
        raise ValueError(f"grouped_linear got {len(qs)} quantizer sets for {num} groups")
    w_list = weights if weights is not None else list(weight.unbind(0))
    route = _route(x2d, w_list, qs, bias, backward_mode, on_backward_done)
    if route is None:
        return _per_group(x, x2d, w_list, group_sizes, bias, qs, backward_mode,
                          on_backward_done, group_alignment)
    kind, picked = route
    sizes = _sizes_tensor(group_sizes, num, x2d.shape[0], x.device, group_alignment)
    n = w_list[0].shape[0]
    w_args = weights if weights is not None else (weight,)
    if kind == "plain":
        y = _GroupedPlain.apply(x2d.contiguous(), stacked(w_args), sizes)
    elif kind == "block":
        y = grouped_block_fp8.GroupedBlockFP8.apply(
            x2d.contiguous(), sizes, picked, torch.is_grad_enabled(),
            group_alignment % block_grouped.ALIGN == 0, *w_args)
    elif kind == "exact":
        aligned = group_alignment % grouped_exact.row_align(picked) == 0
        y = grouped_exact.GroupedExact.apply(x2d.contiguous(), sizes, picked,
                                             torch.is_grad_enabled(), aligned, *w_args)
    else:
        q_x, q_w, q_dy = picked
        grouped = _grouped_forward(x2d, n, q_x, q_w)
        if grouped and torch.is_grad_enabled() and not _grouped_backward(x2d, n, q_dy):
            warnings.warn("grouped_linear: E5M2 gradients (Format.HYBRID) have no grouped FP8 "
                          "kernel on Hopper, so dgrad and wgrad run one GEMM per expert and "
                          "read the group sizes on the host; "
                          "Float8CurrentScaling(fp8_format=Format.E4M3) keeps them grouped",
                          stacklevel=2)
        y = _GroupedCurrent.apply(x2d.contiguous(), sizes, picked, torch.is_grad_enabled(),
                                  grouped, group_alignment % grouped_mm.ALIGN == 0, *w_args)
    return y.reshape(*x.shape[:-1], n)


def _route(x2d, w_list, qs, bias, backward_mode, on_backward_done):
    """("plain", None), ("current", quantizers), ("block", quantizers), ("exact",
    quantizers) or None (one Linear per group)."""
    if (bias is not None or on_backward_done is not None or isinstance(x2d, QuantizedTensor)
            or x2d.shape[0] == 0):
        return None  # (no rows: the per-group path runs the empty GEMMs)
    if torch.is_autocast_enabled(x2d.device.type):
        return None
    w0 = w_list[0]
    if any(isinstance(w, QuantizedTensor) or w.dtype != x2d.dtype or w.shape != w0.shape
           or w.dim() != 2 for w in w_list) or w0.shape[1] != x2d.shape[1]:
        return None
    n, k = w0.shape
    if qs is None:
        return ("plain", None) if grouped_mm.plain_available(x2d, k, n) else None
    if backward_mode != "default":
        return None
    current = current_scaling_quantizers(qs)
    if current is not None:
        return "current", current
    block = grouped_block_fp8.block_fp8_quantizers(qs, n, k)
    if block is not None and grouped_block_fp8.runs_on(x2d, block):
        return "block", block
    if grouped_mm.plain_available(x2d, k, n):
        # block formats whose per-expert GEMMs run on the bf16 tensor cores (MXFP8)
        exact = grouped_exact.exact_quantizers(qs, n, k)
        if exact is not None:
            return "exact", exact
    return None


def _per_group(x, x2d, w_list, group_sizes, bias, qs, backward_mode, on_backward_done,
               group_alignment=1):
    if isinstance(group_sizes, torch.Tensor):
        _check_sizes_tensor(group_sizes, len(w_list))
    sizes = _host_sizes(group_sizes)
    _check_sizes(sizes, len(w_list), x2d.shape[0], group_alignment)
    biases = ([None] * len(w_list) if bias is None else list(bias))
    outs = [quantized_linear(xg, w_list[g], biases[g], quantizers=qs[g] if qs else None,
                             backward_mode=backward_mode, on_backward_done=on_backward_done)
            for g, xg in enumerate(torch.split(x2d, sizes))]
    return torch.cat(outs).reshape(*x.shape[:-1], w_list[0].shape[0])
