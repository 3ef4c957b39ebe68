"""lowprec modules and ops under ``torch.compile``: each call is one opaque op.

Dynamo does not trace into a lowprec module's forward. When it meets one (a
forward decorated with :func:`compiled_as_one_op`), it records a single op,
``lowprec::call``, whose arguments are the call's tensors, the module's
parameters, a handle tensor naming the module, and the key of the recipe
active at that point. At run time the op runs the module's ordinary eager
forward on those tensors, under that recipe, and keeps the autograd graph it
builds; its backward op, ``lowprec::call_backward``, runs that graph's
backward. So the compiled forward and gradients are the eager ones bit for
bit, every recipe works (delayed scaling included), and the compiler is free
to fuse and schedule everything around the call.

Why the pieces look as they do:

* The module is named by a small CPU tensor (``_lowprec_handle``), a graph
  input like a parameter, so dynamo guards on its shape, not its value:
  same-shaped layers with different names share one compiled code.
* The recipe is named by ``Recipe._lowprec_key``, an int that every recipe
  object gets at construction; the guard is on the recipe, which layers share.
  A region with an ``amax_reduction_group`` is named by a negative int standing
  for the (recipe, group) pair (``_region_key``), so that a region of the call's
  own reduces delayed scaling's amaxes over the group as the traced one would.
* The call's graph is held by the returned token tensor (its storage owns
  the record), so it lives exactly as long as the compiled graph keeps the
  token for backward.
* Inductor may reuse the memory of a tensor once the graph no longer reads
  it; a saved tensor of the eager graph that shares memory with one of the
  op's inputs is therefore saved as a copy, and an output the eager graph
  saved is returned as a copy (``_PrivateSaves``).
* Output shapes come from each module's ``compiled_output_shapes``, so the
  op's fake implementation never runs lowprec code.
* Expert weights an FSDP2 quantized all-gather brings (``QuantizedExperts``)
  support no op but aliases; the op gets a data-less plain stand-in of their
  shape, whose gradient autograd hands to the parameter, and its eager forward
  reads the parameter itself.

With ``lowprec.autocast`` outside the compiled function the call joins the
real autocast region (delayed-scaling amaxes enter the history when it
exits, as in eager mode). With ``autocast`` inside it, the region exists only
while tracing; the region's calls then share one region at run time
(``recipe.enter_deferred``), whose states the traced region's exit updates
through ``lowprec::exit_deferred``: the eager result again, also for a module
called twice in one region.
"""

from __future__ import annotations

import functools
import itertools
import logging
import weakref

import torch
from torch.distributed.distributed_c10d import _resolve_process_group

from ..formats import QuantizedExperts, QuantizedTensor
from ..kernels import CUDAGRAPH_UNSAFE, graph_op
from ..linear import graph_kept
from ..recipe import (
    active_region,
    enter_deferred,
    for_running_backward_pass,
    new_handle,
    pop_region,
    push_region,
    recipe_from_key,
    register_delayed_state,
    resolve_handle,
    torch_autocast_dtype,
)

HANDLE_ATTR = "_lowprec_handle"


def assign_handle(module: torch.nn.Module) -> None:
    """Give ``module`` a fresh handle (``recipe.new_handle``) for compiled calls."""
    object.__setattr__(module, HANDLE_ATTR, new_handle(module))


def ensure_handle(module: torch.nn.Module) -> None:
    if HANDLE_ATTR not in module.__dict__:
        assign_handle(module)


