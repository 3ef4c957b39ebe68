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

This module is where the rest of lowprec imports these names from; the code lives in

* ``checks``: nominal dtypes and usages, the 2-D shape, shape and option checks;
* ``quantized_tensor``: ``QuantizedTensor``, its ``__torch_dispatch__`` handler table and
  its pickling (``_rebuild_quantized_tensor`` keeps this module's path in pickles);
* ``quantizer``: ``Quantizer``.

Everything the module defined before the split is re-exported here, private names
included, so ``lowprec.formats.base.<name>`` keeps naming the same object.
"""

from __future__ import annotations

from .checks import (
    HIGH_PRECISION_DTYPES,
    USAGES,
    check_amax_epsilon,
    check_bool_option,
    check_divisible,
    check_exact_only,
    check_int_option,
    check_usage,
    flatten_2d,
    rows_fit,
)
from .quantized_tensor import (
    _CONVERSIONS,
    _HANDLERS,
    _HANDLERS_BY_PACKET,
    COLUMNWISE_IN_BACKWARD_ATTR,
    REQUANTIZE_ATTR,
    DequantizeFunction,
    QuantizedTensor,
    _as_strided,
    _clone,
    _Conversions,
    _copy,
    _detach,
    _empty_like,
    _flat_tensors,
    _handles,
    _is_parameter,
    _like_args,
    _rebuild_quantized_tensor,
    _requantize_into,
    _to_copy,
    _view,
    _view_shape,
    aten,
    columnwise_from_backward,
    contiguous_data,
    keep_quantized,
    register_safe_globals,
    user_attributes,
)
from .quantizer import Quantizer, _row_major_2d

__all__ = [
    # checks
    "HIGH_PRECISION_DTYPES", "USAGES", "check_usage", "flatten_2d", "rows_fit",
    "check_divisible", "check_bool_option", "check_int_option", "check_amax_epsilon",
    "check_exact_only",
    # quantized_tensor
    "aten", "QuantizedTensor", "contiguous_data", "DequantizeFunction", "_Conversions",
    "_CONVERSIONS",
    "keep_quantized", "_flat_tensors", "user_attributes", "_is_parameter",
    "_rebuild_quantized_tensor", "_HANDLERS", "_HANDLERS_BY_PACKET", "_handles", "_detach",
    "_clone", "_copy", "REQUANTIZE_ATTR", "COLUMNWISE_IN_BACKWARD_ATTR",
    "columnwise_from_backward", "_requantize_into",
    "_like_args", "_to_copy",
    "_empty_like", "_view_shape", "_view", "_as_strided", "register_safe_globals",
    # quantizer
    "Quantizer", "_row_major_2d",
]
