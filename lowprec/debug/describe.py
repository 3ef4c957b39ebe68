"""Names of the format a quantizer gives one GEMM direction, for reports and CSV rows."""

from __future__ import annotations

import torch

from ..formats import HybridQuantizer

_FP8_NAMES = {torch.float8_e4m3fn: "e4m3", torch.float8_e5m2: "e5m2"}


def format_of(q, usage: str) -> str:
    """The format ``q`` quantizes ``usage`` ("rowwise" or "columnwise") in, e.g.
    ``fp8_current(e4m3)``, ``mxfp8(e5m2)``, ``nvfp4+rht+sr``, ``identity``: the quantizer's
    ``format_name``, its fp8 dtype, and the options that change the numbers (RHT on the
    columnwise direction, 2D blocks, stochastic rounding). A hybrid names the quantizer of
    that direction."""
    if isinstance(q, HybridQuantizer):
        q = q.rowwise_quantizer if usage == "rowwise" else q.columnwise_quantizer
    name = getattr(q, "format_name", type(q).__name__)
    fp8 = getattr(q, "fp8_dtype", None)
    if fp8 is not None:
        name += f"({_FP8_NAMES.get(fp8, fp8)})"
    extras = [tag for tag, on in (("rht", getattr(q, "with_rht", False) and usage == "columnwise"),
                                  ("2d", getattr(q, "with_2d_quantization", False)),
                                  ("sr", getattr(q, "stochastic_rounding", False))) if on]
    return name + (f"+{'+'.join(extras)}" if extras else "")