class CompiledCallMixin:
    """Gives a module a handle at construction and a new one in each copy (a deepcopy or
    an unpickled module is a different module)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        ensure_handle(self)

    def __getstate__(self):
        state = dict(super().__getstate__())
        state.pop(HANDLE_ATTR, None)
        return state

    def __setstate__(self, state) -> None:
        super().__setstate__(state)
        assign_handle(self)


def _module_of(handle: torch.Tensor) -> torch.nn.Module:
    return resolve_handle(handle, "module")


@graph_op("join_region", mutates_args=("amax",))
def join_region(amax: torch.Tensor, handle: torch.Tensor, held: list[torch.Tensor]) -> None:
    """A traced delayed-scaling forward that records its amaxes into ``amax`` (its forward
    state's, in the graph) next, run where the autocast region is real (entered around
    the compiled call): the module's forward state joins the region's update, as an eager
    forward's does. An op rather than traced Python: the region's list is appended to at
    run time, beside the opaque calls' own appends. ``amax`` is declared written because
    the region's update writes it (which keeps the compiler from dropping the op); the op
    itself only reads the handle. ``held``, the scales the call's backward reads, is
    passed only so that the forward reads it (``linear.traced_delayed`` says why).
    Defined through ``kernels.graph_op``: a compiled step runs one per module."""
    state = _module_of(handle).__dict__["_recipe_states"]["forward"].delayed
    state.pending = True
    register_delayed_state(state)


@torch.library.register_fake("lowprec::join_region")
def _join_region_fake(amax, handle, held):
    return None


# ---- the call's arguments: tensors, None, ints, bools and lists of ints -------------------------
def _encode(args: tuple, kwargs: dict):
    """(layout string, ints, tensors) describing ``args``/``kwargs``."""
    layout, ints, tensors = [], [], []

    def one(v, where):
        if isinstance(v, torch.Tensor):
            tensors.append(v)
            return "T"
        if v is None:
            return "N"
        if isinstance(v, bool):
            ints.append(int(v))
            return "B"
        if isinstance(v, int) or isinstance(v, torch.SymInt):
            ints.append(v)
            return "I"
        if isinstance(v, (list, tuple)) and all(isinstance(e, (int, torch.SymInt))
                                               and not isinstance(e, bool) for e in v):
            ints.extend(v)
            return f"L{len(v)}"
        raise TypeError(f"under torch.compile a lowprec module takes tensors, None, bools, ints "
                        f"and lists of ints as forward arguments; {where} is "
                        f"{type(v).__name__}")

    for i, a in enumerate(args):
        layout.append(one(a, f"argument {i}"))
    for k, v in kwargs.items():
        layout.append(f"{k}={one(v, f'argument {k!r}')}")
    return ",".join(layout), ints, tensors


def _decode(layout: str, ints: list, tensors: list):
    args, kwargs = [], {}
    it_i, it_t = iter(ints), iter(tensors)
    for item in layout.split(",") if layout else []:
        key, _, kind = item.rpartition("=")
        if kind == "T":
            v = next(it_t)
        elif kind == "N":
            v = None
        elif kind == "B":
            v = bool(next(it_i))
        elif kind == "I":
            v = next(it_i)
        else:
            v = [next(it_i) for _ in range(int(kind[1:]))]
        if key:
            kwargs[key] = v
        else:
            args.append(v)
    return args, kwargs


# ---- memory the compiler may reuse -----------------------------------------------------------
def _storage_key(t: torch.Tensor):
    return (t.device, t.untyped_storage().data_ptr())


def _inner_tensors(t: torch.Tensor) -> list:
    if isinstance(t, QuantizedTensor):
        names, _ = t.__tensor_flatten__()
        return [x for n in names for x in _inner_tensors(getattr(t, n))]
    return [t]


class _PrivateSaves:
    """saved_tensors_hooks for the eager forward of a compiled call: a tensor saved for
    backward that shares memory with one of the call's inputs is saved as a copy (the
    compiled graph may write into that memory once the call has read it); the memory of
    every saved tensor is noted so outputs that share it are returned as copies."""

    def __init__(self, inputs: list) -> None:
        self.inputs = {_storage_key(t) for t in inputs if t.numel()}
        self.saved: set = set()

    def pack(self, t):
        if isinstance(t, torch.Tensor):
            inner = _inner_tensors(t)
            if any(x.numel() and _storage_key(x) in self.inputs for x in inner):
                with torch.no_grad():
                    t = t.detach().clone()
                inner = _inner_tensors(t)
            self.saved.update(_storage_key(x) for x in inner if x.numel())
        return t

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)

    def shares(self, t: torch.Tensor) -> bool:
        return bool(t.numel()) and _storage_key(t) in self.saved


# ---- the record a forward leaves for its backward ------------------------------------------------
class _Record(bytearray):
    """The token's storage: 8 bytes holding the record's key, plus the record itself (the
    eager outputs and the leaves their gradients are taken for)."""


_RECORDS: "weakref.WeakValueDictionary[int, _Record]" = weakref.WeakValueDictionary()
_next_record = itertools.count(1)


def _token(outputs=None, leaves=None) -> torch.Tensor:
    key = next(_next_record)
    rec = _Record(key.to_bytes(8, "little", signed=True))
    rec.outputs, rec.leaves = outputs, leaves
    _RECORDS[key] = rec
    return torch.frombuffer(rec, dtype=torch.int64)


def _record_of(token: torch.Tensor) -> _Record:
    rec = _RECORDS.get(int(token.item()))
    if rec is None or rec.outputs is None:
        raise RuntimeError("the backward of a compiled lowprec call ran after its graph was "
                           "freed; pass retain_graph=True to run a backward twice")
    return rec


def _torch_autocast(device_type: str, amp: int):
    """torch.autocast as it was where the call was traced (``amp``: its dtype's index in
    ``_DTYPES``, -1: off), whatever the state where the compiled code runs."""
    if amp < 0:
        return torch.autocast(device_type, enabled=False)
    return torch.autocast(device_type, dtype=_DTYPES[amp])


class _RuntimeRegion:
    """The autocast region a compiled call runs in: the real one where autocast encloses
    the compiled function, else one of its own (see the module docstring)."""

    def __init__(self, recipe_key: int, deferred: bool = False) -> None:
        self.group, self.key, self.deferred = None, recipe_key, deferred
        if recipe_key <= -2:
            recipe_key, group_name = _GROUPED[-2 - recipe_key]
            # resolved when the call runs: a process group made again under the same
            # name (a new init in this process) is the one the region reduces over
            self.group = _resolve_process_group(group_name)
        self.recipe = recipe_from_key(recipe_key) if recipe_key >= 0 else None
        self.own = None

    def __enter__(self):
        real = active_region()
        if self.recipe is None:
            if real is not None:
                self.own = push_region(None)
        elif real is None or real.recipe is not self.recipe or real.group is not self.group:
            self.own = (enter_deferred(self.key, self.recipe, self.group) if self.deferred
                        else push_region(self.recipe, self.group))
        return self

    def __exit__(self, *exc) -> None:
        if self.own is not None:
            # a deferred region's states wait for its traced exit (enter_deferred)
            pop_region(self.own, update=not self.deferred)


#: the (recipe key, group name) of each region with an amax reduction group; the region's
#: key is -2 - its place here
_GROUPED: list[tuple[int, str]] = []


def _region_key(region) -> int:
    """The int a compiled call names its autocast region by (see the module docstring)."""
    key = region.recipe._lowprec_key
    return key if region.group is None else _grouped_key(key, region.group.group_name)


@torch._dynamo.assume_constant_result
def _grouped_key(recipe_key: int, group_name: str) -> int:
    # run for real while dynamo traces (the op reads the table when the graph runs), with
    # the group's name: dynamo hands a function it runs a stand-in of the group itself
    entry = (recipe_key, group_name)
    if entry not in _GROUPED:
        _GROUPED.append(entry)
    return -2 - _GROUPED.index(entry)



# ---- the ops ---------------------------------------------------------------------------------
_AUTOGRAD_KEYS = (torch._C.DispatchKey.ADInplaceOrView, torch._C.DispatchKey.AutogradFunctionality,
                  torch._C.DispatchKey.AutogradNestedTensor, torch._C.DispatchKey.AutogradOther)


def _autograd_dispatch():
    """A custom op's implementation runs with autograd excluded from dispatch; the eager
    forward inside must build its graph (views of the inputs included), so this puts the
    autograd keys back for its duration."""
    exclude = torch._C._dispatch_tls_local_exclude_set()
    for key in _AUTOGRAD_KEYS:
        exclude = exclude.remove(key)
    return torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), exclude)


def _fix_aliases(outs: list, inputs: list, private: _PrivateSaves | None) -> list:
    """Outputs the compiled graph may own: copies where one shares memory with an input,
    an earlier output or a saved tensor."""
    seen = {_storage_key(t) for t in inputs if t.numel()}
    fixed = []
    for o in outs:
        if o.numel() and (_storage_key(o) in seen or (private is not None and private.shares(o))):
            o = o.clone()
        if o.numel():
            seen.add(_storage_key(o))
        fixed.append(o)
    return fixed


def _call_impl(handle: torch.Tensor, recipe_key: int, amp: int, grad_enabled: bool,
               needs: list[bool],
               layout: str, ints: list[int], tensors: list[torch.Tensor],
               params: list[torch.Tensor], out_shapes: list[int], out_ndims: list[int],
               deferred: bool) -> list[torch.Tensor]:
    module = _module_of(handle)
    n_in = len(tensors)
    params_live = list(module.parameters())
    with _autograd_dispatch(), torch.set_grad_enabled(grad_enabled):
        inner, leaves = [], []
        for t, need in zip(tensors, needs[:n_in]):
            if grad_enabled and need:
                t = t.detach().requires_grad_()
                leaves.append(t)
            inner.append(t)
        leaves += [p for p, need in zip(params_live, needs[n_in:]) if grad_enabled and need]
        args, kwargs = _decode(layout, ints, inner)
        private = _PrivateSaves(tensors) if leaves else None
        with _RuntimeRegion(recipe_key, deferred), \
                _torch_autocast(tensors[0].device.type, amp):
            if private is not None:
                with private.hooks():
                    out = module.forward(*args, **kwargs)
            else:
                out = module.forward(*args, **kwargs)
    outs = [out] if isinstance(out, torch.Tensor) else list(out)
    for o in outs:
        if isinstance(o, QuantizedTensor):
            raise TypeError(f"{type(module).__name__} returned a quantized tensor; under "
                            f"torch.compile a lowprec module must return plain tensors (no "
                            f"output_quantizer_role, no standalone Quantize op)")
    token = _token(outs, leaves) if leaves and any(o.requires_grad for o in outs) else _token()
    returned = _fix_aliases([o.detach() for o in outs], tensors, private)
    return returned + [token]


def _call_fake(handle, recipe_key, amp, grad_enabled, needs, layout, ints, tensors, params,
               out_shapes, out_ndims, deferred):
    x = tensors[0]
    dtype = _DTYPES[amp] if amp >= 0 else x.dtype  # under torch.autocast: its dtype
    outs, pos = [], 0
    for nd in out_ndims:
        outs.append(x.new_empty(tuple(out_shapes[pos:pos + nd]), dtype=dtype))
        pos += nd
    return outs + [torch.empty(1, dtype=torch.int64)]


_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def _call_backward_impl(token: torch.Tensor, grads: list[torch.Tensor | None],
                        shapes: list[int], ndims: list[int], dtypes: list[int],
                        device: torch.device) -> list[torch.Tensor]:
    rec = _record_of(token)
    pairs = [(o, g) for o, g in zip(rec.outputs, grads) if g is not None and o.requires_grad]
    keep = graph_kept()
    if pairs:
        # the nested pass is the running one's part: a delayed-scaling module called more
        # than once updates its backward state once, at that pass's end, as in eager
        with _autograd_dispatch(), for_running_backward_pass():
            got = torch.autograd.grad([o for o, _ in pairs], rec.leaves, [g for _, g in pairs],
                                      retain_graph=keep, allow_unused=True)
    else:
        got = [None] * len(rec.leaves)
    if not keep:
        rec.outputs = rec.leaves = None
    out, pos = [], 0
    for g, nd, dt in zip(got, ndims, dtypes):
        shape = tuple(shapes[pos:pos + nd])
        pos += nd
        out.append(g if g is not None else torch.zeros(shape, dtype=_DTYPES[dt], device=device))
    return _fix_aliases(out, [g for g in grads if g is not None], None)


def _call_backward_fake(token, grads, shapes, ndims, dtypes, device):
    out, pos = [], 0
    for nd, dt in zip(ndims, dtypes):
        out.append(torch.empty(tuple(shapes[pos:pos + nd]), dtype=_DTYPES[dt], device=device))
        pos += nd
    return out


call_op = torch.library.custom_op(
    "lowprec::call", _call_impl, mutates_args=(), tags=CUDAGRAPH_UNSAFE,
    schema="(Tensor handle, int recipe_key, int amp, bool grad_enabled, bool[] needs, str layout, "
           "SymInt[] ints, Tensor[] tensors, Tensor[] params, SymInt[] out_shapes, "
           "int[] out_ndims, bool deferred) -> Tensor[]")
call_op.register_fake(_call_fake)
call_backward_op = torch.library.custom_op(
    "lowprec::call_backward", _call_backward_impl, mutates_args=(), tags=CUDAGRAPH_UNSAFE,
    schema="(Tensor token, Tensor?[] grads, SymInt[] shapes, int[] ndims, int[] dtypes, "
           "Device device) -> Tensor[]")
call_backward_op.register_fake(_call_backward_fake)


def _setup_context(ctx, inputs, output) -> None:
    (handle, recipe_key, amp, grad_enabled, needs, layout, ints, tensors, params,
     out_shapes, out_ndims, _deferred) = inputs
    ctx.n_in, ctx.n_params = len(tensors), len(params)
    ctx.needs = list(needs)
    wanted = [t for t, need in zip(list(tensors) + list(params), needs) if need]
    ctx.shapes = [s for t in wanted for s in t.shape]
    ctx.ndims = [t.dim() for t in wanted]
    ctx.dtypes = [_DTYPES.index(t.dtype) for t in wanted]
    ctx.device = wanted[0].device if wanted else torch.device("cpu")
    # backward answers each input; a list of tensors (an empty list too) with a list
    ctx.tensor_lists = [len(v) if isinstance(v, (list, tuple))
                        and all(isinstance(e, torch.Tensor) for e in v) else None
                        for v in inputs]
    ctx.save_for_backward(output[-1])


def _backward(ctx, grads):
    (token,) = ctx.saved_tensors
    got = iter(call_backward_op(token, list(grads[:-1]), ctx.shapes, ctx.ndims, ctx.dtypes,
                                ctx.device)) if ctx.ndims else iter(())
    per = [next(got) if need else None for need in ctx.needs]
    out = [None if n is None else [None] * n for n in ctx.tensor_lists]
    out[7], out[8] = per[:ctx.n_in], per[ctx.n_in:]
    return tuple(out)


call_op.register_autograd(_backward, setup_context=_setup_context)


# ---- tracing ---------------------------------------------------------------------------------
class ExpertsStandIn(torch.autograd.Function):
    """A plain tensor of a :class:`QuantizedExperts` parameter's shape and dtype (no data:
    the call reads the parameter itself), whose gradient is the parameter's."""

    @staticmethod
    def forward(ctx, experts):
        inner = getattr(experts, experts._inner[0])
        return inner.new_empty_strided(tuple(experts.shape), (0,) * experts.dim(),
                                       dtype=experts.dtype)

    @staticmethod
    def backward(ctx, grad):
        return grad


