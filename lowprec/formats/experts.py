"""``QuantizedExperts``: the base of 3-D expert weights held in a quantized form.

The unsharded parameter of an FSDP2 quantized all-gather of a (E, N, K) expert weight
(:mod:`lowprec.distributed.experts_gather`) arrives as its codes and scales, not as the
high-precision tensor. A subclass per format holds them (``_inner``: the inner tensors,
``_meta``: plain settings) and poses as the (E, N, K) weight: the grouped GEMMs read its
codes as they are, the module's forward and backward see it as its weight.

It supports what FSDP2 and autograd do to a parameter (aliases and detaches, FSDP's
identity ``as_strided``) and a cast to another floating dtype (the same codes, the
weight's dtype changed: a module computing in bf16 over fp32 parameters). Any other op
raises, naming it: the values are for the grouped GEMMs, ``dequantize()`` gives them as a
plain tensor.
"""

from __future__ import annotations

from typing import ClassVar

import torch

aten = torch.ops.aten

#: ops that give the same weight back (FSDP2 makes its unsharded parameter with them)
_ALIASES = frozenset({aten.detach.default, aten.alias.default})


def _dtype_only(t, kwargs) -> bool:
    """Whether a ``_to_copy`` only changes the (floating) dtype."""
    extra = {k: v for k, v in kwargs.items() if k != "dtype" and v is not None}
    device = extra.pop("device", t.device)
    extra.pop("layout", None)
    return (not extra and torch.device(device) == t.device
            and kwargs.get("dtype", t.dtype).is_floating_point)


def _identity_view(t, size, stride, storage_offset=0) -> bool:
    return (tuple(size) == tuple(t.shape) and storage_offset == 0
            and tuple(stride) == torch.empty(tuple(size), device="meta").stride())


class QuantizedExperts(torch.Tensor):
    """(E, N, K) experts in a quantized form; ``dtype``: the weight's high-precision dtype
    (its gradient's). Subclasses declare ``_inner`` and ``_meta``, and ``_block`` and
    ``_layout`` for the generic ``_check`` (or check their fields in their own)."""

    _inner: ClassVar[tuple[str, ...]] = ()
    _meta: ClassVar[tuple[str, ...]] = ()
    #: each expert holds whole (block, block) tiles: N and K are multiples of it
    _block: ClassVar[int] = 1

    @staticmethod
    def __new__(cls, shape, dtype: torch.dtype, *, requires_grad: bool = False, **fields):
        first = fields[cls._inner[0]]
        self = torch.Tensor._make_wrapper_subclass(cls, tuple(shape), dtype=dtype,
                                                   device=first.device,
                                                   requires_grad=requires_grad)
        missing = [name for name in cls._inner + cls._meta if name not in fields]
        if missing:
            raise TypeError(f"{cls.__name__} needs the fields {missing}")
        for name in cls._inner + cls._meta:
            setattr(self, name, fields.pop(name))
        if fields:
            raise TypeError(f"{cls.__name__} got unknown fields {sorted(fields)}")
        self._check()
        return self

    def _layout(self, e: int, n: int, k: int) -> dict:
        """Each inner tensor's (accepted dtypes, their name in messages, shape) for E experts
        of (N, K)."""
        raise NotImplementedError

    def _check(self) -> None:
        """Raise ValueError where the fields do not describe (E, N, K) experts of whole
        blocks, laid out as ``_layout`` says."""
        name = type(self).__name__
        if len(self.shape) != 3:
            raise ValueError(f"{name} must be (E, N, K), got shape {tuple(self.shape)}")
        e, n, k = self.shape
        b = self._block
        if n % b or k % b:
            raise ValueError(f"{name} needs N and K multiples of {b} (whole {b}x{b} blocks in "
                             f"each expert), got shape {tuple(self.shape)}")
        for field, (dtypes, what, shape) in self._layout(e, n, k).items():
            t = getattr(self, field)
            if t.dtype not in dtypes or tuple(t.shape) != shape:
                raise ValueError(f"{name} {field} must be {what} of shape {shape}, got "
                                 f"{t.dtype} of shape {tuple(t.shape)}")

    __torch_function__ = torch._C._disabled_torch_function_impl

    def fields(self) -> dict:
        """The inner tensors and settings, as the constructor takes them."""
        return {name: getattr(self, name) for name in self._inner + self._meta}

    @classmethod
    def build(cls, shape, dtype: torch.dtype, fields: dict) -> "QuantizedExperts":
        """One of these experts from the constructor's generic form (subclasses may give
        their own constructor a shorter signature)."""
        return QuantizedExperts.__new__(cls, shape, dtype, **fields)

    def with_dtype(self, dtype: torch.dtype) -> "QuantizedExperts":
        """The same codes posing as a weight of ``dtype``."""
        return self.build(self.shape, dtype, self.fields())

    def __repr__(self, *, tensor_contents=None):
        parts = [f"shape={tuple(self.shape)}", f"dtype={self.dtype}"]
        codes = getattr(self, self._inner[0])
        if codes.dtype.is_floating_point:  # FP8 codes: name E4M3 or E5M2
            parts.append(f"fp8={codes.dtype}")
        parts += [f"{name}={getattr(self, name)}" for name in self._meta]
        parts.append(f"device={self.device}")
        return f"{type(self).__name__}({', '.join(parts)})"

    def __tensor_flatten__(self):
        return list(self._inner), (tuple(self.shape), self.dtype,
                                   {name: getattr(self, name) for name in self._meta})

    @classmethod
    def __tensor_unflatten__(cls, inner, ctx, outer_size, outer_stride):
        shape, dtype, meta = ctx
        return cls.build(shape, dtype, {**inner, **meta})

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The experts' values as a plain (E, N, K) tensor (the weight's dtype)."""
        raise NotImplementedError

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func in _ALIASES or (func is aten.as_strided.default and _identity_view(*args)):
            # FSDP2 takes its unsharded parameter as as_strided(t, t.shape, contiguous
            # strides, 0): the one strided view these experts have
            return args[0].with_dtype(args[0].dtype)
        if func is aten._to_copy.default and _dtype_only(args[0], kwargs or {}):
            # a cast of the weight (a module computing in bf16): the same codes; autograd
            # casts the gradient back
            return args[0].with_dtype(kwargs["dtype"])
        raise TypeError(f"{cls.__name__} (quantized experts for grouped GEMMs) does not "
                        f"support {func}; dequantize() gives their values")
