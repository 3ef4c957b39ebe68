"""Quantizer and QuantizedTensor: the two base classes every format builds on.

Storage convention (all formats): the data of a quantized tensor is kept as
2-D matrices. With ``M = prod(shape[:-1])`` and ``K = shape[-1]``:

* the *rowwise* representation is stored ``(M, K)`` (scaled along K);
* the *columnwise* representation is the rowwise quantization of the
  transposed matrix, stored ``(K, M)`` and contiguous (scaled along M).

Both directions are therefore K- resp. M-contiguous, which is what cuBLAS
FP8 on Hopper wants for every GEMM layout (both operands contiguous in the
contraction dimension). The nominal ``shape``/``dtype`` of the wrapper are
those of the high-precision tensor that was quantized.

A quantized tensor carries everything needed to read it back (data, scales,
format parameters) and never a reference to the quantizer that made it.
"""

from __future__ import annotations

import contextlib
import copy
import numbers
import sys
import threading
from typing import Any, Callable, ClassVar

import torch

from .casting import FP32_MAX

aten = torch.ops.aten

HIGH_PRECISION_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
USAGES = ("rowwise", "columnwise")


def _check_usage(usage: str) -> str:
    if usage not in USAGES:
        raise ValueError(f"usage={usage!r} is not valid; use 'rowwise' or 'columnwise'")
    return usage


def flatten_2d(shape: torch.Size | tuple[int, ...]) -> tuple[int, int]:
    """(M, K) for a nominal shape: M = prod(shape[:-1]), K = shape[-1]."""
    if len(shape) == 0:
        raise ValueError("cannot quantize a 0-d tensor; give it at least one dimension")
    k = int(shape[-1])
    m = 1
    for s in shape[:-1]:
        m *= int(s)
    return m, k


def rows_fit(quantizer: "Quantizer", t: torch.Tensor, *, rowwise: bool, columnwise: bool) -> bool:
    """Whether ``t``'s M (product of the leading dimensions) is a multiple of what
    ``quantizer`` needs along M for these usages (see ``Quantizer.row_multiple``)."""
    if t.dim() == 0 or t.shape[-1] == 0:
        return True
    return (t.numel() // t.shape[-1]) % quantizer.row_multiple(rowwise=rowwise,
                                                              columnwise=columnwise) == 0


def check_divisible(shape, m: int, k: int, *, row_block: int, col_block: int,
                    what: str) -> None:
    """Raise ValueError naming the shape and block when a blocked dim does not divide."""
    if k % row_block or m % col_block:
        raise ValueError(
            f"{what} needs the last dimension divisible by {row_block} and the product of the "
            f"leading dimensions divisible by {col_block}; got shape {tuple(shape)} "
            f"(M={m}, K={k}, block {col_block}x{row_block}). Pad the tensor or use a "
            f"per-tensor format."
        )


# ---- constructor options (quantizers and recipes) ---------------------------------------
def check_bool_option(owner: str, name: str, value: Any) -> bool:
    """``value`` as a Python bool when it is ``True``/``False`` or a numpy bool; else
    ValueError naming ``owner``, the option and the value.

    Truthiness is not enough: a flag read from a YAML/CLI config as the string ``"false"``
    is truthy and would silently switch the option on.
    """
    if isinstance(value, bool):
        return value
    # numpy cannot have made the value unless it is already imported
    np = sys.modules.get("numpy")
    if np is not None and isinstance(value, np.bool_):
        return bool(value)
    raise ValueError(f"{owner}: {name} must be a bool (True or False), got {value!r} "
                     f"({type(value).__name__})")


def check_int_option(owner: str, name: str, value: Any) -> int:
    """``value`` as a Python int when it is an integer (numpy integers too) and not a bool;
    else ValueError naming ``owner``, the option and the value."""
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return int(value)
    raise ValueError(f"{owner}: {name} must be an int, got {value!r} ({type(value).__name__})")


