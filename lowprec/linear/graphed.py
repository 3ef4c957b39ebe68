"""Eager Linear calls replayed from CUDA graphs (``lowprec.autocast(cuda_graphs=True)``).

An eager quantized Linear launches a handful of kernels a direction (the quantizes, the
GEMM, their scales), and at the widths of a 1B model its host time exceeds its GPU time:
the GPU waits for Python. Under ``cuda_graphs=True`` each kind of call (its shapes,
strides, dtypes, gradient flags, backward mode and the storage of its weight and bias) is
captured on its second call, its forward then and its backward at its first backward, in
CUDA graphs that share a private memory pool; every later call of that kind replays them.
A replay runs the kernels the eager call runs, with the same arguments, so its results are
the eager call's bit for bit (stochastic rounding draws its bits from counters on the
device, which the replays advance as eager calls do).

A graph reads its input, and its backward reads dY, where the capture found them: the
caching allocator hands a training step's tensors the same memory step after step, so in
steady state nothing is copied in. A call whose input lies elsewhere (checked by address
and layout on every call) takes a graph that copies it into a buffer, as does every later
capture of that kind; a dY elsewhere takes a second backward graph, over a buffer, until
dY is found twice in a row at a new place, where the first graph is recorded again. Such
buffers are read only while a graph replays, so graphs of one layout share them, and
graphs that read one tensor in a row (q/k/v, gate/up) copy it in once. A forward that
saves its input for backward (a high-precision backward, a plan that quantizes the input
again in backward) and reads it where it lies keeps the caller's tensor until its
backward, as autograd does, and raises there if it was changed in place; where it would
copy, it copies into a buffer of its own.

Linears that read one input in a row (q/k/v, gate/up) share its quantize as eager calls
do (``shared_input``): a capture that follows a graph which quantized the same input reads
that graph's quantize from its memory. Such a graph replays only where the feeding
graph's last replay read the very input it is called with, unchanged since, and the
feeding graph is not replayed again while a reader's backward (which may read its
columnwise form) is still to run.

The graphs own their memory: the output and the gradients they hand out, and what the
forward saves for backward, stay allocated between steps (about the activations of one
step per graphed Linear, as with Transformer Engine's ``make_graphed_callables``). The
output a replay hands out aliases its graph's output buffer, and the gradients alias the
graph's gradient buffers (autograd copies one into a ``.grad`` rather than keeping it). So
a graph is replayed only when what it handed out last time is free: its backward has run
or its autograd graph is gone, and nothing references its output any more. When none of a
kind's graphs is free (a second forward before the first one's backward, as pipeline
schedules run), another is captured, up to ``MAX_GRAPHS`` a kind, and beyond that the call
runs eagerly (same bits). A backward run twice (``retain_graph=True``) raises: the second
run would read buffers the first one released. A weight whose storage moves between calls
(a reload, FSDP's resharding) is captured again once, and then its calls run eagerly; a
backward that reads the weight itself (its forward saved it) raises if the weight moved
since its forward.

Delayed scaling is graphed too: a replay casts with the state's scales and records the
amaxes into it on the device, as the eager call's kernels do, and the replayed backward
joins the module's backward state to the pass's update on the host
(``lowprec.recipe.backward_pass``); a slot still without a scale when its kind is
captured records the amax-first quantize, which casts with the state's scale once there
is one.

What is not graphed runs eagerly, with a warning once per reason: calls whose step keeps
state on the host (a cached quantized weight),
quantized inputs, weights or outputs (``output``/``grad_input`` quantizers), weights that
are not leaf tensors (their storage may move), calls under saved-tensor hooks (activation
checkpointing, CPU offload: they would not see the graph's saved tensors), calls inside a
backward pass (a reentrant checkpoint's recompute) or in inference mode. Calls off CUDA,
under ``torch.compile`` or inside a capture of the caller's own are not graphed, silently:
there the option has nothing to do.
"""

