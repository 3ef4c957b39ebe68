"""Statistics of one quantized operand against its high-precision value, and their sum over
the calls of one step.

Per direction of one quantize call, from what the step really quantized (:mod:`.scaling`):

* ``amax``: max |x| of the high-precision input (NaN if it holds a NaN);
* ``scale``: the per-tensor encode scale (per-tensor FP8; NVFP4's global scale), else None;
* ``block_scale_min`` / ``block_scale_max``: the smallest and largest block decode scale
  (block FP8, MXFP8, NVFP4; non-finite blocks left out), else None;
* ``saturated``: elements whose scaled value exceeded the element format's largest
  magnitude, so the cast clipped them;
* ``flushed``: finite nonzero inputs that came back as zero;
* ``signal`` / ``noise``: ``sum x^2`` and ``sum (x - dequant)^2``, for the SQNR;
* ``nonfinite``: NaN/Inf elements of the input; ``nonfinite_quantized``: whether the
  values the direction gives back hold a NaN/Inf.

Cost: :func:`operand_stats` computes them as device scalars, each a single reduction over
a tensor the step already has or one elementwise temporary, in fp32 (the sums of squares
are accumulated in fp32 by ``torch.linalg.vector_norm``, from bf16/fp16 inputs without an
upcast copy on CUDA; no fp64 copy of any operand is made), and never reads them back.
:func:`fetch` brings the scalars of any number of calls to the host in one transfer per
device (the recorder calls it once per recorded step); :meth:`OperandStats.resolve` then
gives each direction's :class:`DirectionStats`. :func:`direction_stats` does all three for
one direction (one transfer). ``signal`` and ``noise`` are the squares of fp32 2-norms:
about 1e-7 relative rounding, and an operand whose 2-norm exceeds the fp32 range (about
1.8e19) gives an infinite sum, so its SQNR reads NaN (unknown) rather than a wrong value.
:func:`sqnr_db` computes one SQNR in float64 for checks outside the recorder (and for
``lowprec compare``'s probe), over row chunks so that no float64 copy of a whole operand
is made.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..formats import QuantizedTensor, flatten_2d
from .scaling import direction_scaling, x_domain

#: dtypes ``torch.linalg.vector_norm`` reduces into fp32 directly (others are upcast first)
_NORM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_INF = float("inf")


#: elements of each row chunk :func:`signal_noise` upcasts at once (128 MiB of float64 each)
SQNR_CHUNK_ELEMENTS = 1 << 24


def signal_noise(x: torch.Tensor, approx: torch.Tensor,
                 chunk_elements: int = SQNR_CHUNK_ELEMENTS) -> tuple[float, float]:
    """``(sum x^2, sum (x - approx)^2)`` in float64 (one host synchronization).

    The sums run over chunks of whole rows of at most ``chunk_elements`` elements (one row
    where a row is longer), so the float64 copies stay small whatever the operand: an
    output head's gradient (8192 x 32000) would otherwise take four 2 GiB copies at once."""
    if x.shape != approx.shape:
        raise ValueError(f"signal_noise: x has shape {tuple(x.shape)} and approx "
                         f"{tuple(approx.shape)}; they must match")
    if chunk_elements < 1:
        raise ValueError(f"signal_noise: chunk_elements={chunk_elements}; it must be >= 1")
    if x.numel() == 0:
        return 0.0, 0.0
    cols = x.shape[-1] if x.dim() else 1
    x2, a2 = x.detach().reshape(-1, cols), approx.detach().reshape(-1, cols)
    rows = max(1, chunk_elements // max(cols, 1))
    sums = torch.zeros(2, dtype=torch.float64, device=x.device)
    for i in range(0, x2.shape[0], rows):
        x64, a64 = x2[i:i + rows].double(), a2[i:i + rows].double()
        sums[0] += (x64 * x64).sum()
        sums[1] += (x64 - a64).square_().sum()
    signal, noise = sums.tolist()
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


def norm32(t: torch.Tensor, ord: float = 2.0) -> torch.Tensor:
    """The fp32 ``ord``-norm of all of ``t`` as a 0-d device tensor (``inf``: max |t|, NaN
    if ``t`` holds a NaN); one reduction, accumulated in fp32 (a GPU reduction sums each
    thread's few hundred elements, then a tree: about 1e-7 relative). On CPU, whose
    vectorized norm runs each lane through the whole tensor (1e-5 relative at 8M
    elements), a 2-D ``t``'s 2-norm is taken per row, then over the rows."""
    if t.dtype not in _NORM_DTYPES:
        t = t.to(torch.float32)
    if ord == 2.0 and t.dim() == 2 and t.device.type == "cpu":
        t = torch.linalg.vector_norm(t, ord, dim=-1, dtype=torch.float32)
    return torch.linalg.vector_norm(t, ord, dtype=torch.float32)


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
    nonfinite_quantized: bool


class Pending:
    """Device scalars of one quantize call, read back by :func:`fetch`: fp32 values
    (``floats``) and exact counts (``counts``); after the fetch, ``host_floats`` and
    ``host_counts`` hold them as Python numbers, in the order they were added."""

    def __init__(self) -> None:
        self.floats: list[torch.Tensor] = []
        self.counts: list[torch.Tensor] = []
        self.host_floats: list[float] | None = None
        self.host_counts: list[int] | None = None

    def add_float(self, t: torch.Tensor) -> int:
        self.floats.append(t.reshape(()).to(torch.float32))
        return len(self.floats) - 1

    def add_count(self, t: torch.Tensor) -> int:
        self.counts.append(t.reshape(()).to(torch.int64))
        return len(self.counts) - 1


def fetch(pending: list[Pending]) -> None:
    """Bring the scalars of every call in ``pending`` to the host: stacked on the device
    and copied in one transfer per device (one host synchronization for a single-device
    model), then handed back to each call (``host_floats``, ``host_counts``)."""
    by_device: dict[torch.device, list[Pending]] = {}
    for p in pending:
        if p.floats or p.counts:
            first = p.floats[0] if p.floats else p.counts[0]
            by_device.setdefault(first.device, []).append(p)
    for group in by_device.values():
        floats = [t for p in group for t in p.floats]
        counts = [t for p in group for t in p.counts]
        # counts travel as float64: exact below 2**53 elements
        parts = [torch.stack(ts).to(torch.float64) for ts in (floats, counts) if ts]
        host = (torch.cat(parts) if len(parts) > 1 else parts[0]).tolist()
        nf = len(floats)
        fi, ci = 0, nf
        for p in group:
            p.host_floats = host[fi:fi + len(p.floats)]
            p.host_counts = [int(v) for v in host[ci:ci + len(p.counts)]]
            fi += len(p.floats)
            ci += len(p.counts)
            p.floats, p.counts = [], []


def count(mask: torch.Tensor) -> torch.Tensor:
    """The number of True elements of a bool tensor (0-d int64 device tensor). Summed as
    bytes in chunks of 128 (at most 128 each: no overflow), then the chunk sums: a bool
    tensor's own ``sum`` first copies it to int64 (8 bytes an element) on CPU and CUDA."""
    if mask.is_contiguous() and mask.numel() % 128 == 0:
        return mask.view(torch.uint8).view(-1, 128).sum(dim=1, dtype=torch.uint8).sum()
    return mask.sum()


def _nonzero(t: torch.Tensor) -> torch.Tensor:
    """The mask of the finite nonzero elements of ``t``."""
    return torch.nan_to_num(t, nan=0.0, posinf=0.0, neginf=0.0) != 0


def _finite_range(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(min, max) over the finite elements of ``t``; (inf, -inf) where there are none."""
    lo = torch.nan_to_num(t, nan=_INF, posinf=_INF, neginf=_INF).amin()
    hi = torch.nan_to_num(t, nan=-_INF, posinf=-_INF, neginf=-_INF).amax()
    return lo, hi


def abs_max(lo: float, hi: float) -> float:
    """max |t| from ``torch.aminmax(t)``: NaN if ``t`` held a NaN (both are NaN then)."""
    return lo if math.isnan(lo) else max(-lo, hi)


class OperandStats(Pending):
    """The statistics of the directions of one quantize call, as device scalars until
    :func:`fetch`; :meth:`resolve` gives each direction's :class:`DirectionStats`."""

    def __init__(self) -> None:
        super().__init__()
        #: usage -> (numel, {statistic: index into floats or counts}, whether the format
        #: never clips: no ``saturated`` count means 0 then, unknown otherwise)
        self.directions: dict[str, tuple[int, dict[str, int], bool]] = {}

    def resolve(self) -> dict[str, DirectionStats]:
        """Each direction's statistics (after :func:`fetch`)."""
        f, c = self.host_floats, self.host_counts
        if f is None or c is None:
            raise RuntimeError("OperandStats.resolve before fetch")
        out = {}
        for usage, (numel, at, never_clips) in self.directions.items():
            lo = f[at["lo"]] if "lo" in at else _INF
            has_blocks = math.isfinite(lo)
            nz, anyz = c[at["nonzero"]], c[at["nonzero_or_nonfinite"]]
            out[usage] = DirectionStats(
                numel=numel, amax=abs_max(f[at["min"]], f[at["max"]]),
                scale=f[at["scale"]] if "scale" in at else None,
                block_scale_min=lo if has_blocks else None,
                block_scale_max=f[at["hi"]] if has_blocks else None,
                saturated=c[at["saturated"]] if "saturated" in at
                else (0 if never_clips else None),
                nonzero=nz, flushed=c[at["flushed"]], signal=f[at["signal"]] ** 2,
                noise=f[at["noise"]] ** 2, nonfinite=anyz - nz,
                nonfinite_quantized=not all(math.isfinite(f[at[k]])
                                            for k in ("stored_min", "stored_max")))
        return out


def operand_stats(x: torch.Tensor, qt: QuantizedTensor, usages, quantizer=None
                  ) -> OperandStats:
    """The statistics of the ``usages`` directions of ``qt``, quantized from ``x`` by
    ``quantizer`` (see the module docstring), as device scalars: no host synchronization.
    What depends on x alone (amax, the sum of squares, the nonzero and non-finite counts)
    is computed once for all directions (for NVFP4's RHT direction, the counts are taken
    on the transformed values it rounded). Each direction's statistics are computed in its
    stored layout: x is transposed once, for the columnwise direction, so that no
    elementwise operation mixes two layouts."""
    m, k = flatten_2d(x.shape)
    x2d = x.detach().reshape(m, k)
    out = OperandStats()
    lo, hi = torch.aminmax(x2d)
    shared = {"min": out.add_float(lo), "max": out.add_float(hi),
              "signal": out.add_float(norm32(x2d))}
    x_counts = None
    for usage in usages:
        x_dir = x2d if usage == "rowwise" else x2d.t().contiguous()
        sc = direction_scaling(qt, usage, x2d, quantizer, x_dir)
        at = dict(shared)
        mask = _nonzero(sc.source)
        if sc.transformed:  # flush and non-finite counts in the domain the format rounded
            at["nonzero"] = out.add_count(count(mask))
            at["nonzero_or_nonfinite"] = out.add_count(count(sc.source != 0))
        else:
            if x_counts is None:
                x_counts = (out.add_count(count(mask)), out.add_count(count(x2d != 0)))
            at["nonzero"], at["nonzero_or_nonfinite"] = x_counts
        stored = sc.stored
        at["flushed"] = out.add_count(count((stored == 0) & mask))
        del mask
        if sc.encoded is not None:
            at["saturated"] = out.add_count(count(sc.encoded.abs() > sc.grid_max))
        sc.encoded = None
        lo, hi = torch.aminmax(stored)
        at["stored_min"], at["stored_max"] = out.add_float(lo), out.add_float(hi)
        # SQNR in x's own domain (NVFP4's RHT cancels in the GEMM)
        at["noise"] = out.add_float(norm32(x_dir - x_domain(sc)))
        if sc.scale is not None:
            at["scale"] = out.add_float(sc.scale)
        if sc.block_decode is not None:
            lo, hi = _finite_range(sc.block_decode.to(torch.float32))
            at["lo"], at["hi"] = out.add_float(lo), out.add_float(hi)
        # a format that clips, read without its scales: saturation unknown
        out.directions[usage] = (sc.source.numel(), at, not sc.clips)
    return out


def direction_stats(x: torch.Tensor, qt: QuantizedTensor, usage: str,
                    quantizer=None) -> DirectionStats:
    """The statistics of ``qt``'s ``usage`` direction, quantized from ``x`` by
    ``quantizer`` (see the module docstring). One host synchronization."""
    stats = operand_stats(x, qt, [usage], quantizer)
    fetch([stats])
    return stats.resolve()[usage]


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
