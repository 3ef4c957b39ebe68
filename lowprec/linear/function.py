"""The one quantized-linear forward/backward shared by every module and op.

``y = x @ weight.T + bias`` with three GEMMs:

* fprop ``gemm(x, rowwise, W, rowwise)``
* dgrad ``gemm(dY, rowwise, W, columnwise)``
* wgrad ``gemm(dY, columnwise, x, columnwise)``

The backward mode decides what the forward saves:

* ``default``: the columnwise quantized input and weight (only the
  directions a needed gradient consumes; never a high-precision copy);
  the gradient is quantized per the recipe.
* ``high_precision``: the original input and weight; dgrad/wgrad run in
  high precision with the unquantized gradient.
* ``dequantized``: the rowwise quantized input and weight (what fprop used);
  backward dequantizes them and runs dgrad/wgrad in high precision.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from ..formats import QuantizedTensor, Quantizer
from ..gemm import accumulating, gemm
from ..memory import offload
from ..recipe import (
    BACKWARD_MODES,
    BackwardMode,
    active_region,
    normalize_backward_mode,
    operand_usages,
    torch_autocast_dtype,
    torch_autocast_off,
)
from . import eager_plan, exact_split, grad_split, graphed, padding, shared_input, weight_cache
from .plan import BOTH, plan_for


@dataclass
class LinearQuantizers:
    """The quantizers of one GEMM's slots (None: slot not quantized)."""

    input: Optional[Quantizer]
    weight: Optional[Quantizer]
    output: Optional[Quantizer] = None
    grad_output: Optional[Quantizer] = None
    grad_input: Optional[Quantizer] = None
    #: (fprop, dgrad, wgrad): whether the GEMMs of two per-tensor FP8 operands accumulate
    #: fast, as the recipe's ``fp8_gemm_*`` ask (``recipe.gemm_fast_accum``)
    fast_accum: tuple = (False, False, False)
    #: the calls' plans (``lowprec.linear.plan``), decided once per kind of call
    plans: dict = field(default_factory=dict, compare=False, repr=False)
    #: the calls' CUDA graphs (``lowprec.linear.graphed``), captured once per kind of call
    graphs: dict = field(default_factory=dict, compare=False, repr=False)

    def __getstate__(self):
        # Plans are a cache whose prepared quantizes hold these very quantizers, and graphs
        # belong to the device memory they were captured on: a copy (pickle, deepcopy)
        # starts without any, deciding and capturing its own.
        state = dict(self.__dict__)
        state["plans"], state["graphs"] = {}, {}
        return state


def quantize_operand(quantizer: Quantizer | None, t: torch.Tensor, *, rowwise: bool,
                     columnwise: bool, exact: tuple[str, ...] = (),
                     codes: bool = True) -> tuple[torch.Tensor, bool]:
    """Quantize ``t`` with exactly the usages asked for; returns (tensor, owned).

    ``exact``: the usages a GEMM consumes right away; formats emulated on a bf16 GEMM
    (MXFP8, NVFP4) then also write their exact bf16 values in the same pass
    (``Quantizer.quantize_for_gemm``), which saves the GEMM a dequantize pass.
    ``codes=False``: nothing but those GEMMs reads the result, so such formats may keep
    only the exact values (an ``ExactTensor``).

    An already quantized ``t`` (a quantized weight, or the output of a
    previous module) is used as it is: missing usages are derived where the
    format allows and nothing is ever dropped from it (``owned`` is False).
    """
    if isinstance(t, QuantizedTensor):
        missing = {u: True for u, want in (("rowwise", rowwise), ("columnwise", columnwise))
                   if want and not t.has_usage(u)}
        if missing:
            t.update_usage(rowwise_usage=missing.get("rowwise"),
                           columnwise_usage=missing.get("columnwise"))
        return t, False
    if quantizer is None:
        return t, False
    quantizer.set_usage(rowwise=rowwise, columnwise=columnwise)
    return quantizer.quantize_for_gemm(t, exact, codes=codes), True


def _plain(t: torch.Tensor) -> torch.Tensor:
    return t.dequantize() if isinstance(t, QuantizedTensor) else t


def _keep_only(t: torch.Tensor, owned: bool, usage: str) -> torch.Tensor:
    """Free the direction backward does not need (only on tensors this call made)."""
    if owned and isinstance(t, QuantizedTensor):
        other = "columnwise" if usage == "rowwise" else "rowwise"
        if t.has_usage(other):
            t.update_usage(**{f"{other}_usage": False})
    return t