from __future__ import annotations

import threading
import warnings
import weakref
from collections import Counter

import torch

from ..formats import QuantizedTensor
from ..recipe import for_running_backward_pass
from . import shared_input
from .graph_sources import SHARED, At, Input, forward_source, layout, mark, unchanged

#: graphs a kind of call may hold at once (each with its own buffers and pool)
MAX_GRAPHS = 2
#: times a backward graph is recorded again for dY's new place
MAX_AIMS = 2
#: kinds of call a Linear captures (variable token counts would otherwise hold a graph,
#: and its memory, per count); later kinds run eagerly
MAX_KINDS = 4

#: what happened to graphed-eligible calls: "captured", "replayed", "eager (<reason>)"
counts: Counter = Counter()

_WARNED: set = set()


def _storage_refs(t: torch.Tensor) -> int:
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata)


class _Shares(threading.local):
    """This thread's last replayed graph that made a quantize of its input that the next
    Linears reading that input may take (a weakref, or None)."""

    last = None


_SHARES = _Shares()


class _Graphs:
    """One captured kind of call: its forward graph, the backward graphs (one for dY where
    the first backward found it, one over a shared buffer for dY elsewhere), and what they
    read and write."""

    def __init__(self, kind, recorder, fwd, x, y, held, leaves, pins, backward_reads_params,
                 keeps_input, made, reads):
        self.kind = kind
        self.recorder = recorder  # the backward graphs record on the forward's stream and pool
        #: the capturing call's end-of-backward callback, which the capture's autograd
        #: graph calls whenever it runs (delayed scaling: joins the backward pass)
        self.capture_done = None
        self.fwd = fwd
        self.x, self.y = x, y
        #: the capture's output with its autograd graph, which the backward graphs run
        #: (None without gradients)
        self.held = held
        self.leaves = leaves  # the capture's leaves: input, weight and bias aliases
        self.pins = pins  # (weight, bias) data pointers the graphs read
        #: whether the backward graph reads the parameters' storage (its forward saved
        #: them: a high-precision backward, or a weight's columnwise copy made in backward);
        #: else it reads only what the forward made
        self.backward_reads_params = backward_reads_params
        #: the backward graphs, each (dY's source, graph, the gradients it writes): the one
        #: reading dY where it lies, and the one reading a shared buffer (None until needed)
        self.backward_where = self.backward_buffered = None
        self.missed = None  # the layout of the last dY found elsewhere
        self.aims = 0  # times the first graph was recorded again for dY's new place
        #: the forward saves its input, read where it lies: the replay's node keeps the
        #: caller's tensor (and checks its version) until its backward
        self.keeps_input = keeps_input
        #: the quantize of the input this graph's forward makes, kept for the graphs of
        #: the Linears after it that read the same input (q/k/v, gate/up): {"made": the
        #: region's record of it, or None}; dropped at the second replay where no graph
        #: reads it (those Linears are captured right after this one)
        self.made = made
        #: the graphs whose quantize this one reads instead of making its own (None: it
        #: quantizes its input itself); those that read this one's
        self.reads = reads
        self.readers = weakref.WeakSet()
        self.last_input = None  # ``mark`` of the input of the last replay
        self.node = None  # weakref to the autograd node of the last replay awaiting backward
        self.generation = 0
        self.y_refs = 0  # references to y's storage while nothing is handed out (``settle``)

    def settle(self) -> None:
        """Count the references to the output's storage that the graphs hold themselves
        (once the capture's own tensors are gone)."""
        self.y_refs = _storage_refs(self.y)

    def pending(self) -> bool:
        """Whether a replay's backward is still to run."""
        node = self.node
        return node is not None and node() is not None

    def free(self) -> bool:
        """Whether a replay may overwrite what the last one handed out: its backward has
        run (and the backward of every graph that read its quantize), and nothing else
        references its output."""
        if self.pending() or any(r.pending() for r in self.readers):
            return False
        return _storage_refs(self.y) == self.y_refs

    def fed(self, x: torch.Tensor) -> bool:
        """Whether this graph's last replay read ``x`` as it is now (so the quantize it
        made is ``x``'s)."""
        return unchanged(self.last_input, x)

    def serves(self, x: torch.Tensor) -> bool:
        """Whether a replay for ``x`` reads the right input: where it lies (or from a
        buffer), and, where the graph reads another's quantize, that graph's of ``x``."""
        return self.x.accepts(x) and (self.reads is None or self.reads.fed(x))

    def backward(self, dy: torch.Tensor) -> tuple:
        """The gradients of (input, weight, bias) for ``dy``, from the backward graph that
        reads it (recorded at the first backward that needs it). One graph reads dY where
        it lies: where the first backward found it, or where dY has since been found twice
        in a row (the first backward of a run may find it elsewhere than the steps after);
        a dY elsewhere is copied into a shared buffer that a second graph reads."""
        where, buffered = self.backward_where, self.backward_buffered
        if where is not None and where[0].accepts(dy):
            found = where
        else:
            again, self.missed = self.missed == layout(dy), layout(dy)
            aim = dy.numel() > 0 and (where is None or (again and self.aims < MAX_AIMS))
            found = buffered if not aim else None
            if found is None:
                source = At(dy) if aim else SHARED.get(self.y)
                _copy_in(source, dy)  # before the recording (see _record_forward)
                try:
                    found = self._record_backward(source)
                except Exception as err:  # noqa: BLE001 - the kind runs eagerly from now on
                    self.kind.graphs = None
                    _warn(f"capture failed ({type(err).__name__}: {err})")
                    return self._through_capture(dy)
                counts["captured backward"] += 1
                if aim:
                    self.aims += where is not None
                    self.backward_where = found
                else:
                    self.backward_buffered = found
        source, graph, grads = found
        _copy_in(source, dy)
        graph.replay()
        return grads

    def _through_capture(self, dy: torch.Tensor) -> tuple:
        """The gradients of (input, weight, bias) for ``dy`` through the capture's autograd
        graph: what a backward graph records, or, where the recording failed, the call's
        gradients computed eagerly."""
        inputs = [t for t in self.leaves if t is not None and t.requires_grad]
        # ``autograd.grad`` runs a pass of its own, nested in the one running: the capture's
        # callback joins the outer pass, whose end updates the state once (never inside the
        # recording, nor twice in a step)
        with for_running_backward_pass():
            got = iter(torch.autograd.grad(self.held["y"], inputs, dy, retain_graph=True,
                                           allow_unused=True))
        return tuple(next(got) if t is not None and t.requires_grad else None
                     for t in self.leaves)

    def _record_backward(self, source) -> tuple:
        graph, grads = self.recorder.record(lambda: self._through_capture(source.buffer))
        if any(g is not None and _same_storage(g, source.buffer) for g in grads):
            raise RuntimeError("a gradient is a view of dY, which the graph does not own")
        return source, graph, grads


