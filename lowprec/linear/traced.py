"""The quantized linear as ``torch.compile`` sees it: one autograd Function over the
quantizers' traced forms.

Under ``torch.compile`` a lowprec linear is not an opaque call: dynamo traces
:class:`TracedLinear` into the graph, so inductor sees every quantize and GEMM. What it
traces is decided once per call by :func:`plan_for` from the call's *quantizers*, never
from the recipe's type: each quantizer gives its traced form
(``Quantizer.graph_operand``, written by each format in ``formats/<format>/graph.py``),
so built-in recipes, ``CustomRecipe`` factories, ``HybridQuantizer`` (one format per
direction), ``IdentityQuantizer`` and every backward mode take the same path.

The compiled forward and gradients are eager's bit for bit:

* each operand's traced form computes the values eager's quantize makes (a quantize is a
  function of its input; any order of a max reduction gives the same amax);
* each GEMM is the one eager's dispatcher (``lowprec.gemm``) picks for the same operand
  pair, through the same library calls: ``lowprec.gemm.traced``'s table (:func:`route`,
  ``plain``, ``cublas_fp8``, ``cublas_fp8_block``, ``exact_bf16``, the fp32 emulation),
  which :func:`plan_for` asks for every GEMM of the call before tracing;
* the one reduction whose order matters (the bias gradient) runs as a custom op around
  eager's own sum, and bf16 rounding a fusing compiler would skip is kept
  (``formats.graph.rounded``, ``as_output``).

Where eager would do something the traced form does not (pad to whole blocks, slice a
backward the operands cannot slice, hand a GEMM to a backend the traced table does not
mirror, quantize the output or the input gradient), :func:`plan_for` returns the reason
and the call stays one opaque op (``lowprec.compile.call``), which says so once.

Delayed scaling traces as per-tensor FP8 whose scales the module's state holds: the
quantizes read them and record their amaxes into the state in place
(:mod:`.traced_delayed`). Eager calls run :class:`TracedLinear` too where the plan's forms
launch eager's kernels (:mod:`.eager_plan`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..formats import GraphOperand, PlainOperand, QuantizedTensor, drawn_after
from ..gemm import emulated_product, route, routes_cuda, traced_gemm
from ..recipe import (
    BackwardMode,
    QuantizerRole,
    stateful,
    stateless_quantizers,
    torch_autocast_dtype,
)
from . import exact_split, grad_split, shared_input
from . import traced_steps as steps
from .padding import NONE as NO_PADDING
from .padding import Padding, feature_padding, padding_for
from .plan import row_padding
from .traced_delayed import (
    StateQuantizers,
    delayed_forward,
    delayed_grad,
)


# ---- the plan --------------------------------------------------------------------------------
@dataclass(frozen=True)
class TracedPlan:
    """What a traced linear does, decided once: each operand's traced form, the backward
    mode, the route of each GEMM (fprop, dgrad, wgrad) and dY's slices (``grad_split``)."""

    x: GraphOperand
    w: GraphOperand
    dy: GraphOperand | None
    mode: str
    routes: tuple
    split: tuple[int, int] | None = None
    #: delayed scaling: the operands read the state's scales and record amaxes into it
    delayed: bool = False
    #: the zeros that make the call's operands whole blocks (:func:`decide`), as
    #: ``Padding``'s (k, n, rows): plain ints, which dynamo builds into a plan it traces
    pads: tuple = (0, 0, 0)
    #: (fprop, dgrad, wgrad) fast accumulation of per-tensor FP8 GEMMs (the quantizers')
    fast: tuple = (False, False, False)

    @property
    def padding(self) -> Padding:
        return Padding(*self.pads) if any(self.pads) else NO_PADDING


def _operand(quantizer, t: torch.Tensor, grad: bool = False):
    if quantizer is None:
        return PlainOperand(t.dtype)
    return quantizer.graph_operand(t, grad=grad)


def _given_weight(quantizer, weight: QuantizedTensor):
    """The traced form of a weight that arrives quantized (FSDP2's quantized all-gather,
    ``quantized_model_init``): the quantizer's form that reads it as it is (its own data,
    as eager's GEMMs read it), or the reason there is none."""
    form = (quantizer.graph_operand(weight) if quantizer is not None
            else "a quantized weight without a weight quantizer")
    if isinstance(form, str) or form.given:
        return form
    return f"a quantized weight ({type(weight).__name__}) the quantizer's form does not read"


