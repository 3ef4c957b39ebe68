"""Grouped linear: the experts of a mixture-of-experts layer over their routed rows.

``grouped_linear(x, weight, group_sizes)`` runs rows ``x[s_g : s_g + n_g]`` through expert
``g``'s weight. Each group is quantized on its own rows, as one :class:`lowprec.Linear`
per expert would quantize it, so the result is the per-expert one.

How it runs is decided once per set of quantizers and kind of call (a
``grouped_engine.GroupedPlan``, which the one ``grouped_engine.GroupedFunction`` runs), by
the quantizers and the device:

* high precision on Hopper: one ``torch._grouped_mm`` per direction;
* FP8 current scaling on Hopper, bf16 activations: per-group amaxes (one Triton pass),
  the scales from one launch and one Triton cast pass (group sizes read on the device, no
  host sync), one grouped GEMM per direction: lowprec's Triton kernel, bit for bit the
  per-expert cuBLAS GEMMs (E4M3 and E5M2 operands), or ``torch._scaled_grouped_mm`` for
  few large experts (:mod:`.grouped_current`); nothing waits for the host;
* FP8 current scaling elsewhere: the same quantize, then each group's GEMM as
  :func:`lowprec.gemm.gemm` runs it;
* MXFP8 (block formats emulated on bf16 GEMMs) on Hopper, bf16 activations: one quantize
  of the padded rows, of the stacked weights and of dY, one ``torch._grouped_mm`` per
  direction over their exact values (:mod:`.grouped_exact`), nothing read on the host;
* block-scaled FP8 (1x128 activations and gradients) on Hopper, bf16 activations, E4M3:
  the same layout and quantizes, one launch of lowprec's grouped block-scaled FP8 GEMM
  per direction, bit for bit the per-expert cuBLAS GEMMs (:mod:`.grouped_block_fp8`),
  nothing read on the host;
* NVFP4 on Hopper, bf16 activations: each expert's global scales found on the device, one
  pass a direction writes every expert's exact bf16 values, one grouped bf16 GEMM a
  direction with each expert's ``1 / (S_a * S_b)`` applied before the rounding, bit for
  bit the per-expert GEMMs without stochastic rounding (:mod:`.grouped_nvfp4`), nothing
  read on the host;
* a :class:`lowprec.formats.float8.experts.Float8Experts` weight (the experts as an FSDP2
  quantized all-gather brings them): FP8 current scaling's path, the weights' codes and
  scales as they are; other recipes refuse it;
* a :class:`lowprec.formats.block.experts.Float8BlockExperts` or
  :class:`lowprec.formats.nvfp4.experts.NVFP4Experts` weight (likewise): the recipe's
  grouped path (block-scaled FP8, NVFP4) with the weights' codes and scales where it
  runs, else one :func:`quantized_linear` per group over that expert's own quantized
  weight;
* every other recipe, a bias, quantized weights or boundary quantizers: one
  :func:`quantized_linear` per group. This reads ``group_sizes`` on the host (a device
  tensor costs one synchronization a call).
"""

from __future__ import annotations

import warnings
from typing import Sequence

import torch

from ..formats import QuantizedExperts, QuantizedTensor
from ..formats.block import Float8BlockExperts
from ..formats.float8 import Float8Experts
from ..formats.nvfp4 import NVFP4Experts
from ..gemm import grouped_mm
from ..kernels.moe_route import group_sizes_ok
from ..recipe import BackwardMode, torch_autocast_dtype, torch_autocast_off
from . import grouped_block_fp8, grouped_blocks, grouped_current, grouped_exact, grouped_nvfp4
from .function import LinearQuantizers, quantized_linear
from .grouped_engine import PLAIN, GroupedFunction, GroupedPlan
from .grouped_parts import group_ids, hooked, host_sizes
from .plan import keep