class _Kind:
    """The calls of one kind: how many ran, and their graphs (None: refused)."""

    def __init__(self):
        self.calls = 0
        self.moves = 0
        self.graphs: list | None = []
        #: whether captures read the input where it lies, until a call's input lies
        #: elsewhere; then they copy it into a buffer
        self.where = True


def _pins(weight, bias) -> tuple:
    """The parameters' storage the graphs read."""
    return weight.data_ptr(), None if bias is None else bias.data_ptr()


def refusal(x: torch.Tensor, weight: torch.Tensor, bias, quantizers,
            caching_weights: bool) -> str | None:
    """Why this call is not graphed (None: it is). Only asked of CUDA calls outside tracing
    and capture."""
    if caching_weights:
        return "cache_weights keeps the quantized weight on the host side"
    if quantizers.output is not None or quantizers.grad_input is not None:
        return "an output or grad_input quantizer hands out quantized tensors"
    if isinstance(x, QuantizedTensor) or isinstance(weight, QuantizedTensor):
        return "a quantized input or weight"
    if weight.grad_fn is not None or (bias is not None and bias.grad_fn is not None):
        return "a weight or bias that is not a leaf tensor (its storage may move)"
    if torch.is_inference_mode_enabled() or x.is_inference():
        return "inference mode"
    if torch._C._autograd._top_saved_tensors_default_hooks(False) is not None:
        return "saved-tensor hooks (activation checkpointing or CPU offload) are active"
    if torch._C._current_graph_task_id() != -1:
        return "a call inside a backward pass (a reentrant checkpoint's recompute)"
    return None


