"""Launchers for the NVFP4 Triton kernels (kernels: :mod:`.triton_kernels`).

Both entry points are torch custom ops (``torch.ops.lowprec.nvfp4_quantize`` and
``torch.ops.lowprec.nvfp4_dequantize_unscaled_bf16``) with fake implementations,
so ``torch.compile(fullgraph=True)`` traces through them. Triton is imported
lazily, inside the op bodies: this module imports on machines without Triton
or CUDA, where :func:`dequantize_unscaled_bf16` falls back to plain torch.

* :func:`quantize_2d`: the kernel path of ``NVFP4Quantizer._quantize_2d``,
  bit-identical to :func:`.reference.quantize_matrix` applied as the quantizer
  does (rowwise on x, columnwise on the -- RHT-transformed -- transpose).
  Stochastic rounding takes one key per direction (:mod:`.draws`, drawn by the
  caller in the reference's order, rowwise first) and computes the uniforms in
  registers, so results match the reference for the same generator state. Up to
  three launches (plus a 12-byte memset):
  the amax pass (global amax over finite values, of the RHT'd transpose for
  the columnwise side when ``with_rht``, combined on device with atomics; its
  last program writes the global scales: no host sync), then the rowwise and
  the columnwise kernel, each reading x once.
* :func:`dequantize_unscaled_bf16`: ``q * d`` of one stored direction as a
  bf16 matrix (exact: at most 6 significant bits and exponents well inside
  bf16's range) plus the fp32 global encode scale ``S``, for GEMM emulation
  (bf16 tensor-core GEMM with fp32 accumulation, ``1 / (S_a * S_b)`` applied
  in fp32 before the one rounding; ``lowprec.gemm.exact_bf16``).
  Values stay in the stored layout and domain (columnwise: (K, M),
  RHT-transformed when the tensor carries it).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ...kernels import kernel_op, use_kernels
from ...kernels.grid import num_sms
from ...kernels.launch import BoundCalls, launch, launch_calls
from ...kernels.tuning import tuning
from ..base import QuantizedTensor, check_exact_only
from ..casting import e2m1_codes_to_float, unpack_e2m1
from .reference import BLOCK, SCALE_DTYPE

# FMA contraction off: every fp32 operation rounds as in the reference.
_LAUNCH_OPTS = {"enable_fp_fusion": False}


def _kernels():
    from . import triton_kernels
    return triton_kernels


def triton_cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


def _idx64(rows: int, cols: int, base: int = 0) -> bool:
    """Whether element offsets (with a tile's worth of slack), from ``base`` on, may exceed
    int32."""
    return base + (rows + 64) * (cols + 256) + (1 << 16) >= 2**31


def _row_stride(x: Tensor) -> int:
    return x.stride(0) if x.shape[0] > 1 else x.shape[1]


# ---- quantize -----------------------------------------------------------------------------------
#: whole-tensor quantizes and dequantizes, their launches bound per kind of call
_QUANTIZES, _DEQUANTIZES = BoundCalls(), BoundCalls()


@kernel_op("lowprec::nvfp4_quantize", mutates_args=())
def nvfp4_quantize(x: Tensor, key_row: Optional[Tensor], key_col: Optional[Tensor],
                   rowwise: bool, columnwise: bool, with_rht: bool,
                   two_d: bool, exact_row: bool = False, exact_col: bool = False,
                   codes: bool = True, rglob_in: Optional[Tensor] = None,
                   cglob_in: Optional[Tensor] = None, row_offset: int = 0,
                   col_offset: int = 0
                   ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(rdata, rscale u8, rglobal, cdata, cscale u8, cglobal, rexact, cexact) of a 2-D x;
    an unused direction's tensors are empty. Scales are the E4M3 bytes (view as
    float8_e4m3fn). ``exact_row`` / ``exact_col``: also the exact bf16 ``q * d`` of that
    direction (stored layout and domain), else an empty tensor. ``codes=False`` (every
    direction in use asks for its exact values): no data or scales (empty tensors; the
    global scales are still computed).

    Slices of a larger tensor (``NVFP4Quantizer.gemm_slicer``): ``rglob_in`` /
    ``cglob_in`` are the whole tensor's global scales (:func:`nvfp4_global_scales`), given
    for every direction in use; there is then no amax pass, the returned global scales are
    empty, and x may be row-strided (a column slice, read in place). ``row_offset`` /
    ``col_offset``: the stochastic-rounding index of each direction's first element in the
    whole tensor's matrix of that direction."""
    m, kk = x.shape
    given = rglob_in is not None or cglob_in is not None
    if given and (rowwise and rglob_in is None or columnwise and cglob_in is None):
        raise ValueError("nvfp4_quantize: given global scales must cover every direction it "
                         "quantizes")
    if not given and (row_offset or col_offset):
        raise ValueError("nvfp4_quantize: index offsets are for slices, which take the whole "
                         "tensor's global scales")
    if x.stride(-1) != 1 or not given:
        x = x.contiguous()
    sr = key_row is not None or key_col is not None
    if rowwise and sr and key_row is None or columnwise and sr and key_col is None:
        raise ValueError("nvfp4_quantize: stochastic rounding needs a key for every "
                         "direction it quantizes")
    for key in (key_row, key_col):
        _check_key("nvfp4_quantize", key, x.device)
    if not codes:
        check_exact_only("nvfp4_quantize", rowwise, columnwise, exact_row, exact_col)
    outs = quantize_outputs(x, rowwise, columnwise, two_d, exact_row, exact_col, codes, given)
    if not (rowwise or columnwise) or m == 0 or kk == 0:
        return outs
    _quantize(x, key_row, key_col, rowwise, columnwise, with_rht, two_d,
              bool(rowwise and exact_row), bool(columnwise and exact_col), codes, outs,
              rglob_in, cglob_in, row_offset, col_offset)
    return outs


def exact_values(x: Tensor, key_row: Optional[Tensor], key_col: Optional[Tensor],
                 rowwise: bool, columnwise: bool, with_rht: bool, two_d: bool
                 ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(rowwise exact bf16 ``q * d``, its S, columnwise one, its S) of a 2-D x with at
    least one element and the keys its directions need: :func:`nvfp4_quantize`'s launches
    with ``codes=False`` for the directions asked, and one shared placeholder for the codes
    and scales it does not write. A compiled graph's op (``compiled.nvfp4_graph_values``),
    whose host time a step pays: nothing is allocated that is not returned."""
    x = x.contiguous()
    none = x.new_empty(0, dtype=torch.uint8)
    m, kk = x.shape

    def direction(on, rows, cols):
        if not on:  # outputs of an op: each its own tensor
            return (x.new_empty(0, dtype=torch.bfloat16), x.new_empty(0, dtype=torch.float32))
        return (x.new_empty((rows, cols), dtype=torch.bfloat16),
                x.new_empty(1, dtype=torch.float32))

    (rv, rs), (cv, cs) = direction(rowwise, m, kk), direction(columnwise, kk, m)
    _quantize(x, key_row, key_col, rowwise, columnwise, with_rht, two_d, rowwise, columnwise,
              False, (none, none, rs, none, none, cs, rv, cv))
    return rv, rs, cv, cs


def _quantize(x, key_row, key_col, rowwise, columnwise, with_rht, two_d, exact_row, exact_col,
              codes, outs, rglob_in=None, cglob_in=None, row_offset=0, col_offset=0) -> None:
    """Runs the launches of :func:`nvfp4_quantize` into ``outs`` (its eight outputs) for a
    checked x with at least one element."""
    rdata, rscale, rglob, cdata, cscale, cglob, rex, cex = outs
    m, kk = x.shape
    dev = x.device
    given = rglob_in is not None or cglob_in is not None
    rht = bool(with_rht and columnwise)
    sx = _row_stride(x)
    idx64 = _idx64(m, max(kk, sx), max(row_offset, col_offset))
    rs, cs = (rglob_in, cglob_in) if given else (rglob, cglob)
    ws = None if given else torch.zeros(3, dtype=torch.int32, device=dev)
    ex_r, ex_c = rex if exact_row else None, cex if exact_col else None

    def calls():
        made = [] if given else [_amax_call(x, ws, rglob, cglob, rowwise, columnwise, rht,
                                            idx64)]
        if rowwise:
            made.append(_row_call(x, sx, rdata, rscale, rs, key_row, row_offset, ex_r, two_d,
                                  codes, idx64))
        if columnwise:
            made.append(_col_call(x, sx, cdata, cscale, cs, key_col, col_offset, ex_c, rht,
                                  two_d, codes, idx64))
        return made

    if given:  # a slice of a larger tensor, read in place: launched the usual way
        launch_calls(calls())
    else:  # a whole tensor (the linear's call): its launches bound per kind of call
        c = tuning.nvfp4_config
        kind = (m, kk, sx, x.dtype, dev.index, rowwise, columnwise, rht, two_d, exact_row,
                exact_col, bool(codes), key_row is None, key_col is None,
                c["amax"]["FLAT"], c["amax"]["KW"], c["amax"]["PROGS_PER_SM"],
                c["row"]["KB"], c["row"]["RB"], c["col"]["KW"])
        _QUANTIZES.run(kind, (x, ws, rdata, rscale, rglob, cdata, cscale, cglob, rex, cex,
                              key_row, key_col), calls)


def _check_key(op: str, key: Optional[Tensor], device: torch.device) -> None:
    if key is not None and (key.dtype != torch.int64 or tuple(key.shape) != (2,)
                            or key.device != device):
        raise ValueError(f"{op}: a stochastic-rounding key must be an int64 (2,) tensor on "
                         f"{device}, got {key.dtype} {tuple(key.shape)} on {key.device}")


def _launch_row(x, sx, data, scale, glob, key, offset, exact, two_d, codes, idx64,
                grouped=False) -> None:
    """The rowwise kernel over x (M, K), rows sx elements apart (see the kernel's doc);
    ``exact`` None: no exact values written; ``grouped``: ``glob`` holds one S per 16-row
    block."""
    kernel, grid, args, kwargs = _row_call(x, sx, data, scale, glob, key, offset, exact,
                                           two_d, codes, idx64, grouped)
    launch(kernel, grid, *args, **kwargs)


def _row_call(x, sx, data, scale, glob, key, offset, exact, two_d, codes, idx64,
              grouped=False) -> tuple:
    """:func:`_launch_row`'s (kernel, grid, args, kwargs)."""
    m, kk = x.shape
    cr = tuning.nvfp4_config["row"]
    kb, rb = cr["KB"], (16 if two_d else cr["RB"])
    grid = (triton_cdiv(m, rb) * triton_cdiv(kk // BLOCK, kb),)
    return (_kernels()._nvfp4_row_kernel, grid,
            (x, m, kk, sx, data, scale, glob, key if key is not None else glob, offset, exact),
            dict(TWO_D=bool(two_d), SR=key is not None, VEC=16 // x.element_size(), KB=kb,
                 RB=rb, EVEN=m % rb == 0 and (kk // BLOCK) % kb == 0, IDX64=idx64,
                 EXACT=exact is not None, CODES=bool(codes), GROUPED=bool(grouped),
                 num_warps=max(1, kb * rb // 32), **_LAUNCH_OPTS))


def _launch_col(x, sx, data, scale, glob, key, offset, exact, rht, two_d, codes,
                idx64, grouped=False) -> None:
    """The columnwise kernel over x (M, K), rows sx elements apart (see the kernel's doc);
    ``grouped``: ``glob`` holds one S per 16-row block of x."""
    kernel, grid, args, kwargs = _col_call(x, sx, data, scale, glob, key, offset, exact,
                                           rht, two_d, codes, idx64, grouped)
    launch(kernel, grid, *args, **kwargs)


def _col_call(x, sx, data, scale, glob, key, offset, exact, rht, two_d, codes, idx64,
              grouped=False) -> tuple:
    """:func:`_launch_col`'s (kernel, grid, args, kwargs)."""
    m, kk = x.shape
    kw = tuning.nvfp4_config["col"]["KW"]
    grid = (triton_cdiv(m, 64) * triton_cdiv(kk, 16 * kw),)
    return (_kernels()._nvfp4_col_kernel, grid,
            (x, m, kk, sx, data, scale, glob, key if key is not None else glob, offset, exact),
            dict(RHT=bool(rht), TWO_D=bool(two_d), SR=key is not None, KW=kw,
                 EVEN=m % 64 == 0 and kk % (16 * kw) == 0, IDX64=idx64,
                 EXACT=exact is not None, CODES=bool(codes), GROUPED=bool(grouped),
                 num_warps=kw, **_LAUNCH_OPTS))


@kernel_op("lowprec::nvfp4_exact_slice", mutates_args=())
def nvfp4_exact_slice(x: Tensor, glob: Tensor, key: Optional[Tensor], offset: int,
                      rowwise: bool, with_rht: bool, two_d: bool) -> Tensor:
    """The exact bf16 ``q * d`` of one direction of x, a slice of a larger tensor (what
    :func:`nvfp4_quantize` writes for it with ``codes=False``, in one allocation): ``glob``
    the whole tensor's global scale of that direction, ``key`` its stochastic-rounding key
    (None: nearest-even), ``offset`` the slice's first stochastic-rounding index in that
    direction's matrix. (M, K) rowwise, (K, M) columnwise (RHT'd when ``with_rht``); x may
    be row-strided."""
    _check_key("nvfp4_exact_slice", key, x.device)
    if x.stride(-1) != 1:
        x = x.contiguous()
    m, kk = x.shape
    out = x.new_empty((m, kk) if rowwise else (kk, m), dtype=torch.bfloat16)
    if m == 0 or kk == 0:
        return out
    sx = _row_stride(x)
    idx64 = _idx64(m, max(kk, sx), offset)
    if rowwise:
        _launch_row(x, sx, out, out, glob, key, offset, out, two_d, False, idx64)
    else:
        _launch_col(x, sx, out, out, glob, key, offset, out, with_rht, two_d, False, idx64)
    return out


@nvfp4_exact_slice.register_fake
def _nvfp4_exact_slice_fake(x, glob, key, offset, rowwise, with_rht, two_d):
    m, kk = x.shape
    return x.new_empty((m, kk) if rowwise else (kk, m), dtype=torch.bfloat16)


def _amax_pass(x: Tensor, rglob: Tensor, cglob: Tensor, rowwise: bool, columnwise: bool,
               rht: bool, idx64: bool) -> None:
    """Write the global encode scales of the contiguous x's directions in use."""
    ws = torch.zeros(3, dtype=torch.int32, device=x.device)
    kernel, grid, args, kwargs = _amax_call(x, ws, rglob, cglob, rowwise, columnwise, rht,
                                            idx64)
    launch(kernel, grid, *args, **kwargs)


def _amax_call(x, ws, rglob, cglob, rowwise, columnwise, rht, idx64) -> tuple:
    """:func:`_amax_pass`'s (kernel, grid, args, kwargs), ``ws`` its zeroed int32 (3,)."""
    m, kk = x.shape
    ca = tuning.nvfp4_config["amax"]
    grid, warps, even = amax_launch(m, kk, rht, x.device)
    return (_kernels()._nvfp4_amax_kernel, grid, (x, m, kk, ws, rglob, cglob),
            dict(ROW=bool(rowwise), COL=bool(columnwise), RHT=rht, KW=ca["KW"],
                 FLAT=ca["FLAT"], EVEN=even, IDX64=idx64, num_warps=warps, **_LAUNCH_OPTS))


@kernel_op("lowprec::nvfp4_global_scales", mutates_args=())
def nvfp4_global_scales(x: Tensor, rowwise: bool, columnwise: bool,
                        with_rht: bool) -> tuple[Tensor, Tensor]:
    """(rowwise S, columnwise S) of a 2-D x, (1,) fp32 each (the columnwise one of the
    RHT'd transpose when ``with_rht``), as :func:`nvfp4_quantize` computes them; a direction
    not in use gets an empty tensor. One pass over x."""
    x = x.contiguous()
    rglob = x.new_empty(1 if rowwise else 0, dtype=torch.float32)
    cglob = x.new_empty(1 if columnwise else 0, dtype=torch.float32)
    m, kk = x.shape
    if m and kk and (rowwise or columnwise):
        _amax_pass(x, rglob, cglob, rowwise, columnwise, bool(with_rht and columnwise),
                   _idx64(m, kk))
    else:  # no elements: amax 0, S = 1
        rglob.fill_(1.0)
        cglob.fill_(1.0)
    return rglob, cglob


@nvfp4_global_scales.register_fake
def _nvfp4_global_scales_fake(x, rowwise, columnwise, with_rht):
    return (x.new_empty(1 if rowwise else 0, dtype=torch.float32),
            x.new_empty(1 if columnwise else 0, dtype=torch.float32))


def amax_launch(m: int, kk: int, rht: bool, device: torch.device) -> tuple:
    """(grid, num_warps, EVEN) of the amax pass over an (m, kk) input: at most
    ``PROGS_PER_SM`` programs per SM, each folding tiles (grid-stride)."""
    ca = tuning.nvfp4_config["amax"]
    if rht:
        tiles = triton_cdiv(m, 64) * triton_cdiv(kk, 16 * ca["KW"])
        warps = ca["KW"]
        even = m % 64 == 0 and kk % (16 * ca["KW"]) == 0
    else:
        tiles = triton_cdiv(m * kk, ca["FLAT"])
        warps = 4
        even = (m * kk) % ca["FLAT"] == 0
    return (max(1, min(tiles, num_sms(device) * ca["PROGS_PER_SM"])),), warps, even


def quantize_outputs(x: Tensor, rowwise: bool, columnwise: bool, two_d: bool,
                      exact_row: bool = False, exact_col: bool = False, codes: bool = True,
                      scales_given: bool = False):
    """Uninitialized (data, scale bytes, S) of each direction of an (M, K) x, then the
    exact bf16 of each; an unused direction's tensors are empty, as is S when the scales
    are given. Shared by the op and its fake."""
    m, kk = x.shape

    def direction(on, rows, cols):
        if not on:
            return tuple(x.new_empty(0, dtype=torch.uint8) for _ in range(3))
        glob = x.new_empty(0 if scales_given else 1, dtype=torch.float32)
        if not codes:
            return x.new_empty(0, dtype=torch.uint8), x.new_empty(0, dtype=torch.uint8), glob
        return (x.new_empty(rows, cols // 2, dtype=torch.uint8),
                x.new_empty(rows // BLOCK if two_d else rows, cols // BLOCK, dtype=torch.uint8),
                glob)

    def exact(on, rows, cols):
        return x.new_empty((rows, cols) if on else (0,), dtype=torch.bfloat16)

    return (*direction(rowwise, m, kk), *direction(columnwise, kk, m),
            exact(rowwise and exact_row, m, kk), exact(columnwise and exact_col, kk, m))


@nvfp4_quantize.register_fake
def _nvfp4_quantize_fake(x, key_row, key_col, rowwise, columnwise, with_rht, two_d,
                         exact_row=False, exact_col=False, codes=True, rglob_in=None,
                         cglob_in=None, row_offset=0, col_offset=0):
    return quantize_outputs(x, rowwise, columnwise, two_d, exact_row, exact_col, codes,
                             rglob_in is not None or cglob_in is not None)


def quantize_2d(x2d: Tensor, *, rowwise: bool, columnwise: bool, with_rht: bool,
                two_d: bool, key_row: Tensor | None = None,
                key_col: Tensor | None = None, exact: tuple[str, ...] = (),
                scales: tuple | None = None, offsets: tuple[int, int] = (0, 0)) -> dict:
    """NVFP4Tensor fields for an (M, K) input through the kernels (see module doc).

    ``key_row`` / ``key_col``: the stochastic-rounding keys of the rowwise (M, K) and
    columnwise (K, M) directions (:func:`.draws.draw_key`; both ``None``: nearest-even).
    ``exact``: the directions whose exact bf16 ``q * d`` the kernels also write, kept as
    the tensor's ``_exact_<usage>`` records. ``scales`` (rowwise S, columnwise S) and
    ``offsets`` (rowwise, columnwise): for a slice of a larger tensor, its global scales
    and the slice's first stochastic-rounding index in each direction (see
    :func:`nvfp4_quantize`).
    """
    ex_row = bool(rowwise) and "rowwise" in exact
    ex_col = bool(columnwise) and "columnwise" in exact
    rs_in, cs_in = scales if scales is not None else (None, None)
    rdata, rscale, rglob, cdata, cscale, cglob, rex, cex = nvfp4_quantize(
        x2d, key_row, key_col, bool(rowwise), bool(columnwise), bool(with_rht), bool(two_d),
        ex_row, ex_col, True, rs_in, cs_in, offsets[0], offsets[1])
    if scales is not None:
        rglob, cglob = rs_in, cs_in
    fields: dict = {}
    if rowwise:
        fields.update(rowwise_data=rdata, rowwise_scale=rscale.view(SCALE_DTYPE),
                      rowwise_global=rglob)
    if columnwise:
        fields.update(columnwise_data=cdata, columnwise_scale=cscale.view(SCALE_DTYPE),
                      columnwise_global=cglob)
    if ex_row:
        fields["_exact_rowwise"] = QuantizedTensor.derived_record(rdata, rex)
    if ex_col:
        fields["_exact_columnwise"] = QuantizedTensor.derived_record(cdata, cex)
    return fields


def quantize_2d_exact(x2d: Tensor, *, rowwise: bool, columnwise: bool, with_rht: bool,
                      two_d: bool, key_row: Tensor | None = None,
                      key_col: Tensor | None = None) -> dict:
    """ExactTensor fields of an (M, K) input (no codes or scales written): each direction's
    exact bf16 ``q * d`` with its global scale ``S`` as the divisor, the values
    :func:`quantize_2d` would record for the same keys."""
    _, _, rglob, _, _, cglob, rex, cex = nvfp4_quantize(
        x2d, key_row, key_col, bool(rowwise), bool(columnwise), bool(with_rht), bool(two_d),
        bool(rowwise), bool(columnwise), False)
    return {"rowwise_data": rex if rowwise else None,
            "rowwise_divisor": rglob if rowwise else None,
            "columnwise_data": cex if columnwise else None,
            "columnwise_divisor": cglob if columnwise else None,
            "source_format": "nvfp4", "columnwise_rht": bool(with_rht and columnwise)}


# ---- dequantize (unscaled, bf16) ----------------------------------------------------------------
@kernel_op("lowprec::nvfp4_dequantize_unscaled_bf16", mutates_args=())
def nvfp4_dequantize_unscaled_bf16(data: Tensor, scale: Tensor, two_d: bool) -> Tensor:
    """bf16 (R, C) ``q * d`` from packed codes (R, C/2) and E4M3 scale bytes (uint8)."""
    r, c2 = data.shape
    c = 2 * c2
    out = torch.empty(r, c, dtype=torch.bfloat16, device=data.device)
    if r == 0 or c == 0:
        return out
    cfg = tuning.nvfp4_config["dequant"]
    kb, rb = cfg["KB"], cfg["RB"]
    data, scale = data.contiguous(), scale.contiguous()

    def calls():
        grid = (triton_cdiv(r, rb) * triton_cdiv(c // BLOCK, kb),)
        return [(_kernels()._nvfp4_dequant_unscaled_kernel, grid, (data, scale, out, r, c),
                 dict(TWO_D=bool(two_d), KB=kb, RB=rb,
                      EVEN=r % rb == 0 and (c // BLOCK) % kb == 0, IDX64=_idx64(r, c),
                      num_warps=max(1, kb * rb // 32), **_LAUNCH_OPTS))]

    _DEQUANTIZES.run((r, c, data.device.index, bool(two_d), kb, rb), (data, scale, out), calls)
    return out


@nvfp4_dequantize_unscaled_bf16.register_fake
def _nvfp4_dequantize_unscaled_bf16_fake(data, scale, two_d):
    r, c2 = data.shape
    return data.new_empty(r, 2 * c2, dtype=torch.bfloat16)


def _dequantize_unscaled_torch(data: Tensor, scale: Tensor, two_d: bool) -> Tensor:
    q = e2m1_codes_to_float(unpack_e2m1(data))
    r, c = q.shape
    d = scale.to(torch.float32)
    if two_d:
        v = q.reshape(r // BLOCK, BLOCK, c // BLOCK, BLOCK) * d[:, None, :, None]
    else:
        v = q.reshape(r, c // BLOCK, BLOCK) * d[:, :, None]
    return v.reshape(r, c).to(torch.bfloat16)


def dequantize_unscaled_bf16(qt, usage: str = "rowwise") -> tuple[Tensor, Tensor]:
    """``(q * d as a bf16 (R, C) matrix, S)`` for one stored direction of an NVFP4Tensor.

    Rowwise: (M, K); columnwise: (K, M), still RHT-transformed when the tensor
    carries it. ``q * d`` is exact in bf16; the high-precision value is
    ``(q * d) / S`` with ``S`` the (1,) fp32 global encode scale returned
    beside it. Triton kernel on CUDA, plain torch elsewhere (same values).
    """
    if usage not in ("rowwise", "columnwise"):
        raise ValueError(f"usage={usage!r} is not valid; use 'rowwise' or 'columnwise'")
    if not qt.has_usage(usage):
        raise RuntimeError(f"{type(qt).__name__} holds no {usage} data")
    data = getattr(qt, f"{usage}_data")
    scale = getattr(qt, f"{usage}_scale")
    s = getattr(qt, f"{usage}_global")
    two_d = bool(qt.with_2d_quantization)
    if use_kernels(data):
        out = nvfp4_dequantize_unscaled_bf16(data, scale.view(torch.uint8), two_d)
    else:
        out = _dequantize_unscaled_torch(data, scale, two_d)
    return out, s