def check_linear_args(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, *,
                      quantized_weight_dtype_free: bool = False) -> None:
    """Shapes and dtypes of a linear's operands. ``quantized_weight_dtype_free``: a quantized
    weight's nominal dtype need not be the input's (under torch.autocast, where the GEMM
    output takes the input's dtype and the weight gradient the weight's)."""
    if weight.dim() != 2:
        raise ValueError(f"linear weight must be 2-D (out_features, in_features), got shape "
                         f"{tuple(weight.shape)}")
    if x.shape[-1] != weight.shape[1]:
        raise ValueError(f"linear input has {x.shape[-1]} features (shape {tuple(x.shape)}), the "
                         f"weight expects {weight.shape[1]}")
    if x.dtype != weight.dtype and not (quantized_weight_dtype_free
                                        and isinstance(weight, QuantizedTensor)):
        raise TypeError(f"linear input dtype {x.dtype} does not match the weight dtype "
                        f"{weight.dtype}; cast the input or build the module with "
                        f"params_dtype={x.dtype}")
    if bias is not None and bias.dtype != x.dtype:
        raise TypeError(f"linear bias dtype {bias.dtype} does not match the weight dtype "
                        f"{weight.dtype}")


def _dgrad_weight(w: torch.Tensor | None) -> torch.Tensor | None:
    """The weight as dgrad reads it: a quantized weight that does not hold contiguous
    columnwise data (an FSDP-gathered weight holds a transposed view of the gathered rows,
    or only rowwise data where columnwise derives from it) gives a copy for this backward
    alone, so the weight itself never keeps one."""
    if not isinstance(w, QuantizedTensor) or w.holds_gemm_layout("columnwise"):
        return w
    return w.usage_copy("columnwise")


def graph_kept() -> bool:
    """Whether the running backward keeps the graph (``retain_graph=True``), i.e. saved
    tensors may be read again. True when unknown (tracing, no engine task, older torch)."""
    if torch.compiler.is_compiling():
        return True
    query = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)
    if query is None:
        return True
    try:
        return bool(query())
    except RuntimeError:
        return True


def _whole_backward(ctx, dy, saved_x, saved_w, need_dx: bool, need_dw: bool,
                    quantized: bool, release_x: Callable[[], None]):
    """(dX as (M, K) or None, dW or None) with dY quantized (or not) as a whole."""
    dx = dw = None
    dy_owned = False
    if quantized and (need_dx or need_dw):
        # dY is read by dgrad and wgrad only: exact values alone where the format allows
        # (only the directions in use are quantized)
        prepared = ctx.plan.quantize_dy
        if prepared is not None and not isinstance(dy, QuantizedTensor):
            dy_lp, dy_owned = prepared(dy), True
        else:
            dy_lp, dy_owned = quantize_operand(ctx.quantizers.grad_output, dy,
                                               rowwise=need_dx, columnwise=need_dw,
                                               exact=BOTH, codes=False)
        w_op, x_op = saved_w, saved_x
    else:
        dy_lp = _plain(dy)
        w_op = _plain(saved_w) if saved_w is not None else None
        x_op = _plain(saved_x) if saved_x is not None else None
    # wgrad first, so dY's columnwise copy and the saved input are freed before dgrad
    # allocates dX (lower peak).
    fast = ctx.quantizers.fast_accum if ctx.quantizers is not None else (False,) * 3
    if need_dw:
        with accumulating(fast[2]):
            dw = gemm(dy_lp, "columnwise", x_op, "columnwise", out_dtype=ctx.w_dtype)
        if need_dx:
            _keep_only(dy_lp, dy_owned, "rowwise")
        release_x()
    if need_dx:
        with accumulating(fast[1]):
            dx = gemm(dy_lp, "rowwise", w_op, "columnwise", out_dtype=ctx.x_dtype)
    return dx, dw


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    t2d = t.reshape(-1, t.shape[-1])
    return torch.cat([t2d, t2d.new_zeros(rows, t2d.shape[1])])


