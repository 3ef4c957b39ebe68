"""``launch(kernel, grid, *args, **kwargs)``: ``kernel[grid](*args, **kwargs)`` for less host time.

A Triton launch through ``JITFunction.run`` spends most of its host time outside the
launch itself: it looks up the current device and stream, turns the options into a string
for its cache key, builds launch metadata, checks the globals the kernel read and then
calls the compiled kernel's C launcher. Measured on an H200 host (Triton 3.6): 26 us a
launch that way, 9.6 us calling the C launcher directly. A quantized Linear step makes
6-14 launches, and small steps are bound by the host.

:func:`launch` keeps the part that decides *which* compiled kernel runs, Triton's own
binder (the same specialization: dtypes, 16-byte alignment of pointers and integers,
integers equal to 1), and keys its cache on that specialization and the launch options.
On a miss it launches through ``kernel[grid]``, which compiles when needed and
hands back the compiled kernel it ran; on a hit it calls that kernel's launcher directly on
the current stream. Anything it does not cover takes the ordinary path: launch hooks (a
profiler's; Triton 3.6 keeps an empty hook chain when there are none), pre-run hooks, a
callable grid, Triton's interpreter or a stand-in object, and the whole fast path inside
:class:`slow_launches` (for A/B comparisons and to rule it out). What the fast path skips,
Triton's check that the globals a kernel read have not changed since it was compiled,
holds here: lowprec's kernels read only constants.
"""

from __future__ import annotations

import functools

import torch

from . import FlagOff, _tracing

_enabled = True
#: whether :class:`BoundCalls` binds (off: every call launches through :func:`launch`)
_bind_calls = True

#: (id(kernel), device, specialization, options) -> (kernel, compiled kernel); keyed by id
#: because hashing a JITFunction takes a lock
_compiled: dict = {}


class slow_launches(FlagOff):
    """Context manager: every launch goes through ``JITFunction.run`` (see module doc)."""

    _module, _flag = __name__, "_enabled"


class unbound_calls(FlagOff):
    """Context manager: :class:`BoundCalls` launches through :func:`launch` (A/B runs)."""

    _module, _flag = __name__, "_bind_calls"


@functools.lru_cache(maxsize=None)
def _knobs():
    """Triton's knobs when this Triton's ``JITFunction`` internals are the ones the
    fast path was written against (3.6: ``device_caches[device][4]`` is the binder), else
    None: every launch then takes the ordinary path."""
    import triton
    from triton import knobs
    major, minor = (int(v) for v in triton.__version__.split(".")[:2])
    return knobs if (major, minor) == (3, 6) else None


def _quiet(hook) -> bool:
    """Whether a launch hook slot calls nothing: None, or Triton's empty ``HookChain``."""
    return hook is None or getattr(hook, "calls", None) == []


def _remember(key, kernel, compiled) -> None:
    """Caches ``compiled``, what ``kernel[grid](...)`` just ran, under ``key`` (None: the
    arguments had no hashable key)."""
    if hasattr(compiled, "result"):  # an asynchronous compile's future
        compiled = compiled.result()
    if key is not None and compiled is not None:
        _compiled[key] = (kernel, compiled)


def launch(kernel, grid, *args, **kwargs) -> None:
    """Launch ``kernel`` (a ``@triton.jit`` or Gluon kernel) on ``grid`` (a tuple of up
    to three ints), as ``kernel[grid](*args, **kwargs)`` does, on the current device and
    stream."""
    caches = getattr(kernel, "device_caches", None) if _enabled else None
    knobs = _knobs() if caches is not None else None
    if knobs is None or kernel.pre_run_hooks or callable(grid) \
            or not _quiet(knobs.runtime.launch_enter_hook) \
            or not _quiet(knobs.runtime.launch_exit_hook):
        kernel[grid](*args, **kwargs)
        return
    # the two options JITFunction.run adds before binding: part of the key, so turning
    # Triton's debug mode (device asserts) or an instrumentation on takes effect here too
    kwargs["debug"] = kwargs.get("debug", kernel.debug) or knobs.runtime.debug
    kwargs["instrumentation_mode"] = knobs.compilation.instrumentation_mode
    device = torch.cuda.current_device()
    first = device not in caches  # the kernel's first launch here builds its binder
    if first:
        compiled = kernel[grid](*args, **kwargs)
    bound, specialization, options = caches[device][4](*args, **kwargs)
    key = (id(kernel), device, tuple(specialization), tuple(options.items()))
    try:
        hit = _compiled.get(key)
    except TypeError:  # an unhashable constexpr or option: no cache entry for it
        key = hit = None
    if first:
        _remember(key, kernel, compiled)
        return
    if hit is None or hit[0] is not kernel:
        _remember(key, kernel, kernel[grid](*args, **kwargs))
        return
    compiled = hit[1]
    stream = torch._C._cuda_getCurrentRawStream(device)
    n = len(grid)
    compiled.run(grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1, stream,
                 compiled.function, compiled.packed_metadata, None, None, None,
                 *bound.values())