def plan_for(q, backward_mode: str, x: torch.Tensor, weight: torch.Tensor,
             bias: torch.Tensor | None = None, *, amp: bool = False,
             input_grad: bool | None = None, weight_grad: bool | None = None,
             padded: Padding | bool = False) -> TracedPlan | str:
    """The traced plan of ``x @ weight.T (+ bias)`` with quantizers ``q`` (a
    ``LinearQuantizers``) under ``backward_mode``, or the reason the call stays one
    opaque op. ``amp``: under torch.autocast a quantized weight's nominal dtype need not
    be the input's, as in eager mode. ``input_grad``, ``weight_grad``: whether the input
    and the weight need a gradient (default: their ``requires_grad``; for stand-ins of
    operands made later); ``padded``: the caller has padded the operands to whole blocks
    (``padding.padding_for``, that ``Padding``, which the plan carries, or True), so the
    padding checks are skipped."""
    if q is None:
        return "no quantizers"
    if q.output is not None or q.grad_input is not None:
        return "a quantized output or input gradient (boundary roles)"
    if x.dim() < 2 or weight.dim() != 2:
        return "an input of fewer than two dimensions"
    if x.dtype not in (torch.bfloat16, torch.float32):
        return f"a {x.dtype} input (bf16 and fp32 trace)"
    quantized_w = isinstance(weight, QuantizedTensor)
    if x.dtype != weight.dtype and not (amp and quantized_w):
        return "input and weight dtypes differ"
    if isinstance(x, QuantizedTensor):
        return "a quantized input"
    k, n = x.shape[-1], weight.shape[0]
    m = x.numel() // k if k else 0
    if m == 0 or k == 0 or n == 0:
        return "an empty GEMM"
    grad = torch.is_grad_enabled()
    need_dx = grad and (x.requires_grad if input_grad is None else input_grad)
    need_dw = grad and (weight.requires_grad if weight_grad is None else weight_grad)
    default = backward_mode == BackwardMode.DEFAULT
    if not padded:
        if any(feature_padding(q, x, weight)):
            return "eager pads K or N to whole blocks"
        if row_padding(q, x, backward_mode, need_dw):
            return "eager pads M to whole blocks"
    if exact_split.applies(q, x, weight, backward_mode, need_dx, need_dw):
        return "eager slices the whole call (grad_split.sliced)"
    xo = _operand(q.input, x)
    wo = _given_weight(q.weight, weight) if quantized_w else _operand(q.weight, weight)
    dyo = _operand(q.grad_output, x, grad=True) if default else None
    for form in (xo, wo, dyo):
        if isinstance(form, str):
            return form
    delayed = xo.reads_state
    cuda = routes_cuda(x)
    wdt = weight.dtype if not (amp and quantized_w) else x.dtype
    routes = [route(xo.kind("rowwise"), wo.kind("rowwise"), m, n, k, x.dtype,
                    None if bias is None else bias.dtype, cuda)]
    if default:
        routes += [route(dyo.kind("rowwise"), wo.kind("columnwise"), m, k, n, x.dtype, None,
                         cuda),
                   route(dyo.kind("columnwise"), xo.kind("columnwise"), n, k, m, wdt, None,
                         cuda)]
    elif quantized_w:
        return f"a quantized weight under backward_mode={backward_mode!r}"
    split = None
    if default and need_dx and need_dw and grad_split.slicing_enabled(q.grad_output):
        split = grad_split.split_sizes(m, n, k, x.dtype.itemsize, weight.dtype.itemsize)
        if split is not None and not dyo.sliceable:
            return "eager slices dY where its quantize cannot be sliced in a graph"
    pads = (padded.k, padded.n, padded.rows) if isinstance(padded, Padding) else (0, 0, 0)
    return TracedPlan(xo, wo, dyo, backward_mode, tuple(routes), split, delayed, pads,
                      tuple(q.fast_accum))


# ---- the Function ----------------------------------------------------------------------------
def _hp_product(a: torch.Tensor, b: torch.Tensor, out_dtype) -> torch.Tensor:
    """``a @ b.T`` of high-precision matrices as eager's dispatcher multiplies them: the
    ``plain`` backend where every dtype is the output's, else the fp32 emulation."""
    if a.dtype == b.dtype == out_dtype:
        return a @ b.t()
    return emulated_product(a.to(torch.float32), b.to(torch.float32), None, out_dtype)


