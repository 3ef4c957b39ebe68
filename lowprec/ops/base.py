"""The ops machinery: ``BasicOperation``, ``Sequential`` and how a run is planned.

An op is an ``nn.Module`` that also knows how to run as one step of a
:class:`Sequential`. At forward, a ``Sequential`` flattens its ops into
*basic parts* (``ops.Linear`` is two: its GEMM and its bias), groups them
into *pieces* (a fused piece where a registered pattern matches, one part
otherwise) and runs the pieces in order. Each piece gets a
:class:`RunContext` that tells it about its neighbours:

* ``prep``: the quantizers of the GEMM the piece starts with (fetched once);
* ``emit``: when the next piece starts with a ``BasicLinear`` under
  autocast, the quantizer and usages with which that linear would quantize
  its input; a norm, bias or activation then emits its output already
  quantized and the linear consumes it as is (``quantize_operand`` never
  re-quantizes a quantized tensor). The gradient flows back as a plain
  tensor;
* ``next_usages``: the usages the next linear needs of its input (the
  ``Quantize`` op quantizes with those);
* ``prev_takes_quantized_grad``: whether the previous piece's backward
  consumes a quantized gradient as is (a ``Quantize`` op with
  ``backward=True`` then hands it the quantized gradient, else its values).

Fusion patterns are registered with :func:`register_fusion`
(``lowprec.ops.fused`` registers the built-in ones).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Optional

import torch
from torch import nn

from ..compile import CompiledCallMixin, compiled_as_one_op
from ..formats import QuantizedTensor, Quantizer, rows_fit
from ..recipe import check_num_quantizers
from .traced import traced_run


# ---- quantized hand-over --------------------------------------------------------------------
@dataclass
class EmitSpec:
    """Quantize a tensor with ``quantizer`` for exactly the usages a consumer needs."""

    quantizer: Quantizer
    rowwise: bool
    columnwise: bool

    def fits(self, t: torch.Tensor) -> bool:
        """Whether ``t``'s token count fills the quantizer's blocks along M; where it does
        not, ``t`` is handed over in high precision and the consumer pads it
        (``lowprec.linear.plan.row_padding``)."""
        return rows_fit(self.quantizer, t, rowwise=self.rowwise, columnwise=self.columnwise)

    def quantize(self, t: torch.Tensor) -> torch.Tensor:
        if not self.fits(t):
            return t
        self.quantizer.set_usage(rowwise=self.rowwise, columnwise=self.columnwise)
        return self.quantizer.quantize(t)


def plain(t: torch.Tensor | None) -> torch.Tensor | None:
    """High-precision values of ``t`` (the rowwise representation of a quantized tensor,
    the columnwise one when only that is held). Not differentiable: for gradients."""
    if isinstance(t, QuantizedTensor):
        return t.dequantize(usage="rowwise" if t.has_usage("rowwise") else "columnwise")
    return t


class _Dequantize(torch.autograd.Function):
    """Quantized tensor -> its values; the gradient passes straight through."""

    @staticmethod
    def forward(ctx, x):
        return plain(x)

    @staticmethod
    def backward(ctx, g):
        return plain(g)


def as_plain(x: torch.Tensor) -> torch.Tensor:
    """The input of an op that computes in high precision (differentiable)."""
    return _Dequantize.apply(x) if isinstance(x, QuantizedTensor) else x


class _EmitQuantized(torch.autograd.Function):
    """Quantize an op's output for the next GEMM; the gradient passes through as a plain
    tensor (the GEMM's dgrad)."""

    @staticmethod
    def forward(ctx, h, spec: EmitSpec):
        return spec.quantize(h)

    @staticmethod
    def backward(ctx, g):
        return plain(g), None


def emit_output(h: torch.Tensor, ctx: "RunContext") -> torch.Tensor:
    """``h``, quantized for the next linear when the run asks for it."""
    return _EmitQuantized.apply(h, ctx.emit) if ctx.emit is not None and ctx.emit.fits(h) else h


# ---- ops ----------------------------------------------------------------------------------
@dataclass
class RunContext:
    """What a piece knows about its place in the run (see the module docstring)."""

    prep: Optional[tuple] = None
    emit: Optional[EmitSpec] = None
    next_usages: Optional[tuple] = None
    next_kind: Optional[str] = None
    prev_takes_quantized_grad: bool = False
    intermediate: bool = False


class BasicOperation(CompiledCallMixin, nn.Module):
    """Base of every op.

    Class attributes a subclass sets:

    * ``op_kind``: what fusion patterns match on (``linear``, ``bias``,
      ``activation``, ``norm``, ``quantize``, ``grouped_linear``);
    * ``num_extra_inputs``: extra forward arguments it takes from
      ``Sequential.forward(x, *extra_inputs)`` (``GroupedLinear``: m_splits);
    * ``can_emit``: it can hand a following linear an already quantized input;
    * ``takes_quantized_grad``: its backward consumes a quantized gradient as is.

    A subclass implements ``op_forward(x, extra_inputs, ctx)``.
    """

    op_kind = "op"
    num_extra_inputs = 0
    can_emit = False
    takes_quantized_grad = False

    def basic_parts(self) -> list:
        """The basic parts this op contributes to a run."""
        return [self]

    def get_quantizer_roles(self, *, fwd: bool, num_quantizers: int | None = None) -> list:
        """Roles of this op's quantizer slots (none for an op without quantizers)."""
        return check_num_quantizers(self, fwd, num_quantizers, [])

    def op_forward(self, x: torch.Tensor, extra_inputs: list, ctx: RunContext) -> torch.Tensor:
        raise NotImplementedError

    def reset_parameters(self) -> None:
        """Draw the op's parameters again (meta-device init: ``to_empty``, then this).
        Nothing for an op without parameters; ops with parameters override it."""

    def output_shape(self, shape: tuple) -> tuple:
        """The shape of this op's output for an input of ``shape``."""
        return shape

    def compiled_output_shapes(self, x: torch.Tensor, *extra_inputs) -> list[tuple]:
        return [output_shape_of(self.basic_parts(), tuple(x.shape))]

    def traced_forward(self, x: torch.Tensor, *extra_inputs):
        """The call as torch.compile traces it (``lowprec.ops.traced``), or the reason (a
        string) it stays one opaque op."""
        parts = self.basic_parts()
        return traced_run(parts, plan(parts, True), x, extra_inputs, fuse=True)

    @compiled_as_one_op
    def forward(self, x: torch.Tensor, *extra_inputs) -> torch.Tensor:
        return run_parts(self.basic_parts(), x, extra_inputs, fuse=True)


# ---- pieces and plans ------------------------------------------------------------------------
class Piece:
    """One step of a run: one basic part, or (subclasses) a fused group of parts."""

    #: how a compiled run traces the piece (``lowprec.ops.traced``): ``"op"`` (one part),
    #: ``"linear"`` (linear, bias, activation), ``"bias_act"``; None: it does not
    graph_kind = None

    def __init__(self, *parts) -> None:
        self.parts = tuple(parts)

    @property
    def name(self) -> str:
        return type(self).__name__

    @property
    def leading_linear(self):
        first = self.parts[0]
        return first if first.op_kind == "linear" else None

    @property
    def num_extra_inputs(self) -> int:
        return sum(p.num_extra_inputs for p in self.parts)

    @property
    def can_emit(self) -> bool:
        return self.parts[-1].can_emit

    @property
    def takes_quantized_grad(self) -> bool:
        return self.parts[-1].takes_quantized_grad

    def run(self, x: torch.Tensor, extra_inputs: list, ctx: RunContext) -> torch.Tensor:
        (part,) = self.parts
        return part.op_forward(x, extra_inputs, ctx)

    def __repr__(self) -> str:
        return f"{self.name}({', '.join(part_name(p) for p in self.parts)})"


def part_name(part) -> str:
    return getattr(part, "part_name", type(part).__name__)


class OpPiece(Piece):
    """A single basic part, run on its own."""

    graph_kind = "op"

    @property
    def name(self) -> str:
        return part_name(self.parts[0])


#: Fusion matchers, tried in order at each position: ``match(parts, i) -> Piece | None``.
FUSIONS: list[Callable] = []


def register_fusion(match: Callable) -> Callable:
    """Register a pattern matcher (a decorator); later ones are tried after earlier ones."""
    if match not in FUSIONS:
        FUSIONS.append(match)
    return match


def plan(parts: list, fuse: bool = True) -> list[Piece]:
    """Group ``parts`` into pieces: the first matching fusion at each position, else one part."""
    pieces, i = [], 0
    while i < len(parts):
        piece = None
        if fuse:
            for match in FUSIONS:
                piece = match(parts, i)
                if piece is not None:
                    break
        if piece is None:
            piece = OpPiece(parts[i])
        pieces.append(piece)
        i += len(piece.parts)
    return pieces


def run_parts(parts: list, x: torch.Tensor, extra_inputs: Iterable, *, fuse: bool) -> torch.Tensor:
    """Run ``parts`` on ``x``; each part takes its extra inputs in order."""
    extra_inputs = list(extra_inputs)
    need = sum(p.num_extra_inputs for p in parts)
    if len(extra_inputs) != need:
        takers = [type(p).__name__ for p in parts if p.num_extra_inputs]
        raise ValueError(f"expected {need} extra input(s) after x (for {takers or 'no op'}), "
                         f"got {len(extra_inputs)}")
    pieces = plan(parts, fuse)
    preps: dict[int, tuple] = {}

    def prep_of(k: int) -> tuple:
        # One gemm_quantizers() call per linear and forward: it registers delayed-scaling
        # state and makes the backward callback.
        if k not in preps:
            preps[k] = pieces[k].leading_linear.prepare(x.device)
        return preps[k]

    extra = iter(extra_inputs)
    caller_x = x
    for k, piece in enumerate(pieces):
        # Only a tensor this run made may lose data after its use: a piece may pass the
        # caller's own (quantized) input through unchanged.
        ctx = RunContext(intermediate=k > 0 and x is not caller_x)
        if piece.leading_linear is not None:
            ctx.prep = prep_of(k)
        if k > 0:
            ctx.prev_takes_quantized_grad = pieces[k - 1].takes_quantized_grad
        if k + 1 < len(pieces):
            nxt = pieces[k + 1]
            ctx.next_kind = nxt.parts[0].op_kind
            if nxt.leading_linear is not None and (piece.can_emit or
                                                   piece.parts[-1].op_kind == "quantize"):
                linear, nprep = nxt.leading_linear, prep_of(k + 1)
                ctx.next_usages = linear.input_usages(nprep)
                if fuse and piece.can_emit:
                    ctx.emit = linear.input_emit_spec(nprep)
        x = piece.run(x, [next(extra) for _ in range(piece.num_extra_inputs)], ctx)
    return x


# ---- Sequential ------------------------------------------------------------------------------
def output_shape_of(parts: list, shape: tuple) -> tuple:
    """The output shape of running ``parts`` on an input of ``shape``."""
    for part in parts:
        shape = part.output_shape(shape)
    return shape


class Sequential(CompiledCallMixin, nn.Module):
    """Ops in order: ``forward(x, *extra_inputs)``.

    ``Sequential(*ops, fuse=True)``; ops may be any lowprec op (``Linear``
    counts as ``BasicLinear`` + ``Bias``) or another ``Sequential`` (whose
    ops join this one's run: the outermost ``fuse`` applies). Ops
    that take extra inputs (``GroupedLinear``'s ``m_splits``) take them from
    ``extra_inputs`` in order. With ``fuse=True`` matching patterns run as
    fused pieces and norms/biases/activations hand a following linear its
    input already quantized; ``fuse=False`` runs every op on its own (the
    reference the fused path is tested against).
    """

    def __init__(self, *ops: nn.Module, fuse: bool = True) -> None:
        super().__init__()
        self.fuse = bool(fuse)
        for op in ops:
            self.append(op)

    def append(self, op: nn.Module) -> "Sequential":
        if not isinstance(op, (BasicOperation, Sequential)):
            raise TypeError(f"Sequential takes lowprec ops (lowprec.ops.*) or Sequentials, got "
                            f"{type(op).__name__}")
        self.add_module(str(len(self._modules)), op)
        return self

    def __len__(self) -> int:
        return len(self._modules)

    def __iter__(self):
        return iter(self._modules.values())

    def __getitem__(self, idx):
        ops = list(self._modules.values())
        if isinstance(idx, slice):
            return Sequential(*ops[idx], fuse=self.fuse)
        return ops[idx]

    def basic_parts(self) -> list:
        return [part for op in self for part in op.basic_parts()]

    def reset_parameters(self) -> None:
        """Nothing: a Sequential holds no parameters of its own. As with torch's modules,
        each module resets its own (``for m in model.modules(): m.reset_parameters()``),
        so a Sequential that reset its ops would draw theirs twice."""

    def get_quantizer_roles(self, *, fwd: bool, num_quantizers: int | None = None) -> list:
        """Every op's roles, in op order."""
        roles = [r for op in self for r in op.get_quantizer_roles(fwd=fwd)]
        return check_num_quantizers(self, fwd, num_quantizers, roles)

    def fusion_plan(self) -> list[tuple[str, tuple[str, ...]]]:
        """(piece name, part class names) of each step a forward runs; for inspection."""
        return [(p.name, tuple(part_name(q) for q in p.parts))
                for p in plan(self.basic_parts(), self.fuse)]

    def compiled_output_shapes(self, x: torch.Tensor, *extra_inputs) -> list[tuple]:
        return [output_shape_of(self.basic_parts(), tuple(x.shape))]

    def traced_forward(self, x: torch.Tensor, *extra_inputs):
        """The call as torch.compile traces it (``lowprec.ops.traced``), or the reason (a
        string) it stays one opaque op."""
        parts = self.basic_parts()
        return traced_run(parts, plan(parts, self.fuse), x, extra_inputs, fuse=self.fuse)

    @compiled_as_one_op
    def forward(self, x: torch.Tensor, *extra_inputs) -> torch.Tensor:
        return run_parts(self.basic_parts(), x, extra_inputs, fuse=self.fuse)

    def extra_repr(self) -> str:
        return f"fuse={self.fuse}"
