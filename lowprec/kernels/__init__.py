"""The GPU code every format shares: launch plumbing (``launch``, ``grid``), the kernel
switches and tile configs (``tuning``), the ``@triton.jit`` helpers of the fp8 cast and
scale rules (``fp8_cast``, ``e8m0``), the block-scaled tile kernel (``block_scaled``) and
the norm/activation prologue (``prologue``). It imports nothing else of lowprec; each
format's own kernels live in its folder under ``formats/``.

Kernels run only on CUDA tensors and only when Triton imports; everything
else takes the pure-PyTorch reference path, which the kernels match bit for
bit.
"""

from __future__ import annotations

import functools
import sys
import threading

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

_enabled = True


_triton_found: bool | None = None


@torch._dynamo.assume_constant_result
def triton_available() -> bool:
    """True when Triton imports and a CUDA device is present."""
    # A plain cached flag rather than functools.lru_cache: the plans call this while
    # dynamo traces them, and dynamo warns about (and traces through) lru_cache wrappers.
    # A constant to dynamo: traced, the first call's setting of the flag became a guard on
    # the flag being unset, and every compiled model compiled twice.
    global _triton_found
    if _triton_found is None:
        _triton_found = torch.cuda.is_available() and _triton_imports()
    return _triton_found


def _triton_imports() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


@functools.lru_cache(maxsize=None)
def gluon_available() -> bool:
    """Gluon imports and its API is the one the Gluon kernels were written against (Triton
    3.6; Gluon is experimental and changed between releases). Older Triton: the Triton
    kernels."""
    try:
        import triton
        from triton.experimental import gluon  # noqa: F401
    except ImportError:
        return False
    major, minor = (int(v) for v in triton.__version__.split(".")[:2])
    return (major, minor) >= (3, 6)


def gluon_takes(x: torch.Tensor) -> bool:
    """Whether the Gluon quantize kernels can read ``x`` (2-D): a unit inner stride, a
    16-bit or fp32 dtype, and Gluon available."""
    return (x.stride(1) == 1 and x.dtype in (torch.bfloat16, torch.float16, torch.float32)
            and gluon_available())


def use_kernels(t: torch.Tensor) -> bool:
    """Whether ``t`` should be quantized by a Triton kernel rather than the reference."""
    return _enabled and t.is_cuda and triton_available()


class FlagOff:
    """Base of context managers that turn a module-level boolean off and restore it;
    subclasses name the module (``_module``) and the flag (``_flag``). For switches of the
    implementation alone (kernels or reference, bound or unbound launches: the same bits
    either way), which tests and benchmarks set for the whole process: the backward runs
    on the autograd engine's device threads, which must see them too."""

    _module: str
    _flag: str

    def __enter__(self):
        mod = sys.modules[self._module]
        self._saved = getattr(mod, self._flag)
        setattr(mod, self._flag, False)
        return self

    def __exit__(self, *exc):
        setattr(sys.modules[self._module], self._flag, self._saved)
        return False


class ThreadFlagOn:
    """Base of context managers that turn a thread-local boolean on and restore it;
    subclasses name the ``threading.local`` (``_local``) and its attribute (``_flag``),
    which reads False where unset. For settings that steer what a call computes: state of
    the thread that sets it, never of the module."""

    _local: threading.local
    _flag: str

    def __enter__(self):
        self._saved = getattr(self._local, self._flag, False)
        setattr(self._local, self._flag, True)
        return self

    def __exit__(self, *exc):
        setattr(self._local, self._flag, self._saved)
        return False


class reference_only(FlagOff):
    """Context manager that forces the pure-PyTorch path (for tests and benchmarks)."""

    _module, _flag = __name__, "_enabled"


def _tracing(args) -> bool:
    """True when a call must go through the dispatcher: torch.compile/export tracing, an
    active dispatch mode (fake tensors, functionalization) or a tensor subclass argument."""
    if torch.compiler.is_compiling() or _get_current_dispatch_mode() is not None:
        return True
    for a in args:
        if isinstance(a, torch.Tensor) and type(a) not in _PLAIN:
            return True
    return False


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def kernel_op(name: str, *, mutates_args=()):
    """An op (``lowprec::<name>``, as :func:`graph_op` defines one) for a kernel launcher
    that eager calls skip.

    The returned callable runs the launcher directly in eager mode: going through the
    dispatcher costs far more host time (about 0.1 ms a call) than the launch itself, and
    small steps are bound by that. Under tracing (see ``_tracing``) it calls the registered
    op, so ``torch.compile(fullgraph=True)`` still sees one opaque op with its fake; a
    compiled step calls it through the dispatcher alone (``torch.library.custom_op``'s
    Python layer would triple that host time: 0.14 ms a delayed-scaling update). ``.op``
    is the op (``torch.ops.lowprec.<name>.default``); ``.register_fake`` registers its
    fake implementation.
    """
    namespace, _, short = name.partition("::")
    if not namespace or not short:
        raise ValueError(f"kernel_op {name!r}: the name must be <namespace>::<name>")

    def wrap(fn):
        op = _define(namespace, short, fn, mutates_args)

        @functools.wraps(fn)
        def call(*args):
            return op(*args) if _tracing(args) else fn(*args)
        call.op = op
        call.register_fake = functools.partial(torch.library.register_fake, name)
        return call
    return wrap