def _trace_call(module, args: tuple, kwargs: dict):
    """What dynamo traces in place of a lowprec forward: one ``lowprec::call``."""
    from ..memory import current_frame

    if current_frame() is not None:
        # the eager recompute must replay the eager call (lowprec.checkpoint)
        raise RuntimeError("a lowprec module compiled inside an eagerly run activation "
                           "checkpoint is not supported: put the checkpoint inside the "
                           "compiled function (a recipe without delayed scaling), or leave "
                           "the checkpointed function eager")
    region = active_region()
    recipe_key = -1
    if region is not None:
        recipe_key = _region_key(region)
    params = list(module.parameters())
    # experts gathered quantized (FSDP2) enter as stand-ins: the call reads the live
    # parameter, and their gradient passes through the stand-in to it
    params = [ExpertsStandIn.apply(p) if isinstance(p, QuantizedExperts) else p for p in params]
    layout, ints, tensors = _encode(args, kwargs)
    if not tensors:
        raise TypeError(f"{type(module).__name__} called with no tensor argument")
    shapes = module.compiled_output_shapes(*args, **kwargs)
    out_shapes = [s for shape in shapes for s in shape]
    out_ndims = [len(shape) for shape in shapes]
    grad_enabled = torch.is_grad_enabled()
    needs = [grad_enabled and t.requires_grad and t.is_floating_point()
             for t in tensors + params]
    amp = torch_autocast_dtype(tensors[0])
    # in a region of the compiled function: its exit updates the states (enter_deferred)
    deferred = region is not None and region.traced
    outs = call_op(getattr(module, HANDLE_ATTR), recipe_key,
                   -1 if amp is None else _DTYPES.index(amp), grad_enabled, needs, layout, ints,
                   tensors, params, out_shapes, out_ndims, deferred)
    if deferred:  # the traced region's exit runs after this call (its token)
        region.deferred.setdefault(recipe_key, []).append(outs[-1])
    if len(shapes) == 1:
        return outs[0]
    return tuple(outs[:len(shapes)])


