"""Launchers for the per-tensor FP8 Triton kernels, registered as torch custom ops.

The ops return uint8 codes (viewed as the fp8 dtype here, outside the op) and take plain
tensors and scalars, so ``torch.compile(fullgraph=True)`` traces them through their fake
implementations. Importing this module needs neither Triton nor CUDA: the kernels module is
imported on first launch.

Passes over memory (M x K input):

* current scaling: amax pass (read x) + one cast pass (read x, write rowwise and/or the
  transposed columnwise data); the scale is computed on the device, no host sync. With
  ``tuning.one_launch_current`` both run in one cooperative launch (``cooperative.py``);
* delayed scaling: one pass (read x, write both directions, record the amax) whose last
  program stores the amax and scale and, only for a NaN/Inf input, fills the data with NaN
  (a separate finishing kernel when the cast is split in two launches);
* a cast with a known scale (one usage after the other, slices): one pass.

Each quantize also stores ``1 / scale`` (``DECODE_AT``), which the GEMMs take as their
decode scale instead of launching a reciprocal per operand, and counts in int32 words kept
on its quantizer that it leaves zero (``kept_amax_words``): no zeroing launch per quantize.

The cast kernel works on (BM, BN) tiles: each program loads its tile once, casts it, and
writes the rowwise tile and/or its transpose (columnwise (K, M) layout).
"""

from __future__ import annotations

from typing import Optional

import torch

from ...kernels import _tracing, kernel_op
from ...kernels.fp8_args import FP8_PARAMS, fp8_dtype_of, kernel_fp8_args
from ...kernels.grid import (
    cast_bottom_up,
    device_guard,
    launches,
    logical_shape,
    num_sms,
    prologue_args,
    prologue_launch_args,
    tile_config,
    tile_grid,
    triton_cdiv,
)
from ...kernels.launch import bind, fast_launches, launch
from ...kernels.tuning import tuning
from ..base import QuantizedTensor

#: int32 words a per-tensor quantize counts in: the amax bits and program counts (two for
#: the cooperative kernel's barrier), padded to 16 bytes; see ``kept_amax_words``
AMAX_WORDS = 4


def _cast_cfg(rowwise: bool, columnwise: bool):
    configs = tuning.fp8_configs
    if rowwise and columnwise:
        return configs["cast_both"]
    return configs["cast_row"] if rowwise else configs["cast_col"]


def _outputs(x: torch.Tensor, rowwise: bool, columnwise: bool, pro: int = 0):
    m, k = logical_shape(x, pro)
    row = x.new_empty((m, k) if rowwise else (0,), dtype=torch.uint8)
    col = x.new_empty((k, m) if columnwise else (0,), dtype=torch.uint8)
    return row, col


def _amax_call(x: torch.Tensor, amax_bits: torch.Tensor, pro: int = 0, pro_args: list = ()):
    """(kernel, grid, args, kwargs) of the amax pass of ``x`` into ``amax_bits[0]``; the
    tensors that change per call lead the arguments (``x``, ``amax_bits``)."""
    from .triton_kernels import amax_kernel
    m, k = logical_shape(x, pro)
    bm, bn, warps = tuning.fp8_configs["amax"]
    tiles = triton_cdiv(m, bm) * triton_cdiv(k, bn)
    progs = max(1, min(tiles, num_sms(x.device) * 4))
    return (amax_kernel, (progs,),
            (x, amax_bits, m, k, x.stride(0), x.stride(1), *prologue_args(x, pro_args), tiles,
             triton_cdiv(tiles, progs)),
            {"PRO": pro, "BM": bm, "BN": bn, "num_warps": warps})


