"""``Float8Experts``: a 3-D expert weight held as FP8 codes with one scale an expert.

FP8 current scaling's grouped path quantizes a (E, N, K) expert weight one expert at a time
(:func:`.grouped.quantize_experts`: each expert's amax, scale and codes). A weight that
arrives already in that form (the unsharded parameter of an FSDP2 quantized all-gather,
:mod:`lowprec.distributed.experts_gather`) is a ``Float8Experts``: the module's weight for
the forward and backward, whose GEMMs read its codes and scales instead of quantizing the
weight again (the same bits: the quantize is each expert's own).

It supports what FSDP2 and autograd do to a parameter (aliases and detaches) and a cast
to another floating dtype (the same codes, the weight's dtype changed: a module computing in
bf16 over fp32 parameters); any other op raises: its values are for the grouped GEMMs,
:meth:`dequantize` gives them as a plain tensor.
"""

from __future__ import annotations

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


class Float8Experts(torch.Tensor):
    """(E, N, K) experts as FP8 ``codes`` (E, N, K) and fp32 encode ``scales`` (E,): the
    value of expert e is ``codes[e] / scales[e]``. ``dtype``: the weight's high-precision
    dtype (its gradient's)."""

    @staticmethod
    def __new__(cls, codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype,
                requires_grad: bool = False):
        if codes.dim() != 3 or codes.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
            raise ValueError(f"Float8Experts codes must be a 3-D float8 tensor, got "
                             f"{codes.dtype} of shape {tuple(codes.shape)}")
        if tuple(scales.shape) != (codes.shape[0],) or scales.dtype != torch.float32:
            raise ValueError(f"Float8Experts scales must be fp32 of shape ({codes.shape[0]},), "
                             f"got {scales.dtype} of shape {tuple(scales.shape)}")
        self = torch.Tensor._make_wrapper_subclass(cls, codes.shape, dtype=dtype,
                                                   device=codes.device,
                                                   requires_grad=requires_grad)
        self.codes, self.scales = codes, scales
        return self

    __torch_function__ = torch._C._disabled_torch_function_impl

    @property
    def fp8_dtype(self) -> torch.dtype:
        return self.codes.dtype

    def __repr__(self, *, tensor_contents=None):
        return (f"Float8Experts(shape={tuple(self.shape)}, dtype={self.dtype}, "
                f"fp8={self.codes.dtype}, device={self.device})")

    def __tensor_flatten__(self):
        return ["codes", "scales"], self.dtype

    @staticmethod
    def __tensor_unflatten__(inner, dtype, outer_size, outer_stride):
        return Float8Experts(inner["codes"], inner["scales"], dtype)

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The experts' values ``codes / scales`` as a plain tensor (the weight's dtype)."""
        values = self.codes.to(torch.float32) / self.scales[:, None, None]
        return values.to(dtype or self.dtype)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func in _ALIASES or (func is aten.as_strided.default and _identity_view(*args)):
            # FSDP2 takes its unsharded parameter as as_strided(t, t.shape, contiguous
            # strides, 0): the one strided view these experts have
            src = args[0]
            return Float8Experts(src.codes, src.scales, src.dtype)
        if func is aten._to_copy.default and _dtype_only(args[0], kwargs or {}):
            # a cast of the weight (a module computing in bf16): the same codes and scales;
            # autograd casts the gradient back
            return Float8Experts(args[0].codes, args[0].scales, kwargs["dtype"])
        raise TypeError(f"Float8Experts (FP8 experts for grouped GEMMs) does not support "
                        f"{func}; its values are codes / scales (dequantize())")