__all__ = ["group_alignment_for", "group_ids", "grouped_linear", "grouped_refusal",
           "per_group_equivalent", "check_sizes"]


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
        if sizes.is_cuda or torch.compiler.is_compiling():
            # checked on the device: a bad count stops the stream, the host never waits
            # (and a compiled graph does not break)
            torch._assert_async(group_sizes_ok(sizes, rows, alignment),
                                "group sizes must be non-negative multiples of group_alignment "
                                "and sum to the row count")
        else:
            check_sizes(sizes.tolist(), num_groups, rows, alignment)
        return sizes
    sizes = [int(m) for m in group_sizes]
    check_sizes(sizes, num_groups, rows, alignment)
    return torch.tensor(sizes, dtype=torch.int64, device=device)


def check_sizes(sizes: list, num_groups: int, rows: int, alignment: int = 1) -> None:
    """Refuse group sizes (ints) that are not ``num_groups`` non-negative multiples of
    ``alignment`` summing to ``rows``."""
    if len(sizes) != num_groups or any(m < 0 for m in sizes):
        raise ValueError(f"m_splits={sizes} must have {num_groups} non-negative sizes")
    if sum(sizes) != rows:
        raise ValueError(f"m_splits sum to {sum(sizes)} but the input has {rows} rows")
    if any(m % alignment for m in sizes):
        raise ValueError(f"m_splits={sizes} must be multiples of group_alignment={alignment}")


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
    return _kept(qs, ("alignment", n, k), lambda: _alignment(qs, n, k))