class BoundLaunch:
    """One compiled kernel with every argument fixed but its first ``n`` (the tensors that
    change from call to call): ``bound(t0, ..., tn-1)`` launches it on the current stream.

    Made by :func:`bind` for a quantize whose kind (shape, strides, dtypes, options) a
    plan has decided once. The caller keeps what makes that valid: the same dtypes and
    16-byte alignment of the tensors it passes (Triton specializes on both) and
    :func:`fast_launches` true at the call.
    """

    __slots__ = ("_run", "_grid", "_head", "_tail", "_device")

    def __init__(self, compiled, grid: tuple, values: list, n: int, device: int) -> None:
        self._run = compiled.run
        self._grid = tuple(grid) + (1,) * (3 - len(grid))
        self._head = (compiled.function, compiled.packed_metadata, None, None, None)
        self._tail = tuple(values[n:])
        self._device = device

    def __call__(self, *tensors) -> None:
        g = self._grid
        self._run(g[0], g[1], g[2], torch._C._cuda_getCurrentRawStream(self._device),
                  *self._head, *tensors, *self._tail)


def fast_launches() -> bool:
    """Whether bound launches may run now: the fast path is on, no launch hook is set (a
    profiler's) and nothing traces or intercepts ops."""
    if not _enabled:
        return False
    knobs = _knobs()
    return (knobs is not None and _quiet(knobs.runtime.launch_enter_hook)
            and _quiet(knobs.runtime.launch_exit_hook))


def _bound_values(kernel, grid, args, kwargs):
    """(compiled kernel, every argument's bound value, device) of a launch that already ran
    through :func:`launch`, or None (see :func:`bind`)."""
    caches = getattr(kernel, "device_caches", None)
    knobs = _knobs() if caches is not None else None
    if knobs is None or not fast_launches() or kernel.pre_run_hooks or callable(grid):
        return None
    kwargs["debug"] = kwargs.get("debug", kernel.debug) or knobs.runtime.debug
    kwargs["instrumentation_mode"] = knobs.compilation.instrumentation_mode
    device = torch.cuda.current_device()
    if device not in caches:
        return None
    bound, specialization, options = caches[device][4](*args, **kwargs)
    try:
        hit = _compiled.get((id(kernel), device, tuple(specialization),
                             tuple(options.items())))
    except TypeError:
        return None
    if hit is None or hit[0] is not kernel:
        return None
    return hit[1], list(bound.values()), device


def bind(kernel, grid, n: int, *args, **kwargs) -> BoundLaunch | None:
    """A :class:`BoundLaunch` of ``kernel[grid](*args, **kwargs)`` whose first ``n``
    positional arguments change per call, or None where there is none: the same launch
    has not run through :func:`launch` yet (nothing compiled to bind), or it takes the
    ordinary path (hooks, a callable grid, another Triton)."""
    got = _bound_values(kernel, grid, args, kwargs)
    return None if got is None else BoundLaunch(got[0], grid, got[1], n, got[2])


def launch_calls(calls) -> None:
    """:func:`launch` each of ``calls`` ((kernel, grid, args, kwargs) each), in order."""
    for kernel, grid, args, kwargs in calls:
        launch(kernel, grid, *args, **kwargs)


def _takes_bound(tensors: tuple) -> bool:
    """Whether a call with these tensors may run bound launches: binding on, the fast path
    open, and every tensor 16-byte aligned (as Triton specialized the bound kernels)."""
    return (_bind_calls and fast_launches()
            and not any(t is not None and t.data_ptr() % 16 for t in tensors))