_logger = logging.getLogger("lowprec.compile")
_FALLBACKS: dict = {}


@torch._dynamo.assume_constant_result
def _note_fallback(module: str, reason: str) -> bool:
    """Log once per (module type, reason) that a compiled call stays one opaque op. Dynamo
    runs it while it traces (a constant result), so it costs no graph break and is seen
    from a module called anywhere inside a compiled function (dynamo drops the deferred
    calls of a reorderable logging function made below the compiled frame)."""
    key = f"{module}: {reason}"
    if key not in _FALLBACKS:
        _FALLBACKS[key] = True
        _logger.warning("torch.compile runs a %s call as one opaque lowprec op: %s", module,
                        reason)
    return True


def fallback_reasons() -> list[str]:
    """Every ``"<module type>: <reason>"`` for which a compiled call has stayed one opaque
    op in this process (each logged once when it first happened)."""
    return list(_FALLBACKS)


def _holds_quantized_weight(module) -> bool:
    return any(isinstance(p, QuantizedTensor) for p in module.parameters())


_QUANTIZED_WEIGHT = ("a quantized weight (quantized_model_init, FSDP2's quantized_all_gather) "
                     "that the traced form does not read: per-tensor FP8, block FP8, MXFP8 1x32 "
                     "and NVFP4 weights without the transform trace; "
                     "the call runs eagerly behind a graph break (fullgraph=True refuses it)")


