"""Uniform draws for NVFP4 stochastic rounding: a counter-based generator keyed by torch's RNG.

Each quantized direction takes one *key* from torch's generator (the quantizer's, else the
default generator of the input's device): two 32-bit words ``k0, k1`` drawn with
``torch.randint``, rowwise direction first. The uniform of the element at row-major index
``i`` of that direction's (R, C) matrix is then a pure function of ``(key, i)``::

    h = mix(lo32(i) * 0x9E3779B9 + hi32(i) * 0x85EBCA6B + k0) ^ k1     (mod 2**32)
    u = (h >> 10) * 2**-22                     # exact in fp32, in [0, 1)

with ``mix`` the 32-bit integer hash ``x ^= x >> 16; x *= 0x7FEB352D; x ^= x >> 15;
x *= 0x846CA68B; x ^= x >> 16`` (arithmetic mod 2**32; "lowbias32", a published
low-bias constant set). The index is spread by an odd (golden-ratio) multiplier, so
neighbouring elements enter the hash far apart. For a fixed key and ``hi32(i)`` the map
from ``lo32(i)`` to ``h`` is a bijection, so over 2**32 consecutive elements every 22-bit
value of ``u`` occurs equally often. One hash round per element: the quantize kernels
that draw are bound by instruction issue, and a second round cost about a tenth of them.
22 bits, because that is the resolution of the rounding decision from 1 up, where v has
22 bits below the E2M1 grid step (``casting.stochastic_round_e2m1_codes``); the kernels
then decide with one integer add (``triton_kernels._sr_codes``).

Why not ``torch.rand``: materializing one fp32 uniform per element costs a write and a read
of 4 bytes per element, more memory traffic than the quantization itself; the Triton
kernels evaluate the same function in registers (``triton_kernels._sr_uniform``), and this
module is the pure-torch definition they are tested against bit for bit. ``torch.manual_seed``
(or the quantizer's ``generator``) makes the draws repeatable.
"""

from __future__ import annotations

import torch

MASK32 = 0xFFFFFFFF
MIX_MUL = (0x7FEB352D, 0x846CA68B)
#: Odd multipliers spreading the low and high 32 bits of an element index.
INDEX_MUL = (0x9E3779B9, 0x85EBCA6B)
MIX_SHIFT = (16, 15, 16)


def draw_key(generator: torch.Generator | None, device) -> torch.Tensor:
    """One key: an int64 (2,) tensor on ``device`` holding two values in [0, 2**32)."""
    return torch.randint(0, 1 << 32, (2,), dtype=torch.int64, generator=generator,
                         device=device)


def _mul32(h: torch.Tensor, c: int) -> torch.Tensor:
    """``h * c mod 2**32`` for int64 ``h`` in [0, 2**32), without int64 overflow."""
    lo, hi = c & 0xFFFF, c >> 16
    return (h * lo + (((h * hi) & 0xFFFF) << 16)) & MASK32


def mix32(h: torch.Tensor) -> torch.Tensor:
    """The 32-bit hash of the module doc, on int64 tensors holding uint32 values."""
    h = h ^ (h >> MIX_SHIFT[0])
    h = _mul32(h, MIX_MUL[0])
    h = h ^ (h >> MIX_SHIFT[1])
    h = _mul32(h, MIX_MUL[1])
    return h ^ (h >> MIX_SHIFT[2])


def uniforms_at(key: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """fp32 uniforms of the (non-negative, int64) row-major element indices ``index``."""
    k0, k1 = key.to(torch.int64).reshape(2).to(index.device).unbind()
    lo = index & MASK32
    hi = (index >> 32) & MASK32
    h = mix32((_mul32(lo, INDEX_MUL[0]) + _mul32(hi, INDEX_MUL[1]) + k0) & MASK32) ^ k1
    return (h >> 10).to(torch.float32) * (2.0 ** -22)


def uniforms(key: torch.Tensor, rows: int, cols: int, start: int = 0,
             device=None) -> torch.Tensor:
    """The (rows, cols) fp32 uniforms of one direction (see the module doc), of the
    row-major indices from ``start`` on (a slice of a larger matrix), on ``device``
    (default: the key's)."""
    index = start + torch.arange(rows * cols, dtype=torch.int64,
                                 device=key.device if device is None else device)
    return uniforms_at(key, index).reshape(rows, cols)