class TracedLinear(torch.autograd.Function):
    """``y = x @ weight.T + bias`` over a :class:`TracedPlan`: fprop reads the input and
    weight rowwise; in the default mode dgrad reads dY rowwise and the weight columnwise,
    and wgrad dY and the input columnwise, the columnwise forms made from what the forward
    kept (``GraphOperand.save_columnwise``). ``high_precision`` keeps the input and weight,
    ``dequantized`` their rowwise values, and both run the backward GEMMs on them with
    the unquantized dY."""

    @staticmethod
    def forward(ctx, x, weight, bias, plan: TracedPlan, grad_enabled: bool, held: bool,
                fwd=None, bwd=None):
        x2d = steps.as_2d(x)
        # needs_input_grad ignores no_grad(): an evaluation forward keeps nothing
        need_dx = grad_enabled and ctx.needs_input_grad[0]
        need_dw = grad_enabled and ctx.needs_input_grad[1]
        ctx.state = fwd if isinstance(fwd, StateQuantizers) else None
        default = plan.mode == BackwardMode.DEFAULT
        if plan.delayed and ctx.state is None:  # a traced delayed-scaling call
            (xr, x_keep), (wr, w_keep) = delayed_forward(plan, x2d, weight, fwd)
            x_keep, w_keep = x_keep if need_dw else (), w_keep if need_dx else ()
            ctx.save_for_backward(*x_keep, *w_keep)
            # the backward state's tensors are kept as they are, not saved: another GEMM's
            # backward of this state (the module's other GEMM, a second call) records into
            # them before this one reads them, which autograd's version check would refuse
            ctx.update = bwd
        else:
            if ctx.state is not None:  # an eager delayed-scaling call: the state's quantizers
                q = fwd.quantizers
                xr, x_keep = plan.x.state_forward(x2d, q.input, default and need_dw)
                wr, w_keep = plan.w.state_forward(weight, q.weight, default and need_dx,
                                                  held=held)
            elif default:
                # q/k/v (gate/up) read one input: one quantize serves them (``shared_input``)
                xr, x_keep = shared_input.shared_form(plan.x, x, need_dw,
                                                      lambda: plan.x.forward(x2d, need_dw))
                # eager quantizes (and draws keys for) the input before the weight
                wr, w_keep = plan.w.forward(weight, need_dx, held=held,
                                            after=drawn_after((xr, x_keep)))
            else:
                xr = plan.x.rowwise(x2d)
                wr, _ = plan.w.forward(weight, False, held=held, after=drawn_after(xr))
            if plan.mode == BackwardMode.HIGH_PRECISION:
                x_keep, w_keep = (x2d,) if need_dw else (), (weight,) if need_dx else ()
            elif plan.mode == BackwardMode.DEQUANTIZED:
                x_keep = (plan.x.dequantized(xr, x.dtype),) if need_dw else ()
                w_keep = (plan.w.dequantized(wr, weight.dtype),) if need_dx else ()
            ctx.save_for_backward(*x_keep, *w_keep)
        ctx.n_saved = (len(x_keep), len(w_keep))
        y = traced_gemm(plan.routes[0], xr, wr, x.dtype, bias,
                        ((plan.x, "rowwise"), (plan.w, "rowwise")), plan.fast[0])
        return steps.finish(ctx, x, weight, bias, plan, y)

    @staticmethod
    def backward(ctx, dy):
        grads = steps.traced_backward(ctx, dy, TracedLinear._grads)
        if ctx.state is not None and ctx.state.done is not None:
            ctx.state.done()  # joins the backward state to the pass's update (delayed scaling)
        return (*grads, None, None, None, None)

    @staticmethod
    def _grads(ctx, dy2d, need_dx, need_dw, *saved):
        if not (need_dx or need_dw):
            return None, None
        plan = ctx.plan
        nx, nw = ctx.n_saved
        x_keep, w_keep = saved[:nx], saved[nx:nx + nw]
        if plan.mode != BackwardMode.DEFAULT:  # high-precision GEMMs on the kept values
            dw = _hp_product(dy2d.t(), x_keep[0].t(), ctx.w_dtype) if need_dw else None
            dx = _hp_product(dy2d, w_keep[0].t(), ctx.x_dtype) if need_dx else None
            return dx, dw
        if ctx.state is not None:
            dy = plan.dy.state_quantize(dy2d, ctx.state.quantizers.grad_output, need_dx, need_dw)
            return TracedLinear._gemms(ctx, plan, dy2d, dy, need_dx, need_dw, x_keep, w_keep)
        if plan.delayed:
            dy = delayed_grad(plan, dy2d, ctx.update)
            return TracedLinear._gemms(ctx, plan, dy2d, dy, need_dx, need_dw, x_keep, w_keep)
        sliced = plan.split is not None and need_dx and need_dw
        dy = None if sliced else plan.dy.grad(dy2d, need_dx, need_dw)
        return TracedLinear._gemms(ctx, plan, dy2d, dy, need_dx, need_dw, x_keep, w_keep)

    @staticmethod
    def _gemms(ctx, plan, dy2d, dy, need_dx, need_dw, x_keep, w_keep):
        """(dX, dW) from dY's (rowwise, columnwise) forms ``dy``, or, where ``dy`` is None,
        from dY quantized slice by slice as the plan's ``split`` (``grad_split``) says."""
        dx = dw = None
        if need_dw:  # mat(dY, columnwise) @ mat(X, columnwise).T
            xc = plan.x.saved_columnwise(x_keep)
            ops = ((plan.dy, "columnwise"), (plan.x, "columnwise"))
            if dy is not None:
                dw = traced_gemm(plan.routes[2], dy[1], xc, ctx.w_dtype, None, ops, plan.fast[2])
            else:
                cols = plan.split[1]
                dw = steps.joined([
                    traced_gemm(plan.routes[2], plan.dy.grad(dy2d[:, a:a + cols], False, True)[1],
                                xc, ctx.w_dtype, None, ops, plan.fast[2])
                    for a in range(0, dy2d.shape[1], cols)])
        if need_dx:  # mat(dY, rowwise) @ mat(W, columnwise).T
            wc = plan.w.saved_columnwise(w_keep, dy2d)
            ops = ((plan.dy, "rowwise"), (plan.w, "columnwise"))
            if dy is not None:
                dx = traced_gemm(plan.routes[1], dy[0], wc, ctx.x_dtype, None, ops, plan.fast[1])
            else:
                rows = plan.split[0]
                dx = steps.joined([
                    traced_gemm(plan.routes[1], plan.dy.grad(dy2d[a:a + rows], True, False)[0],
                                wc, ctx.x_dtype, None, ops, plan.fast[1])
                    for a in range(0, dy2d.shape[0], rows)])
        return dx, dw


