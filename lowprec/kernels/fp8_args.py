"""The host side of the fp8 cast every FP8-based format's kernels share
(``fp8_cast.py``): the fp8 formats' parameters and the constexpr arguments a launch passes.
Importing this module needs neither Triton nor CUDA."""

from __future__ import annotations

import torch

from .tuning import tuning

# fp8 dtype -> (mantissa bits, exponent bias, fp32 bits of the max finite value, max)
FP8_PARAMS = {
    torch.float8_e4m3fn: (3, 7, 0x43E00000, 448.0),
    torch.float8_e5m2: (2, 15, 0x47600000, 57344.0),
}


def fp8_dtype_of(is_e5m2: bool) -> torch.dtype:
    return torch.float8_e5m2 if is_e5m2 else torch.float8_e4m3fn


def kernel_fp8_args(fp8_dtype: torch.dtype) -> dict:
    """MBITS, BIAS, MAX_BITS of ``fp8_dtype`` and the cast switches of ``tuning``
    (``hw_cvt``, ``col_mode``)."""
    mbits, bias, max_bits, fmax = FP8_PARAMS[fp8_dtype]
    return {"MBITS": mbits, "BIAS": bias, "MAX_BITS": max_bits, "HW_CVT": tuning.hw_cvt,
            "COL_MODE": tuning.col_mode}
