"""Random Hadamard transform (RHT) for NVFP4 columnwise (wgrad) operands.

The transform acts on 16-element tiles of the last dimension. For a tile
``v`` (a row vector of 16 values)::

    y = H16 @ (s * v) / 4        i.e.   y = v @ R,   R = diag(s) @ H16 / 4

where ``H16`` is the 16x16 Sylvester Hadamard matrix (entries
``(-1)**popcount(i & j)``) and ``s`` a fixed +-1 sign vector. ``R`` is
orthogonal (``R @ R.T == I``), so the transform cancels in a GEMM whose two
operands both carry it along the contraction dimension.

The sign vector is fixed by :data:`RHT_SIGN_MASK` = ``0xD7E8``: bit ``i`` set
means ``s[i] = -1``, i.e.
``(1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1)``.

Numerics (fp32, the product's definition; kernels must match bit for bit):
forward = sign multiply, then four butterfly stages ``(a, b) -> (a + b, a - b)``
at strides 8, 4, 2, 1 in that order (each add/sub rounded to fp32), then
``* 0.25``. The inverse runs the same butterflies on ``y``, multiplies by 0.25
and then by ``s`` (``H16 @ H16 = 16 I``).
"""

from __future__ import annotations

import torch

RHT_TILE = 16
RHT_SIGN_MASK = 0xD7E8
_STRIDES = (8, 4, 2, 1)


def rht_signs(dtype: torch.dtype = torch.float32, device=None) -> torch.Tensor:
    """The fixed sign vector ``s`` (16 entries of +-1)."""
    bits = [(RHT_SIGN_MASK >> i) & 1 for i in range(RHT_TILE)]
    return torch.tensor([-1.0 if b else 1.0 for b in bits], dtype=dtype, device=device)


def hadamard16() -> torch.Tensor:
    """The 16x16 Sylvester Hadamard matrix (float64, entries +-1)."""
    idx = torch.arange(RHT_TILE)
    parity = torch.zeros(RHT_TILE, RHT_TILE, dtype=torch.int64)
    both = idx[:, None] & idx[None, :]
    for bit in range(4):
        parity ^= (both >> bit) & 1
    return (1 - 2 * parity).to(torch.float64)


def rht_matrix() -> torch.Tensor:
    """float64 ``R = diag(s) @ H16 / 4`` with ``y = v @ R`` for a row tile ``v``."""
    return torch.diag(rht_signs(torch.float64)) @ hadamard16() / 4


def _tiles(x: torch.Tensor) -> torch.Tensor:
    if x.dim() == 0 or x.shape[-1] % RHT_TILE:
        raise ValueError(f"the RHT needs the last dimension divisible by {RHT_TILE}; got shape "
                         f"{tuple(x.shape)} (tile {RHT_TILE})")
    return x.to(torch.float32).reshape(*x.shape[:-1], x.shape[-1] // RHT_TILE, RHT_TILE)


def _butterflies(t: torch.Tensor) -> torch.Tensor:
    lead = t.shape[:-1]
    for h in _STRIDES:
        # Element i pairs with i + h where bit h of i is clear.
        pairs = t.reshape(*lead, RHT_TILE // (2 * h), 2, h)
        a, b = pairs[..., 0, :], pairs[..., 1, :]
        t = torch.stack((a + b, a - b), dim=-2).reshape(*lead, RHT_TILE)
    return t


def rht_forward(x: torch.Tensor) -> torch.Tensor:
    """Apply the RHT to every 16-tile of the last dimension; fp32 result, same shape."""
    t = _tiles(x)
    t = _butterflies(t * rht_signs(device=t.device)) * 0.25
    return t.reshape(x.shape)


def rht_inverse(y: torch.Tensor) -> torch.Tensor:
    """Undo :func:`rht_forward` (fp32): butterflies, ``* 0.25``, then ``* s``."""
    t = _tiles(y)
    t = (_butterflies(t) * 0.25) * rht_signs(device=t.device)
    return t.reshape(y.shape)