def _finish_forward(ctx, x, weight, bias, y, saved_x, saved_w, q, backward_mode,
                    on_backward_done, need_dx, need_dw, *, x_owned, w_owned, pad=0, x_shape=None):
    """Save what backward reads, record the rest on ``ctx``; y (quantized where the recipe
    quantizes the output). With ``pad`` rows appended to the input, ``x_shape`` is the
    caller's shape and the padded rows are cut from y."""
    if (saved_w is not None and saved_w is not weight
            and not isinstance(saved_w, torch.nn.Parameter)):
        offload.keep_on_device(saved_w)  # a weight's working copy stays with the weight
    ctx.save_for_backward(saved_x if need_dw else None, saved_w if need_dx else None)
    # Backward may free a saved operand once consumed only if nothing else holds it.
    ctx.x_releasable = backward_mode == BackwardMode.DEFAULT and x_owned
    ctx.w_releasable = backward_mode == BackwardMode.DEFAULT and w_owned
    ctx.quantizers = q
    ctx.backward_mode = backward_mode
    ctx.on_backward_done = on_backward_done
    ctx.x_shape, ctx.x_dtype, ctx.w_dtype = x_shape or x.shape, x.dtype, weight.dtype
    ctx.pad = pad
    ctx.has_bias = bias is not None
    if pad:
        y = y.reshape(-1, y.shape[-1])[:-pad].reshape(*ctx.x_shape[:-1], y.shape[-1])
    if q is not None and q.output is not None:
        y = q.output.quantize(y)
    return y


class EagerLinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, quantizers, backward_mode, on_backward_done, grad_enabled,
                weight_lp):
        # needs_input_grad ignores no_grad(); an eval forward must not make columnwise data.
        need_dx = grad_enabled and ctx.needs_input_grad[0]
        need_dw = grad_enabled and ctx.needs_input_grad[1]
        q = quantizers
        quantized = q is not None
        plan = plan_for(q, x, weight, backward_mode, need_dx, need_dw, weight_lp is not None)
        ctx.plan = plan
        ctx.w_like = None  # set where backward makes the weight's copy (w_in_backward)
        pad = plan.pad
        x_shape = x.shape
        if pad:
            x = _pad_rows(x, pad)
        padding = {"pad": pad, "x_shape": x_shape}
        ctx.exact_split = plan.exact_split
        if ctx.exact_split:
            y, saved_x, saved_w = exact_split.forward(q, x, weight, bias)
            return _finish_forward(ctx, x, weight, bias, y, saved_x, saved_w,
                                                    q, backward_mode, on_backward_done,
                                                    need_dx, need_dw, x_owned=True,
                                                    w_owned=True, **padding)
        x_col, w_col = plan.x_columnwise, plan.w_columnwise
        # "dequantized" saves fprop's rowwise copies: no exact records held on to them
        exact = plan.exact
        x_q = q.input if q else None

        def quantize_x():
            if plan.quantize_x is not None:
                return plan.quantize_x(x), True
            return quantize_operand(x_q, x, rowwise=True, columnwise=x_col, exact=exact)

        # q/k/v (gate/up) read one input: one quantize serves them (``shared_input``)
        x_shared = (shared_input.quantize(x_q, x, columnwise=x_col, exact=exact,
                                          make=lambda: quantize_x()[0])
                    if backward_mode == BackwardMode.DEFAULT and not pad else None)
        if x_shared is not None:
            x_lp, x_owned = x_shared, False
        else:
            x_lp, x_owned = quantize_x()
        # The weight's columnwise copy is made after fprop, once x's rowwise copy is freed:
        # made with it, the forward would hold x (the caller's), both copies of x and of W
        # and y at once, as much as a bf16 backward's peak (x, y, dX, dW).
        w_q = q.weight if q else None
        if weight_lp is not None:  # a cached quantized weight (lowprec.linear.weight_cache)
            w_two_steps = False
            w_lp, w_owned = quantize_operand(None, weight_lp, rowwise=True, columnwise=w_col)
        elif isinstance(weight, QuantizedTensor):
            # A quantized weight is saved as it is and dgrad reads its columnwise data in
            # backward (``_dgrad_weight``): an FSDP-gathered weight gets that direction from
            # the backward's own all-gather, and one that derives it makes the copy then.
            w_two_steps = False
            w_lp, w_owned = quantize_operand(None, weight, rowwise=True, columnwise=False)
        else:
            w_two_steps = plan.w_two_steps
            if plan.quantize_w is not None:
                w_lp, w_owned = plan.quantize_w(weight), True
            else:
                w_lp, w_owned = quantize_operand(w_q, weight, rowwise=True,
                                                 columnwise=w_col and not w_two_steps,
                                                 exact=exact)
        out_features = weight.shape[0]
        with accumulating(quantized and q.fast_accum[0]):
            y = gemm(x_lp, "rowwise", w_lp, "rowwise", out_dtype=x.dtype, bias=bias)
        y = y.reshape(*x.shape[:-1], out_features)

        if not quantized or backward_mode == BackwardMode.HIGH_PRECISION:
            saved_x, saved_w = x, weight
        elif backward_mode == BackwardMode.DEFAULT:
            if x_shared is not None:  # this backward's own view of the shared columnwise data
                saved_x = x_shared.usage_copy("columnwise") if need_dw else None
                x_owned = True
            else:
                saved_x = _keep_only(x_lp, x_owned, "columnwise") if need_dw else None
            if w_two_steps and plan.w_in_backward and need_dx:
                saved_w, ctx.w_like = weight, w_lp.keep_shared_only()
                del w_lp
            elif w_two_steps:
                saved_w = plan.quantize_w_like(weight.detach(), w_lp)
                del w_lp
            else:
                saved_w = _keep_only(w_lp, w_owned, "columnwise") if need_dx else None
        else:  # dequantized
            saved_x, saved_w = x_lp, w_lp
        return _finish_forward(ctx, x, weight, bias, y, saved_x, saved_w, q,
                                                backward_mode, on_backward_done, need_dx,
                                                need_dw, x_owned=x_owned, w_owned=False,
                                                **padding)

    @staticmethod
    def backward(ctx, dy):
        # the forward ran with torch.autocast off; so does its backward, whatever the caller's
        with torch_autocast_off(dy.device.type):
            return EagerLinearFunction._backward(ctx, dy)

    @staticmethod
    def _backward(ctx, dy):
        saved_x, saved_w = ctx.saved_tensors
        need_dx, need_dw, need_db = ctx.needs_input_grad[:3]
        q = ctx.quantizers
        quantized_bwd = q is not None and ctx.backward_mode == BackwardMode.DEFAULT
        if ctx.w_like is not None and saved_w is not None:
            # the weight's columnwise copy, with the statistics of fprop's rowwise one
            saved_w = ctx.plan.quantize_w_like(saved_w.detach(), ctx.w_like)
        elif quantized_bwd and need_dx:
            saved_w = _dgrad_weight(saved_w)
        if ctx.pad:
            if isinstance(dy, QuantizedTensor):
                raise ValueError(
                    f"a linear whose input was padded to whole blocks along M ({ctx.pad} zero "
                    f"rows) got a quantized grad_output of shape {tuple(dy.shape)}; hand it a "
                    f"high-precision gradient (the layer above quantizes its grad_input only "
                    f"for token counts that fill the blocks)")
            dy = _pad_rows(dy, ctx.pad)

        def release_x():
            # The saved input is dead once wgrad has run, unless backward may run again.
            if ctx.x_releasable and isinstance(saved_x, QuantizedTensor) and not graph_kept():
                saved_x.release()

        def release_w():
            if ctx.w_releasable and isinstance(saved_w, QuantizedTensor) and not graph_kept():
                saved_w.release()

        # the plan's slices, where dY arrives unquantized and both saved operands are quantized
        split = ctx.plan.split
        if split is not None and (not quantized_bwd or not (need_dx and need_dw)
                                  or isinstance(dy, QuantizedTensor)
                                  or not isinstance(saved_x, QuantizedTensor)
                                  or not isinstance(saved_w, QuantizedTensor)):
            split = None
        # (a dY quantized upstream is used whole, as the default path does)
        if ctx.exact_split and need_dx and need_dw and not isinstance(dy, QuantizedTensor):
            dx, dw = exact_split.backward(q.grad_output, dy, saved_x, saved_w, ctx.x_dtype,
                                          ctx.w_dtype, release_x, release_w)
        elif split is not None:
            dx, dw = grad_split.sliced_backward(q.grad_output, dy, saved_x, saved_w, *split,
                                                ctx.x_dtype, ctx.w_dtype, release_x,
                                                q.fast_accum[1:])
        else:
            dx, dw = _whole_backward(ctx, dy, saved_x, saved_w, need_dx, need_dw,
                                     quantized_bwd, release_x)
        if dx is not None:
            if ctx.pad:
                dx = dx.reshape(-1, dx.shape[-1])[:-ctx.pad]
            dx = dx.reshape(ctx.x_shape)
            if quantized_bwd and q.grad_input is not None:
                dx = q.grad_input.quantize(dx)
        db = None
        if need_db and ctx.has_bias:
            dy2d = _plain(dy).reshape(-1, dy.shape[-1])
            db = dy2d.sum(dim=0).to(ctx.w_dtype)
        if ctx.on_backward_done is not None:
            ctx.on_backward_done()
        return dx, dw, db, None, None, None, None, None


