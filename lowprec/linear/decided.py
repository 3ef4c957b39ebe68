"""A compiled linear's decisions, made once per kind of call outside dynamo's interpretation.

Tracing a quantized linear, dynamo interprets the Python that decides what the call runs:
the recipe's rule building the quantizers, their traced forms, the padding and the GEMM
table (``traced.decide``). Each of a model's layers pays it again, and it is about half of
a linear's tracing time. Under a built-in recipe without state these decisions read only
the recipe's value (not the role names), the call's shapes, dtypes and gradient flags, the
autocast dtype and the slicing mode. :func:`decided_linear` reads those as constants and
hands them to :func:`_decided`, which dynamo runs natively
(``torch._dynamo.assume_constant_result``) and which keeps its answers: same-shaped layers
share one answer, and dynamo guards on the constants alone, so equal recipe objects and
layers of other names share compiled code.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch._dynamo.source import CallMethodItemSource
from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily

from ..formats import COLUMNWISE_IN_BACKWARD_ATTR, QuantizedTensor, columnwise_from_backward
from ..kernels import use_kernels
from ..recipe import (
    BackwardMode,
    QuantizerRole,
    delayed_stand_ins,
    gemm_fast_accum,
    recipe_of_value,
    stateless_quantizers,
    torch_autocast_dtype,
)
from . import grad_split, traced
from . import traced_steps as steps
from .function import LinearQuantizers


class _Decisions:
    """Every decision made, one attribute each (never dropped: compiled graphs' guards
    read them)."""


DECISIONS = _Decisions()
_NAMES: dict[tuple, str] = {}


def decided_linear(recipe, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                   input_grad: bool | None = None):
    """The :class:`Decision` of a compiled one-GEMM call of ``x @ weight.T + bias`` under
    ``recipe`` (built-in, without state, no boundary roles), or None where the shapes are
    symbolic or the operands not plain contiguous tensors (the caller decides in the
    trace). ``input_grad``: whether the GEMM's input needs a gradient, for a caller that
    decides before it makes the input from ``x`` (default: ``x.requires_grad``)."""
    call = _call_key(x, weight, bias, input_grad)
    return None if call is None else getattr(DECISIONS, _decided((recipe._lowprec_value, *call)))


def decided_delayed_linear(q: LinearQuantizers, x: torch.Tensor, weight: torch.Tensor,
                           bias: torch.Tensor | None, delayed,
                           input_grad: bool | None = None) -> "Decision | None":
    """The :class:`Decision` of a compiled delayed-scaling call (``traced.traced_linear``'s
    ``delayed``: the module's states, handle, recipe, records, group) with the module's
    quantizers ``q``, or None where it is decided in the trace (as for
    :func:`decided_linear`). The plan reads the quantizers' FP8 dtypes and whether each
    slot seeds a missing scale (``Float8Quantizer.graph_first_margin``) only: the states
    come in as the node's tensors, and their updates run outside the graph."""
    call = _call_key(x, weight, bias, input_grad)
    if call is None:
        return None
    slots = (q.input, q.weight, q.grad_output)
    kernel = use_kernels(x)  # the forms seed as their slots' eager quantizes do
    head = (*(s.fp8_dtype for s in slots), tuple(s.graph_first_margin(kernel) for s in slots),
            q.fast_accum)
    return getattr(DECISIONS, _decided((head, *call)))


def _call_key(x, weight, bias, input_grad: bool | None = None) -> tuple | None:
    """What a decision reads of a call: the operands' metadata, the grad mode, the autocast
    dtype and the slicing mode (None: decided in the trace)."""
    if (type(x) is not torch.Tensor or not x.is_contiguous()
            or (bias is not None and type(bias) not in (torch.Tensor, nn.Parameter))):
        return None
    w_key = _weight_key(weight)
    if w_key is None or _symbolic_sizes():
        return None
    x_grad = x.requires_grad if input_grad is None else input_grad
    return (tuple(x.shape), x.dtype, x_grad, x.device.type, x.device.index, w_key,
            None if bias is None else (tuple(bias.shape), bias.dtype),
            torch.is_grad_enabled(), torch_autocast_dtype(x), grad_split.mode())


def _weight_key(weight) -> tuple | None:
    """What a decision reads of the weight: a plain contiguous tensor's shape, dtype,
    parameter type and gradient flag; or, for a weight that arrives quantized (FSDP2's
    quantized all-gather, ``quantized_model_init``), its class, shape, dtype, gradient
    flag, inner tensors' metadata, its format's settings and whether its backward's gather
    brings the columnwise data (None: decided in the trace). Read attribute by attribute:
    dynamo interprets this, and would take a method of a tensor subclass for a torch op."""
    if type(weight) in (torch.Tensor, nn.Parameter):
        if not weight.is_contiguous():
            return None
        return (tuple(weight.shape), weight.dtype, type(weight) is nn.Parameter,
                weight.requires_grad)
    if not isinstance(weight, QuantizedTensor):
        return None
    cls = type(weight)
    inner = []
    for name in cls._inner:
        t = getattr(weight, name)
        if t is None:
            continue
        if type(t) is not torch.Tensor:
            return None
        inner.append((name, tuple(t.shape), tuple(t.stride()), t.dtype))
    meta = tuple((name, getattr(weight, name)) for name in cls._meta)
    return (cls, tuple(weight.shape), weight.dtype, weight.requires_grad, tuple(inner), meta,
            columnwise_from_backward(weight))


def _weight_stand_in(w_key: tuple, device: torch.device) -> torch.Tensor:
    """A fake weight with the metadata ``w_key`` (:func:`_weight_key`) records."""
    if not isinstance(w_key[0], type):
        shape, dtype, param, grad = w_key
        w = torch.empty(shape, dtype=dtype, device=device, requires_grad=grad)
        return nn.Parameter(w, requires_grad=grad) if param else w
    cls, shape, dtype, grad, inner, meta, later = w_key
    tensors = {name: torch.empty_strided(size, stride, dtype=dt, device=device)
               for name, size, stride, dt in inner}
    w = cls(torch.Size(shape), dtype, **tensors, **dict(meta))
    setattr(w, COLUMNWISE_IN_BACKWARD_ATTR, later)  # set either way, as a gather sets it
    return w.requires_grad_(grad)


@dataclass(frozen=True)
class Decision:
    """A call's quantizers, backward mode, plan (or the reason it has none; a plan carries
    its padding), and its attribute of ``DECISIONS``."""

    q: LinearQuantizers
    mode: str
    plan: object
    name: str
    w_param: bool

    def call(self, x, weight, bias, delayed=None, gemm: int = 0, updates: bool = True):
        """``traced.traced_linear`` of this call (with the delayed-scaling ``delayed`` it
        was decided for, the module's GEMM ``gemm`` and whether its backward ``updates``
        the backward state), as one node of dynamo's graph (the reason, a string, where
        there is no plan)."""
        if isinstance(self.plan, str):
            return self.plan
        if delayed is None:
            return _linear_node(x, weight, bias, self.name)
        fwd, bwd, handle, recipe, records, group = delayed
        return _delayed_node(x, weight, bias, fwd.scale, fwd.amax_current, handle, bwd.scale,
                             bwd.amax_current, bwd.key, self.name, records,
                             recipe._lowprec_value, gemm, updates, group)

    def run(self, x, weight, bias, delayed=None, gemm: int = 0, updates: bool = True):
        return traced.traced_linear(self.q, self.mode, x, weight, bias, delayed, self.plan,
                                    gemm=gemm, updates=updates, weight_param=self.w_param)


@dataclass(frozen=True)
class _StateTensors:
    """A delayed-scaling state's tensors as a node receives them (what ``traced_linear``
    reads of a ``DelayedScalingState``)."""

    scale: torch.Tensor
    amax_current: torch.Tensor
    key: torch.Tensor | None = None


@torch._dynamo.allow_in_graph
def _linear_node(x, weight, bias, name: str):
    # Dynamo puts this call into its graph as it is, without interpreting the Python below
    # (the linear's casts, padding and autograd Function): AOT autograd runs that Python
    # natively when it traces the graph, and records the same ops. ``name`` is a constant
    # of the graph, so equal calls share one node function and one plan.
    with steps.compile_session():
        return getattr(DECISIONS, name).run(x, weight, bias)


@torch._dynamo.allow_in_graph
def _delayed_node(x, weight, bias, scale, amax, handle, bwd_scale, bwd_amax, bwd_key,
                  name: str, records: bool, value: int, gemm: int, updates: bool, group: str):
    # _linear_node's delayed-scaling twin: the states' tensors are the node's inputs, which
    # the forward and the backward record into in place (AOT autograd functionalizes both,
    # as it does the interpreted call's); ``group`` is the amax reduction group's name
    fwd = _StateTensors(scale, amax)
    bwd = _StateTensors(bwd_scale, bwd_amax, bwd_key)
    with steps.compile_session():
        return getattr(DECISIONS, name).run(
            x, weight, bias, (fwd, bwd, handle, recipe_of_value(value), records, group),
            gemm, updates)


@torch._dynamo.assume_constant_result
def _symbolic_sizes() -> bool:
    """Whether the frame being traced has symbolic sizes (dynamic shapes), which cannot be
    a decision's key. Asked of the trace's shape environment: dynamo shows a symbolic
    size to traced code as an int, and no expression tells the two apart on every
    supported torch. A symbol read from a tensor's value (``.item()``: a delayed-scaling
    module's handle) is not a size."""
    context = torch._guards.TracingContext.try_get()
    env = None if context is None or context.fake_mode is None else context.fake_mode.shape_env
    if env is None:
        return False
    # torch 2.13 names the sizes' symbols backed_var_to_val (var_to_val before)
    symbols = env.backed_var_to_val if hasattr(env, "backed_var_to_val") else env.var_to_val
    for symbol in symbols:
        sources = env.var_to_sources.get(symbol)
        if not sources or not all(isinstance(s, CallMethodItemSource) for s in sources):
            return True
    return False


@torch._dynamo.assume_constant_result
def _decided(key: tuple) -> str:
    # The name of the decision's attribute of DECISIONS, a constant of the graph. The trace
    # then reads that one attribute, which dynamo guards as it is (the same objects for
    # every layer of this kind), where objects returned from here would carry a source
    # dynamo cannot guard, and a table read as a whole would be the table as it was when
    # the trace first read it.
    name = _NAMES.get(key)
    if name is None:
        name = _NAMES[key] = f"d{len(_NAMES)}"
        setattr(DECISIONS, name, _decide(name, *key))
    return name


def _decide(name, head, x_shape, x_dtype, x_grad, device_type, device_index, w_key, b_meta,
            grad, amp, split_mode):
    q, mode = _quantizers(head)
    device = torch.device(device_type, device_index)
    # a quantized weight is read as it is, never as a parameter's copy (traced_linear)
    w_param = not isinstance(w_key[0], type) and w_key[2]
    # stand-ins with the operands' metadata, put through traced_linear's own steps
    with unset_fake_temporarily(), FakeTensorMode(), torch.set_grad_enabled(grad), \
            grad_split.in_mode(split_mode):
        x = torch.empty(x_shape, dtype=x_dtype, device=device, requires_grad=x_grad)
        w = _weight_stand_in(w_key, device)
        b = None if b_meta is None else torch.empty(b_meta[0], dtype=b_meta[1], device=device)
        if amp is not None:
            x = x.to(amp)
            w = w if isinstance(w, QuantizedTensor) else w.to(amp)
            b = b.to(amp) if b is not None else None
        plan = traced.decide(q, mode, x, w, b, amp is not None)
    return Decision(q, mode, plan, name, w_param)


def _quantizers(head) -> tuple[LinearQuantizers, str]:
    """(quantizers, backward mode) of a key's head: a recipe's value, or delayed scaling's
    (input, weight, dY) FP8 dtypes, whose quantizers here are stand-ins: a delayed form
    reads its scales and amaxes from the tensors the call passes."""
    if isinstance(head, tuple):
        *dtypes_margin, fast = head
        x, w, dy = delayed_stand_ins(tuple(dtypes_margin))
        return LinearQuantizers(input=x, weight=w, output=None, grad_output=dy,
                                grad_input=None, fast_accum=fast), BackwardMode.DEFAULT
    recipe = recipe_of_value(head)
    # built-in rules read a role's tensor type and direction only (reads_role_names)
    fq = stateless_quantizers(recipe, "forward", [QuantizerRole(tensor_type="input"),
                                                  QuantizerRole(tensor_type="weight")])
    (bq,) = stateless_quantizers(recipe, "backward", [QuantizerRole(tensor_type="grad_output")])
    return LinearQuantizers(input=fq[0], weight=fq[1], output=None, grad_output=bq,
                            grad_input=None, fast_accum=gemm_fast_accum(recipe)), \
        recipe.backward_mode