def applies(x: torch.Tensor) -> bool:
    """Whether graphs can apply at all: a CUDA call outside tracing and capture."""
    return (x.is_cuda and not torch.compiler.is_compiling()
            and not torch.cuda.is_current_stream_capturing())


def call(run, x: torch.Tensor, weight: torch.Tensor, bias, kinds: dict, key: tuple,
         reason: str | None, done=None):
    """``run(x, weight, bias)`` (the eager call), replayed from this kind's graphs where
    they apply. ``kinds``: where the kinds of call are kept (the quantizers' plans).
    ``done``: the call's end-of-backward callback (delayed scaling: it joins the module's
    backward state to the backward pass's update, host bookkeeping that a replay does not
    run), which a replayed backward calls itself."""
    if reason is not None:
        _eager(reason)
        return run(x, weight, bias)
    kind = kinds.get(key)
    if kind is None:
        kind = kinds[key] = _Kind()
        if sum(k.graphs is not None for k in kinds.values()) > MAX_KINDS:
            kind.graphs = None
            _eager(f"more than {MAX_KINDS} kinds of call (shapes, strides, gradient flags) "
                   "for one Linear")
            return run(x, weight, bias)
    kind.calls += 1
    if kind.graphs is None:
        counts["eager (refused before)"] += 1
        return run(x, weight, bias)
    if kind.calls < 2:
        # the first call runs eagerly: it loads the kernels and decides the plans, which a
        # capture cannot do
        return run(x, weight, bias)
    pins = _pins(weight, bias)
    if kind.graphs and kind.graphs[0].pins != pins:
        # the parameters' storage moved (loaded anew, or resharded by FSDP): capture again
        # once; a second move refuses the kind
        kind.moves += 1
        kind.graphs = [] if kind.moves < 2 else None
        if kind.graphs is None:
            _eager("the weight's storage moves between calls (FSDP resharding?)")
            return run(x, weight, bias)
    graphs = next((g for g in kind.graphs if g.free() and g.serves(x)), None)
    if graphs is None:
        stale = next((g for g in kind.graphs if g.free() and not g.x.accepts(x)), None)
        if stale is not None:
            # free, but reading its input where it no longer lies: this kind's inputs move
            # from call to call, so its graphs copy them in from now on
            kind.graphs.remove(stale)
            kind.where = False
        if len(kind.graphs) >= MAX_GRAPHS:
            counts["eager (every graph of the kind is in use)"] += 1
            return run(x, weight, bias)
        try:
            graphs = _capture(run, x, weight, bias, pins, kind)
        except Exception as err:  # noqa: BLE001 - any capture failure: this kind runs eagerly
            kind.graphs = None
            _warn(f"capture failed ({type(err).__name__}: {err})")
            return run(x, weight, bias)
        graphs.settle()
        graphs.capture_done = done
        kind.graphs.append(graphs)
        counts["captured"] += 1
    counts["replayed"] += 1
    return _Replay.apply(graphs, x, weight, bias, done)


def _copy_in(source, t: torch.Tensor) -> None:
    """``t``'s values into ``source``'s buffer, where its graph does not read ``t`` where it
    lies (counted)."""
    if source.fill(t):
        counts["copied in"] += 1


