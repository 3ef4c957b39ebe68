"""Stochastic rounding of fp32 values to bf16 with reproducible random bits.

The random bits of an element are a hash of (seed, step, tensor, element index), not the
output of a generator: a step gives the same bits on any device, after a resume (nothing
but the step counter needs saving), for any split of the tensor over ranks (the index is
the element's index in the whole tensor), and a kernel can compute them where it rounds.
The hash is integer arithmetic that int64 torch ops and uint32 kernel code compute alike:
every product is a value below 2**32 times a constant below 2**31.
"""

from __future__ import annotations

import torch

M32 = 0xFFFFFFFF
_C1, _C2 = 0x7FEB352D, 0x5BD1E995


def mix32(h):
    """A 32-bit integer hash (xor-shift-multiply) of ``h`` (a Python int, or an int64 tensor
    of values in [0, 2**32)); same type out."""
    h = h & M32
    h = ((h ^ (h >> 16)) * _C1) & M32
    h = ((h ^ (h >> 15)) * _C2) & M32
    return h ^ (h >> 16)


def stream_base(seed: int, step: int) -> int:
    """What the keys of every tensor at one step derive from."""
    return mix32(mix32(seed) ^ (step & M32))


def stream_key(seed: int, step: int, tensor_id: int) -> int:
    """The key of one tensor's random bits at one step."""
    return mix32(stream_base(seed, step) ^ (tensor_id & M32))


def random_bits(n: int, key: int, offset: int, device) -> torch.Tensor:
    """Random 32-bit values (int64) of elements ``offset .. offset + n - 1`` under ``key``."""
    index = torch.arange(offset, offset + n, dtype=torch.int64, device=device)
    return mix32(mix32(index) ^ key)


def round_to_bf16_stochastic(x: torch.Tensor, key: int, offset: int = 0) -> torch.Tensor:
    """``x`` (fp32) rounded to bf16 stochastically: up in magnitude with probability equal
    to the dropped fraction of a bf16 unit, so the rounding is unbiased. Infinities stay,
    NaN stays NaN; a magnitude above bf16's largest may round to infinity. ``offset`` is
    the index of x's first element in the whole tensor (x is read flat, row-major)."""
    if x.dtype != torch.float32:
        raise TypeError(f"stochastic rounding to bf16 takes fp32 values, got {x.dtype}")
    flat = x.contiguous().view(-1)
    bits = flat.view(torch.int32).to(torch.int64) & M32
    noise = random_bits(flat.numel(), key, offset, flat.device) & 0xFFFF
    # sign and magnitude: adding below the kept 16 bits rounds the magnitude up exactly
    # when the noise exceeds the complement of the dropped bits
    half = ((bits + noise) >> 16) & 0xFFFF
    half = torch.where(half >= 0x8000, half - 0x10000, half).to(torch.int16)
    out = half.view(torch.bfloat16)
    out = torch.where(torch.isnan(flat), flat.to(torch.bfloat16), out)
    return out.view(x.shape)
