"""Exact element casts shared by every format's reference path.

All arithmetic here is fp32 (or exact integer/bit manipulation): these
functions *are* the product's numerics, and GPU kernels must reproduce them
bit for bit.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

FP8_MAX = {
    torch.float8_e4m3fn: 448.0,
    torch.float8_e5m2: 57344.0,
}

FP32_MAX = torch.finfo(torch.float32).max

# E2M1 magnitudes indexed by their 3-bit code (sign is bit 3).
E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_MAX = 6.0

# E8M0 (MX block scale) stores a biased exponent; 0xFF encodes NaN.
E8M0_BIAS = 127
E8M0_NAN = 255
E8M0_MIN_EXP = -127
E8M0_MAX_EXP = 127


def check_fp8_dtype(fp8_dtype) -> torch.dtype:
    """Validate an fp8 dtype argument and return it."""
    if fp8_dtype not in FP8_MAX:
        raise ValueError(
            f"fp8_dtype={fp8_dtype!r} is not supported; use torch.float8_e4m3fn or "
            f"torch.float8_e5m2"
        )
    return fp8_dtype


def cast_fp8(x_fp32: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """Round-to-nearest-even with saturation to the fp8 max finite value.

    Saturation is explicit (clamp, then convert) because torch's own fp8
    conversion maps out-of-range values differently across versions and
    devices. NaN stays NaN (clamp keeps NaN).
    """
    fmax = torch.finfo(fp8_dtype).max  # FP8_MAX's value; a constant to torch.compile
    return x_fp32.clamp(-fmax, fmax).to(fp8_dtype)


def scale_from_amax(amax: torch.Tensor, fp8_max: float, *, eps: float = 0.0,
                    pow2: bool = False) -> torch.Tensor:
    """Current-scaling rule shared by per-tensor and block FP8 (fp32 throughout).

    ``scale = fp8_max / max(amax, eps)``; amax 0 gives 1; an infinite scale
    becomes the fp32 max; ``pow2`` rounds the scale down to a power of two.
    A non-finite amax gives a NaN scale, so the whole scaling unit
    dequantizes to NaN instead of to a silent finite value.
    """
    amax = amax.to(torch.float32)
    clamped = torch.clamp_min(amax, eps) if eps > 0 else amax
    # The fp32 quotient, correctly rounded: computed in fp64 and rounded once (a quotient of
    # two fp32 values rounded to 53 bits, then to 24, is the correctly rounded one), so a
    # compiler whose fp32 division is approximate (inductor on the GPU) gives the same bits.
    # Clamped to the fp32 max before that rounding: a quotient past it (amax tiny) becomes
    # the max. ``amax < inf`` holds for a finite amax only (amax >= 0: a magnitude). Few ops
    # on purpose: the rule is traced into every compiled quantize. The fp32 max from finfo,
    # not a module global: torch.compile folds it to a constant, where a global float would
    # become a symbolic input under dynamic=True.
    quotient = (fp8_max / clamped.to(torch.float64)).clamp(max=torch.finfo(torch.float32).max)
    scale = torch.where(clamped == 0, 1.0, quotient.to(torch.float32))
    if pow2:
        scale = floor_pow2(scale)
    # the NaN from full_like: a scalar NaN compiles to other bits than eager's
    return torch.where(amax < float("inf"), scale, torch.full_like(scale, float("nan")))


def floor_pow2(x: torch.Tensor) -> torch.Tensor:
    """Largest power of two <= x for positive normal fp32 x (mantissa bits cleared)."""
    bits = x.contiguous().view(torch.int32) & 0x7F800000
    out = bits.view(torch.float32)
    return torch.where(torch.isfinite(x), out, x)


def ceil_pow2_exponent(x: torch.Tensor) -> torch.Tensor:
    """Exponent e of the smallest power of two >= x, for finite x > 0 (int32).

    Exact for subnormal fp32 too (frexp normalizes them).
    """
    mant, exp = torch.frexp(x.to(torch.float32))
    # x = mant * 2**exp with mant in [0.5, 1): an exact power of two has mant 0.5.
    return torch.where(mant == 0.5, exp - 1, exp).to(torch.int32)


def exp2_int(e: torch.Tensor) -> torch.Tensor:
    """2**e as fp32 for integer e in [-127, 127] (exact, subnormal 2**-127 included)."""
    return torch.ldexp(torch.ones_like(e, dtype=torch.float32), e.to(torch.int32))


def round_e2m1_codes(v: torch.Tensor) -> torch.Tensor:
    """Round fp32 values to E2M1 codes (uint8, sign in bit 3), nearest-even, saturating.

    Ties go to the even code (mantissa bit 0): 0.25->0, 0.75->1, 1.25->1,
    1.75->2, 2.5->2, 3.5->4, 5->4. NaN inputs give code 0; callers mark the
    block NaN through its scale.
    """
    a = v.abs()
    code = ((a > 0.25).to(torch.uint8) + (a >= 0.75).to(torch.uint8) + (a > 1.25).to(torch.uint8)
            + (a >= 1.75).to(torch.uint8) + (a > 2.5).to(torch.uint8) + (a >= 3.5).to(torch.uint8)
            + (a > 5.0).to(torch.uint8))
    return code | (torch.signbit(v).to(torch.uint8) << 3)


def stochastic_round_e2m1_codes(v: torch.Tensor, rand: torch.Tensor) -> torch.Tensor:
    """Stochastically round fp32 values to E2M1 codes.

    |v| is first cut toward zero to a multiple of 2**-23 (a no-op from 1 up, where fp32
    has no finer bits; below, it keeps 22 bits under the grid step 0.5, as from 1 up).
    For that value between grid neighbours lo < hi, round up when
    ``rand < (|v| - lo) / (hi - lo)``, so P(hi) is the spec's probability to 22 bits
    (``rand`` holds 22-bit uniform [0, 1) draws, one per element, see
    ``nvfp4/draws.py``); values on the grid are kept exactly and |v| >= 6 saturates
    to 6.
    """
    grid = _e2m1_grid(v.device)
    a = v.abs().clamp_max(E2M1_MAX)
    a = torch.where(a < 1.0, torch.floor(a * 2.0 ** 23) * 2.0 ** -23, a)  # exact in fp32
    # lo index: number of grid points <= a, minus one.
    lo_idx = (torch.bucketize(a, grid, right=True) - 1).clamp(0, 7)
    hi_idx = (lo_idx + 1).clamp_max(7)
    lo, hi = grid[lo_idx], grid[hi_idx]
    span = torch.where(hi > lo, hi - lo, torch.ones_like(hi))
    p_hi = (a - lo) / span
    up = (rand < p_hi) & (hi > lo)
    code = torch.where(up, hi_idx, lo_idx).to(torch.uint8)
    code = torch.where(torch.isnan(v), torch.zeros_like(code), code)
    return code | (torch.signbit(v).to(torch.uint8) << 3)


#: (name, device) -> a small fp32 constant tensor of a format (see device_constant)
_DEVICE_CONSTANTS: dict = {}


def device_constant(name: str, make, device: torch.device) -> torch.Tensor:
    """The small constant tensor ``make()`` (built on the CPU) on ``device``, made once per
    (name, device). Built from Python values on every call, it would be a host-to-device
    copy that synchronizes on a GPU; the copy here goes through pinned memory without one.
    Under tracing or a dispatch mode (fake tensors, meta) nothing is kept: the constant is
    built where it is used, as it always was."""
    device = torch.device(device)
    tracing = torch.compiler.is_compiling() or _get_current_dispatch_mode() is not None
    t = None if tracing else _DEVICE_CONSTANTS.get((name, device))
    if t is None:
        with torch.inference_mode(False):  # kept: usable outside inference mode too
            t = make()
            if tracing or device.type == "meta":
                return t.to(device)
            if device.type == "cuda":
                t = t.pin_memory().to(device, non_blocking=True)
            t = _DEVICE_CONSTANTS[(name, device)] = t.to(device)
    return t


def _e2m1_grid(device) -> torch.Tensor:
    return device_constant("e2m1", lambda: torch.tensor(E2M1_GRID, dtype=torch.float32), device)


def _e2m1_signed_table(device) -> torch.Tensor:
    # codes 0-7 are the grid, 8-15 its negation (code 8 is -0.0)
    return device_constant(
        "e2m1_signed", lambda: torch.cat((torch.tensor(E2M1_GRID, dtype=torch.float32),
                                          -torch.tensor(E2M1_GRID, dtype=torch.float32))),
        device)


#: elements :func:`e2m1_codes_to_float` decodes at once outside a graph
E2M1_DECODE_CHUNK = 1 << 22


def e2m1_codes_to_float(codes: torch.Tensor) -> torch.Tensor:
    """Decode E2M1 codes (uint8, low 4 bits) to fp32, keeping the sign of zero.

    A lookup in a signed 16-entry table. Eagerly it runs over chunks of the codes, since
    a lookup's int64 indices take twice the output's bytes; in a graph, inductor fuses the
    whole lookup into one kernel, with no indices in memory."""
    table = _e2m1_signed_table(codes.device)
    if torch.compiler.is_compiling() or codes.numel() <= E2M1_DECODE_CHUNK:
        return table[(codes & 15).long()]
    out = torch.empty(codes.shape, dtype=torch.float32, device=codes.device)
    flat, out_flat = codes.reshape(-1), out.view(-1)
    for i in range(0, flat.numel(), E2M1_DECODE_CHUNK):
        out_flat[i:i + E2M1_DECODE_CHUNK] = table[(flat[i:i + E2M1_DECODE_CHUNK] & 15).long()]
    return out


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """Pack pairs of codes along the last dim: element 2i in the low nibble."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_e2m1`."""
    lo = packed & 0x0F
    hi = packed >> 4
    return torch.stack((lo, hi), dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)