def _eager(reason: str) -> None:
    counts[f"eager ({reason})"] += 1
    if reason not in _WARNED:
        _warn(reason)


def _warn(reason: str) -> None:
    _WARNED.add(reason)
    warnings.warn(f"lowprec.autocast(cuda_graphs=True): a Linear call runs eagerly: {reason}",
                  stacklevel=4)


class _CudaRecorder:
    """Records a kind's graphs on a side stream of its own, into one private memory pool
    (the backward graphs on the forward's stream: autograd runs the captured nodes there)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self.pool = torch.cuda.graph_pool_handle()

    def record(self, fn):
        """(the graph of what ``fn()`` launches, what it returned)."""
        current = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(current)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.stream(self.stream):
                graph.capture_begin(pool=self.pool, capture_error_mode="thread_local")
                try:
                    out = fn()
                finally:
                    graph.capture_end()
        finally:
            current.wait_stream(self.stream)
        return graph, out


#: what records the graphs (the tests' CPU pretend replaces it)
RECORDER = _CudaRecorder


def _capture(run, x, weight, bias, pins, kind: _Kind) -> _Graphs:
    """Capture the forward of ``run`` reading ``x`` where it lies (or from a shared buffer,
    once the kind's inputs have moved). A forward that saves its input for backward and
    reads it where it lies keeps the caller's tensor until its backward; one that would
    read a shared buffer takes a buffer of its own instead."""
    graphs = _record_forward(RECORDER(x.device), run, x, weight, bias, pins, kind,
                             forward_source(x, kind.where))
    if graphs is None:
        graphs = _record_forward(RECORDER(x.device), run, x, weight, bias, pins, kind,
                                 Input(x))
    return graphs


def _record_forward(recorder, run, x, weight, bias, pins, kind, source) -> _Graphs | None:
    """The forward's graph, or None where it saves its input while ``source`` is a shared
    buffer."""
    # x's values in the buffer before the recording: a recording that runs its kernels
    # (the tests' pretend recorder) then records the amaxes a delayed-scaling state sees
    _copy_in(source, x)
    sx = source.buffer.detach().requires_grad_(x.requires_grad and torch.is_grad_enabled())
    # The graphs read the parameters' storage through leaves of their own: autograd then
    # never reaches the parameters' gradient accumulators during the capture (one made on
    # another stream, kept alive by a previous step's graph, would make the backward wait
    # on that stream: not allowed in a capture).
    weight, bias = (_leaf_alias(p) for p in (weight, bias))
    saves_input, saves_params = [], []

    def pack(t):
        # what the forward saves for backward: the input, or the parameters' storage
        # (then the backward graph reads them where they were at capture)
        if type(t) in (torch.Tensor, torch.nn.Parameter):
            if _same_storage(t, sx):
                saves_input.append(True)
            if any(p is not None and _same_storage(t, p) for p in (weight, bias)):
                saves_params.append(True)
        return t

    held, made, lending = {}, {"made": None}, {}
    # The Linear before this one read the same input (q before k and v, gate before up)
    # and its graph kept its quantize: lend it to this capture (``shared_input``), which
    # then reads it from that graph's memory instead of quantizing again.
    feeder = _SHARES.last() if _SHARES.last is not None else None
    if feeder is not None and (feeder.kind is kind or not feeder.fed(x)):
        feeder = None

    def forward():
        # (a recording runs this once; the tests' pretend recorder on every replay)
        if feeder is not None and feeder.made["made"] is not None:
            lending["lent"] = shared_input.lend(feeder.made["made"], sx)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            held["y"] = run(sx, weight, bias)
        made["made"] = shared_input.made_from(sx)
        return held["y"]

    fwd, y = recorder.record(forward)
    if saves_input and isinstance(source, Input) and source.shared:
        return None
    lent = lending.get("lent")
    reads = feeder if lent is not None and lent.hits else None
    graphs = _Graphs(kind, recorder, fwd, source, y.detach(),
                     held if y.grad_fn is not None else None, (sx, weight, bias), pins,
                     bool(saves_params), bool(saves_input) and isinstance(source, At),
                     made, reads)
    if reads is not None:
        reads.readers.add(graphs)
        counts["captured reading another's quantize"] += 1
    return graphs


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _leaf_alias(p: torch.Tensor | None) -> torch.Tensor | None:
    """A leaf on ``p``'s storage, of ``p``'s kind (a Parameter stays one)."""
    if p is None:
        return None
    if isinstance(p, torch.nn.Parameter):
        return torch.nn.Parameter(p.detach(), p.requires_grad)
    return p.detach().requires_grad_(p.requires_grad)


class _Replay(torch.autograd.Function):
    """A replay of captured graphs as one autograd node."""

    @staticmethod
    def forward(ctx, graphs: _Graphs, x, weight, bias, done=None):
        _copy_in(graphs.x, x)  # (a graph chosen for x reads it where it lies, or a buffer)
        graphs.fwd.replay()
        graphs.last_input = mark(x)
        if graphs.generation and not graphs.readers:
            # no Linear after this one took its quantize when both were captured: let the
            # pool reuse the rowwise copy it kept for them
            graphs.made["made"] = None
        if graphs.made["made"] is not None:
            _SHARES.last = weakref.ref(graphs)
        graphs.generation += 1
        ctx.graphs, ctx.generation = graphs, graphs.generation
        ctx.params, ctx.done = (weight, bias), done
        if graphs.keeps_input:  # the backward graph reads x's memory: x must live till then
            ctx.x, ctx.x_version = x, x._version
        if graphs.held is not None:
            graphs.node = weakref.ref(ctx)
        return graphs.y.detach()

    @staticmethod
    def backward(ctx, dy):
        graphs = ctx.graphs
        if (graphs.held is None or graphs.node is None or graphs.node() is not ctx
                or graphs.generation != ctx.generation):
            raise RuntimeError(
                "lowprec.autocast(cuda_graphs=True): a graphed Linear's backward ran twice "
                "(retain_graph=True) or after its graphs were reused; run such steps with "
                "cuda_graphs=False")
        if graphs.backward_reads_params and _pins(*ctx.params) != graphs.pins:
            raise RuntimeError(
                "lowprec.autocast(cuda_graphs=True): a graphed Linear whose backward reads its "
                "weight saw the weight move to other storage between its forward and its "
                "backward (FSDP resharding?); the graph would read the old storage. Run it "
                "with cuda_graphs=False")
        if graphs.keeps_input:
            if ctx.x._version != ctx.x_version:
                raise RuntimeError(
                    "lowprec.autocast(cuda_graphs=True): the input of a graphed Linear whose "
                    "backward reads it was modified by an inplace operation between its "
                    f"forward and its backward (version {ctx.x_version} -> {ctx.x._version})")
            ctx.x = None
        if isinstance(dy, QuantizedTensor):
            raise TypeError(
                "lowprec.autocast(cuda_graphs=True): a graphed Linear got a quantized "
                f"grad_output ({type(dy).__name__}); its graph reads a high-precision one. "
                "Run without cuda_graphs, or without the grad_input quantizer above it")
        grads = graphs.backward(dy)
        graphs.node = None
        if ctx.done is not None:
            # the replay ran the GEMM's backward kernels (dY's amax recorded into the
            # state on the device); the join to the pass's update is the host's part.
            # Joining twice in a pass (a backward recorded or run through the capture
            # calls the capture's callback too) is joining once.
            ctx.done()
        # the buffers themselves: autograd copies them into a .grad (they are referenced
        # here, so never taken over) and reads them once as another node's gradient
        return (None, *grads, None)
