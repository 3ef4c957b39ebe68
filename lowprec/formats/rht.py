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
forward = multiply by ``s / 8`` (entries +-0.125), then four butterfly stages
``(a, b) -> (a + b, a - b)`` at strides 8, 4, 2, 1 in that order (each add/sub
rounded to fp32), then ``* 2``. The inverse multiplies ``y`` by 0.125, runs the
same butterflies and multiplies by ``2 s`` (``H16 @ H16 = 16 I``).

Where the 1/4 goes: multiplying by a power of two commutes with fp32 rounding
while values stay in the normal range, so the split ``1/8 ... 2`` gives the bits
of "butterflies, then ``* 0.25``" evaluated with an unbounded exponent. An
output of stage ``k`` is a signed sum of ``2**k`` inputs: with the 1/8 up front,
the outputs of stages 1 to 3 stay within ``max |x|`` of the tile and the last
stage's are half the results, so an output is inf only where its own value
exceeds the fp32 range (a tile of ``x_i = s_i * fp32_max`` gives ``y_0 = inf``
and fifteen zeros, not NaNs). Dividing by less than 8 before stage 4 lets an
intermediate overflow next to finite results: the whole 1/4 after the
butterflies from ``max |x|`` ~ 2e37 on, 1/2 after each of the first two stages
from ``fp32_max / 2`` on, and with 1/4 up front an overflowing stage 3 turns
finite results into inf or NaN.

Dividing by more than 8 would only widen the range where the division rounds:
``x / 8`` is inexact where it is subnormal and not a multiple of ``2**-149``. A
tile whose inputs are all multiples of ``2**-146`` (every ``|x| >= 2**-123`` ~
9.4e-38, and zeros) gets exactly the "butterflies, then ``* 0.25``" bits; a tile
holding a smaller input with low bits set may not (that input's ``x / 8`` is off
by at most ``2**-150``), though its results keep the usual fp32 accuracy.
"""

from __future__ import annotations

import torch

from .casting import device_constant

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
    """Apply the RHT to every 16-tile of the last dimension; fp32 result, same shape
    (``* s / 8``, butterflies, ``* 2``: see the module docstring)."""
    t = _tiles(x)
    t = _butterflies(t * device_constant("rht_fwd", lambda: rht_signs() * 0.125, t.device)) * 2.0
    return t.reshape(x.shape)


def rht_inverse(y: torch.Tensor) -> torch.Tensor:
    """Undo :func:`rht_forward` (fp32): ``* 0.125``, butterflies, then ``* 2 s``."""
    t = _tiles(y)
    t = _butterflies(t * 0.125) * device_constant("rht_inv", lambda: rht_signs() * 2.0, t.device)
    return t.reshape(y.shape)


#: elements :func:`rht_inverse_` transforms at once outside a graph
RHT_CHUNK_ELEMENTS = 1 << 22


def rht_inverse_(y: torch.Tensor) -> torch.Tensor:
    """:func:`rht_inverse` of a 2-D fp32 ``y`` written back into ``y``, chunk of rows by
    chunk of rows (the tiles run along rows): a chunk's temporaries are alive at a time
    instead of three copies of ``y``. For a ``y`` the caller owns. In a graph (where
    inductor fuses the transform), or for a ``y`` that is not 2-D fp32, it returns
    :func:`rht_inverse`'s new tensor instead; use the return value."""
    if torch.compiler.is_compiling() or y.dim() != 2 or y.dtype != torch.float32:
        return rht_inverse(y)
    rows = max(1, RHT_CHUNK_ELEMENTS // max(y.shape[1], 1))
    for i in range(0, y.shape[0], rows):
        y[i:i + rows] = rht_inverse(y[i:i + rows])
    return y