def planned(q, backward_mode: str, x: torch.Tensor, weight: torch.Tensor,
            bias: torch.Tensor | None, *, input_grad: bool | None = None
            ) -> TracedPlan | str:
    """:func:`plan_for` of the operands :func:`traced_linear` reads, asked before they
    exist (a module that must know every GEMM's plan before it traces the first): under
    torch.autocast the input, a weight that is not quantized and the bias in its dtype,
    from stand-ins of their shapes (dead ops in the graph)."""
    amp = torch_autocast_dtype(x)
    if amp is None:
        return decide(q, backward_mode, x, weight, bias, input_grad=input_grad)
    like = x.new_empty(x.shape, dtype=amp)
    w_like = (weight if isinstance(weight, QuantizedTensor)
              else weight.new_empty(weight.shape, dtype=amp))
    b_like = None if bias is None else bias.new_empty(bias.shape, dtype=amp)
    return decide(q, backward_mode, like, w_like, b_like, True,
                  input_grad=x.requires_grad if input_grad is None else input_grad,
                  weight_grad=weight.requires_grad)


def refusal(plan: TracedPlan | str, delayed) -> str | None:
    """Why :func:`traced_linear` does not trace a call with this plan (or :func:`plan_for`'s
    reason) and these delayed-scaling states, or None: a caller that must not trace
    anything before a refusal (a collective, a norm) asks first."""
    if isinstance(plan, str):
        return plan
    if plan.delayed != (delayed is not None):
        return "delayed scaling without its state"
    return None