def quantized_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                     quantizers: LinearQuantizers | None = None, backward_mode: str = "default",
                     on_backward_done: Callable[[], None] | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` with the GEMMs quantized by ``quantizers`` (None: high precision).

    ``backward_mode`` is a :class:`lowprec.recipe.BackwardMode` or its string (aliases
    accepted; anything else raises ValueError). ``on_backward_done`` runs after this GEMM's
    backward (delayed scaling uses it to push backward amaxes into the history).
    """
    if type(backward_mode) is not str or backward_mode not in BACKWARD_MODES:
        backward_mode = normalize_backward_mode(backward_mode)
    amp = torch_autocast_dtype(x)
    if amp is not None:
        # torch.autocast: compute as nn.Linear would under it, the activations and a
        # high-precision weight cast (differentiably: the gradient reaches an fp32 .grad) to
        # the autocast dtype, quantized from there; lowprec's own math runs with autocast off.
        # (the parameters are cast inside: a graphed call captures their casts)
        device_type = x.device.type
        x = x.to(amp)
        with torch_autocast_off(device_type):
            return _quantized_linear(x, weight, bias, quantizers, backward_mode,
                                     on_backward_done, amp)
    return _quantized_linear(x, weight, bias, quantizers, backward_mode, on_backward_done, None)


def eager_plan_of(quantizers, backward_mode: str, x: torch.Tensor, weight: torch.Tensor,
                  bias: torch.Tensor | None):
    """The plan an eager call of these operands (cast already under torch.autocast) runs:
    the one a compiled call traces, where its forms run eagerly too (one engine;
    ``eager_plan.eager_plan``); None where the eager Function runs the call."""
    if quantizers is None or _caching_weights():
        return None
    return eager_plan.eager_plan(quantizers, backward_mode, x, weight, bias)


def _quantized_linear(x, weight, bias, quantizers, backward_mode, on_backward_done, amp):
    region = active_region()
    if (region is None or not region.cuda_graphs or quantizers is None
            or not graphed.applies(x)):
        return _eager_linear(x, weight, bias, quantizers, backward_mode, on_backward_done, amp)
    grad = torch.is_grad_enabled()
    key = (backward_mode, amp, x.shape, x.stride(), x.dtype, x.device, grad and x.requires_grad,
           grad, id(weight), weight.shape, weight.dtype, grad and weight.requires_grad,
           None if bias is None else (id(bias), grad and bias.requires_grad),
           grad_split.mode(), eager_plan.eager_plans_are_off())
    reason = graphed.refusal(x, weight, bias, quantizers, region.cache_weights)
    return graphed.call(
        lambda x_, w_, b_: _eager_linear(x_, w_, b_, quantizers, backward_mode,
                                         on_backward_done, amp),
        x, weight, bias, quantizers.graphs, key, reason, on_backward_done)


def _eager_linear(x, weight, bias, quantizers, backward_mode, on_backward_done, amp):
    param = weight
    if amp is not None:
        if not isinstance(weight, QuantizedTensor):
            weight = weight.to(amp)
        bias = bias.to(amp) if bias is not None else None
    check_linear_args(x, weight, bias, quantized_weight_dtype_free=amp is not None)
    grad_enabled = torch.is_grad_enabled()
    if on_backward_done is not None and grad_enabled and not (
            x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)):
        # autograd records no node for this GEMM: its backward will never count
        skip = getattr(on_backward_done, "skip", None)
        if skip is not None:
            skip()
    plan = eager_plan_of(quantizers, backward_mode, x, weight, bias)
    if plan is not None:
        return eager_plan.run_plan(plan, x, weight, bias, quantizers, on_backward_done)
    pad = padding.Padding(*padding.feature_padding(quantizers, x, weight))
    if pad:
        # K and N to whole blocks (M the Function pads itself, ``LinearPlan.pad``)
        x_shape = x.shape
        x, weight, bias = pad.operands(x, weight, bias)
        y = EagerLinearFunction.apply(x, weight, bias, quantizers, backward_mode,
                                      on_backward_done, grad_enabled, None)
        return pad.cut(y, x_shape)
    weight_lp = None
    if (quantizers is not None and quantizers.weight is not None
            and not isinstance(weight, QuantizedTensor) and _caching_weights()):
        # keyed by the parameter, not by its autocast copy (a new tensor each call)
        weight_lp = weight_cache.cached_weight(
            param, quantizers.weight,
            columnwise=operand_usages(backward_mode, grad_enabled and x.requires_grad,
                                      False).weight[1],
            dtype=amp)
    return EagerLinearFunction.apply(x, weight, bias, quantizers, backward_mode,
                                     on_backward_done, grad_enabled, weight_lp)


def _caching_weights() -> bool:
    region = active_region()
    return region is not None and region.cache_weights