def check_amax_epsilon(owner: str, value: Any, name: str = "amax_epsilon") -> float:
    """``value`` as a float when it is a real number in ``[0, fp32 max]``; else ValueError
    naming ``owner``, the value and the accepted range.

    The epsilon is a lower bound on the amax that the scale divides by, and it is stored
    as fp32 where the scale is computed: an infinite or NaN one (or one that overflows to
    inf in fp32) would give zero or NaN scales and turn every value NaN.
    """
    if (isinstance(value, numbers.Real) and not isinstance(value, bool)
            and 0.0 <= value <= FP32_MAX):
        return float(value)
    raise ValueError(f"{owner}: {name} must be a real number >= 0 and at most the fp32 "
                     f"maximum {FP32_MAX!r}, got {value!r} ({type(value).__name__})")


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

    # ---- exact bf16 GEMM operands (lowprec.backends.exact_bf16) --------------------------
    def bf16_operand_domain(self, usage: str) -> str | None:
        """Whether ``usage``'s values enter a bf16 tensor-core GEMM exactly: ``"original"``;
        ``"rht"`` for values in NVFP4's Hadamard domain along the contraction dimension
        (exact only against another such operand, where the transform cancels); None where
        they are not exact in bf16 or ``usage`` is not held."""
        if not self.has_usage(usage):
            return None
        return self._bf16_domain(usage)

    def _bf16_domain(self, usage: str) -> str | None:
        return None  # formats whose values are exact in bf16 say so

    def bf16_operand(self, usage: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(bf16 matrix, fp32 divisor or None)``: ``usage``'s values, in the layout and
        domain it is stored in, are exactly ``matrix / divisor`` (see
        :meth:`bf16_operand_domain`)."""
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
                 dtype=None) -> "QuantizedTensor":
        inner = {n: (None if t is None else fn(t)) for n, t in self.inner_tensors().items()}
        return type(self)(self.shape if shape is None else shape,
                          self.dtype if dtype is None else dtype,
                          **inner, **self.metadata())

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

    def __repr__(self, *, tensor_contents=None):
        meta = ", ".join(f"{k}={v}" for k, v in self.metadata().items())
        return (f"{type(self).__name__}(shape={tuple(self.shape)}, dtype={self.dtype}, "
                f"device={self.device}, rowwise={self.has_usage('rowwise')}, "
                f"columnwise={self.has_usage('columnwise')}{', ' + meta if meta else ''})")

    # ---- usages ---------------------------------------------------------------------------
    def has_usage(self, usage: str) -> bool:
        return getattr(self, f"{_check_usage(usage)}_data") is not None

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

    def holds_gemm_layout(self, usage: str) -> bool:
        """Whether ``usage``'s data is held in the layout the GEMMs read (contiguous); an
        FSDP-gathered weight holds its columnwise data as a transposed view."""
        return self.has_usage(usage) and all(
            t.is_contiguous() for n, t in self.inner_tensors().items()
            if t is not None and n.startswith(usage + "_"))

    def usage_copy(self, usage: str) -> "QuantizedTensor":
        """A new tensor holding only ``usage``'s data, contiguous: the held data (the same
        tensors where already contiguous), or derived from the other direction where the
        format allows. ``self`` is left as it is, so a derived copy lives only as long as
        whoever asked for it (a GEMM operand of one backward)."""
        _check_usage(usage)
        other = "columnwise" if usage == "rowwise" else "rowwise"
        fields = {n: (None if n.startswith(other + "_") or t is None else _contiguous(t))
                  for n, t in self.inner_tensors().items()}
        if not self.has_usage(usage):
            if not self.has_usage(other):
                raise RuntimeError(f"{type(self).__name__} holds no data to derive {usage} from")
            fields.update(self._derive(usage))
        return type(self)(self.shape, self.dtype, **fields, **self.metadata())

    def _derive(self, usage: str) -> dict[str, torch.Tensor]:
        raise RuntimeError(
            f"{type(self).__name__} cannot derive its {usage} representation from the other "
            f"direction without the high-precision values; quantize again with "
            f"{usage}_usage on"
        )

    # ---- dequantization -------------------------------------------------------------------
    def dequantize(self, dtype: torch.dtype | None = None, usage: str = "rowwise") -> torch.Tensor:
        """High-precision values of one direction, in the nominal (untransposed) shape.

        ``dtype`` defaults to the nominal dtype. The values are computed in
        fp32 and rounded once to ``dtype``.
        """
        _check_usage(usage)
        if not self.has_usage(usage):
            held = [u for u in USAGES if self.has_usage(u)]
            raise RuntimeError(
                f"{type(self).__name__} holds no {usage} data (it holds {held}); quantize with "
                f"{usage} usage or call update_usage({usage}_usage=True) where derivable"
            )
        out = self._dequantize_2d(usage)
        if usage == "columnwise":
            out = out.t()
        return out.reshape(self.shape).to(dtype or self.dtype)

    def _dequantize_2d(self, usage: str) -> torch.Tensor:
        """fp32 values of one direction in its stored 2-D layout."""
        raise NotImplementedError

    # ---- plain-tensor conversions ---------------------------------------------------------
    def _as_plain(self, dtype: torch.dtype) -> torch.Tensor:
        if _CONVERSIONS.keep_quantized:
            # a module's .float()/.half() (``keep_quantized``): only the nominal dtype changes
            return self.to(dtype)
        return _Dequantize.apply(self, dtype)

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
        hint = ("Call .dequantize() (or .float()/.bfloat16()) to get a high-precision tensor "
                "for other operations.")
        if func.overloadpacket in (aten.split, aten.chunk) and any(
                _is_parameter(a) for a in _flat_tensors(args, kwargs)):
            hint = ("A quantized weight (quantized_model_init) is being split, as FSDP2's "
                    "fully_shard does: call lowprec.distributed.quantized_all_gather(model, "
                    "recipe) before fully_shard; it gives each such weight an fp32 shard "
                    "that FSDP2 all-gathers in the weight's quantized format.")
        elif any(_is_parameter(a) for a in _flat_tensors(args, kwargs)):
            hint = ("This is a quantized weight (quantized_model_init): a plain torch optimizer "
                    "cannot update it; wrap the optimizer in "
                    "lowprec.optim.QuantizedWeightOptimizer(model, torch.optim.AdamW, ...), "
                    "which keeps fp32 master weights and re-quantizes them after each step. "
                    "Call .dequantize() for other operations.")
        raise NotImplementedError(
            f"{cls.__name__} does not support {func}. Supported: detach, clone, copy_, to, "
            f"empty_like, view/reshape keeping the last dimension, identity as_strided, "
            f"torch.save. {hint}")


def _contiguous(t: torch.Tensor) -> torch.Tensor:
    """``t.contiguous()``; a transposed view (FSDP's gathered columnwise data) through the
    transpose kernel."""
    if t.is_contiguous() or t.dim() != 2 or not t.t().is_contiguous():
        return t.contiguous()
    from ..kernels.transpose import transpose_contiguous
    return transpose_contiguous(t.t())


class _Dequantize(torch.autograd.Function):
    """``qt.dequantize(dtype)`` with a straight-through gradient to the quantized tensor."""

    @staticmethod
    def forward(ctx, qt, dtype):
        ctx.dtype = qt.dtype
        return qt.dequantize(dtype)

    @staticmethod
    def backward(ctx, grad):
        return grad.to(ctx.dtype), None


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
            return qt._rebuild(lambda t: t.detach())
    return qt._rebuild(lambda t: t.detach())


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
        return dst.copy_(src.dequantize(dst.dtype))
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


#: Attribute a quantized *parameter* may carry: ``f(src, dst)`` re-quantizes the high-precision
#: ``src`` into ``dst`` with its module's weight quantizer (set by the lowprec modules).
REQUANTIZE_ATTR = "_lowprec_requantize"


def _requantize_into(dst: QuantizedTensor, src: torch.Tensor) -> QuantizedTensor:
    """``dst.copy_(src)`` of high-precision values: re-quantized in place by the quantizer the
    parameter's module gives (``load_state_dict`` of a high-precision checkpoint, a master
    weight copied back)."""
    requantize = getattr(dst, REQUANTIZE_ATTR, None)
    if requantize is None:
        raise TypeError(
            f"copy_ of a high-precision tensor into a {type(dst).__name__} needs a quantizer: "
            f"only a quantized weight of a lowprec module built under quantized_model_init "
            f"re-quantizes by itself; use quantizer.update_quantized(src, dst)")
    if tuple(src.shape) != tuple(dst.shape):
        raise ValueError(f"copy_ into a quantized parameter of shape {tuple(dst.shape)} got "
                         f"shape {tuple(src.shape)}; the shapes must match (no broadcasting)")
    # the values the parameter would hold as a plain tensor of its dtype
    requantize(src.to(device=dst.device, dtype=dst.dtype), dst)
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
    dtype = _like_args(qt, kwargs, "to", {"dtype", "device", "non_blocking", "layout",
                                          "memory_format", "pin_memory"})
    device = kwargs.get("device")
    # A dtype change only changes the nominal dtype (what dequantize returns): lossless.
    return qt._rebuild(lambda t: t.to(device=device, non_blocking=kwargs.get("non_blocking", False))
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
    return qt._rebuild(lambda t: t)


class Quantizer:
    """Configuration that turns a high-precision tensor into a QuantizedTensor.

    A quantizer is a small picklable value: it holds its usages and format
    parameters and no process group, module or tensor it does not need.
    """

    #: Name of the format, for messages and reports.
    format_name: ClassVar[str] = "quantizer"
    #: Whether ``quantize`` is a function of its input and the settings ``_repr_params``
    #: lists alone (no state read or written, no random draws), so GEMMs that read one
    #: input may share one quantize of it (:meth:`share_key`).
    stateless: ClassVar[bool] = False

    def __init__(self) -> None:
        self.rowwise_usage = True
        self.columnwise_usage = True

    def set_usage(self, rowwise: bool | None = None, columnwise: bool | None = None) -> "Quantizer":
        """Turn the rowwise/columnwise outputs on or off (``None`` keeps the current value)."""
        if rowwise is not None:
            self.rowwise_usage = check_bool_option(type(self).__name__, "rowwise", rowwise)
        if columnwise is not None:
            self.columnwise_usage = check_bool_option(type(self).__name__, "columnwise",
                                                      columnwise)
        return self

    @contextlib.contextmanager
    def usages(self, rowwise: bool, columnwise: bool):
        """Context manager: these usages inside, the previous ones restored after."""
        saved = (self.rowwise_usage, self.columnwise_usage)
        self.set_usage(rowwise=rowwise, columnwise=columnwise)
        try:
            yield self
        finally:
            self.set_usage(*saved)

    def copy(self) -> "Quantizer":
        """An independent quantizer with the same settings (shared recipe-owned state stays
        shared)."""
        return copy.copy(self)

    def share_key(self):
        """A hashable key, equal for quantizers that quantize any input to the same tensor
        (a stateless format and its settings, usages aside), or None where a quantize
        cannot be shared (scaling state, random draws)."""
        if not self.stateless:
            return None
        return (type(self), tuple(self._repr_params().items()))

    # ---- exact bf16 GEMM operands -----------------------------------------------------------
    #: Whether this format's kernels can also write a direction's exact bf16 values (the
    #: operand of the bf16 GEMM emulation, kept as a ``_derived`` record ``_exact_<usage>``
    #: of the tensor): MXFP8 and NVFP4.
    keeps_exact_bf16: ClassVar[bool] = False
    #: The tensor type ``quantize_for_gemm(codes=False)`` returns (formats with
    #: ``keeps_exact_bf16``: ``lowprec.formats.exact.ExactTensor``).
    exact_tensor_type: ClassVar[type | None] = None
    #: The directions asked for by :meth:`quantize_for_gemm`, during that call only.
    _exact: tuple[str, ...] = ()

    def quantize_for_gemm(self, x: torch.Tensor, exact: tuple[str, ...] = (), *,
                          codes: bool = True) -> QuantizedTensor:
        """``quantize(x)``; where the format keeps exact bf16 operands, its kernel also writes
        those of the directions in ``exact`` (ones a GEMM consumes right away), so the GEMM
        emulation reads them instead of dequantizing in a pass of its own. The quantized
        tensor is the same either way.

        ``codes=False``, for an operand nothing reads but those GEMMs (every direction in
        use listed in ``exact``): where the format's kernels run, the result is an
        :class:`~lowprec.formats.exact.ExactTensor` holding only the exact values (no codes,
        no scales: less memory written and held); elsewhere the usual quantized tensor."""
        if not (exact and self.keeps_exact_bf16):
            return self.quantize(x)
        if not codes:
            wanted = {u for u in USAGES if getattr(self, f"{u}_usage")}
            if not wanted <= set(exact):
                raise ValueError(f"quantize_for_gemm(codes=False) needs the exact values of "
                                 f"every direction in use ({sorted(wanted)}), got {exact}")
            exact_only = self._quantize_exact(x)
            if exact_only is not None:
                return exact_only
        self._exact = tuple(exact)
        try:
            return self.quantize(x)
        finally:
            self._exact = ()

    def _quantize_exact(self, x: torch.Tensor) -> QuantizedTensor | None:
        """An ExactTensor of ``x`` through the format's kernels, or None where they do not
        run (CPU, no Triton, an empty tensor)."""
        from ..kernels import use_kernels
        self._check_input(x)
        m, k = flatten_2d(x.shape)
        self._check_shape(x.shape, m, k)
        if m == 0 or k == 0 or not use_kernels(x):
            return None
        return self.exact_tensor_type(x.shape, x.dtype,
                                      **self._quantize_exact_2d(_row_major_2d(x, m, k)))

    def _quantize_exact_2d(self, x2d: torch.Tensor) -> dict[str, Any]:
        """ExactTensor fields of ``x2d`` (formats with ``keeps_exact_bf16``)."""
        raise NotImplementedError

    def exact_usages(self) -> tuple[str, ...]:
        """The directions whose exact bf16 records the running quantize should write: none
        where records could not be kept (tracing, inference mode; see ``derived_record``)."""
        if not self._exact or torch.compiler.is_compiling() or torch.is_inference_mode_enabled():
            return ()
        return self._exact

    # ---- quantize -------------------------------------------------------------------------
    def quantize(self, x: torch.Tensor) -> QuantizedTensor:
        """Quantize ``x`` into the directions whose usage is on."""
        self._check_input(x)
        if not (self.rowwise_usage or self.columnwise_usage):
            raise ValueError(f"{type(self).__name__} has both usages off; nothing to compute")
        m, k = flatten_2d(x.shape)
        self._check_shape(x.shape, m, k)
        if m == 0 or k == 0:
            # Nothing to scale (e.g. an empty GroupedLinear split): empty buffers, unit scales.
            return self.make_empty(x.shape, dtype=x.dtype, device=x.device)
        fields = self._quantize_2d(_row_major_2d(x, m, k))
        return self._tensor_class()(x.shape, x.dtype, **fields)

    __call__ = quantize

    def part_statistic(self, part: torch.Tensor) -> torch.Tensor | None:
        """The per-tensor statistic of ``part`` (rows of a larger 2-D tensor) that
        :meth:`quantize_part` needs the whole tensor's value of, as an int32 tensor whose
        elementwise maximum over the parts is the whole tensor's (an all-reduce MAX
        combines them); None for formats whose blocks need nothing beyond themselves."""
        return None

    def quantize_part(self, part: torch.Tensor,
                      statistic: torch.Tensor | None = None) -> QuantizedTensor:
        """``part``, whole rows of a 2-D tensor whose other rows other processes hold (a
        weight shard under FSDP), quantized with this quantizer's usages exactly as
        :meth:`quantize` of the whole tensor quantizes those rows, where
        :meth:`can_quantize_part` says the format can (its values depend on nothing but the
        part and a maximum over the parts).

        ``statistic``: the elementwise maximum of :meth:`part_statistic` over every part
        (required where that is not None). Blocks that run along the rows need the part to
        start and end on a block boundary (:meth:`row_multiple`)."""
        self._check_input(part)
        if part.dim() != 2:
            raise ValueError(f"{type(self).__name__}.quantize_part needs a 2-D part, got shape "
                             f"{tuple(part.shape)}")
        if not (self.rowwise_usage or self.columnwise_usage):
            raise ValueError(f"{type(self).__name__} has both usages off; nothing to compute")
        if not self.can_quantize_part():
            raise NotImplementedError(
                f"{self!r} cannot quantize a part of a tensor as the whole tensor's quantize "
                f"would (see can_quantize_part)")
        m, k = part.shape
        self._check_shape(part.shape, m, k)
        if m == 0 or k == 0:
            return self.make_empty(part.shape, dtype=part.dtype, device=part.device)
        return self._tensor_class()(part.shape, part.dtype,
                                    **self._part_fields(part.contiguous(), statistic))

    #: Whether a quantize's values depend on nothing beyond each block's own elements, so a
    #: part of a tensor quantizes alone (``quantize_part``).
    blocks_are_independent: ClassVar[bool] = False

    def can_quantize_part(self) -> bool:
        """Whether :meth:`quantize_part` works with this quantizer and its usages."""
        return self.blocks_are_independent

    def _part_fields(self, part: torch.Tensor, statistic: torch.Tensor | None) -> dict:
        """Fields of :meth:`quantize_part` for a part with elements."""
        return self._quantize_2d(part)

    def supports_fused(self, x: torch.Tensor) -> bool:
        """Whether :meth:`quantize_fused` can take ``x`` (a CUDA input with Triton kernels, a
        format whose kernels take a prologue)."""
        from ..kernels import use_kernels
        return type(self)._quantize_2d_fused is not Quantizer._quantize_2d_fused and \
            use_kernels(x)

    def quantize_fused(self, x: torch.Tensor, prologue) -> QuantizedTensor:
        """Quantize ``prologue(x)`` (a norm or an activation, see ``lowprec.fused``) without
        writing it out: bit-identical to ``quantize(apply_prologue(x, prologue))``."""
        self._check_input(x)
        if not self.supports_fused(x):
            raise NotImplementedError(f"{type(self).__name__} has no fused quantize for "
                                      f"{x.device} input; check supports_fused() first")
        if not (self.rowwise_usage or self.columnwise_usage):
            raise ValueError(f"{type(self).__name__} has both usages off; nothing to compute")
        shape = (*x.shape[:-1], prologue.out_features(x.shape[-1]))
        m, k = flatten_2d(shape)
        self._check_shape(shape, m, k)
        if m == 0 or k == 0:
            return self.make_empty(shape, dtype=x.dtype, device=x.device)
        x2d = x.detach().reshape(m, -1).contiguous()
        return self._tensor_class()(shape, x.dtype, **self._quantize_2d_fused(x2d, prologue))

    #: Whether :meth:`slice_quantizer` reads the whole tensor first (per-tensor amax).
    slices_need_stats_pass: ClassVar[bool] = False

    def slice_quantizer(self, x2d: torch.Tensor
                        ) -> Callable[[torch.Tensor, str], QuantizedTensor] | None:
        """A function ``f(part, usage)`` quantizing slices of the 2-D ``x2d`` exactly as
        ``quantize(x2d)`` quantizes those elements, or None where the format cannot.

        ``part`` is a row range ``x2d[a:b]`` quantized for ``"rowwise"`` usage or a column
        range ``x2d[:, a:b]`` for ``"columnwise"``, with ``a`` a multiple of 128 (no block
        straddles a slice). Per-tensor formats compute the statistics of the whole tensor
        here, once (recording what ``quantize`` records), and every slice uses them. This
        lets a backward quantize dY a slice at a time and hand each slice to its GEMM
        (see ``lowprec.linear.grad_split``).
        """
        return None

    def gemm_slicer(self, x2d: torch.Tensor) -> Any:
        """A :class:`~lowprec.formats.gemm_slicer.GemmSlicer` of the 2-D ``x2d``: its slices
        quantized as ``quantize(x2d)`` quantizes them, in the form a GEMM consumes at once
        (for formats emulated on bf16 GEMMs whose kernels run, an
        :class:`~lowprec.formats.exact.ExactTensor` of the slice's exact values). None
        where the format has no such path (see ``lowprec.linear.exact_split``)."""
        return None

    def can_gemm_slice(self) -> bool:
        """Whether :meth:`gemm_slicer` is implemented by this format."""
        return type(self).gemm_slicer is not Quantizer.gemm_slicer

    def can_slice(self) -> bool:
        """Whether :meth:`slice_quantizer` is implemented by this format."""
        return type(self).slice_quantizer is not Quantizer.slice_quantizer

    def can_quantize_usage_like(self) -> bool:
        """Whether :meth:`quantize_usage_like` works with this quantizer."""
        return not self.slices_need_stats_pass and self.can_slice()

    def quantize_usage_like(self, x2d: torch.Tensor, like: QuantizedTensor,
                            usage: str) -> QuantizedTensor:
        """The 2-D ``x2d`` quantized for ``usage`` alone, bit for bit the ``usage`` half of one
        ``quantize(x2d)`` with both usages, given ``like``: ``x2d`` already quantized by this
        quantizer for the other usage, whose statistics are reused (no pass over ``x2d`` for
        them). A linear forward uses it to make the weight's columnwise copy after fprop,
        once the rowwise copies are freed. Formats whose blocks hold their own scales
        quantize ``usage`` afresh; per-tensor formats reuse ``like``'s scale.
        """
        if not self.can_quantize_usage_like():
            raise NotImplementedError(f"{type(self).__name__} cannot quantize one usage after "
                                      f"the other; quantize both usages at once")
        return self.slice_quantizer(x2d)(x2d, usage)

    def _slicer(self, fields_of: Callable[[torch.Tensor], dict], tensor_class=None
                ) -> Callable[[torch.Tensor, str], QuantizedTensor]:
        """The ``f(part, usage)`` of :meth:`slice_quantizer` for a ``fields_of(part)``."""
        return lambda part, usage: self._slice_tensor(part, usage, fields_of, tensor_class)

    def _slice_tensor(self, part: torch.Tensor, usage: str,
                      fields_of: Callable[[torch.Tensor], dict],
                      tensor_class=None) -> QuantizedTensor:
        """One slice for :meth:`slice_quantizer`: ``fields_of(part)`` with only ``usage`` on.
        Kernels read the strided slice in place; the reference gets a contiguous copy."""
        from ..kernels import use_kernels
        _check_usage(usage)
        self._check_input(part)
        m, k = part.shape
        with self.usages(rowwise=usage == "rowwise", columnwise=usage == "columnwise"):
            self._check_shape(part.shape, m, k)
            fields = fields_of(part if use_kernels(part) else part.contiguous())
        return (tensor_class or self._tensor_class())(part.shape, part.dtype, **fields)

    def update_quantized(self, x: torch.Tensor, qt: QuantizedTensor) -> QuantizedTensor:
        """Quantize ``x`` into the existing buffers of ``qt`` (its held usages), in place."""
        if not isinstance(qt, self._tensor_class()):
            raise TypeError(f"{type(self).__name__}.update_quantized needs a "
                            f"{self._tensor_class().__name__}, got {type(qt).__name__}")
        if tuple(x.shape) != tuple(qt.shape):
            raise ValueError(f"update_quantized: shape {tuple(x.shape)} does not match the "
                             f"quantized tensor's {tuple(qt.shape)}")
        with self.usages(rowwise=qt.has_usage("rowwise"), columnwise=qt.has_usage("columnwise")):
            fresh = self.quantize(x)
        if fresh.metadata() != qt.metadata():
            raise ValueError(f"update_quantized: {qt!r} was made with other settings than {self!r}")
        for name, dst in qt.inner_tensors().items():
            src = getattr(fresh, name)
            if dst is not None:
                dst.copy_(src)
        return qt

    def make_empty(self, shape, dtype: torch.dtype = torch.float32,
                   device: torch.device | str | None = None) -> QuantizedTensor:
        """An uninitialized quantized tensor with this quantizer's usages, for update_quantized."""
        if dtype not in HIGH_PRECISION_DTYPES:
            raise TypeError(f"make_empty: dtype must be one of {HIGH_PRECISION_DTYPES}, "
                            f"got {dtype}")
        device = torch.device(device) if device is not None else torch.device("cpu")
        shape = tuple(shape)
        m, k = flatten_2d(shape)
        self._check_shape(shape, m, k)
        return self._tensor_class()(shape, dtype, **self._empty_fields(m, k, device))

    # ---- for subclasses -------------------------------------------------------------------
    def _check_input(self, x) -> None:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{type(self).__name__}.quantize expects a torch.Tensor, "
                            f"got {type(x).__name__}")
        if isinstance(x, QuantizedTensor):
            raise TypeError(f"{type(self).__name__}.quantize got an already quantized "
                            f"{type(x).__name__}; dequantize it first")
        if x.dtype not in HIGH_PRECISION_DTYPES:
            raise TypeError(f"{type(self).__name__}.quantize expects fp32, bf16 or fp16 input, "
                            f"got {x.dtype}")

    def _check_shape(self, shape, m: int, k: int) -> None:
        """Raise ValueError when the shape does not fit the format's blocks."""

    def row_multiple(self, *, rowwise: bool, columnwise: bool) -> int:
        """The multiple of M (the product of the leading dimensions) that quantizing with
        these usages needs: the block length of blocks that run along M (columnwise 1-D
        blocks, 2-D blocks), 1 where M is free. A GEMM module pads M up to it
        (``lowprec.linear.function``)."""
        return 1

    def col_multiple(self, *, rowwise: bool, columnwise: bool) -> int:
        """The multiple of K (the last dimension) that quantizing with these usages needs:
        the block length of blocks that run along K (rowwise 1-D blocks, 2-D blocks), 1
        where K is free. A linear pads its feature dimensions up to it with zeros
        (``lowprec.linear.function.feature_padding``)."""
        return 1

    def _tensor_class(self) -> type[QuantizedTensor]:
        raise NotImplementedError

    def _quantize_2d(self, x2d: torch.Tensor) -> dict[str, torch.Tensor | Any]:
        """Return the tensor fields for an (M, K) input, for the usages that are on."""
        raise NotImplementedError

    def _quantize_2d_fused(self, x2d: torch.Tensor, prologue) -> dict[str, torch.Tensor | Any]:
        """``_quantize_2d`` of ``prologue(x2d)`` in one kernel (formats that have one)."""
        raise NotImplementedError

    def _empty_fields(self, m: int, k: int, device: torch.device) -> dict[str, Any]:
        raise NotImplementedError

    def __repr__(self) -> str:
        params = ", ".join(f"{k}={v!r}" for k, v in self._repr_params().items())
        return (f"{type(self).__name__}({params}{', ' if params else ''}"
                f"rowwise={self.rowwise_usage}, columnwise={self.columnwise_usage})")

    def _repr_params(self) -> dict[str, Any]:
        return {}


def check_exact_only(op: str, rowwise: bool, columnwise: bool, exact_row: bool,
                     exact_col: bool) -> None:
    """A quantize that writes no codes (``codes=False``) must write the exact values of
    every direction it quantizes, else that direction would hold nothing."""
    if rowwise and not exact_row or columnwise and not exact_col:
        raise ValueError(f"{op}: codes=False needs the exact values of every direction it "
                         f"quantizes (rowwise={rowwise} exact_row={exact_row}, "
                         f"columnwise={columnwise} exact_col={exact_col})")


def _row_major_2d(x: torch.Tensor, m: int, k: int) -> torch.Tensor:
    """``x`` detached as a contiguous (m, k) matrix (stored data is always row-major)."""
    return x.detach() if x.dim() == 2 and x.is_contiguous() else \
        x.detach().reshape(m, k).contiguous()


def register_safe_globals(*objs) -> None:
    """Allow ``torch.load(weights_only=True)`` to rebuild lowprec objects."""
    torch.serialization.add_safe_globals([_rebuild_quantized_tensor, *objs])
