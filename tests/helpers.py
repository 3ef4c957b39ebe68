"""Helpers shared across the test directories: the SQNR measure, seeded random inputs and
the marks of a GPU-only test file.

Test files import them as ``from helpers import sqnr_db, randn`` (``tests/`` is on the
path through its conftest).
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

import lowprec.kernels

#: ``pytestmark`` of a file whose tests need CUDA and Triton: marked ``gpu``, skipped elsewhere
GPU_ONLY = [
    pytest.mark.gpu,
    pytest.mark.skipif(not lowprec.kernels.triton_available(),
                       reason="needs a CUDA device and Triton"),
]


def cases(axes: dict, quick, covered_elsewhere: dict | None = None) -> list:
    """The product of ``axes`` (argument name -> values, a list, or a dict of test id ->
    value) as ``pytest.param``s, the ones ``quick(**case)`` refuses marked ``slow`` (run
    with ``--slow``): CI's CPU run covers each axis without the whole matrix. Every value
    of every axis must be in some quick case, but those ``covered_elsewhere`` names (axis
    -> ids) for the values another test of the default run covers (say why where it is
    passed)."""
    named = {name: (vals if isinstance(vals, dict) else {str(v): v for v in vals})
             for name, vals in axes.items()}
    out, covered = [], {name: set() for name in named}
    for ids in itertools.product(*named.values()):
        case = {name: named[name][i] for name, i in zip(named, ids)}
        fast = quick(**case)
        if fast:
            for name, i in zip(named, ids):
                covered[name].add(i)
        out.append(pytest.param(*case.values(), id="-".join(ids),
                                marks=() if fast else pytest.mark.slow))
    elsewhere = covered_elsewhere or {}
    missing = {name: sorted(set(named[name]) - covered[name] - set(elsewhere.get(name, ())))
               for name in named}
    assert not any(missing.values()), f"values in no quick case: {missing}"
    return out


def pairwise(axes: dict):
    """A ``quick`` for :func:`cases`: true on a few cases of the product of ``axes`` (as
    for ``cases``; other arguments are ignored) in which every pair of values of every two
    axes occurs. Greedy: each next case is the product's first covering the most pairs not
    yet covered, so the choice is the same on every run."""
    values = [list(v.values()) if isinstance(v, dict) else list(v) for v in axes.values()]
    rows = list(itertools.product(*(range(len(v)) for v in values)))

    def pairs(row):
        return {(a, row[a], b, row[b]) for a, b in itertools.combinations(range(len(row)), 2)}
    uncovered = set().union(*(pairs(r) for r in rows))
    chosen = set() if uncovered else set(rows)
    while uncovered:
        best = max(rows, key=lambda r: len(pairs(r) & uncovered))
        chosen.add(best)
        uncovered -= pairs(best)

    def index(vals, v):
        return next(i for i, w in enumerate(vals) if w is v or w == v)

    def quick(**case):
        return tuple(index(vals, case[name]) for name, vals in zip(axes, values)) in chosen
    return quick


def sqnr_db(ref: torch.Tensor, test: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio of ``test`` against ``ref`` in dB, in float64:
    ``10 log10(sum ref^2 / sum (ref - test)^2)``; inf when they are equal (zeros included),
    so a bit-exact result passes any threshold."""
    ref, test = ref.detach().double(), test.detach().double()
    noise = (ref - test).pow(2).sum()
    return math.inf if noise == 0 else float(10 * torch.log10(ref.pow(2).sum() / noise))


def randn(*shape, seed: int, dtype: torch.dtype = torch.float32, scale: float = 1.0,
          shift: float = 0.0, device="cpu") -> torch.Tensor:
    """``randn(shape) * scale + shift`` from a generator of ``device`` seeded with ``seed``,
    cast to ``dtype``: the same values on every run, whatever else drew numbers before.
    ``shape`` may be given as one tuple or as separate sizes."""
    if len(shape) == 1 and isinstance(shape[0], (tuple, list, torch.Size)):
        shape = tuple(shape[0])
    g = torch.Generator(device=device).manual_seed(seed)
    t = torch.randn(shape, generator=g, device=device)
    # an identity scale/shift is skipped, not applied: randn's values stay exactly as drawn
    if scale != 1.0:
        t = t * scale
    if shift != 0.0:
        t = t + shift
    return t.to(dtype)