def decide(q, backward_mode: str, x: torch.Tensor, weight: torch.Tensor,
           bias: torch.Tensor | None, amp: bool = False, *, input_grad: bool | None = None,
           weight_grad: bool | None = None) -> TracedPlan | str:
    """:func:`plan_for`'s plan or reason for :func:`traced_linear`'s operands ``x``,
    ``weight``, ``bias`` (after torch.autocast's casts, ``amp``): the plan of the operands
    padded to whole blocks, which carries that padding (``TracedPlan.padding``).
    ``input_grad``, ``weight_grad``: as :func:`plan_for`'s."""
    pad = padding_for(q, backward_mode, x, weight, weight_grad)
    if pad:
        x, weight, bias = pad.operands(x, weight, bias)
    return plan_for(q, backward_mode, x, weight, bias, amp=amp, padded=pad,
                    input_grad=input_grad, weight_grad=weight_grad)


def traced_linear(quantizers, backward_mode: str, x: torch.Tensor, weight: torch.Tensor,
                  bias: torch.Tensor | None, delayed=None, plan: TracedPlan | None = None, *,
                  gemm: int = 0, updates: bool = True, weight_param: bool | None = None):
    """``x @ weight.T + bias`` quantized by ``quantizers`` in ops the compiler traces, or the
    reason (a string) where :func:`plan_for` has no plan (the caller keeps the opaque op).
    ``delayed``: the (forward, backward) delayed-scaling states, the module's handle
    that a delayed-scaling call records into (None: the region is in the graph), the
    recipe, whether the forward records its amaxes (not in an evaluation), and the name of
    the group the backward state's update all-reduces its amaxes over ("" for none); ``gemm``:
    which of the module's GEMMs this is (its slots in the states); ``updates``: whether its
    backward, the module's last to run, updates the backward state (eager's end-of-backward
    callback). ``plan``: :func:`decide`'s plan, where the caller has asked for it already
    (for an input of the same shape and dtype), padding included.
    ``weight_param``: whether ``weight`` is a parameter (default: its type), for a caller
    whose weight is a stand-in that has lost the type (AOT autograd's functional tensors).

    Under ``torch.autocast`` the operands are first cast to its dtype (differentiably, so
    an fp32 weight gets an fp32 gradient) and the rest runs with autocast off, as
    ``lowprec.linear.quantized_linear`` does in eager mode."""
    held = weight_param  # stays None where the type of the weight read tells
    amp = torch_autocast_dtype(x)
    if amp is not None:
        x = x.to(amp)
        if not isinstance(weight, QuantizedTensor):  # a quantized weight is read as it is
            cast = weight.to(amp)
            held, weight = held and cast is weight, cast
        bias = bias.to(amp) if bias is not None else None
    if plan is None:
        plan = decide(quantizers, backward_mode, x, weight, bias, amp is not None)
    refused = refusal(plan, delayed)
    if refused is not None:
        return refused
    pad = plan.padding
    x_shape = x.shape
    if pad:  # zeros to whole blocks, the same ops as an eager call's
        x, padded, bias = pad.operands(x, weight, bias)
        held, weight = held and padded is weight, padded
    # a parameter's columnwise copy is cast in backward from the parameter itself (which
    # lives anyway), where a temporary weight's is cast in forward and saved
    held = isinstance(weight, torch.nn.Parameter) if held is None else held
    args = (x, weight, bias, plan, torch.is_grad_enabled(), held, None, None)
    if delayed is not None:
        fwd, bwd, handle, recipe, records, group = delayed
        # a GEMM's slots: (input, weight, output) forward, (grad_output, grad_input) backward
        args = args[:6] + ((fwd.scale, fwd.amax_current, handle, 3 * gemm, records),
                           (bwd.scale, bwd.amax_current, bwd.key, 2 * gemm, updates, group))
    if amp is None:
        y = TracedLinear.apply(*args)
    else:
        with torch.autocast(x.device.type, enabled=False):
            y = TracedLinear.apply(*args)
    return pad.cut(y, x_shape) if pad else y


def reads_recipe_weights(recipe) -> bool:
    """Whether a compiled linear reads a weight quantized under ``recipe`` as it is (FSDP2's
    quantized all-gathers of it under torch.compile, ``quantized_model_init``): where the
    weight quantizer's form and the quantized weight's own agree, default backward."""
    if recipe.backward_mode != BackwardMode.DEFAULT or stateful(recipe):
        return False
    q = stateless_quantizers(recipe, "forward", [QuantizerRole("linear", "weight", "")])[0]
    weight = q.make_empty((128, 128), dtype=torch.bfloat16)
    return not isinstance(_given_weight(q, weight), str)