class PlacedLaunch:
    """One compiled kernel with its arguments fixed but those at ``places`` ((argument
    position, index into the call's tensors) pairs): ``launch(tensors)`` puts each of the
    call's tensors in its places and launches on the current stream."""

    __slots__ = ("_run", "_grid", "_head", "_values", "_places", "_device")

    def __init__(self, compiled, grid: tuple, values: list, places: tuple, device: int):
        self._run = compiled.run
        self._grid = tuple(grid) + (1,) * (3 - len(grid))
        self._head = (compiled.function, compiled.packed_metadata, None, None, None)
        values = list(values)
        for at, _ in places:  # the binding call's tensors are not kept alive
            values[at] = None
        self._values, self._places, self._device = values, places, device

    def launch(self, tensors: tuple) -> None:
        values = list(self._values)
        for at, i in self._places:
            values[at] = tensors[i]
        g = self._grid
        self._run(g[0], g[1], g[2], torch._C._cuda_getCurrentRawStream(self._device),
                  *self._head, *values)


class BoundCalls:
    """The launches of calls of one kind, bound at the kind's second call.

    A launcher whose every call of one kind (shapes, dtypes, options) makes the same
    launches, with only its tensors new, calls ``run(key, tensors, calls)``: ``tensors``
    the call's tensors (inputs and fresh outputs; None entries allowed), ``calls`` a
    callable giving the launches as (kernel, grid, args, kwargs), every tensor argument one
    of ``tensors``. The first call of a kind that could bind launches them through
    :func:`launch` (which compiles), the second binds them (:class:`PlacedLaunch`), and
    from then on a call puts its tensors in place and runs the bound launches: no binder,
    no argument lists.
    A kind whose launches cannot all be bound, a call with a tensor that is not 16-byte
    aligned (Triton specializes on it) or on another current device than the binding
    call's, launches the usual way. ``key`` names everything else the launches
    specialize on (shapes, dtypes, options). At most ``size`` kinds
    are kept."""

    def __init__(self, size: int = 256) -> None:
        self._kinds: dict = {}
        self._size = size

    def run(self, key, tensors: tuple, calls) -> None:
        state = self._kinds.get(key)
        takes = _takes_bound(tensors)
        if state is None or state is False or not takes:
            launch_calls(calls())
            # only a call that could bind counts as the kind's first: binding reads the
            # compiled kernel of the specialization its launches ran (an unaligned tensor
            # compiles another one)
            if state is None and takes:
                if len(self._kinds) >= self._size:
                    self._kinds.clear()
                self._kinds[key] = True
            return
        if state is True:  # the kind's second call binds its launches
            made = calls()
            state = self._kinds[key] = self._bind(tensors, made)
            if state is False:
                launch_calls(made)
                return
        elif state and state[0]._device != torch.cuda.current_device():
            launch_calls(calls())
            return
        for bound in state:
            bound.launch(tensors)

    @staticmethod
    def _bind(tensors: tuple, calls: list):
        where = {id(t): i for i, t in enumerate(tensors) if t is not None}
        made = []
        for kernel, grid, args, kwargs in calls:
            # every tensor argument by its position in the signature (the bound values'
            # order), positional or named
            named = [(kernel.arg_names.index(name), a) for name, a in kwargs.items()
                     if isinstance(a, torch.Tensor)]
            given = [(at, a) for at, a in enumerate(args) if isinstance(a, torch.Tensor)]
            if any(id(a) not in where for _, a in given + named):
                return False
            got = _bound_values(kernel, grid, args, dict(kwargs))
            if got is None:
                return False
            places = tuple((at, where[id(a)]) for at, a in given + named)
            made.append(PlacedLaunch(got[0], grid, got[1], places, got[2]))
        return tuple(made)


def launch_in_graph(kernel, grid, *args, **kwargs) -> None:
    """``launch`` for the body of a ``torch.library.triton_op``: the kernel goes through
    ``wrap_triton``, so a compiled graph launches it from inductor's generated code (no
    dispatch, no Python launcher per call). Every parameter is passed by name, defaults
    included, which inductor's user-kernel path needs; None arguments stay None (it leaves
    them out of its mutation analysis, as Triton makes them constexprs). Called outside a
    graph (an eager call of the op), it is :func:`launch`: the same kernel and arguments,
    without the signature walk and ``wrap_triton``'s Python launcher each call."""
    if not _tracing((*args, *kwargs.values())):  # the op's body on real tensors
        launch(kernel, grid, *args, **kwargs)
        return
    import inspect

    from torch.library import wrap_triton
    named = dict(zip(kernel.arg_names, args))
    for p in inspect.signature(kernel.fn).parameters.values():
        named.setdefault(p.name, kwargs.pop(p.name, p.default))
    wrap_triton(kernel)[grid](**named, **kwargs)