def _eager_call(forward, module, args: tuple, kwargs: dict):
    """``forward(module, *args, **kwargs)`` run eagerly from a compiled function."""
    return forward(module, *args, **kwargs)


# the reason is the message fullgraph=True raises with
_eager_call = torch._dynamo.disable(_eager_call, reason=_QUANTIZED_WEIGHT)


def opaque_refusal(module) -> str | None:
    """Why ``module`` cannot be one ``lowprec::call`` op (a quantized weight, which the op
    does not take), or None."""
    return _QUANTIZED_WEIGHT if _holds_quantized_weight(module) else None


def opaque_call(module, *args):
    """``module(*args)`` as one ``lowprec::call`` op inside a caller dynamo traces (the
    piece of a traced ``lowprec.ops`` run that has no traced form), for a module
    :func:`opaque_refusal` takes."""
    return _trace_call(module, args, {})


def compiled_as_one_op(forward):
    """Decorates a lowprec module's ``forward``: under torch.compile the call becomes one
    ``lowprec::call`` op (see the module docstring); eager calls are unchanged. The module
    must define ``compiled_output_shapes(*args, **kwargs)``.

    A module may also define ``traced_forward(*args, **kwargs)``: under torch.compile it
    is tried first, and dynamo traces it into the graph (``lowprec.linear.traced``) unless
    it returns a string (the reason it does not trace the call), which falls back to the
    op and is logged once (:func:`fallback_reasons`)."""

    @functools.wraps(forward)
    def wrapper(self, *args, **kwargs):
        if torch.compiler.is_compiling():
            traced = getattr(self, "traced_forward", None)
            if traced is not None:
                out = traced(*args, **kwargs)
                if not isinstance(out, str):
                    return out
                _note_fallback(type(self).__name__, out)
            if _holds_quantized_weight(self):
                # The opaque op takes plain tensors only: the call runs eagerly, one graph
                # break around it (never a break inside the eager code, which would
                # compile it as a frame of its own per module)
                _note_fallback(type(self).__name__, _QUANTIZED_WEIGHT)
                return _eager_call(forward, self, args, kwargs)
            return _trace_call(self, args, kwargs)
        return forward(self, *args, **kwargs)

    return wrapper
