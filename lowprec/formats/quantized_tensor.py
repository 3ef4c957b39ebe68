"""QuantizedTensor: the base class of every format's quantized tensor, with the table of
``__torch_dispatch__`` handlers (the few aten ops a quantized tensor supports) and its
pickling (``torch.save``/``torch.load``, deepcopy).

See ``lowprec.formats.base`` for the storage convention; the rest of lowprec imports these
names from there.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import threading
from typing import Any, Callable, ClassVar

import torch
import torch.utils._pytree as pytree

from .checks import HIGH_PRECISION_DTYPES, USAGES, check_usage, flatten_2d
from .graph import Kind

_EMULATED = Kind("emulated")

aten = torch.ops.aten


class QuantizedTensor(torch.Tensor):
    """A quantized tensor that poses as its high-precision original.

    Subclasses declare their inner tensors once in ``_inner`` (each may be
    ``None`` when a direction is not held) and their plain metadata in
    ``_meta``; flattening for torch.compile, pickling, deepcopy and the op
    handlers are all derived from those two tuples. Inner tensor names start
    with ``rowwise_`` or ``columnwise_`` (a direction's data and scales) or
    ``shared_`` (used by both directions).
    """

    _inner: ClassVar[tuple[str, ...]] = ()
    _meta: ClassVar[tuple[str, ...]] = ()
    #: Optional private values a quantize computes beside the inner tensors (a decode
    #: scale), kept while this object lives but never flattened, pickled or copied; whoever
    #: reads one checks it still matches the inner tensors (through torch's version
    #: counter: writes that bypass it, such as ``t.data.copy_()`` or a raw kernel writing
    #: an inner tensor in place, must drop the record, i.e. set the name to None).
    _derived: ClassVar[tuple[str, ...]] = ()
    #: Elements a column of a direction's stored data holds (two 4-bit codes a byte: 2).
    _packing: ClassVar[int] = 1

    @staticmethod
    def __new__(cls, shape, dtype, *, requires_grad: bool = False, **fields):
        device = None
        for name in cls._inner:
            t = fields.get(name)
            if t is not None:
                device = t.device
                break
        if device is None:
            raise ValueError(f"{cls.__name__} needs at least one inner tensor")
        self = torch.Tensor._make_wrapper_subclass(
            cls, tuple(shape), dtype=dtype, device=device, requires_grad=requires_grad
        )
        for name in cls._inner:
            setattr(self, name, fields.pop(name, None))
        for name in cls._meta:
            setattr(self, name, fields.pop(name))
        for name in cls._derived:
            setattr(self, name, fields.pop(name, None))
        if fields:
            raise TypeError(f"{cls.__name__} got unknown fields {sorted(fields)}")
        return self

    __torch_function__ = torch._C._disabled_torch_function_impl

    # ---- derived records (see ``_derived``) ----------------------------------------------
    @staticmethod
    def derived_record(source: torch.Tensor, value: torch.Tensor):
        """A ``_derived`` record of ``value`` computed from ``source``, or None where it could
        not be checked later: inference tensors have no version counter, and under
        ``torch.compile`` the records are never read."""
        if torch.compiler.is_compiling() or source.is_inference():
            return None
        return (source, source._version, value)

    def _read_derived(self, name: str, source: torch.Tensor) -> torch.Tensor | None:
        """The value of record ``name`` if it was made from ``source`` (the same tensor
        object) and ``source`` has not been written since; else None."""
        if torch.compiler.is_compiling():
            return None
        rec = getattr(self, name)
        if rec is not None and rec[0] is source and rec[1] == source._version:
            return rec[2]
        return None

    # ---- what the GEMM table reads (lowprec.gemm.table) ---------------------------------
    def gemm_kind(self, usage: str, read: bool = False) -> Kind | None:
        """What ``mat(self, usage)`` is to the GEMM table (``lowprec.gemm.table.route``):
        the same :class:`~lowprec.formats.Kind` a traced form of the format gives, so an
        eager GEMM and a traced one of the same operands take the same route. None where
        ``usage`` is not held (the fp32 emulation then raises the proper error).
        ``read``: a kind that depends on the values (block FP8's power-of-two scales) may
        be learned by reading them back (a host sync); without it, the kind says only what
        is known without looking. A usage ending in a partial block (:meth:`partial`) is
        ``Kind("emulated")``: only the fp32 emulation multiplies it."""
        if getattr(self, f"{usage}_data") is None:
            return None
        if self.partial(usage):
            return _EMULATED
        return self._gemm_kind(usage, read)

    def _gemm_kind(self, usage: str, read: bool) -> Kind | None:
        return _EMULATED  # formats the tensor cores take say how

    def bf16_operand(self, usage: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(bf16 matrix, fp32 divisor or None)``: ``usage``'s values, in the layout and
        domain it is stored in, are exactly ``matrix / divisor`` (where the table's
        ``bf16_domain`` of :meth:`gemm_kind` says so)."""
        raise TypeError(f"no exact bf16 form for {type(self).__name__}")

    def _exact_bf16_record(self, usage: str) -> torch.Tensor | None:
        """The exact bf16 matrix the quantize kernel wrote beside ``usage``'s data
        (``Quantizer.quantize_for_gemm``), if it is still that data's; else None."""
        name = f"_exact_{usage}"
        if name not in type(self)._derived:
            return None
        return self._read_derived(name, getattr(self, f"{usage}_data"))

    # ---- derived from the declarations -------------------------------------------------
    def inner_tensors(self) -> dict[str, torch.Tensor | None]:
        return {name: getattr(self, name) for name in self._inner}

    def metadata(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self._meta}

    def _rebuild(self, fn: Callable[[torch.Tensor], torch.Tensor], *, shape=None,
                 dtype=None, alias: bool = False) -> "QuantizedTensor":
        """The tensor of ``fn`` applied to each inner tensor. ``alias``: the new inner
        tensors are views of the same storage, of the same shapes (detach, the identity
        ``as_strided``), so what is promised of that storage holds for them too."""
        inner = {n: (None if t is None else fn(t)) for n, t in self.inner_tensors().items()}
        # a record stays where its source is the same tensor in the new one (``fn`` the
        # identity, a reshape of the outer tensor): its value still holds, and a read
        # checks the version. Others are dropped, not to keep the old tensors alive.
        kept = {n: rec for n in self._derived if (rec := getattr(self, n)) is not None
                and any(rec[0] is t for t in inner.values())}
        out = type(self)(self.shape if shape is None else shape,
                         self.dtype if dtype is None else dtype, **inner, **self.metadata(),
                         **kept)
        quantizer = self.__dict__.get(QUANTIZER_ATTR)
        if quantizer is not None:
            setattr(out, QUANTIZER_ATTR, quantizer)
        if alias and COLUMNWISE_IN_BACKWARD_ATTR in self.__dict__:
            # kept as it is, False too: a compiled call guards on the attribute being there
            setattr(out, COLUMNWISE_IN_BACKWARD_ATTR, self.__dict__[COLUMNWISE_IN_BACKWARD_ATTR])
        return out

    def __tensor_flatten__(self):
        names = [n for n in self._inner if getattr(self, n) is not None]
        return names, (self.dtype, tuple(self.metadata().items()))

    @classmethod
    def __tensor_unflatten__(cls, inner_tensors, ctx, outer_size, outer_stride):
        dtype, meta = ctx
        return cls(outer_size, dtype, **inner_tensors, **dict(meta))

    def __reduce_ex__(self, protocol):
        # Plain pickle cannot reload fp8 storages (torch bug), so fp8 inner tensors travel
        # as uint8 views with their dtype beside them.
        inner, views = {}, {}
        for name, t in self.inner_tensors().items():
            if t is not None and t.dtype.itemsize == 1 and t.dtype.is_floating_point:
                inner[name], views[name] = t.view(torch.uint8), t.dtype
            else:
                inner[name] = t
        return (_rebuild_quantized_tensor,
                (type(self), tuple(self.shape), self.dtype, self.requires_grad, inner,
                 self.metadata(), views, _is_parameter(self),
                 getattr(self, REQUANTIZE_ATTR, None)))

    def __deepcopy__(self, memo):
        inner = {n: copy.deepcopy(t, memo) for n, t in self.inner_tensors().items()}
        out = type(self)(self.shape, self.dtype, requires_grad=self.requires_grad,
                         **inner, **copy.deepcopy(self.metadata(), memo))
        if _is_parameter(self):
            out = torch.nn.Parameter(out, requires_grad=self.requires_grad)
        link = getattr(self, REQUANTIZE_ATTR, None)
        if link is not None:  # deep-copied with its module: the copy's link is to the copy
            setattr(out, REQUANTIZE_ATTR, copy.deepcopy(link, memo))
        memo[id(self)] = out
        return out

    def form(self) -> str:
        """This tensor's form by name (a hybrid's names each half's; see
        ``Quantizer.tensor_form``)."""
        return type(self).__name__

    def __repr__(self, *, tensor_contents=None):
        meta = ", ".join(f"{k}={v}" for k, v in self.metadata().items())
        return (f"{type(self).__name__}(shape={tuple(self.shape)}, dtype={self.dtype}, "
                f"device={self.device}, rowwise={self.has_usage('rowwise')}, "
                f"columnwise={self.has_usage('columnwise')}{', ' + meta if meta else ''})")

    # ---- usages ---------------------------------------------------------------------------
    def has_usage(self, usage: str) -> bool:
        return getattr(self, f"{check_usage(usage)}_data") is not None

    @property
    def shape_2d(self) -> tuple[int, int]:
        return flatten_2d(self.shape)

    def update_usage(self, rowwise_usage: bool | None = None,
                     columnwise_usage: bool | None = None) -> "QuantizedTensor":
        """Drop a direction (False) or add one (True) where it derives from what is held.

        Adding a direction that cannot be derived (it needs the original
        high-precision values) raises. Returns ``self``.
        """
        wanted = {"rowwise": rowwise_usage, "columnwise": columnwise_usage}
        for usage, want in wanted.items():
            if want is not None and not isinstance(want, bool):
                raise TypeError(f"update_usage: {usage}_usage must be True, False or None, "
                                f"got {want!r}")
        for usage, want in wanted.items():
            if want and not self.has_usage(usage):
                other = "columnwise" if usage == "rowwise" else "rowwise"
                if not self.has_usage(other):
                    raise RuntimeError(f"{type(self).__name__} holds no data to derive "
                                       f"{usage} from")
                for name, t in self._derive(usage).items():
                    setattr(self, name, t)
        if all(w is False or (w is None and not self.has_usage(u)) for u, w in wanted.items()):
            raise ValueError("update_usage would leave the tensor with no data; keep one usage")
        for usage, want in wanted.items():
            if want is False:
                for name in self._inner + self._derived:
                    # a record of one direction (``_decode_rowwise``) goes with it
                    if name.startswith(usage + "_") or name.endswith("_" + usage):
                        setattr(self, name, None)
        return self

    def held_bytes(self) -> int:
        """Bytes this tensor holds: its inner tensors and the exact bf16 records beside them."""
        parts = [v for v in self.inner_tensors().values() if v is not None]
        parts += [getattr(self, n)[2] for n in self._derived
                  if n.startswith("_exact_") and getattr(self, n) is not None]
        return sum(p.numel() * p.element_size() for p in parts)

    def release(self) -> None:
        """Drop every inner tensor, so their memory can be reused at once.

        For a tensor nothing else will read again (the linear backward frees the
        input it saved once wgrad has consumed it); any later use raises.
        """
        for name in self._inner + self._derived:
            setattr(self, name, None)

    def keep_shared_only(self) -> "QuantizedTensor":
        """Drop both directions' data in place, keeping what they share (``shared_*`` inner
        tensors and the records made from them); returns ``self``. What stays is what
        :meth:`Quantizer.quantize_usage_like` reads of its ``like`` (a per-tensor scale): a
        linear forward keeps it for the backward that makes the weight's columnwise copy,
        and frees the rowwise data at once. The tensor must be nobody else's."""
        shared = _shared_names(type(self))
        for name in self._inner + self._derived:
            if name not in shared:
                setattr(self, name, None)
        return self

    def holds_gemm_layout(self, usage: str) -> bool:
        """Whether ``usage``'s data is held in the layout the GEMMs read (contiguous); an
        FSDP-gathered weight holds its columnwise data as a transposed view."""
        if not self.has_usage(usage):
            return False
        for name in _names_of(type(self), usage)[2]:
            t = getattr(self, name)
            if t is not None and not t.is_contiguous():
                return False
        return True

    def usage_copy(self, usage: str) -> "QuantizedTensor":
        """A new tensor holding only ``usage``'s data, contiguous: the held data (the same
        tensors where already contiguous), or derived from the other direction where the
        format allows. ``self`` is left as it is, so a derived copy lives only as long as
        whoever asked for it (a GEMM operand of one backward)."""
        check_usage(usage)
        other = "columnwise" if usage == "rowwise" else "rowwise"
        inner, derived, _ = _names_of(type(self), usage)
        fields = {}
        for name in inner:
            t = getattr(self, name)
            fields[name] = t if t is None or t.is_contiguous() else contiguous_data(t)
        if not self.has_usage(usage):
            if not self.has_usage(other):
                raise RuntimeError(f"{type(self).__name__} holds no data to derive {usage} from")
            fields.update(self._derive(usage))
        # records of what is kept go along (each is checked against its source tensor when
        # read, so one whose data was derived anew is simply not used)
        for name in derived:
            fields[name] = getattr(self, name)
        return type(self)(self.shape, self.dtype, **fields, **self.metadata())

    def _derive(self, usage: str) -> dict[str, torch.Tensor]:
        raise RuntimeError(
            f"{type(self).__name__} cannot derive its {usage} representation from the other "
            f"direction without the high-precision values; quantize again with "
            f"{usage}_usage on"
        )

    # ---- dequantization -------------------------------------------------------------------
    def dequantize(self, dtype: torch.dtype | None = None,
                   usage: str | None = None) -> torch.Tensor:
        """High-precision values of one direction, in the nominal (untransposed) shape.

        ``dtype`` defaults to the nominal dtype. The values are computed in
        fp32 and rounded once to ``dtype``. ``usage`` None: the rowwise representation
        where it is held, else the columnwise one (a tensor quantized for wgrad alone); a
        direction asked for by name that is not held raises.

        Differentiable, as Transformer Engine's dequantize is: where autograd records (grad
        mode on and ``self`` requires grad, e.g. the output of a differentiable
        ``Quantizer.quantize``) the gradient reaches ``self`` unchanged, in its nominal
        dtype.
        """
        if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise TypeError(f"dequantize: dtype must be a floating-point torch.dtype (or None "
                            f"for the nominal {self.dtype}), got {dtype!r}")
        if self.requires_grad and torch.is_grad_enabled():
            return DequantizeFunction.apply(self, dtype, usage)
        return self._dequantize(dtype, usage)

    def _dequantize(self, dtype: torch.dtype | None = None,
                    usage: str | None = None) -> torch.Tensor:
        """:meth:`dequantize` outside autograd (formats override this one)."""
        usage = self._held_usage(usage)
        if not self.has_usage(usage):
            held = [u for u in USAGES if self.has_usage(u)]
            raise RuntimeError(
                f"{type(self).__name__} holds no {usage} data (it holds {held}); quantize with "
                f"{usage} usage or call update_usage({usage}_usage=True) where derivable"
            )
        out = self._stored_values(usage)
        if usage == "columnwise":
            out = out.t()
        return out.reshape(self.shape).to(dtype or self.dtype)

    # ---- partial blocks -------------------------------------------------------------------
    def _stored_block(self, usage: str) -> tuple[int, int]:
        """(rows, columns) of one scaling block of ``usage``'s stored 2-D layout; (1, 1)
        for per-tensor formats."""
        return 1, 1

    def _stored_dims(self, usage: str) -> tuple[int, int]:
        m, k = self.shape_2d
        return (m, k) if usage == "rowwise" else (k, m)

    def partial(self, usage: str) -> bool:
        """Whether ``usage``'s stored layout ends in a partial block (or tile): a
        dimension that is not a whole number of blocks. Its scale covers the values the
        block holds; the stored data has the tensor's own size."""
        br, bc = self._stored_block(usage)
        if br == bc == 1:
            return False
        rows, cols = self._stored_dims(usage)
        return bool(rows % br or cols % bc)

    def _stored_values(self, usage: str) -> torch.Tensor:
        """fp32 values of ``usage`` in its stored 2-D layout, partial blocks included: the
        data is zero-padded to whole blocks (zero codes decode to zero), read by the
        format's :meth:`_dequantize_2d`, and cut back."""
        if not self.partial(usage):
            return self._dequantize_2d(usage)
        (rows, cols), (br, bc) = self._stored_dims(usage), self._stored_block(usage)
        whole_rows, whole_cols = -(-rows // br) * br, -(-cols // bc) * bc
        data = getattr(self, f"{usage}_data")
        padded = data.new_zeros(whole_rows, -(-whole_cols // self._packing))
        padded[:rows, :data.shape[1]] = data
        fields = {n: (getattr(self, n) if n.startswith(usage + "_") or n.startswith("shared_")
                      else None) for n in self._inner}
        fields[f"{usage}_data"] = padded
        shape = (whole_rows, whole_cols) if usage == "rowwise" else (whole_cols, whole_rows)
        whole = type(self)(shape, self.dtype, **fields, **self.metadata())
        return whole._dequantize_2d(usage)[:rows, :cols]

    def _held_usage(self, usage: str | None) -> str:
        """``usage`` checked, or for None the direction :meth:`dequantize` reads."""
        if usage is None:
            return "rowwise" if self.has_usage("rowwise") or not self.has_usage(
                "columnwise") else "columnwise"
        return check_usage(usage)

    def _dequantize_2d(self, usage: str) -> torch.Tensor:
        """fp32 values of one direction in its stored 2-D layout."""
        raise NotImplementedError

    # ---- plain-tensor conversions ---------------------------------------------------------
    def _as_plain(self, dtype: torch.dtype) -> torch.Tensor:
        if _CONVERSIONS.keep_quantized:
            # a module's .float()/.half() (``keep_quantized``): only the nominal dtype changes
            return self.to(dtype)
        return DequantizeFunction.apply(self, dtype)

    def float(self, memory_format=torch.preserve_format) -> torch.Tensor:
        """The dequantized values as a plain fp32 tensor; gradients flow back to ``self``."""
        return self._as_plain(torch.float32)

    def bfloat16(self, memory_format=torch.preserve_format) -> torch.Tensor:
        """The dequantized values as a plain bf16 tensor; gradients flow back to ``self``."""
        return self._as_plain(torch.bfloat16)

    def half(self, memory_format=torch.preserve_format) -> torch.Tensor:
        """The dequantized values as a plain fp16 tensor; gradients flow back to ``self``."""
        return self._as_plain(torch.float16)

    # ---- op table -------------------------------------------------------------------------
    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        handler = _HANDLERS.get(func)
        if handler is not None:
            return handler(func, args, kwargs)
        if func.overloadpacket in _HANDLERS_BY_PACKET:
            return _HANDLERS_BY_PACKET[func.overloadpacket](func, args, kwargs)
        return _outside_table(cls, func, args, kwargs)


@functools.cache
def _names_of(cls: type, usage: str) -> tuple[tuple, tuple, tuple]:
    """(inner tensors a ``usage_copy(usage)`` keeps, derived records it keeps, the inner
    tensors of ``usage`` alone) of a tensor class, worked out once per class."""
    other = "columnwise" if usage == "rowwise" else "rowwise"
    return (tuple(n for n in cls._inner if not n.startswith(other + "_")),
            tuple(n for n in cls._derived
                  if not (n.startswith(other + "_") or n.endswith("_" + other))),
            tuple(n for n in cls._inner if n.startswith(usage + "_")))


@functools.cache
def _shared_names(cls: type) -> frozenset:
    """The inner tensors and derived records of a tensor class that both directions'
    ``usage_copy`` keep (what ``keep_shared_only`` leaves), worked out once per class."""
    row_inner, row_derived, _ = _names_of(cls, "rowwise")
    col_inner, col_derived, _ = _names_of(cls, "columnwise")
    return frozenset((set(row_inner) & set(col_inner)) | (set(row_derived) & set(col_derived)))


def contiguous_data(t: torch.Tensor) -> torch.Tensor:
    """``t.contiguous()``; a transposed view (FSDP's gathered columnwise data) through the
    transpose kernel."""
    if t.is_contiguous() or t.dim() != 2 or not t.t().is_contiguous():
        return t.contiguous()
    from ..kernels.transpose import transpose_contiguous
    return transpose_contiguous(t.t())


class DequantizeFunction(torch.autograd.Function):
    """``qt.dequantize(dtype)`` with a straight-through gradient to the quantized tensor."""

    @staticmethod
    def forward(ctx, qt, dtype, usage=None):
        ctx.dtype = qt.dtype
        return qt._dequantize(dtype, usage)

    @staticmethod
    def backward(ctx, grad):
        return grad.to(ctx.dtype), None, None


class _Conversions(threading.local):
    keep_quantized = False


_CONVERSIONS = _Conversions()


@contextlib.contextmanager
def keep_quantized():
    """Inside, ``qt.float()``/``.bfloat16()``/``.half()`` change a quantized tensor's nominal
    dtype (lossless, still quantized) instead of dequantizing it: what a module's
    ``.float()``/``.half()`` means for its quantized weights."""
    saved = _CONVERSIONS.keep_quantized
    _CONVERSIONS.keep_quantized = True
    try:
        yield
    finally:
        _CONVERSIONS.keep_quantized = saved


def _flat_tensors(args, kwargs) -> list:
    out = []
    for a in list(args) + list(kwargs.values()):
        out += list(a) if isinstance(a, (list, tuple)) else [a]
    return [a for a in out if isinstance(a, QuantizedTensor)]


def user_attributes(qt: QuantizedTensor) -> dict[str, Any]:
    """Python attributes set on a quantized tensor beyond its declared fields (a
    parameter's sharding or tensor-parallel marks, the re-quantize link)."""
    own = set(qt._inner) | set(qt._meta) | set(qt._derived) | {"_is_param"}
    return {k: v for k, v in qt.__dict__.items() if k not in own}


def _is_parameter(t: torch.Tensor) -> bool:
    # nn.Parameter(subclass) keeps the subclass type and marks the instance instead.
    return bool(getattr(t, "_is_param", False))


def _rebuild_quantized_tensor(cls, shape, dtype, requires_grad, inner, meta, views,
                              is_param=False, requantize=None):
    inner = {n: (t.view(views[n]) if n in views else t) for n, t in inner.items()}
    out = cls(shape, dtype, requires_grad=requires_grad, **inner, **meta)
    if is_param:
        out = torch.nn.Parameter(out, requires_grad=requires_grad)
    if requantize is not None:
        setattr(out, REQUANTIZE_ATTR, requantize)
    return out


# Pickles (``torch.save`` checkpoints) name the rebuild function by module path, and the
# ``torch.load(weights_only=True)`` allowlist (``register_safe_globals``) matches that path:
# keep the one it always had, ``lowprec.formats.base`` (which re-exports it), so that
# checkpoints saved before and after this module was split out of it load alike.
_rebuild_quantized_tensor.__module__ = "lowprec.formats.base"


# ---- handlers: one small function per supported op -------------------------------------
_HANDLERS: dict = {}
_HANDLERS_BY_PACKET: dict = {}


def _handles(*ops):
    def register(fn):
        for op in ops:
            (_HANDLERS_BY_PACKET if isinstance(op, torch._ops.OpOverloadPacket)
             else _HANDLERS)[op] = fn
        return fn
    return register


@_handles(aten.detach.default, aten.alias.default)
def _detach(func, args, kwargs):
    qt = args[0]
    if torch.is_inference_mode_enabled() and not qt.is_inference():
        # A view of a normal tensor shares its version counter, which an inference tensor
        # has none of: the wrapper is made as a normal tensor (state_dict() under
        # inference_mode detaches every parameter).
        with torch.inference_mode(False):
            return qt._rebuild(lambda t: t.detach(), alias=True)
    return qt._rebuild(lambda t: t.detach(), alias=True)


@_handles(aten.clone.default)
def _clone(func, args, kwargs):
    return args[0]._rebuild(lambda t: t.clone())


@_handles(aten.copy_.default)
def _copy(func, args, kwargs):
    dst, src = args[0], args[1]
    if not isinstance(dst, QuantizedTensor):
        if dst.is_pinned():
            # torch.autograd.graph.save_on_cpu(pin_memory=True) copies saved tensors this way:
            # a quantized operand would come back as a plain one
            raise TypeError(
                f"copying a {type(src).__name__} into a pinned plain tensor would save its "
                f"dequantized values; to offload saved activations use "
                f"lowprec.cpu_offload(pin_memory=True), which moves quantized tensors as "
                f"their codes and scales")
        return dst.copy_(src._dequantize(dst.dtype))
    if not isinstance(src, QuantizedTensor):
        return _requantize_into(dst, src)
    if type(src) is not type(dst) or src.metadata() != dst.metadata() or src.shape != dst.shape:
        raise TypeError(f"copy_ needs the same format and shape: {dst!r} <- {src!r}")
    for name, d in dst.inner_tensors().items():
        s = getattr(src, name)
        if (d is None) != (s is None):
            raise TypeError(f"copy_ needs the same usages: {dst!r} <- {src!r}")
        if d is not None:
            d.copy_(s)
    return dst


#: Attribute a quantized tensor made by ``Quantizer.quantize`` or ``make_empty`` carries:
#: the quantizer, which an in-place op outside the table re-quantizes the tensor with
#: (Transformer Engine's tensors hold theirs the same way). Not pickled.
QUANTIZER_ATTR = "_quantizer"

#: Attribute a quantized *parameter* may carry: ``f(src, dst)`` re-quantizes the high-precision
#: ``src`` into ``dst`` with its module's weight quantizer (set by the lowprec modules).
REQUANTIZE_ATTR = "_lowprec_requantize"

#: Attribute (True) of a quantized weight holding only its rowwise data whose columnwise
#: data the backward brings into the storage of its rowwise inner tensors, each transposed
#: (FSDP2's quantized all-gather of a format whose columnwise side does not derive: the
#: backward's gather refills the forward's buffers, ``lowprec.distributed``). A compiled
#: linear keeps those buffers and reads them in its backward (``formats.graph``). Kept by
#: aliases of the same storage (``_rebuild(alias=True)``), by nothing else.
COLUMNWISE_IN_BACKWARD_ATTR = "_lowprec_columnwise_in_backward"


def columnwise_from_backward(t: QuantizedTensor) -> bool:
    """Whether ``t`` holds no columnwise data and the backward's gather brings it into its
    rowwise buffers (``COLUMNWISE_IN_BACKWARD_ATTR``). A function, not a method: dynamo
    traces it, where it would take a method of a tensor subclass for a torch op."""
    return t.columnwise_data is None and bool(getattr(t, COLUMNWISE_IN_BACKWARD_ATTR, False))


def _requantize_into(dst: QuantizedTensor, src: torch.Tensor, op: str = "copy_") -> QuantizedTensor:
    """``dst.copy_(src)`` of high-precision values (or an in-place ``op``'s result):
    re-quantized in place by the quantizer the parameter's module gives (``load_state_dict``
    of a high-precision checkpoint, a master weight copied back), else by the quantizer
    that made ``dst`` (:data:`QUANTIZER_ATTR`)."""
    requantize = getattr(dst, REQUANTIZE_ATTR, None)
    quantizer = getattr(dst, QUANTIZER_ATTR, None)
    if requantize is None and quantizer is None:
        raise TypeError(
            f"{op} of high-precision values into a {type(dst).__name__} re-quantizes it with "
            f"its quantizer, and this one has none: only tensors made by Quantizer.quantize "
            f"or make_empty, and quantized weights of lowprec modules built under "
            f"quantized_model_init, hold one (a loaded or kernel-made tensor does not); use "
            f"quantizer.update_quantized(values, tensor)")
    if tuple(src.shape) != tuple(dst.shape):
        raise ValueError(f"{op} into a quantized tensor of shape {tuple(dst.shape)} got "
                         f"shape {tuple(src.shape)}; the shapes must match (no broadcasting)")
    # the values the tensor would hold as a plain tensor of its dtype
    values = src.to(device=dst.device, dtype=dst.dtype)
    if requantize is not None:
        requantize(values, dst)
    else:
        quantizer.update_quantized(values, dst)
    return dst


def _like_args(qt: QuantizedTensor, kwargs: dict, op: str, accepted: set) -> torch.dtype:
    """The nominal dtype a ``to``/``empty_like`` asks for, after checking its arguments."""
    extra = set(kwargs) - accepted
    if extra:
        raise NotImplementedError(f"{type(qt).__name__}: {op} does not support {sorted(extra)}")
    dtype = kwargs.get("dtype") or qt.dtype
    if dtype not in HIGH_PRECISION_DTYPES:
        raise TypeError(f"a quantized tensor's nominal dtype must be one of "
                        f"{HIGH_PRECISION_DTYPES}, got {dtype}")
    return dtype


@_handles(aten._to_copy.default)
def _to_copy(func, args, kwargs):
    qt = args[0]
    device = kwargs.get("device")
    non_blocking = kwargs.get("non_blocking", False)
    wanted = kwargs.get("dtype")
    if wanted == torch.float64:
        # a dtype no quantized tensor carries: the values, as Transformer Engine gives them
        # (an op outside the table dequantizes)
        _like_args(qt, {k: v for k, v in kwargs.items() if k != "dtype"}, "to",
                   {"device", "non_blocking", "layout", "memory_format", "pin_memory"})
        return qt._dequantize().to(device=device or qt.device, dtype=wanted,
                                  non_blocking=non_blocking)
    dtype = _like_args(qt, kwargs, "to", {"dtype", "device", "non_blocking", "layout",
                                          "memory_format", "pin_memory"})
    # A dtype change only changes the nominal dtype (what dequantize returns): lossless.
    # The inner tensors move by the aten op itself: inside this dispatch ``t.to`` would reach
    # a quantized inner tensor (a hybrid's) as the undecomposed ``aten.to``, which it refuses.
    return qt._rebuild(lambda t: aten._to_copy.default(t, device=device,
                                                       non_blocking=non_blocking)
                       if device is not None else t.clone(), dtype=dtype)


@_handles(aten.empty_like.default)
def _empty_like(func, args, kwargs):
    # ``module.to_empty(device=...)`` (meta-device init): fresh, uninitialized buffers of the
    # same layout, to be filled by a re-quantize (``reset_parameters``, a checkpoint load).
    qt = args[0]
    dtype = _like_args(qt, kwargs, "empty_like", {"dtype", "device", "layout", "pin_memory",
                                                  "memory_format"})
    device = kwargs.get("device") or qt.device
    return qt._rebuild(lambda t: torch.empty_like(t, device=device), dtype=dtype)


def _view_shape(qt: QuantizedTensor, size) -> tuple[int, ...]:
    size = list(size)
    numel = qt.numel()
    if size.count(-1) == 1:
        known = 1
        for s in size:
            if s != -1:
                known *= s
        size[size.index(-1)] = numel // known if known else 0
    if len(size) == 0 or size[-1] != qt.shape[-1] or torch.Size(size).numel() != numel:
        hint = ""
        if len(size) == 1 and qt.dim() > 1:
            # DistributedDataParallel's constructor broadcasts parameters flattened this way
            hint = ("; under DistributedDataParallel build every rank's quantized weights "
                    "alike (same seed) and pass init_sync=False")
        raise RuntimeError(
            f"{type(qt).__name__} can only be viewed with the same last dimension "
            f"({qt.shape[-1]}) and number of elements; got {tuple(size)} for shape "
            f"{tuple(qt.shape)}{hint}"
        )
    return tuple(size)


@_handles(aten.view.default, aten._unsafe_view.default, aten.reshape.default)
def _view(func, args, kwargs):
    qt, size = args[0], args[1]
    return qt._rebuild(lambda t: t, shape=_view_shape(qt, size))


@_handles(aten.as_strided.default)
def _as_strided(func, args, kwargs):
    # FSDP2 takes its unsharded parameter as ``as_strided(t, t.shape, contiguous stride, 0)``:
    # the identity is the one strided view a quantized tensor has.
    qt, size, stride = args[0], tuple(args[1]), tuple(args[2])
    offset = args[3] if len(args) > 3 else kwargs.get("storage_offset", 0)
    if size != tuple(qt.shape) or stride != torch.empty(size, device="meta").stride() or offset:
        raise NotImplementedError(
            f"{type(qt).__name__} supports as_strided only as the identity (size "
            f"{tuple(qt.shape)}, contiguous stride, offset 0); got size {size}, stride "
            f"{stride}, offset {offset}")
    return qt._rebuild(lambda t: t, alias=True)



# ---- ops outside the table ----------------------------------------------------------------
#: In-place ops that set a tensor's values without reading them (initializers): on a
#: quantized parameter they re-quantize as ``copy_`` does; any other in-place op on one
#: raises (see :func:`_outside_table`).
_SETTERS = {aten.fill_, aten.zero_, aten.normal_, aten.uniform_, aten.bernoulli_,
            aten.exponential_, aten.log_normal_, aten.cauchy_, aten.geometric_,
            aten.random_}
_SPLITS = {aten.split, aten.chunk, aten.split_with_sizes, aten.unbind, aten.tensor_split}


def _written(func, args, kwargs) -> list:
    """The quantized tensors ``func`` writes (its schema's mutated arguments)."""
    out = []
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = args[i] if i < len(args) else kwargs.get(arg.name)
        for t in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(t, QuantizedTensor):
                out.append(t)
    return out


def _outside_table(cls, func, args, kwargs):
    """An op outside the table, as Transformer Engine's quantized tensors run it: an
    out-of-place op on the dequantized values (a plain result); an in-place one dequantizes
    the tensor it writes, applies the op and re-quantizes the result into it with the
    tensor's quantizer. A quantized *parameter* keeps two clear errors, where running the
    op would hide a bug: FSDP2 sharding it (split/chunk would shard dequantized copies) and
    an optimizer updating it without master weights (any in-place op but ``copy_`` and the
    initializers)."""
    written = _written(func, args, kwargs)
    if func.overloadpacket in _SPLITS and any(
            _is_parameter(a) for a in _flat_tensors(args, kwargs)):
        raise NotImplementedError(
            f"{cls.__name__} does not support {func} on a quantized weight "
            f"(quantized_model_init): it is being split, as FSDP2's fully_shard does; call "
            f"lowprec.distributed.quantized_all_gather(model, recipe) before fully_shard, "
            f"which gives each such weight an fp32 shard that FSDP2 all-gathers in the "
            f"weight's quantized format.")
    if func.overloadpacket not in _SETTERS and any(_is_parameter(t) for t in written):
        raise NotImplementedError(
            f"{cls.__name__} does not support the in-place {func} on a quantized weight "
            f"(quantized_model_init): an update re-quantized in place loses every change "
            f"smaller than the format's step, so a plain torch optimizer would silently stop "
            f"training it. Wrap the optimizer in lowprec.optim.QuantizedWeightOptimizer(model, "
            f"torch.optim.AdamW, ...), which keeps fp32 master weights and re-quantizes them "
            f"after each step; copy_ and the initializers (fill_, zero_, normal_, uniform_, "
            f"...) re-quantize.")
    plain = {}

    def dequantized(t: QuantizedTensor) -> torch.Tensor:
        out = plain[id(t)] = t._dequantize()
        return out

    p_args, p_kwargs = pytree.tree_map_only(QuantizedTensor, dequantized, (args, kwargs))
    out = func(*p_args, **p_kwargs)
    if not written:
        return out
    back = {}
    for t in written:
        values = plain[id(t)]
        _requantize_into(t, values, f"the in-place {func}")
        back[id(values)] = t
    return pytree.tree_map_only(torch.Tensor, lambda v: back.get(id(v), v), out)


def register_safe_globals(*objs) -> None:
    """Allow ``torch.load(weights_only=True)`` to rebuild lowprec objects."""
    torch.serialization.add_safe_globals([_rebuild_quantized_tensor, *objs])