def assert_same_quantized(a, b, what=""):
    """``a`` and ``b`` are quantized tensors of one type and metadata holding the same inner
    tensors (fp8 codes compared as bytes), recursing into nested ones."""
    from lowprec.formats.base import QuantizedTensor
    assert type(a) is type(b) and a.metadata() == b.metadata(), what
    for name, t in a.inner_tensors().items():
        u = getattr(b, name)
        assert (t is None) == (u is None), f"{what}.{name}"
        if isinstance(t, QuantizedTensor):
            assert_same_quantized(t, u, f"{what}.{name}")
        elif t is not None:
            assert t.dtype == u.dtype and torch.equal(_bytes(t), _bytes(u)), f"{what}.{name}"


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t


class GraphOps:
    """A torch.compile backend that records the ops of the forward and backward graphs AOT
    autograd makes of every graph dynamo hands it, with inductor's decompositions (the
    graphs inductor would receive), then runs them as aot_eager does. ``partition_fn``:
    the partitioner that splits them (default: AOT autograd's own)."""

    def __init__(self, partition_fn=None) -> None:
        self.targets: list = []
        #: each graph's targets, in the order they were compiled
        self.graphs: list = []
        #: AOT autograd's partitioner (None: its default one)
        self.partition_fn = partition_fn

    def steady(self) -> list:
        """The targets of the last forward and backward graphs compiled: what the steps run
        once nothing recompiles (a delayed-scaling model on CUDA compiles again after its
        first step, whose Linears are opaque while their slots have no scales)."""
        return [t for g in self.graphs[-2:] for t in g]

    def __call__(self, gm, example_inputs):
        from torch._dynamo.backends.common import aot_autograd
        from torch._inductor.decomposition import select_decomp_table

        def name(n):
            # an ordered effectful op (``kernels.register_ordered``) is a ``with_effects``
            # node whose second argument is the op, an op that writes its inputs an
            # ``auto_functionalized`` node whose first argument is
            if "with_effects" in str(n.target):
                return str(n.args[1])
            if "auto_functionalized" in str(n.target):
                return str(n.args[0])
            return str(n.target)

        def record(g, _inputs):
            self.graphs.append([name(n) for n in g.graph.nodes if n.op == "call_function"])
            self.targets += self.graphs[-1]
            return g

        split = {} if self.partition_fn is None else {"partition_fn": self.partition_fn}
        return aot_autograd(fw_compiler=record, bw_compiler=record,
                            decompositions=select_decomp_table(), **split)(gm, example_inputs)


def plan_of(recipe, x, weight, bias=None):
    """The traced plan (``lowprec.linear.traced.plan_for``) of a Linear named "l" under
    ``recipe`` with these operands, or None where the call stays opaque."""
    from lowprec.linear import traced
    from lowprec.linear.function import LinearQuantizers
    from lowprec.recipe.roles import gemm_roles
    from lowprec.recipe.state import RecipeState

    quantizers = []
    for mode in ("forward", "backward"):
        roles = gemm_roles("linear", "l", fwd=mode == "forward", output_role=None,
                           grad_input_role=None)
        quantizers.append(RecipeState.create(recipe, mode, roles, x.device).quantizers)
    (fi, fw, _), (bg, _) = quantizers
    q = LinearQuantizers(input=fi, weight=fw, grad_output=bg)
    plan = traced.plan_for(q, recipe.backward_mode, x, weight, bias)
    return None if isinstance(plan, str) else plan


def train_layers(layers, recipe, x: torch.Tensor, steps: int = 2) -> None:
    """``steps`` forward + backward passes of ``x`` through ``layers`` one after another
    under ``lowprec.autocast(recipe)`` (layers compiled one by one, say)."""
    for _ in range(steps):
        with lowprec.autocast(recipe=recipe):
            y = x
            for layer in layers:
                y = layer(y)
        y.sum().backward()


def assert_inference_reads_rowwise_only(forward, inference, columnwise_made: list) -> None:
    """``forward(context)`` (a forward under a recipe inside ``context()``, returning
    (module, output)) makes columnwise data in training, which the spy ``columnwise_made``
    (tests/conftest.py) sees, and none inside ``inference`` (``torch.no_grad``,
    ``torch.inference_mode``), whose output has no autograd history."""
    import contextlib

    forward(contextlib.nullcontext)  # training: the backward reads some
    assert columnwise_made, "the spy saw no columnwise data in a training forward"
    columnwise_made.clear()
    _, y = forward(inference)
    assert columnwise_made == []
    assert y.grad_fn is None and not y.requires_grad


class _RunsInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, fn):
        ctx.fn = fn
        return t.clone()

    @staticmethod
    def backward(ctx, g):
        return ctx.fn(g), None


def runs_in_backward(t: torch.Tensor, fn) -> torch.Tensor:
    """A copy of ``t`` whose gradient is ``fn(g)``: code that an autograd node runs in its
    backward (a probe of what lowprec sees there)."""
    return _RunsInBackward.apply(t, fn)