#: the ops' libraries, by namespace
_LIBS: dict = {}


def _define(namespace: str, name: str, fn, mutates_args=(), tags: tuple = ()):
    """``<namespace>::<name>`` defined with ``fn``'s inferred schema and ``fn`` as its
    implementation (``CompositeExplicitAutograd``); returns the op's default overload."""
    lib = _LIBS.get(namespace)
    if lib is None:
        lib = _LIBS[namespace] = torch.library.Library(namespace, "FRAGMENT")
    lib.define(name + torch.library.infer_schema(fn, mutates_args=mutates_args), tags=tags)
    lib.impl(name, fn, "CompositeExplicitAutograd")
    return getattr(getattr(torch.ops, namespace), name).default


#: the op tag that keeps a compiled graph's CUDA graphs from capturing an op, for an op whose
#: work is on the host, which a replay would not do (torch 2.11+; none before)
CUDAGRAPH_UNSAFE = tuple(t for t in (getattr(torch.Tag, "cudagraph_unsafe", None),)
                         if t is not None)


def graph_op(name: str, *, tags: tuple = (), mutates_args: tuple = ()):
    """Define ``lowprec::<name>`` as an op of the compiled graph that runs ``fn`` (its
    schema inferred from ``fn``'s annotations, ``mutates_args`` the arguments it writes),
    with the op ``tags`` (``torch.Tag.nondeterministic_seeded`` for an op that draws from
    torch's generator: the compiler then neither merges nor recomputes it).

    Defined through ``torch.library.Library`` rather than ``custom_op``: a compiled step
    calls these ops from inductor's code, and ``custom_op``'s Python autograd layer costs
    about three times the dispatcher's host time per call. The op has no autograd formula:
    it is meant for the forward and backward of an ``autograd.Function``, where gradients
    are off. Returns the op (``torch.ops.lowprec.<name>.default``); register its fake
    implementation with ``torch.library.register_fake("lowprec::<name>")``."""
    def wrap(fn):
        return _define("lowprec", name, fn, mutates_args, tags)
    return wrap


def register_ordered(op) -> None:
    """Make ``op`` (a :func:`graph_op`) an ordered effectful op: AOT autograd threads one
    effect token through every such op of a graph, so the compiler keeps them in the
    order they were traced (random draws from torch's generator, which eager makes in
    program order), even where no data dependency orders them."""
    register = getattr(torch.library, "_register_effectful_op", None)
    if register is not None:
        register(op, torch.library.EffectType.ORDERED)
    else:  # torch 2.11
        from torch._higher_order_ops import effects
        effects._register_effectful_op(op, effects._EffectType.ORDERED)


def traced_op(name: str):
    """Define ``lowprec::<name>`` as one op to dynamo and AOT's first pass, and ``fn``'s torch
    ops to inductor.

    ``fn`` (its schema inferred from its annotations; no mutated arguments, outputs that
    alias neither the inputs nor each other) runs the op outside a compiler, and is
    registered in inductor's decomposition table, so AOT autograd traces the graph inductor
    receives with ``fn``'s ops in place of the node: inductor fuses them exactly as if
    ``fn`` had been traced inline. Dynamo records a call as one node and propagates it
    with the op's fake implementation (register it with
    ``torch.library.register_fake("lowprec::<name>")``), where tracing ``fn`` op by op
    costs about a millisecond an op: the quantizes traced into each of a model's linears
    are otherwise most of its tracing time. Returns a callable that calls the op under
    dynamo and ``fn`` itself elsewhere (the dispatcher's host time is not spent on an eager
    call); ``.op`` is the op (``torch.ops.lowprec.<name>.default``)."""
    def wrap(fn):
        op = _define("lowprec", name, fn)
        _decompose_in_inductor(op, fn)

        @functools.wraps(fn)
        def call(*args):
            return op(*args) if torch.compiler.is_compiling() else fn(*args)
        call.op = op
        return call
    return wrap


def _decompose_in_inductor(op, fn) -> None:
    # inductor's table (torch 2.11-2.13); the table inductor reads is a cached copy
    from torch._inductor import decomposition
    decomposition.register_decomposition(op)(fn)
    decomposition.fast_random_decomps.cache_clear()
