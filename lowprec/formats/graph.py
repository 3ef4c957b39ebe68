"""Quantizers as ``torch.compile`` traces them: each format's *graph operand*.

``Quantizer.graph_operand(t)`` gives the form of a quantizer that a compiled linear
traces into its graph (``lowprec.linear.traced``): torch ops and lowprec's custom ops that
compute, from a 2-D high-precision tensor, what eager's GEMMs read of that quantizer's
quantized tensor, bit for bit. Each format writes its own in its folder
(``formats/<format>/graph.py``); this module holds what they share: the forms a GEMM
operand takes in a graph (:class:`Fp8`, :class:`Blocks`, :class:`Exact`, :class:`Plain`),
the protocol (:class:`GraphOperand`), the identity and hybrid operands, and the bf16
rounding that a fusing compiler cannot elide.

A GEMM reads ``mat(t, usage)`` (``lowprec.gemm``): rowwise, the (M, K) matrix scaled
along K; columnwise, the (K, M) matrix of ``t.T`` scaled along M. An operand makes
either, and tells what the backward must keep to make the columnwise one later
(``save_columnwise`` / ``saved_columnwise``): the tensor itself by default (a quantize
is a function of its input, so making it again gives the forward's values, and the
compiler may recompute the input from what its neighbours keep anyway).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch

from ..kernels import graph_op
from .rht import rht_inverse_


# ---- bf16 rounding a fusing compiler cannot elide -------------------------------------------
def bf16_rne_bits(bits: torch.Tensor) -> torch.Tensor:
    """fp32 bits (int32) rounded to nearest even at bf16 precision, still 32 bits wide
    (NaN stays NaN: eager's bf16 NaNs keep high mantissa bits, and inductor's are
    canonical)."""
    return bits + (0x7FFF + ((bits >> 16) & 1))


def rounded(t: torch.Tensor) -> torch.Tensor:
    """``t`` in fp32, rounded to bf16 precision in integer arithmetic: for a bf16 tensor
    its exact value. A compiler that fuses the op producing ``t`` computes it in fp32 and
    hands on the unrounded value (inductor elides the bf16 round trip between fused ops);
    this rounds it as eager's bf16 tensor is rounded, in whatever kernel it lands. fp32
    passes through."""
    if t.dtype == torch.float32:
        return t
    if t.dtype == torch.bfloat16:
        # the bf16 bits widened: a bitcast the compiler must apply to the rounded value
        return (t.view(torch.int16).to(torch.int32) << 16).view(torch.float32)
    return (bf16_rne_bits(t.to(torch.float32).view(torch.int32)) & -65536).view(torch.float32)


def largest_magnitude(t2d: torch.Tensor) -> torch.Tensor:
    """amax(|t2d|) in ``t2d``'s dtype (0-d), reduced over each row first. A max is the same
    in any order; reduced by rows, the first pass runs over the tensor's own rows, and
    inductor fuses a pass over the same tensor (a cast that need not wait for this amax,
    delayed scaling's) into it, so the tensor is read once. A whole-tensor reduction is
    split into chunks no other pass shares, and the cast reads the tensor again."""
    return t2d.abs().amax(dim=-1).amax()


def rounded_amax(t2d: torch.Tensor) -> torch.Tensor:
    """amax(|t2d|) of ``t2d``'s bf16-rounded values (1-element fp32), as eager's amax of the
    bf16 tensor. Rounding to nearest is monotonic and symmetric, so the largest rounded
    magnitude is the rounded largest magnitude: the rounding is applied to the one result,
    and the reduction reads the producer's expression alone, which inductor then fuses
    with its neighbours' reductions instead of writing the rounded magnitudes first."""
    return rounded(largest_magnitude(t2d)).reshape(1)


def decode_scale(scale: torch.Tensor) -> torch.Tensor:
    """``1 / scale`` in fp32, correctly rounded (``torch.reciprocal``'s result in eager):
    in fp64, for the reason ``casting.scale_from_amax`` gives."""
    return torch.reciprocal(scale.to(torch.float64)).to(torch.float32)


def as_output(out_fp32: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``out_fp32.to(dtype)`` whose bf16 rounding a fused consumer cannot elide: the bf16
    values are made from their bits, so any kernel the compiler fuses this into reads the
    rounded numbers eager's consumer reads."""
    if dtype != torch.bfloat16:
        return out_fp32.to(dtype)
    half = bf16_rne_bits(out_fp32.view(torch.int32)) >> 16
    return half.to(torch.int16).view(torch.bfloat16)


# ---- the forms of a GEMM operand in a graph --------------------------------------------------
class Fp8(NamedTuple):
    """Per-tensor FP8: ``data`` (R, C) contiguous, ``scale`` its 1-element encode scale;
    ``decode``: ``1 / scale`` (0-d) where eager's quantize kernel wrote it beside the scale
    (an eager call), else None (the GEMM computes it)."""

    data: torch.Tensor
    scale: torch.Tensor
    decode: Optional[torch.Tensor] = None


class Blocks(NamedTuple):
    """Block-scaled FP8: ``data`` (R, C), encode ``scale`` per 1x128 (``dim`` 1) or
    128x128 (``dim`` 2) block along C; ``decode``: ``1 / scale`` in cuBLAS's layout where
    eager's quantize kernel wrote it (an eager call; 1x128: (C/128, R) contiguous, 128x128:
    the scale's shape), else None (the GEMM computes it)."""

    data: torch.Tensor
    scale: torch.Tensor
    dim: int
    decode: Optional[torch.Tensor] = None


class Exact(NamedTuple):
    """Values exact in bf16 (MXFP8, NVFP4): bf16 ``values`` (R, C) times ``1 / divisor``
    (fp32, or None) where eager's kernels make them, in the transform's domain where
    ``rht``; elsewhere the fp32 values eager's emulation multiplies (no divisor, the
    original domain)."""

    values: torch.Tensor
    divisor: Optional[torch.Tensor] = None
    rht: bool = False


class Plain(NamedTuple):
    """High-precision values (an identity quantizer, or no quantizer): the (R, C) matrix,
    perhaps a transposed view, as eager's GEMMs read an IdentityTensor."""

    values: torch.Tensor


class Kind(NamedTuple):
    """What a direction of an operand becomes, known before tracing (the traced GEMM
    table checks each pair with it): ``name`` one of ``"fp8"``, ``"blocks"``, ``"exact"``,
    ``"plain"``; the fp8 dtype, the block dim, whether values carry a transform or a
    divisor (``"exact"``), or the values' dtype (``"plain"``); ``bf16``: whether
    ``"exact"`` values are exact in bf16 as the form makes them (not the reference's fp32
    NVFP4 values, whose global scale is applied)."""

    name: str
    fp8_dtype: Optional[torch.dtype] = None
    dim: int = 0
    rht: bool = False
    divisor: bool = False
    dtype: Optional[torch.dtype] = None
    pow2: bool = True
    bf16: bool = True


@graph_op("dequantized_values")
def dequantized_values(data: torch.Tensor, divisor: Optional[torch.Tensor],
                       dtype: torch.dtype) -> torch.Tensor:
    """``data / divisor`` in fp32 rounded once to ``dtype``: a dequantize as eager computes
    it (IEEE fp32 division, which inductor's GPU code would approximate)."""
    values = data.to(torch.float32)
    return (values if divisor is None else values / divisor).to(dtype)


@torch.library.register_fake("lowprec::dequantized_values")
def _dequantized_values_fake(data, divisor, dtype):
    return data.new_empty(data.shape, dtype=dtype)


@graph_op("rht_restored_values")
def rht_restored_values(data: torch.Tensor, divisor: Optional[torch.Tensor],
                        dtype: torch.dtype) -> torch.Tensor:
    """The original-domain values of Hadamard-transformed ``data / divisor`` (its rows run
    along the transform's tiles): the fp32 dequantize and inverse transform eager's fp32
    emulation multiplies (``NVFP4Tensor._dequantize_2d``), rounded once to ``dtype``. One
    op the compiler keeps whole: inductor's GPU code would approximate the division."""
    values = data.to(torch.float32)
    values = values / divisor if divisor is not None else values.clone()
    return rht_inverse_(values).to(dtype)


@torch.library.register_fake("lowprec::rht_restored_values")
def _rht_restored_values_fake(data, divisor, dtype):
    return data.new_empty(data.shape, dtype=dtype)


@graph_op("transposed_in_backward")
def transposed_in_backward(t: torch.Tensor, grad: torch.Tensor, rows: int) -> torch.Tensor:
    """A contiguous copy of the transpose of the contiguous ``t`` read as ``rows`` rows,
    made in the backward. ``t`` is a buffer the forward kept whose contents the backward's
    own FSDP2 gather replaces (a quantized weight's columnwise data, which travels
    transposed, perhaps in another shape of as many elements): read in the forward, it
    would hold the forward's rowwise data. ``grad`` (the backward's incoming gradient) is
    read by no one but the compiler's partitioner, for which an op depending on it runs
    in the backward."""
    return t.view(rows, -1).t().clone(memory_format=torch.contiguous_format)


@torch.library.register_fake("lowprec::transposed_in_backward")
def _transposed_in_backward_fake(t, grad, rows):
    return t.new_empty((t.numel() // rows, rows))


def gathered_columnwise(data: torch.Tensor, scale: torch.Tensor, grad: torch.Tensor,
                        packing: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(columnwise codes, columnwise scales) of an (N, K) weight that the backward's
    gather brought into the kept rowwise buffers ``data`` and ``scale``, read in the
    backward (:func:`transposed_in_backward`). They travel transposed: codes in N /
    ``packing`` rows (elements a byte), scales in N / ``block`` rows (the columnwise
    blocks run along N)."""
    n = data.shape[0]
    return (transposed_in_backward(data, grad, n // packing),
            transposed_in_backward(scale, grad, n // block))


class GraphOperand:
    """A quantizer's traced form (see the module docstring). Subclasses, frozen dataclasses
    of the quantizer's settings, implement :meth:`rowwise`, :meth:`columnwise` and
    :meth:`kind`; the others have defaults that a format overrides where one pass makes
    more than one thing."""

    #: whether a sliced backward (``grad_split``) may quantize dY slice by slice: the
    #: slices' blocks are the whole tensor's (no statistic spans slices)
    sliceable = False
    #: whether this form reads a tensor that arrives quantized (a gathered weight) as it is
    given = False
    #: whether its quantize reads and records into state the module keeps (delayed
    #: scaling's scales and amaxes), which the traced linear takes as inputs
    reads_state = False
    #: whether an eager call whose input and weight take this form runs the plan
    #: (``lowprec.linear.eager_plan.eager_plan``; dY's form need only launch eagerly): per-tensor
    #: current and delayed scaling, block FP8, MXFP8 and NVFP4 with their kernels, and
    #: hybrids whose rowwise half is one of them. On the "1b" model each is faster than the eager
    #: Function, at no more memory except a hybrid whose columnwise half re-quantizes the
    #: kept input in backward (mxfp8_fwd_nvfp4_bwd: 13.45 GiB against 12.89, bf16's peak
    #: being 13.42)
    eager = False
    #: whether this form's ops run outside a graph (eager's kernels, launched directly)
    launches_eagerly = False

    def kind(self, usage: str) -> Kind:
        raise NotImplementedError

    def rowwise(self, t: torch.Tensor):
        """``mat(t, "rowwise")`` of the 2-D ``t`` as a graph form."""
        raise NotImplementedError

    def columnwise(self, t: torch.Tensor):
        """``mat(t, "columnwise")``: the (C, R) matrix of ``t.T``, scaled along R."""
        raise NotImplementedError

    def save_columnwise(self, t: torch.Tensor, after: tuple = ()) -> tuple:
        """What the backward keeps to make :meth:`columnwise` of ``t``. ``after``: as for
        :meth:`forward`."""
        return (t,)

    def saved_columnwise(self, saved: tuple, grad: torch.Tensor | None = None):
        """:meth:`columnwise` from what the forward kept. ``grad``: the backward's incoming
        gradient, which a form whose kept buffers hold the columnwise data only once the
        backward has begun (a weight FSDP2 gathers again for the backward, in its other
        direction: ``formats.COLUMNWISE_IN_BACKWARD_ATTR``) hands to
        :func:`transposed_in_backward`."""
        return self.columnwise(saved[0])

    def forward(self, t: torch.Tensor, keep: bool, held: bool = False,
                after: tuple = ()) -> tuple:
        """(rowwise form, what :meth:`saved_columnwise` reads, or () without ``keep``).
        ``held``: ``t`` lives on anyway (a parameter), so keeping it costs no memory.
        ``after``: tensors made by the forms that eager quantizes before this one in the
        same call (the input's, for the weight); this operand's random draws take them as
        inputs, so that a compiled graph draws in eager's order however its scheduler
        orders the ops (``nvfp4.compiled.keys``)."""
        return self.rowwise(t), (self.save_columnwise(t) if keep else ())

    def grad(self, t: torch.Tensor, row: bool, col: bool) -> tuple:
        """(rowwise form or None, columnwise form or None) of a gradient, rowwise first
        (the order eager quantizes, and draws random keys, in)."""
        return (self.rowwise(t) if row else None), (self.columnwise(t) if col else None)

    def half(self, usage: str) -> "GraphOperand":
        """The form that makes direction ``usage`` (itself, but for a hybrid)."""
        return self

    def dequantized(self, rep, dtype: torch.dtype, usage: str = "rowwise") -> torch.Tensor:
        """The values of a form of this operand in ``dtype`` (fp32: what eager's fp32
        emulation multiplies), as ``QuantizedTensor.dequantize`` gives them."""
        if isinstance(rep, Plain):
            return rep.values.to(dtype)
        if isinstance(rep, Exact):
            if rep.rht:  # one-sided: the emulation multiplies the original domain
                return rht_restored_values(rep.values, rep.divisor, dtype)
            if rep.divisor is None:
                return rep.values.to(dtype)
            return dequantized_values(rep.values, rep.divisor, dtype)
        return dequantized_values(rep.data, rep.scale, dtype)  # per-tensor FP8


def _form_tensors(form) -> tuple:
    """The tensors in a graph form, or in a tuple of forms and tensors (what a forward
    keeps), in order."""
    if isinstance(form, torch.Tensor):
        return (form,)
    if isinstance(form, tuple):  # the forms are named tuples
        return tuple(t for part in form for t in _form_tensors(part))
    return ()


def drawn_after(forms, after: tuple = ()) -> tuple:
    """``after`` and the tensors of ``forms`` (forms made before an operand's in the same
    call), for that operand's random draws to follow in a graph (:meth:`GraphOperand.forward`).
    An eager call draws in program order: ``after`` as it is, no host time spent."""
    if not torch.compiler.is_compiling():
        return after
    return (*after, *_form_tensors(forms))


def scale_in_use(scale: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    """A delayed-scaling state's ``scale``, NaN where the matching ``amax`` is not finite
    (plain torch ops, fused into the amax pass)."""
    return torch.where(torch.isfinite(amax), scale, float("nan"))


#: kinds made once (a ``Kind`` built while dynamo traces costs it milliseconds, and every
#: traced linear asks for six; a constant read costs next to nothing)
_PLAIN_KINDS = {dt: Kind("plain", dtype=dt)
                for dt in (torch.bfloat16, torch.float16, torch.float32, torch.float64)}


def plain_kind(dtype: torch.dtype) -> Kind:
    """The kind of plain values of ``dtype`` (a traced identity form, an eager plain or
    identity tensor)."""
    got = _PLAIN_KINDS.get(dtype)
    return got if got is not None else Kind("plain", dtype=dtype)


@dataclass(frozen=True)
class PlainOperand(GraphOperand):
    """An identity quantizer, or a slot with none: the values in ``dtype`` (the one the
    identity quantizer casts to, else the tensor's own)."""

    dtype: torch.dtype
    sliceable = True

    def kind(self, usage: str) -> Kind:
        return plain_kind(self.dtype)

    def _values(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(self.dtype)

    def rowwise(self, t):
        return Plain(self._values(t))

    def columnwise(self, t):
        return Plain(self._values(t).t())


@dataclass(frozen=True)
class HybridOperand(GraphOperand):
    """One format per direction: the rowwise form from ``row``, the columnwise one from
    ``col`` (``HybridQuantizer``)."""

    row: GraphOperand
    col: GraphOperand

    @property
    def sliceable(self) -> bool:
        return self.row.sliceable and self.col.sliceable

    @property
    def eager(self) -> bool:
        # the forward's quantize (the rowwise half) decides: its host time is what an
        # eager step exposes; the columnwise half runs in the backward
        return self.row.eager and self.col.launches_eagerly

    @property
    def launches_eagerly(self) -> bool:
        # a gradient's quantize: each half quantizes on its own (``grad``)
        return self.row.launches_eagerly and self.col.launches_eagerly

    def kind(self, usage: str) -> Kind:
        return self.half(usage).kind(usage)

    def half(self, usage: str) -> GraphOperand:
        return self.row if usage == "rowwise" else self.col

    def rowwise(self, t):
        return self.row.rowwise(t)

    def columnwise(self, t):
        return self.col.columnwise(t)

    def save_columnwise(self, t, after=()):
        return self.col.save_columnwise(t, after)

    def forward(self, t, keep, held=False, after=()):
        # eager's hybrid quantizes (and draws) rowwise first, then columnwise
        row, _ = self.row.forward(t, False, held, after)
        if not keep:
            return row, ()
        return row, self.col.save_columnwise(t, drawn_after(row, after))

    def saved_columnwise(self, saved, grad=None):
        return self.col.saved_columnwise(saved, grad)

    def dequantized(self, rep, dtype, usage="rowwise"):
        return self.half(usage).dequantized(rep, dtype, usage)

    def grad(self, t, row, col):
        # each half quantizes (and draws) on its own, rowwise first, as eager's hybrid does
        return (self.row.grad(t, True, False)[0] if row else None,
                self.col.grad(t, False, True)[1] if col else None)
