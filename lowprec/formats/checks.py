"""Shared numerics of the formats: the nominal dtypes and usages, the 2-D shape of a
quantized tensor, and the checks of shapes and constructor options that quantizers and
recipes run.

Re-exported by ``lowprec.formats.base``, where the rest of lowprec imports them from.
"""

from __future__ import annotations

import numbers
import sys
from typing import TYPE_CHECKING, Any

import torch

from .casting import FP32_MAX

if TYPE_CHECKING:
    from .quantizer import Quantizer

HIGH_PRECISION_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
USAGES = ("rowwise", "columnwise")


def check_usage(usage: str) -> str:
    if usage not in USAGES:
        raise ValueError(f"usage={usage!r} is not valid; use 'rowwise' or 'columnwise'")
    return usage


def flatten_2d(shape: torch.Size | tuple[int, ...]) -> tuple[int, int]:
    """(M, K) for a nominal shape: M = prod(shape[:-1]), K = shape[-1]; a 0-d tensor is the
    (1, 1) matrix of its one value (one scaling unit, as Transformer Engine quantizes it)."""
    if len(shape) == 0:
        return 1, 1
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
    # a float first: the ABC check below costs a compiled call's trace tens of steps
    if type(value) is float and 0.0 <= value <= FP32_MAX:
        return value
    if (isinstance(value, numbers.Real) and not isinstance(value, bool)
            and 0.0 <= value <= FP32_MAX):
        return float(value)
    raise ValueError(f"{owner}: {name} must be a real number >= 0 and at most the fp32 "
                     f"maximum {FP32_MAX!r}, got {value!r} ({type(value).__name__})")



def check_exact_only(op: str, rowwise: bool, columnwise: bool, exact_row: bool,
                     exact_col: bool) -> None:
    """A quantize that writes no codes (``codes=False``) must write the exact values of
    every direction it quantizes, else that direction would hold nothing."""
    if rowwise and not exact_row or columnwise and not exact_col:
        raise ValueError(f"{op}: codes=False needs the exact values of every direction it "
                         f"quantizes (rowwise={rowwise} exact_row={exact_row}, "
                         f"columnwise={columnwise} exact_col={exact_col})")