def _launch_amax(x: torch.Tensor, pro: int = 0, pro_args: list = (),
                 words: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The amax pass into ``words[0]`` (zero, see ``kept_amax_words``), or into a fresh zero."""
    amax_bits = torch.zeros(1, dtype=torch.int32, device=x.device) if words is None else words
    kernel, grid, args, kwargs = _amax_call(x, amax_bits, pro, pro_args)
    launch(kernel, grid, *args, **kwargs)
    return amax_bits


@kernel_op("lowprec::fp8_amax", mutates_args=())
def fp8_amax(x: torch.Tensor) -> torch.Tensor:
    """amax(|x|) of a 2-D tensor as int32 bits of the fp32 value (NaN above +Inf)."""
    with device_guard(x.device):
        return _launch_amax(x)


@fp8_amax.register_fake
def _(x):
    return x.new_empty((1,), dtype=torch.int32)


#: A quantize's scale buffer: the scale at 0, the decode scale at DECODE_AT (16-byte
#: aligned, as cuBLAS wants its scale pointers; see triton_kernels.DECODE_AT).
DECODE_AT = 4
SCALE_BUFFER = DECODE_AT + 1


def _scale_buffer(x: torch.Tensor) -> torch.Tensor:
    return torch.empty(SCALE_BUFFER, dtype=torch.float32, device=x.device)


# ---- current scaling ----------------------------------------------------------------------
@kernel_op("lowprec::fp8_current_quantize", mutates_args=("amax_words",))
def fp8_current_quantize(x: torch.Tensor, e5m2: bool, pow2: bool, eps: float, rowwise: bool,
                         columnwise: bool, pro: int, pro_args: list[torch.Tensor],
                         amax_bits: Optional[torch.Tensor], amax_words: Optional[torch.Tensor]
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``amax_bits``: the int32 amax bits when the producer already computed them (the
    fused norm statistics), else None and an amax pass runs first, into ``amax_words``
    (see ``kept_amax_words``; None allocates a zero)."""
    fp8_dtype = fp8_dtype_of(e5m2)
    m, k = logical_shape(x, pro)
    row, col = _outputs(x, rowwise, columnwise, pro)
    scales = _scale_buffer(x)
    p = prologue_args(x, pro_args)
    reset = False
    with device_guard(x.device):
        if amax_bits is None and tuning.one_launch_current:
            from .cooperative import launch_current_one, usable
            if usable():
                if amax_words is None:
                    amax_words = torch.zeros(AMAX_WORDS, dtype=torch.int32, device=x.device)
                launch_current_one(x, row, col, amax_words, scales, m, k, p, eps, pro,
                                   rowwise, columnwise, fp8_dtype, pow2)
                return row, col, scales
        try:
            if amax_bits is None:
                reset = amax_words is not None  # before the launch: it may raise after it
                amax_bits = _launch_amax(x, pro, pro_args, amax_words)
            parts = launches(rowwise, columnwise, "pertensor")
            for i, (r, c) in enumerate(parts):
                _launch_cast(x, row, col, amax_bits, scales, scales, m, k, p, eps, pro, r, c,
                             fp8_dtype, current=True, pow2=pow2, record=False,
                             reset=reset and i == len(parts) - 1)
        except BaseException:
            # The amax pass may have raised the kept amax word, and no cast reset it. (Under
            # capture the words are the graph's own and the stream may be unusable.)
            if reset and not torch.cuda.is_current_stream_capturing():
                amax_words.zero_()
            raise
    return row, col, scales


@fp8_current_quantize.register_fake
def _(x, e5m2, pow2, eps, rowwise, columnwise, pro, pro_args, amax_bits, amax_words):
    row, col = _outputs(x, rowwise, columnwise, pro)
    return row, col, x.new_empty((SCALE_BUFFER,), dtype=torch.float32)


def _cast_call(x, row, col, amax_bits, scale_in, scale_out, m, k, p, eps, pro, r, c,
               fp8_dtype, *, current, pow2, record, amax_out=None, reset=False):
    """(kernel, grid, args, kwargs) of one ``cast_kernel`` launch (see ``_launch_cast``); the
    seven tensors that change per call lead the arguments."""
    from .triton_kernels import cast_kernel
    cfg = _cast_cfg(r, c)
    bm, bn, warps, iters, stages, k_fast = tile_config(cfg)
    bottom_up = cast_bottom_up(cfg)
    grid, k_fast = tile_grid(m, k, bm, bn, iters, k_fast)
    finish = amax_out is not None
    return (cast_kernel, grid,
            (x, row, col, amax_bits, scale_in, scale_out, amax_out if finish else scale_out,
             m, k, x.stride(0), x.stride(1), *p, eps),
            dict(PRO=pro, CURRENT=current, POW2=pow2, FP8_MAX=FP8_PARAMS[fp8_dtype][3],
                 ROWWISE=r, COLWISE=c, BM=bm, BN=bn, RECORD=record, FINISH=finish,
                 RESET=reset, ITERS=iters, STAGES=stages, K_FAST=k_fast,
                 BOTTOM_UP=bottom_up, num_warps=warps, **kernel_fp8_args(fp8_dtype)))


def _launch_cast(*args, **kwargs):
    """One ``cast_kernel`` launch; ``amax_out`` (delayed scaling): finish in this launch,
    recording the amax there (``amax_bits`` then holds two zeroed words, left zero);
    ``reset`` (current scaling): the amax word and a zeroed count after it are left zero."""
    kernel, grid, args, kwargs = _cast_call(*args, **kwargs)
    launch(kernel, grid, *args, **kwargs)


# ---- delayed scaling ----------------------------------------------------------------------
@kernel_op("lowprec::fp8_delayed_quantize", mutates_args=("amax", "amax_words"))
def fp8_delayed_quantize(x: torch.Tensor, scale: torch.Tensor, amax: torch.Tensor, e5m2: bool,
                         rowwise: bool, columnwise: bool, pro: int,
                         pro_args: list[torch.Tensor], amax_words: Optional[torch.Tensor]
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``amax_words``: zeroed int32 words (the first two used: amax bits, finished
    programs) a one-launch cast counts in and leaves zero (see ``kept_amax_words``); None
    allocates them."""
    from .triton_kernels import delayed_finish_kernel
    fp8_dtype = fp8_dtype_of(e5m2)
    m, k = logical_shape(x, pro)
    row, col = _outputs(x, rowwise, columnwise, pro)
    p = prologue_args(x, pro_args)
    scale_out = _scale_buffer(x)
    parts = launches(rowwise, columnwise, "pertensor")
    with device_guard(x.device):
        # the kernel counts elements in int32 for its fill: larger inputs finish apart
        if len(parts) == 1 and m * k < 2 ** 31:
            if amax_words is None:
                amax_words = torch.zeros(2, dtype=torch.int32, device=x.device)
            _launch_cast(x, row, col, amax_words, scale, scale_out, m, k, p, 0.0, pro,
                         *parts[0], fp8_dtype, current=False, pow2=False, record=True,
                         amax_out=amax)
            return row, col, scale_out
        amax_bits = torch.zeros(2, dtype=torch.int32, device=x.device)
        for r, c in parts:
            _launch_cast(x, row, col, amax_bits, scale, scale_out, m, k, p, 0.0, pro, r, c,
                         fp8_dtype, current=False, pow2=False, record=True)
        block, _, warps = tuning.fp8_configs["finish"]
        n = m * k
        progs = max(1, min(triton_cdiv(n, block), num_sms(x.device) * 2))
        launch(delayed_finish_kernel, (progs,), amax_bits, scale, scale_out, amax, row, col, n,
               triton_cdiv(triton_cdiv(n, block), progs),
               ROWWISE=rowwise, COLWISE=columnwise, BLOCK=block,
               num_warps=warps)
    return row, col, scale_out


@fp8_delayed_quantize.register_fake
def _(x, scale, amax, e5m2, rowwise, columnwise, pro, pro_args, amax_words):
    row, col = _outputs(x, rowwise, columnwise, pro)
    return row, col, x.new_empty((SCALE_BUFFER,), dtype=torch.float32)


# ---- cast with a known scale --------------------------------------------------------------
@kernel_op("lowprec::fp8_cast_with_scale", mutates_args=())
def fp8_cast_with_scale(x: torch.Tensor, scale: torch.Tensor, e5m2: bool, rowwise: bool,
                        columnwise: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Cast ``x * scale`` with a scale that already accounts for x's amax (NaN when x held
    NaN/Inf, so the codes come out NaN as the reference's): one pass, nothing recorded."""
    fp8_dtype = fp8_dtype_of(e5m2)
    m, k = x.shape
    row, col = _outputs(x, rowwise, columnwise)
    p = prologue_args(x, [])
    with device_guard(x.device):
        for r, c in launches(rowwise, columnwise, "pertensor"):
            _launch_cast(x, row, col, scale, scale, scale, m, k, p, 0.0, 0, r, c, fp8_dtype,
                         current=False, pow2=False, record=False)
    return row, col


@fp8_cast_with_scale.register_fake
def _(x, scale, e5m2, rowwise, columnwise):
    return _outputs(x, rowwise, columnwise)


# ---- row groups ---------------------------------------------------------------------------
def _cast_rows(x, scale, group_ids, rows_per_group, e5m2, y, yt) -> None:
    from .triton_kernels import row_scaled_cast_kernel
    m, k = x.shape
    if m == 0 or k == 0:
        return
    bm, bn, warps = 32, 128, 4
    # the kernel's transposed store of 4-byte rows gave wrong codes on the H100 (Triton 3.6):
    # those rows' transpose is copied from the rowwise codes instead
    trans = yt is not None and x.element_size() < 4
    by_ids = group_ids is not None
    with device_guard(x.device):
        launch(row_scaled_cast_kernel, (triton_cdiv(m, bm), triton_cdiv(k, bn)), x, y,
               yt if trans else y, scale, group_ids if by_ids else scale, m, k, x.stride(0),
               max(rows_per_group, 1), BM=bm, BN=bn, TRANS=trans, BY_IDS=by_ids,
               num_warps=warps, **kernel_fp8_args(fp8_dtype_of(e5m2)))
    if yt is not None and not trans:
        yt.copy_(y.t())


@kernel_op("lowprec::fp8_cast_rows", mutates_args=())
def fp8_cast_rows(x: torch.Tensor, scale: torch.Tensor, group_ids: Optional[torch.Tensor],
                  e5m2: bool, rows_per_group: int = 0) -> torch.Tensor:
    """Rowwise fp8 codes (uint8) of ``x * scale[group]``: the cast of
    ``formats.float8.grouped.quantize_rows`` in one pass (``x`` (M, K) with unit inner
    stride, ``scale`` fp32 per group). A row's group: ``group_ids[row]`` (int64), or, with
    ``group_ids`` None, ``row // rows_per_group`` (the rows of stacked (N, K) experts)."""
    y = x.new_empty(x.shape, dtype=torch.uint8)
    _cast_rows(x, scale, group_ids, rows_per_group, e5m2, y, None)
    return y


@fp8_cast_rows.register_fake
def _(x, scale, group_ids, e5m2, rows_per_group=0):
    return x.new_empty(x.shape, dtype=torch.uint8)


@kernel_op("lowprec::fp8_cast_rows_both", mutates_args=())
def fp8_cast_rows_both(x: torch.Tensor, scale: torch.Tensor, group_ids: Optional[torch.Tensor],
                       e5m2: bool, rows_per_group: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`fp8_cast_rows`' codes (M, K) and their transpose (K, M), written by the same
    pass."""
    y = x.new_empty(x.shape, dtype=torch.uint8)
    yt = x.new_empty((x.shape[1], x.shape[0]), dtype=torch.uint8)
    _cast_rows(x, scale, group_ids, rows_per_group, e5m2, y, yt)
    return y, yt


@fp8_cast_rows_both.register_fake
def _(x, scale, group_ids, e5m2, rows_per_group=0):
    return (x.new_empty(x.shape, dtype=torch.uint8),
            x.new_empty((x.shape[1], x.shape[0]), dtype=torch.uint8))


@kernel_op("lowprec::fp8_group_scales", mutates_args=())
def fp8_group_scales(amax: torch.Tensor, e5m2: bool, pow2: bool,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(encode, decode) scales (G,) fp32 of per-group amaxes (G,) fp32 under current
    scaling: ``casting.scale_from_amax`` and its ``torch.reciprocal``, in one launch."""
    from .triton_kernels import group_scales_kernel
    scale, decode = torch.empty_like(amax), torch.empty_like(amax)
    g, bg = amax.shape[0], 128
    if g:
        with device_guard(amax.device):
            launch(group_scales_kernel, (triton_cdiv(g, bg),), amax.view(torch.int32), scale,
                   decode, g, eps, FP8_MAX=FP8_PARAMS[fp8_dtype_of(e5m2)][3], POW2=pow2,
                   BG=bg, num_warps=4)
    return scale, decode


@fp8_group_scales.register_fake
def _(amax, e5m2, pow2, eps):
    return torch.empty_like(amax), torch.empty_like(amax)


# ---- what the quantizers call -------------------------------------------------------------
def _fields(quantizer, row, col, scale, decode=None) -> dict:
    """Float8Tensor fields; ``decode``: the record of ``1 / scale`` (see ``Float8Tensor``)."""
    return _usage_fields(quantizer.fp8_dtype, quantizer.rowwise_usage,
                         quantizer.columnwise_usage, row, col, scale, decode)


def _usage_fields(dt, rowwise: bool, columnwise: bool, row, col, scale, decode) -> dict:
    # codes of a bound launch are made in ``dt`` already (a view is a dispatched op)
    return {"rowwise_data": (row if row.dtype == dt else row.view(dt)) if rowwise else None,
            "columnwise_data": (col if col.dtype == dt else col.view(dt)) if columnwise
            else None,
            "shared_scale": scale, "fp8_dtype": dt, "_decode": decode}


def _kernel_fields(quantizer, row, col, scales) -> dict:
    """Fields of a quantize launch, whose ``scales`` holds the scale at 0 and its reciprocal
    at ``DECODE_AT`` (kept for the GEMMs). Not kept for inference tensors
    (``torch.inference_mode``): they have no version counter to tell it is still valid; nor
    under ``torch.compile``, where ``decode_scale`` never reads it."""
    scale = scales[0:1]
    return _fields(quantizer, row, col, scale,
                   QuantizedTensor.derived_record(scale, scales[DECODE_AT]))


def quantize_current(quantizer, x2d: torch.Tensor, prologue=None, amax_bits=None) -> dict:
    """Float8CurrentScalingQuantizer._quantize_2d through the kernels (same fields), of
    ``prologue(x2d)`` when given (a norm prologue may carry its amax bits). ``amax_bits``:
    the amax of a larger tensor ``x2d`` is a slice of (see ``slice_quantizer``)."""
    pro, pro_args = prologue_launch_args(prologue)
    if amax_bits is None and prologue is not None:
        amax_bits = prologue.amax_bits
    words = None if amax_bits is not None else kept_amax_words(quantizer, x2d.device)
    row, col, scale = fp8_current_quantize(
        x2d, quantizer.fp8_dtype == torch.float8_e5m2, quantizer.force_pow_2_scales,
        quantizer.amax_epsilon, quantizer.rowwise_usage, quantizer.columnwise_usage, pro,
        pro_args, amax_bits, words)
    return _kernel_fields(quantizer, row, col, scale)


def quantize_with_scale(quantizer, x2d: torch.Tensor, scale: torch.Tensor,
                        decode=None) -> dict:
    """Cast ``x2d * scale`` with a scale already known: a delayed-scaling slice (its scale
    NaN-poisoned by the whole tensor's amax), or one usage of a tensor whose other usage
    set the scale (``quantize_usage_like``, which passes that tensor's ``decode`` record).
    The result shares ``scale``."""
    row, col = fp8_cast_with_scale(x2d, scale, quantizer.fp8_dtype == torch.float8_e5m2,
                                   quantizer.rowwise_usage, quantizer.columnwise_usage)
    return _fields(quantizer, row, col, scale, decode)


class _Prepared:
    """Quantize launches of one kind of input (shape, dtype, device; contiguous, 16-byte
    aligned) with fixed usages, for a linear plan that makes the same call again and again.
    The first call is left to the usual path (which compiles the kernels), the second binds
    the launches (``kernels.launch.bind``), and from then on a call allocates the outputs
    and runs the bound launches: the same bits for a fraction of the host time.

    ``__call__`` returns ``Float8Tensor`` fields, or None where the bound path does not
    apply (the first call, another kind of input, a launch hook, tracing): the caller then
    quantizes the usual way."""

    def __init__(self, quantizer, shape: torch.Size, dtype: torch.dtype, device: torch.device,
                 rowwise: bool, columnwise: bool) -> None:
        self.quantizer = quantizer
        self.empty = torch.empty(0, dtype=torch.uint8, device=device)
        # the device with its index (a call's tensor names it: "cuda" alone never matches)
        self.shape, self.dtype, self.device = shape, dtype, self.empty.device
        self.m, self.k = shape.numel() // shape[-1], shape[-1]
        self.rowwise, self.columnwise = rowwise, columnwise
        self.fp8_dtype = quantizer.fp8_dtype
        #: the quantizer's settings the launches are bound with (a later change of them
        #: sends calls the usual way)
        self.settings = self._settings()
        #: settings that cannot change (a traced form's, ``fixed_settings``) go unchecked
        self.fixed = getattr(quantizer, "fixed_settings", False)
        #: None before the first call, True before the second, then the bound launches
        #: (False: none could be bound)
        self.launches = None

    def _settings(self) -> tuple:
        q = self.quantizer
        return (q.fp8_dtype, getattr(q, "force_pow_2_scales", False),
                getattr(q, "amax_epsilon", 0.0))

    def _outputs(self, x: torch.Tensor):
        """(launches, x (as (m, k) before the launches are bound), rowwise codes, columnwise
        codes), or None where the bound path does not take ``x`` (see the class
        docstring)."""
        bound = self.launches
        if (bound is None or bound is False
                or (not self.fixed and self._settings() != self.settings)
                or x.shape != self.shape
                or x.dtype != self.dtype or x.device != self.device or not x.is_contiguous()
                or x.data_ptr() % 16 or self.device.index not in (None, torch.cuda.current_device())
                or _tracing((x,)) or not fast_launches()):
            if bound is None:
                self.launches = True
            return None
        # a bound launch reads x's pointer alone: the (m, k) view only to bind them
        x2d = x if bound is not True or x.dim() == 2 else x.view(self.m, self.k)
        # the codes in their FP8 dtype: a bound launch reads only the pointer (the launches
        # are bound with byte views, as the usual path makes them: ``_codes``)
        row = x2d.new_empty((self.m, self.k), dtype=self.fp8_dtype) if self.rowwise \
            else self.empty
        col = x2d.new_empty((self.k, self.m), dtype=self.fp8_dtype) if self.columnwise \
            else self.empty
        return bound, x2d, row, col

    def _codes(self, row: torch.Tensor, col: torch.Tensor) -> tuple:
        """``row`` and ``col`` as the bytes the kernels were compiled for (binding)."""
        return (row if row is self.empty else row.view(torch.uint8),
                col if col is self.empty else col.view(torch.uint8))

    def _bound(self, bound, calls):
        """``bound`` when already bound, else the launches of ``calls`` ((kernel, grid, n,
        args, kwargs) each) bound and kept; None when any could not be (and never tried
        again)."""
        if bound is not True:
            return bound
        made = tuple(bind(kernel, grid, n, *args, **kwargs)
                     for kernel, grid, n, args, kwargs in calls)
        self.launches = False if None in made else made
        return self.launches or None

    def _casts(self, bound, x2d, row, col, amax_bits, scale_in, scale_out, *,
               current: bool) -> bool:
        """Run the cast launches alone (no amax pass, nothing recorded) with these tensors,
        binding them first where ``bound`` is True; False where they could not be bound
        (the caller then takes the usual path)."""
        if bound is True:
            bound = self._bound(bound, self._cast_calls(x2d, *self._codes(row, col), amax_bits,
                                                        scale_in, scale_out, current=current))
            if bound is None:
                return False
        for cast in bound:
            cast(x2d, row, col, amax_bits, scale_in, scale_out, scale_out)
        return True

    def _cast_calls(self, x2d, row, col, amax_bits, scale_in, scale_out, *, current,
                    reset=False, amax_out=None):
        """The (kernel, grid, n, args, kwargs) of the cast launches, as ``_launch_cast``
        takes them (``amax_out``: delayed scaling's recording, finishing cast)."""
        pow2 = current and self.quantizer.force_pow_2_scales
        eps = self.quantizer.amax_epsilon if current else 0.0
        parts = launches(self.rowwise, self.columnwise, "pertensor")
        calls = []
        for i, (r, c) in enumerate(parts):
            kernel, grid, args, kwargs = _cast_call(
                x2d, row, col, amax_bits, scale_in, scale_out, self.m, self.k,
                prologue_args(x2d, []), eps, 0, r, c, self.fp8_dtype, current=current,
                pow2=pow2, record=amax_out is not None, amax_out=amax_out,
                reset=reset and i == len(parts) - 1)
            calls.append((kernel, grid, 7, args, kwargs))
        return calls


class PreparedCurrent(_Prepared):
    """Current-scaling quantizes (amax pass and cast) of one kind of input; see ``_Prepared``."""

    def __call__(self, x: torch.Tensor) -> dict | None:
        got = self.codes(x)
        if got is None:
            return None
        row, col, scale, decode = got
        return _usage_fields(self.fp8_dtype, self.rowwise, self.columnwise, row, col, scale,
                             QuantizedTensor.derived_record(scale, decode))

    def codes(self, x: torch.Tensor) -> tuple | None:
        """(rowwise codes, columnwise codes, scale, ``1 / scale``) of ``x``, the codes in
        the FP8 dtype (``self.empty`` for a usage not asked for), or None as ``__call__``:
        what a traced form's eager call reads, without a tensor's fields around it."""
        if tuning.one_launch_current:
            return None
        ready = self._outputs(x)
        if ready is None:
            return None
        bound, x2d, row, col = ready
        words = _stream_words(self.quantizer, self.device)
        scales = _scale_buffer(x2d)
        if bound is True:
            kernel, grid, args, kwargs = _amax_call(x2d, words)
            bound = self._bound(bound, [(kernel, grid, 2, args, kwargs)] + self._cast_calls(
                x2d, *self._codes(row, col), words, scales, scales, current=True, reset=True))
            if bound is None:
                return None
        try:
            bound[0](x2d, words)
            for cast in bound[1:]:
                cast(x2d, row, col, words, scales, scales, scales)
        except BaseException:
            if not torch.cuda.is_current_stream_capturing():
                words.zero_()
            raise
        return row, col, scales[0:1], scales[DECODE_AT]


class PreparedPart(_Prepared):
    """Current-scaling casts of one kind of part (rows of a larger tensor: a weight shard
    under FSDP) with the whole tensor's amax bits given (``quantize_part``'s statistic), as
    ``quantize_current(..., amax_bits=)`` launches them; see ``_Prepared``.
    ``__call__(x, amax_bits)``."""

    def __call__(self, x: torch.Tensor, amax_bits: torch.Tensor | None) -> dict | None:
        if amax_bits is None or amax_bits.device != self.device or amax_bits.data_ptr() % 16:
            return None
        ready = self._outputs(x)
        if ready is None:
            return None
        bound, x2d, row, col = ready
        scales = _scale_buffer(x2d)
        if not self._casts(bound, x2d, row, col, amax_bits, scales, scales, current=True):
            return None
        scale = scales[0:1]
        return _usage_fields(self.fp8_dtype, self.rowwise, self.columnwise, row, col, scale,
                             QuantizedTensor.derived_record(scale, scales[DECODE_AT]))


class PreparedDelayed(_Prepared):
    """Delayed-scaling quantizes (one cast that records the amax and finishes) of one kind of
    input; see ``_Prepared``. Calls whose state tensors (``quantizer.scale``/``amax``) are
    not 1-element fp32 on the input's device, or whose cast is split in two launches, go
    the usual way."""

    def __call__(self, x: torch.Tensor) -> dict | None:
        q = self.quantizer
        scale, amax = q.scale, q.amax
        if (q.needs_amax_first()
                or len(launches(self.rowwise, self.columnwise, "pertensor")) != 1
                or self.m * self.k >= 2 ** 31
                or scale.device != self.device or amax.device != self.device
                or scale.dtype != torch.float32 or amax.dtype != torch.float32
                or scale.numel() != 1 or amax.numel() != 1 or not amax.is_contiguous()):
            return None
        ready = self._outputs(x)
        if ready is None:
            return None
        bound, x2d, row, col = ready
        words = _stream_words(q, self.device)
        scale = scale.detach().reshape(1)
        scales = _scale_buffer(x2d)
        if bound is True:
            bound = self._bound(bound, self._cast_calls(x2d, *self._codes(row, col), words,
                                                        scale, scales, current=False,
                                                        amax_out=amax))
            if bound is None:
                return None
        bound[0](x2d, row, col, words, scale, scales, amax)
        scale_out = scales[0:1]
        return _usage_fields(self.fp8_dtype, self.rowwise, self.columnwise, row, col,
                             scale_out, QuantizedTensor.derived_record(scale_out,
                                                                       scales[DECODE_AT]))


class PreparedUsageLike(_Prepared):
    """Casts of one usage with the scale of a tensor already quantized for the other
    (``quantize_usage_like``: a weight's columnwise copy after fprop); see ``_Prepared``.
    ``__call__(x, like)``."""

    def __call__(self, x: torch.Tensor, like) -> dict | None:
        ready = self._outputs(x)
        if ready is None:
            return None
        bound, x2d, row, col = ready
        scale = like.shared_scale
        if not self._casts(bound, x2d, row, col, scale, scale, scale, current=False):
            return None
        return _usage_fields(self.fp8_dtype, self.rowwise, self.columnwise, row, col, scale,
                             like._decode)


def kept_amax_words(quantizer, device: torch.device) -> Optional[torch.Tensor]:
    """The int32 words (``AMAX_WORDS``: amax bits, program counts) a quantize of
    ``quantizer`` on ``device`` counts in, kept on the quantizer, one set per CUDA stream.

    They are zero between quantizes: the quantize's last program reads them and sets them
    back to zero (current scaling's separate amax pass, before the cast, only raises the
    amax word), so a quantize needs no zeroing launch of its own (host time). Quantizes on
    one stream run one after another; a set per stream keeps quantizes that overlap on two
    streams apart, and a copy of the quantizer (``copy()``, deepcopy, pickling) starts
    without any.

    Under CUDA graph capture: fresh zeroed words, not kept, so the graph zeroes its own on
    each replay instead of holding a pointer to words an eager quantize also uses (or that
    a replaced quantizer frees). They are words all the same, so the capture launches the
    kernel variants the eager warm-up compiled (a kernel compiled and loaded for the first
    time inside a capture breaks it). None under tracing (torch.compile), where the ops
    allocate what they need.
    """
    if _tracing(()):
        return None
    return _stream_words(quantizer, device)


def _stream_words(quantizer, device: torch.device) -> torch.Tensor:
    """:func:`kept_amax_words` of a call known not to be traced (a prepared quantize's)."""
    if torch.cuda.is_current_stream_capturing():
        return torch.zeros(AMAX_WORDS, dtype=torch.int32, device=device)
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = (index, torch._C._cuda_getCurrentRawStream(index))
    by_stream = quantizer.__dict__.get("_amax_words")
    if by_stream is None:
        by_stream = quantizer._amax_words = {}
    words = by_stream.get(key)
    if words is None:
        with torch.inference_mode(False):  # a later quantize outside inference mode writes it
            words = by_stream[key] = torch.zeros(AMAX_WORDS, dtype=torch.int32, device=device)
    return words


def quantize_delayed(quantizer, x2d: torch.Tensor, prologue=None) -> dict:
    """Float8Quantizer._quantize_2d through the kernels: records the amax into
    ``quantizer.amax`` in place and keeps a copy of the (NaN-poisoned) scale."""
    row, col, scale_out = delayed_codes(quantizer, x2d, quantizer.rowwise_usage,
                                        quantizer.columnwise_usage, prologue)
    return _kernel_fields(quantizer, row, col, scale_out)


def delayed_codes(quantizer, x2d: torch.Tensor, rowwise: bool, columnwise: bool,
                  prologue=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(rowwise codes, columnwise codes, scale buffer) of a delayed-scaling quantize of
    ``x2d`` with ``quantizer``'s state (``fp8_delayed_quantize``: its amax recorded into
    ``quantizer.amax`` in place, the buffer holding the scale cast with and its
    reciprocal at ``DECODE_AT``); codes as uint8. A slot that may have no scale yet
    (``Float8Quantizer.needs_amax_first``) takes the tensor's amax in a pass of its own
    first, for the scale it casts with."""
    if quantizer.needs_amax_first():
        if prologue is not None:
            raise ValueError("delayed_codes: a slot without a scale yet takes its amax before "
                             "the cast; quantize the prologue's output instead")
        scale = quantizer.cast_scale(fp8_amax(x2d).view(torch.float32))
    else:
        scale = quantizer.scale
    scale = scale.detach().reshape(1).to(device=x2d.device, dtype=torch.float32)
    target = quantizer.amax
    direct = (target.device == x2d.device and target.dtype == torch.float32
              and target.is_contiguous())
    amax = target if direct else torch.empty(1, dtype=torch.float32, device=x2d.device)
    out = fp8_delayed_quantize(
        x2d, scale, amax, quantizer.fp8_dtype == torch.float8_e5m2, rowwise, columnwise,
        *prologue_launch_args(prologue), kept_amax_words(quantizer, x2d.device))
    if not direct:
        target.copy_(amax.reshape(target.shape))
    return out


# ---- delayed-scaling state update ---------------------------------------------------------
#: Longest amax history the one-launch update handles (the whole history sits in registers).
UPDATE_MAX_HISTORY = 4096


@kernel_op("lowprec::fp8_delayed_update", mutates_args=("history", "current", "scale"))
def fp8_delayed_update(history: torch.Tensor, current: torch.Tensor, scale: torch.Tensor,
                       fp8_max: torch.Tensor, inv_margin: float, most_recent: bool) -> None:
    """Roll ``history`` (H, N), push ``current``, recompute ``scale`` and zero ``current``,
    in one launch (see ``delayed_update_kernel``)."""
    from .triton_kernels import delayed_update_kernel
    for name, t in (("history", history), ("current", current), ("scale", scale)):
        if not t.is_contiguous():
            raise ValueError(f"fp8_delayed_update: the state's {name} (shape "
                             f"{tuple(t.shape)}, strides {t.stride()}) must be contiguous")
    h, n = history.shape
    bh, bn = _update_tile(h, n)
    with device_guard(history.device):
        launch(delayed_update_kernel, (triton_cdiv(n, bn),),
            history, current, scale, fp8_max, h, n, inv_margin, MOST_RECENT=most_recent,
            BH=bh, BN=bn, num_warps=4)


@fp8_delayed_update.register_fake
def _(history, current, scale, fp8_max, inv_margin, most_recent):
    return None


def _update_tile(h: int, n: int) -> tuple[int, int]:
    """(BH, BN) of an update launch: the whole history (H - 1 rows kept) in one tile, as
    many columns beside it as keep the tile within 8192 elements."""
    bh = 1
    while bh < max(h - 1, 1):
        bh *= 2
    bn = 1
    while bn < n and bn * bh < 8192:
        bn *= 2
    return bh, bn


def fp8_delayed_update_many(table: torch.Tensor, h: int, max_n: int, inv_margin: float,
                            most_recent: bool) -> None:
    """``fp8_delayed_update`` of many states in one launch (``delayed_update_many_kernel``):
    ``table`` is the int64 (S, 5) table of their tensors' addresses and column counts (see
    ``lowprec.recipe.state_batch``), all of histories with ``h`` rows. Eager only, not a
    custom op: a table of addresses means nothing to a tracer."""
    from .triton_kernels import delayed_update_many_kernel
    bh, bn = _update_tile(h, max_n)
    with device_guard(table.device):
        launch(delayed_update_many_kernel, (table.shape[0], triton_cdiv(max_n, bn)),
               table, h, inv_margin, MOST_RECENT=most_recent, BH=bh, BN=bn, num_warps=4)

