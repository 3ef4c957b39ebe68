"""Random kernel inputs shared by the format kernel tests."""

from __future__ import annotations

import torch


def spread(x: torch.Tensor, dtype: torch.dtype, dist: str, gen: torch.Generator) -> torch.Tensor:
    """Normal fp32 ``x`` spread for ``dist`` and cast to ``dtype``: "wide" multiplies each
    element by 2**n, n uniform in [-span, span) (10 for float16, 60 otherwise), so the
    elements of one block lie many binades apart; "tiny" scales everything below the
    dtype's smallest normal; any other ``dist`` leaves the values (the caller places its
    own special values)."""
    if dist == "wide":
        span = 10 if dtype == torch.float16 else 60
        x = x * torch.exp2(torch.randint(-span, span, x.shape, generator=gen,
                                         device=x.device).float())
    elif dist == "tiny":
        x = x * torch.finfo(dtype).tiny * 0.3
    return x.to(dtype)