def _alignment(qs: list, n: int, k: int) -> int:
    """The row multiple of the scheme the quantizers pick, on any device (the scheme's
    ``align``)."""
    for scheme, picked in (
            (grouped_current.CURRENT, grouped_current.current_scaling_quantizers(qs)),
            (grouped_block_fp8.BLOCK_FP8, grouped_block_fp8.block_fp8_quantizers(qs, n, k)),
            (grouped_nvfp4.NVFP4, grouped_nvfp4.nvfp4_quantizers(qs, n, k)),
            (grouped_exact.EXACT, grouped_exact.exact_quantizers(qs, n, k))):
        if picked is not None:
            return scheme.align(picked)
    return 1


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

    Under ``torch.autocast`` the rows, the high-precision weights and the biases are cast
    to its dtype (differentiably: fp32 weights get fp32 gradients) and the call runs with
    autocast off, as each group's :func:`quantized_linear` would run it: the grouped
    paths then take it (Hugging Face Trainer's ``bf16=True`` over fp32 parameters).
    """
    if not isinstance(group_alignment, int) or group_alignment < 1:
        raise ValueError(f"group_alignment must be a positive int, got {group_alignment!r}")
    amp = torch_autocast_dtype(x)
    if amp is not None and not isinstance(x, QuantizedTensor):
        with torch_autocast_off(x.device.type):
            return grouped_linear(x.to(amp), _cast(weight, amp), group_sizes,
                                  _cast(bias, amp), quantizers=quantizers,
                                  backward_mode=backward_mode,
                                  on_backward_done=on_backward_done,
                                  group_alignment=group_alignment)
    if isinstance(weight, Float8Experts):
        return _float8_experts(x, weight, group_sizes, bias, quantizers, backward_mode,
                               on_backward_done, group_alignment)
    if isinstance(weight, (Float8BlockExperts, NVFP4Experts)):
        return _quantized_experts(x, weight, group_sizes, bias, quantizers, backward_mode,
                                  on_backward_done, group_alignment)
    weights = list(weight) if not isinstance(weight, torch.Tensor) else None
    num = len(weights) if weights is not None else weight.shape[0]
    if weights is None and weight.dim() != 3:
        raise ValueError(f"grouped_linear weight must be (G, N, K) or a list of (N, K) tensors, "
                         f"got shape {tuple(weight.shape)}")
    if num < 1:
        raise ValueError("grouped_linear needs at least one group")
    k = x.shape[-1]
    x2d = x.reshape(-1, k)
    qs = _group_quantizers(quantizers, num)
    plan = _route(x2d, weights if weights is not None else weight, qs, bias, backward_mode,
                  on_backward_done)
    if plan is None:
        w_list = weights if weights is not None else list(weight.unbind(0))
        return _per_group(x, x2d, w_list, group_sizes, bias, qs, backward_mode,
                          on_backward_done, group_alignment)
    sizes = _sizes_tensor(group_sizes, num, x2d.shape[0], x.device, group_alignment)
    n = weight.shape[1] if weights is None else weights[0].shape[0]
    w_args = weights if weights is not None else (weight,)
    if plan.name == "current":
        plan = _with_backend(plan, x2d, n, num)
    y = GroupedFunction.apply(x2d.contiguous(), sizes, plan, torch.is_grad_enabled(),
                              group_alignment % plan.align == 0, *w_args)
    return y.reshape(*x.shape[:-1], n)


def _cast(t, dtype: torch.dtype):
    """A high-precision (G, ...) tensor or list of tensors cast to ``dtype``; quantized
    ones (experts gathered quantized) and None as they are."""
    return _each_plain(t, lambda u: u.to(dtype))


def _each_plain(t, fn):
    """``fn`` of the high-precision tensors of an operand (a tensor, a list of them, or
    None); quantized ones as they are."""
    if t is None:
        return None
    if isinstance(t, torch.Tensor):
        return t if isinstance(t, (QuantizedTensor, QuantizedExperts)) else fn(t)
    return [_each_plain(u, fn) for u in t]


def grouped_refusal(x2d: torch.Tensor, weight, quantizers=None, bias=None,
                   backward_mode: str = "default", on_backward_done=None) -> str | None:
    """Why dynamo cannot trace :func:`grouped_linear`'s grouped path over rows like
    ``x2d`` (a 2-D tensor of the call's input dtype, device and features; its row count
    only has to be positive where the call's is), or None where it can: a grouped path
    that reads nothing on the host in either direction. Those paths are autograd
    Functions over custom ops, so the compiled call runs eager's kernels in eager's
    order: the same bits. One :func:`quantized_linear` a group reads the group sizes on
    the host (a caller with sizes known to the host may trace the groups itself, see
    :func:`per_group_equivalent`)."""
    if isinstance(weight, (Float8Experts, Float8BlockExperts, NVFP4Experts)):
        return "experts gathered quantized (FSDP2's quantized_all_gather) run eagerly"
    num = _num_groups(weight)
    if num < 1 or (isinstance(weight, torch.Tensor) and weight.dim() != 3):
        return "no experts to trace"
    x2d, weight, route = _called_route(x2d, weight, quantizers, bias, backward_mode,
                                       on_backward_done)
    if route is None:
        return ("no grouped GEMM for this recipe, device or call (bias, backward mode, "
                "no rows): one Linear per expert reads the group sizes on the host")
    if route.name == "current":
        n = weight.shape[1] if isinstance(weight, torch.Tensor) else weight[0].shape[0]
        q_x, q_w, q_dy = route.quantizers
        if grouped_current.gemm_backend(x2d, n, num, q_x.fp8_dtype, q_w.fp8_dtype) is None:
            return "no grouped FP8 GEMM here: one GEMM per expert reads the group sizes"
        if torch.is_grad_enabled() and grouped_current.gemm_backend(
                x2d, n, num, q_dy.fp8_dtype, q_w.fp8_dtype, q_x.fp8_dtype) is None:
            return ("no grouped FP8 GEMM here for E5M2 gradients: one GEMM per expert reads "
                    "the group sizes")
    return None


def per_group_equivalent(x2d: torch.Tensor, weight, quantizers=None, bias=None,
                         backward_mode: str = "default") -> bool:
    """Whether :func:`grouped_linear` gives, for rows like ``x2d`` (as
    :func:`grouped_refusal` reads them), the bits of one :func:`quantized_linear` a group
    on every device: no grouped path takes the call, or FP8 current scaling's does (each
    group quantized on its own rows and multiplied as its Linear multiplies it). The
    other grouped paths equal the per-group Linears where they run, but NVFP4's stochastic
    rounding draws its own random bits."""
    route = _called_route(x2d, weight, quantizers, bias, backward_mode, None)[2]
    return route is None or route.name == "current"


def _called_route(x2d, weight, quantizers, bias, backward_mode, on_backward_done):
    """(rows, weight, :func:`_route`) as :func:`grouped_linear` routes the call (see
    :func:`_as_called`)."""
    x2d, weight, bias = _as_called(x2d, weight, bias)
    qs = _group_quantizers(quantizers, _num_groups(weight))
    return x2d, weight, _route(x2d, weight, qs, bias, backward_mode, on_backward_done)


def _as_called(x2d, weight, bias):
    """The operands as :func:`grouped_linear` routes them: under torch.autocast, stand-ins
    of their shapes in its dtype (dead ops in a graph), read with autocast off."""
    amp = torch_autocast_dtype(x2d)
    if amp is None or isinstance(x2d, QuantizedTensor):
        return x2d, weight, bias

    def like(t):
        return t.new_empty(t.shape, dtype=amp)
    return like(x2d), _each_plain(weight, like), _each_plain(bias, like)


def _num_groups(weight) -> int:
    return weight.shape[0] if isinstance(weight, torch.Tensor) else len(weight)


def _float8_experts(x, weight, group_sizes, bias, quantizers, backward_mode, on_backward_done,
                    group_alignment):
    """``grouped_linear`` over experts already in FP8 (``Float8Experts``): FP8 current
    scaling's grouped path with the weight's codes and scales."""
    num, n, k = weight.shape
    qs = None if quantizers is None else _group_quantizers(quantizers, num)
    picked = grouped_current.current_scaling_quantizers(qs) if qs is not None else None
    if (picked is None or bias is not None or on_backward_done is not None
            or backward_mode != BackwardMode.DEFAULT or x.shape[-1] != k):
        raise ValueError(
            "grouped_linear: FP8 experts (gathered quantized, Float8Experts) run under the FP8 "
            "current-scaling recipe they were gathered for (one quantizer setting a slot, "
            "nothing quantized at the boundaries), default backward mode, no bias, "
            f"{k} input features; got quantizers {quantizers!r}, backward_mode "
            f"{backward_mode!r}, input features {x.shape[-1]}")
    x2d = x.reshape(-1, k)
    if x2d.shape[0] == 0:
        return x.new_zeros(*x.shape[:-1], n)
    sizes = _sizes_tensor(group_sizes, num, x2d.shape[0], x.device, group_alignment)
    q_x, q_w, _ = picked
    backend = grouped_current.gemm_backend(x2d, n, num, q_x.fp8_dtype, q_w.fp8_dtype)
    plan = GroupedPlan(grouped_current.CURRENT, picked, backend)
    y = GroupedFunction.apply(x2d.contiguous(), sizes, plan, torch.is_grad_enabled(),
                              group_alignment % plan.align == 0, weight)
    return y.reshape(*x.shape[:-1], n)


def _group_quantizers(quantizers, num: int):
    """The quantizer sets the groups read: None, ``[quantizers]`` where one
    :class:`LinearQuantizers` serves every group (the paths then look at one set, not
    ``num`` copies: a compiled call traces that look), or one per group (checked: ``num``
    of them)."""
    if isinstance(quantizers, LinearQuantizers):
        return [quantizers]
    if quantizers is not None and len(quantizers) != num:
        raise ValueError(f"grouped_linear got {len(quantizers)} quantizer sets for {num} "
                         f"groups")
    return quantizers


def _quantized_experts(x, weight, group_sizes, bias, quantizers, backward_mode,
                       on_backward_done, group_alignment):
    """``grouped_linear`` over experts that arrive quantized (``Float8BlockExperts``,
    ``NVFP4Experts``): their recipe's grouped path with the weight's codes and scales where
    the recipe and the device run it, else one :func:`quantized_linear` per group over
    that expert's own quantized weight (whatever the recipe)."""
    num, n, _ = weight.shape
    x2d = x.reshape(-1, x.shape[-1])
    qs = _group_quantizers(quantizers, num)
    route = _route(x2d, weight, qs, bias, backward_mode, on_backward_done)
    kind = "block" if isinstance(weight, Float8BlockExperts) else "nvfp4"
    grouped = route is not None and route.name == kind
    if kind == "block":
        # the path reads power-of-two scales exactly (its bf16 emulated directions too)
        grouped = grouped and weight.pow2 and route.quantizers[1].fp8_dtype == weight.fp8_dtype
    if grouped:
        sizes = _sizes_tensor(group_sizes, num, x2d.shape[0], x.device, group_alignment)
        y = GroupedFunction.apply(x2d.contiguous(), sizes, route, torch.is_grad_enabled(),
                                  group_alignment % route.align == 0, weight)
        return y.reshape(*x.shape[:-1], n)
    experts = ExpertWeightsFunction.apply(weight, torch.is_grad_enabled())
    return _per_group(x, x2d, list(experts), group_sizes, bias, qs, backward_mode,
                      on_backward_done, group_alignment)


class ExpertWeightsFunction(torch.autograd.Function):
    """Each expert's (N, K) weight of quantized experts, as its own quantize makes it; the
    backward stacks their gradients into the (E, N, K) one."""

    @staticmethod
    def forward(ctx, experts, grad_enabled):
        ctx.shape, ctx.dtype, ctx.device = experts.shape, experts.dtype, experts.device
        # the columnwise data dgrad reads, only where a backward may run
        return tuple(experts.expert(g, columnwise=grad_enabled)
                     for g in range(experts.shape[0]))

    @staticmethod
    def backward(ctx, *grads):
        return torch.stack([torch.zeros(ctx.shape[1:], dtype=ctx.dtype, device=ctx.device)
                            if g is None else g for g in grads]), None


def _weights_fit(x2d, weight) -> bool:
    """Whether the experts' weights (a (G, N, K) tensor or G (N, K) ones) are plain tensors
    of ``x2d``'s dtype, one (N, K) shape, K ``x2d``'s features."""
    if isinstance(weight, torch.Tensor):
        return (not isinstance(weight, QuantizedTensor) and weight.dtype == x2d.dtype
                and weight.shape[2] == x2d.shape[1])
    w0 = weight[0]
    return not any(isinstance(w, QuantizedTensor) or w.dtype != x2d.dtype
                   or w.shape != w0.shape or w.dim() != 2
                   for w in weight) and w0.shape[1] == x2d.shape[1]


def _route(x2d, weight, qs, bias, backward_mode, on_backward_done):
    """The :class:`GroupedPlan` of the call (FP8 current scaling's without its per-call
    ``backend``, see :func:`_with_backend`), or None (one Linear per group), for
    ``weight`` a (G, N, K) tensor (quantized experts too: their dtype is the weight's) or
    G (N, K) ones. Decided once per set of quantizers and kind of call."""
    if not (_grouped_call(x2d, bias, on_backward_done) and _weights_fit(x2d, weight)):
        return None
    n, k = weight.shape[-2:] if isinstance(weight, torch.Tensor) else weight[0].shape
    if qs is None:
        return _PLAIN_PLAN if grouped_mm.plain_available(x2d, k, n) else None
    if backward_mode != BackwardMode.DEFAULT:
        return None
    return _kept(qs, ("route", n, k, x2d.dtype, x2d.device),
                 lambda: _quantizer_route(x2d, qs, n, k))


def _grouped_call(x2d, bias, on_backward_done) -> bool:
    """Whether a call's arguments leave the grouped paths open: no bias, no backward
    callback, plain rows (some: with none the per-group path runs the empty GEMMs).
    Under torch.autocast :func:`grouped_linear` has cast them and turned it off."""
    return (bias is None and on_backward_done is None and not isinstance(x2d, QuantizedTensor)
            and x2d.shape[0] > 0)


def _hooked(q: LinearQuantizers) -> bool:
    return any(s is not None and hooked(s) for s in (q.input, q.weight, q.grad_output))


def _kept(qs: list, key: tuple, decide):
    """``decide()``, kept in the first group's plans for these very quantizers: what the
    quantizers' types and settings decide is fixed while they live, and looking through
    one per expert (128 and more) on every call costs the host more than the call's
    launches. Whether they are hooked (``lowprec.debug``: each group then quantizes
    through its own quantizer) is part of the key; hooks are put on every quantizer a
    module's call gets, so the first group's stand for all."""
    plans = qs[0].plans
    full = (key, _hooked(qs[0]), tuple(map(id, qs)))
    if full not in plans:
        return keep(plans, full, decide())
    return plans[full]


def _quantizer_route(x2d, qs, n, k):
    """The part of :func:`_route` the quantizers decide, for ``x2d``'s dtype and device."""
    current = grouped_current.current_scaling_quantizers(qs)
    if current is not None:
        return GroupedPlan(grouped_current.CURRENT, current)
    block = grouped_block_fp8.block_fp8_quantizers(qs, n, k)
    if block is not None and grouped_block_fp8.runs_on(x2d, block):
        return GroupedPlan(grouped_block_fp8.BLOCK_FP8, block)
    nvfp4 = grouped_nvfp4.nvfp4_quantizers(qs, n, k)
    if nvfp4 is not None and grouped_nvfp4.runs_on(x2d, n, k):
        return GroupedPlan(grouped_nvfp4.NVFP4, nvfp4)
    if grouped_mm.plain_available(x2d, k, n):
        # block formats whose per-expert GEMMs run on the bf16 tensor cores (MXFP8)
        exact = grouped_exact.exact_quantizers(qs, n, k)
        if exact is not None and _formed(exact, x2d):
            return GroupedPlan(grouped_exact.EXACT, exact)
    return None


_PLAIN_PLAN = GroupedPlan(PLAIN)


def _with_backend(plan: GroupedPlan, x2d, n: int, num: int) -> GroupedPlan:
    """FP8 current scaling's plan with the grouped GEMM the device and the row count take
    (``grouped_current.gemm_backend``); warns where only the forward has one."""
    q_x, q_w, q_dy = plan.quantizers
    backend = grouped_current.gemm_backend(x2d, n, num, q_x.fp8_dtype, q_w.fp8_dtype)
    if backend and torch.is_grad_enabled() and grouped_current.gemm_backend(
            x2d, n, num, q_dy.fp8_dtype, q_w.fp8_dtype, q_x.fp8_dtype) is None:
        warnings.warn("grouped_linear: E5M2 gradients (Format.HYBRID) have no grouped FP8 "
                      "kernel here without Triton, so dgrad and wgrad run one GEMM per "
                      "expert and read the group sizes on the host; "
                      "Float8CurrentScaling(fp8_format=Format.E4M3) keeps them grouped",
                      stacklevel=3)
    return plan._replace(backend=backend)


def _formed(quantizers, x2d) -> bool:
    """Whether every quantizer of a block format's grouped path has its graph operand
    (``Quantizer.graph_operand``), through which the path quantizes in both forms. The
    block FP8 path takes ``Float8BlockQuantizer`` itself only, which always has one; the
    exact path takes any class with its flags, a user's subclass too."""
    return not isinstance(grouped_blocks.forms(quantizers, x2d), str)


def _per_group(x, x2d, w_list, group_sizes, bias, qs, backward_mode, on_backward_done,
               group_alignment=1):
    if isinstance(group_sizes, torch.Tensor):
        _check_sizes_tensor(group_sizes, len(w_list))
    sizes = host_sizes(group_sizes)
    check_sizes(sizes, len(w_list), x2d.shape[0], group_alignment)
    biases = ([None] * len(w_list) if bias is None else list(bias))
    shared = qs is not None and len(qs) == 1
    outs = [quantized_linear(xg, w_list[g], biases[g],
                             quantizers=None if qs is None else qs[0] if shared else qs[g],
                             backward_mode=backward_mode, on_backward_done=on_backward_done)
            for g, xg in enumerate(torch.split(x2d, sizes))]
    return torch.cat(outs).reshape(*x.shape[:-1], w_list[0].shape[0])
