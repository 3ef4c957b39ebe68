"""Statistics of one quantized operand against its high-precision value, and their sum over
the calls of one step.

Per direction of one quantize call (:func:`direction_stats`), from what the step really
quantized (:mod:`.scaling`):

* ``amax``: max |x| of the high-precision input (NaN if it holds a NaN);
* ``scale``: the per-tensor encode scale (per-tensor FP8; NVFP4's global scale), else None;
* ``block_scale_min`` / ``block_scale_max``: the smallest and largest block decode scale
  (block FP8, MXFP8, NVFP4; non-finite blocks left out), else None;
* ``saturated``: elements whose scaled value exceeded the element format's largest
  magnitude, so the cast clipped them;
* ``flushed``: finite nonzero inputs that came back as zero;
* ``signal`` / ``noise``: ``sum x^2`` and ``sum (x - dequant)^2`` in float64, for the SQNR;
* ``nonfinite``: NaN/Inf elements of the input; ``nonfinite_quantized``: of the values
  the direction gives back.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..formats.base import QuantizedTensor, flatten_2d
from .scaling import direction_scaling


def signal_noise(x: torch.Tensor, approx: torch.Tensor) -> tuple[float, float]:
    """``(sum x^2, sum (x - approx)^2)`` in float64."""
    x64, a64 = x.detach().double(), approx.detach().double()
    both = torch.stack(((x64 * x64).sum(), ((x64 - a64) ** 2).sum()))
    signal, noise = both.tolist()
    return signal, noise


def sqnr_from(signal: float, noise: float) -> float:
    """``10 log10(signal / noise)`` in dB: inf for an exact match of a nonzero signal, NaN
    where either sum is not finite or both are zero, -inf for a zero signal."""
    if not math.isfinite(noise) or not math.isfinite(signal):
        return float("nan")
    if noise == 0.0:
        return float("inf") if signal > 0 else float("nan")
    if signal == 0.0:
        return float("-inf")
    return 10.0 * math.log10(signal / noise)


def sqnr_db(x: torch.Tensor, approx: torch.Tensor) -> float:
    """``10 log10(sum x^2 / sum (x - approx)^2)`` in float64; inf for an exact match."""
    return sqnr_from(*signal_noise(x, approx))


@dataclass
class DirectionStats:
    """One direction of one quantize call (see the module docstring)."""

    numel: int
    amax: float
    scale: float | None
    block_scale_min: float | None
    block_scale_max: float | None
    saturated: int | None
    nonzero: int
    flushed: int
    signal: float
    noise: float
    nonfinite: int
    nonfinite_quantized: int


def _finite_range(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(min, max) over the finite elements of ``t``; (inf, -inf) where there are none."""
    ok = torch.isfinite(t)
    inf = torch.full_like(t, float("inf"))
    return torch.where(ok, t, inf).amin(), torch.where(ok, t, -inf).amax()


def direction_stats(x: torch.Tensor, qt: QuantizedTensor, usage: str,
                    quantizer=None) -> DirectionStats:
    """The statistics of ``qt``'s ``usage`` direction, quantized from ``x`` by
    ``quantizer`` (see the module docstring). One host synchronization."""
    m, k = flatten_2d(x.shape)
    x2d = x.detach().reshape(m, k)
    sc = direction_scaling(qt, usage, x2d, quantizer)
    src, stored = sc.source, sc.stored
    if sc.transformed:  # SQNR in x's own domain, the one both GEMM operands end up in
        values, approx = x2d, qt.dequantize(torch.float32, usage).reshape(m, k)
    else:
        values, approx = src, stored
    x64, a64 = values.double(), approx.double()
    finite = torch.isfinite(src)
    nonzero = finite & (src != 0)
    zero = src.new_zeros((), dtype=torch.float64)
    saturated = ((sc.encoded.abs() > sc.grid_max).sum() if sc.encoded is not None else zero)
    scale = sc.scale.reshape(()) if sc.scale is not None else zero
    lo, hi = (_finite_range(sc.block_decode.to(torch.float32)) if sc.block_decode is not None
              else (zero, zero))
    parts = [x2d.abs().amax().to(torch.float64) if x2d.numel() else zero, scale, lo, hi,
             saturated, nonzero.sum(), (nonzero & (stored == 0)).sum(),
             (x64 * x64).sum(), ((x64 - a64) ** 2).sum(), (~finite).sum(),
             (~torch.isfinite(stored)).sum()]
    vals = torch.stack([p.to(torch.float64) for p in parts]).tolist()
    amax, scale_v, lo_v, hi_v, sat, nz, flushed, signal, noise, bad, bad_q = vals
    has_blocks = sc.block_decode is not None and math.isfinite(lo_v)
    if sc.encoded is not None or not sc.clips:
        saturated_n = int(sat)
    else:
        saturated_n = None  # a format that clips, read without its scales: unknown
    return DirectionStats(
        numel=src.numel(), amax=amax, scale=scale_v if sc.scale is not None else None,
        block_scale_min=lo_v if has_blocks else None,
        block_scale_max=hi_v if has_blocks else None, saturated=saturated_n,
        nonzero=int(nz), flushed=int(flushed), signal=signal, noise=noise, nonfinite=int(bad),
        nonfinite_quantized=int(bad_q))


class StepStats:
    """One (layer, role, direction) summed over the quantize calls of one step: counts
    add up, the amax is the largest, the block scale range the widest, the scale and
    format those of the last call; the SQNR is that of all calls' values together."""

    def __init__(self) -> None:
        self.calls = 0
        self.format = ""
        self.shape: tuple = ()
        self.numel = self.nonzero = self.flushed = self.nonfinite = 0
        self.saturated: int | None = 0
        self.signal = self.noise = 0.0
        self.amax = float("-inf")
        self.scale: float | None = None
        self.block_min: float | None = None
        self.block_max: float | None = None

    def add(self, s: DirectionStats, fmt: str, shape: tuple) -> None:
        self.calls += 1
        self.format, self.shape = fmt, shape
        self.numel += s.numel
        self.nonzero += s.nonzero
        self.flushed += s.flushed
        self.nonfinite += s.nonfinite
        self.saturated = (None if self.saturated is None or s.saturated is None
                          else self.saturated + s.saturated)
        self.signal += s.signal
        self.noise += s.noise
        # NaN sticks: a NaN amax in any call is the step's
        self.amax = s.amax if math.isnan(s.amax) or s.amax > self.amax else self.amax
        self.scale = s.scale
        if s.block_scale_min is not None:
            self.block_min = s.block_scale_min if self.block_min is None else \
                min(self.block_min, s.block_scale_min)
            self.block_max = s.block_scale_max if self.block_max is None else \
                max(self.block_max, s.block_scale_max)

    def row(self) -> dict:
        """The CSV columns from ``format`` to ``nonfinite`` (see ``lowprec.debug.COLUMNS``)."""
        return {
            "format": self.format, "shape": "x".join(str(d) for d in self.shape),
            "calls": self.calls, "amax": self.amax, "scale": self.scale,
            "block_scale_min": self.block_min, "block_scale_max": self.block_max,
            "saturated": None if self.saturated is None or not self.numel
            else self.saturated / self.numel,
            "flushed": self.flushed / self.nonzero if self.nonzero else 0.0,
            "sqnr_db": sqnr_from(self.signal, self.noise), "nonfinite": self.nonfinite}
