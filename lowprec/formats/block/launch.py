"""Launcher for the block-scaled FP8 kernels, registered as a torch custom op.

Each (BM, BN) tile is read once per launch and its rowwise and/or columnwise data, scales
and decode scales (the reciprocals in cuBLAS's layout, kept as ``_derived`` records of the
tensor so the GEMMs need no launch to make them) are written from registers. The 1x128
columnwise usage, alone or with the rowwise one, goes to a Gluon kernel where one applies
(``tuning.block_gluon``), everything else to the Triton kernel shared with MXFP8
(``kernels/block_scaled.py``). Importing this module needs neither Triton nor CUDA.
"""

from __future__ import annotations

import torch

from ...kernels import _tracing, gluon_takes, kernel_op
from ...kernels.fp8_args import FP8_PARAMS, fp8_dtype_of, kernel_fp8_args
from ...kernels.grid import (
    device_guard,
    launches,
    logical_shape,
    order_axes,
    prologue_args,
    prologue_launch_args,
    tile_config,
    tile_grid,
    triton_cdiv,
)
from ...kernels.launch import (
    BoundCalls,
    bind,
    fast_launches,
    launch,
    launch_calls,
    launch_in_graph,
)
from ...kernels.tuning import tuning
from ..base import QuantizedTensor
from .reference import BLOCK


def gluon_config(kind: str) -> tuple:
    """``tuning.block_gluon_configs[kind]`` with the optional flags filled in where an entry
    omits them (K-fast 0; eviction hints 1): (R, T, warps, k_fast) for "col", (RB, R, T,
    warps, k_fast, evict) for "both"."""
    defaults = {"col": (None,) * 3 + (0,), "both": (None,) * 4 + (0, 1)}[kind]
    cfg = tuple(tuning.block_gluon_configs[kind])
    return cfg + defaults[len(cfg):]


def _gluon_applies(x: torch.Tensor, dim: int, rowwise: bool, columnwise: bool,
                   pro: int) -> bool:
    """The Gluon kernel has no masks along M (whole 128-row blocks) nor along K when it
    makes the rowwise usage too; the quantizers enforce both divisibilities before any
    launch, this keeps a direct call of the op on the masked Triton kernel."""
    m, k = x.shape
    return (tuning.block_gluon and dim == 1 and columnwise and pro == 0 and m % BLOCK == 0
            and (k % BLOCK == 0 or not rowwise) and gluon_takes(x))


def _gluon_call(x, outs, rowwise: bool, fp8_dtype, pow2: bool, eps: float):
    """(kernel, grid, tensors, other args, kwargs) of the Gluon launch."""
    from .gluon_kernels import block1_both_kernel, block1_col_kernel
    rq, rs, rd, cq, cs, cd = outs
    m, k = x.shape
    mbits, bias, max_bits, fmax = FP8_PARAMS[fp8_dtype]
    fp8 = dict(FP8_MAX=fmax, POW2=pow2, MBITS=mbits, BIAS=bias, MAX_BITS=max_bits)
    if rowwise:
        rb, r, t, warps, k_fast, evict = gluon_config("both")
        grid, k_fast = order_axes((m // BLOCK, k // BLOCK), k_fast)
        return (block1_both_kernel, grid, (x, rq, rs, rd, cq, cs, cd), (m, k, x.stride(0), eps),
                dict(RB=rb, R=r, T=t, WARPS=warps, K_FAST=k_fast, EVICT=bool(evict),
                     num_warps=warps, **fp8))
    r, t, warps, k_fast = gluon_config("col")
    grid, k_fast = order_axes((m // BLOCK, triton_cdiv(k, 8 * t)), k_fast)
    return (block1_col_kernel, grid, (x, cq, cs, cd), (m, k, x.stride(0), eps),
            dict(R=r, T=t, WARPS=warps, K_FAST=k_fast, num_warps=warps, **fp8))


def _usage(rowwise: bool, columnwise: bool) -> str:
    return "both" if rowwise and columnwise else ("row" if rowwise else "col")


def _shapes(m: int, k: int, dim: int, rowwise: bool, columnwise: bool):
    """Shapes of (rowwise data, scale, decode; columnwise data, scale, decode); (0,) for a
    usage not made."""
    if dim == 2:
        rs, cs = (m // BLOCK, k // BLOCK), (k // BLOCK, m // BLOCK)
        rd, cd = rs, cs
    else:
        rs, cs = (m, k // BLOCK), (k, m // BLOCK)
        rd, cd = rs[::-1], cs[::-1]
    none = (0,)
    return ((m, k) if rowwise else none, rs if rowwise else none, rd if rowwise else none,
            (k, m) if columnwise else none, cs if columnwise else none,
            cd if columnwise else none)


def empty_outputs(x, dim, rowwise, columnwise, pro=0):
    m, k = logical_shape(x, pro)
    rq, rs, rd, cq, cs, cd = _shapes(m, k, dim, rowwise, columnwise)
    u8, f32 = torch.uint8, torch.float32
    return (x.new_empty(rq, dtype=u8), x.new_empty(rs, dtype=f32), x.new_empty(rd, dtype=f32),
            x.new_empty(cq, dtype=u8), x.new_empty(cs, dtype=f32), x.new_empty(cd, dtype=f32))


@kernel_op("lowprec::fp8_block_quantize", mutates_args=())
def fp8_block_quantize(x: torch.Tensor, e5m2: bool, block_scaling_dim: int, pow2: bool,
                       eps: float, rowwise: bool, columnwise: bool, pro: int,
                       pro_args: list[torch.Tensor]
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                  torch.Tensor, torch.Tensor]:
    """(rowwise data, scale, decode scale, columnwise data, scale, decode scale)."""
    fp8_dtype = fp8_dtype_of(e5m2)
    outs = empty_outputs(x, block_scaling_dim, rowwise, columnwise, pro)
    if x.numel() == 0:  # every output is empty
        return outs

    def calls():
        return [(kernel, grid, (*tensors, *rest), kwargs) for kernel, grid, tensors, rest, kwargs
                in _quantize_calls(x, outs, block_scaling_dim, fp8_dtype, pow2, eps, rowwise,
                                   columnwise, pro, pro_args)]

    with device_guard(x.device):
        if pro:  # a fused prologue's tensors: launched the usual way
            launch_calls(calls())
        else:  # launches bound per kind of call
            _QUANTIZES.run(_kind(x, e5m2, block_scaling_dim, pow2, eps, rowwise, columnwise),
                           (x, *outs), calls)
    return outs


#: quantizes without a prologue, their launches bound per kind of call
_QUANTIZES = BoundCalls()


def _kind(x, e5m2, dim, pow2, eps, rowwise, columnwise) -> tuple:
    """What the launches of a quantize without a prologue specialize on besides its
    tensors: shapes, strides, dtypes, options and the tuning entries they read."""
    usages = [_usage(r, c) for r, c in launches(rowwise, columnwise, f"block{dim}")]
    return (x.shape, x.stride(), x.dtype, x.device.index, e5m2, dim, pow2, eps, rowwise,
            columnwise, tuple(tuning.block_configs.get((dim, u)) for u in usages),
            _gluon_applies(x, dim, rowwise, columnwise, 0), tuning.block_gluon_both,
            tuple(tuning.block_gluon_configs.items()), tuning.hw_cvt, tuning.col_mode)


def _triton_call(x, outs, block_scaling_dim, fp8_dtype, pow2, eps, r, c, pro, pro_args):
    """(kernel, grid, tensors, other args, kwargs) of one Triton launch."""
    from ...kernels.block_scaled import block_scaled_quant_kernel
    rq, rs, rd, cq, cs, cd = outs
    m, k = logical_shape(x, pro)
    bm, bn, warps, iters, stages, k_fast = tile_config(
        tuning.block_configs[(block_scaling_dim, _usage(r, c))])
    grid, k_fast = tile_grid(m, k, bm, bn, iters, k_fast)
    return (block_scaled_quant_kernel, grid, (x, rq, rs, cq, cs, rd, cd),
            (m, k, x.stride(0), x.stride(1), *prologue_args(x, pro_args), eps),
            dict(PRO=pro, FP8_MAX=FP8_PARAMS[fp8_dtype][3], POW2=pow2,
                 TWO_D=block_scaling_dim == 2, ROWWISE=r, COLWISE=c, BM=bm, BN=bn, E8M0=False,
                 BLK=BLOCK, ITERS=iters, STAGES=stages, DECODE=True, K_FAST=k_fast,
                 num_warps=warps, **kernel_fp8_args(fp8_dtype)))


def _launch_triton(x, outs, block_scaling_dim, fp8_dtype, pow2, eps, r, c, pro, pro_args,
                   run=launch):
    kernel, grid, tensors, rest, kwargs = _triton_call(x, outs, block_scaling_dim, fp8_dtype,
                                                       pow2, eps, r, c, pro, pro_args)
    run(kernel, grid, *tensors, *rest, **kwargs)


def _quantize_calls(x, outs, block_scaling_dim, fp8_dtype, pow2, eps, rowwise, columnwise,
                    pro, pro_args) -> list:
    """The launches of one quantize, as (kernel, grid, tensors, other args, kwargs)."""
    if _gluon_applies(x, block_scaling_dim, rowwise, columnwise, pro):
        both = rowwise and tuning.block_gluon_both
        calls = []
        if rowwise and not both:
            calls.append(_triton_call(x, outs, block_scaling_dim, fp8_dtype, pow2, eps, True,
                                      False, pro, pro_args))
        if x.numel():
            calls.append(_gluon_call(x, outs, both, fp8_dtype, pow2, eps))
        return calls
    return [_triton_call(x, outs, block_scaling_dim, fp8_dtype, pow2, eps, r, c, pro, pro_args)
            for r, c in launches(rowwise, columnwise, f"block{block_scaling_dim}")]


@fp8_block_quantize.register_fake
def _(x, e5m2, block_scaling_dim, pow2, eps, rowwise, columnwise, pro, pro_args):
    return empty_outputs(x, block_scaling_dim, rowwise, columnwise, pro)


@torch.library.triton_op("lowprec::fp8_block_quantize_inline", mutates_args=())
def fp8_block_quantize_inline(x: torch.Tensor, e5m2: bool, block_scaling_dim: int, pow2: bool,
                              eps: float, rowwise: bool, columnwise: bool
                              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                         torch.Tensor, torch.Tensor, torch.Tensor]:
    """``fp8_block_quantize`` (no prologue) for compiled graphs: a ``triton_op``, so
    inductor launches the Triton kernel from its own generated code, with no custom-op
    dispatch and no Python launcher per call (host time the compiled step would otherwise
    spend on every quantize). The same kernel as eager's Triton path, so the same bits; the
    Gluon kernel is not traceable this way."""
    fp8_dtype = fp8_dtype_of(e5m2)
    outs = empty_outputs(x, block_scaling_dim, rowwise, columnwise)
    for r, c in launches(rowwise, columnwise, f"block{block_scaling_dim}"):
        _launch_triton(x, outs, block_scaling_dim, fp8_dtype, pow2, eps, r, c, 0, [],
                       run=launch_in_graph)
    return outs


def quantize_block(quantizer, x2d: torch.Tensor, prologue=None) -> dict:
    """Float8BlockQuantizer._quantize_2d through the kernel (same fields)."""
    row, col = quantizer.rowwise_usage, quantizer.columnwise_usage
    dt = quantizer.fp8_dtype
    outs = fp8_block_quantize(
        x2d, dt == torch.float8_e5m2, quantizer.block_scaling_dim, quantizer.force_pow_2_scales,
        quantizer.amax_epsilon, row, col, *prologue_launch_args(prologue))
    return _fields(dt, quantizer.block_scaling_dim, row, col, outs)


def _fields(dt, block_scaling_dim: int, row: bool, col: bool, outs) -> dict:
    """``Float8BlockwiseTensor`` fields of a quantize's outputs."""
    rq, rs, rd, cq, cs, cd = outs
    record = QuantizedTensor.derived_record
    return {"rowwise_data": rq.view(dt) if row else None, "rowwise_scale": rs if row else None,
            "columnwise_data": cq.view(dt) if col else None,
            "columnwise_scale": cs if col else None,
            "fp8_dtype": dt, "block_scaling_dim": block_scaling_dim,
            "_decode_rowwise": record(rs, rd) if row else None,
            "_decode_columnwise": record(cs, cd) if col else None}


class PreparedBlock:
    """Block quantizes of one kind of input (shape, dtype, device; contiguous, 16-byte
    aligned) with fixed usages, for a linear plan that makes the same call again and again:
    the first call goes the usual way (it compiles the kernels), the second binds the
    launches (``kernels.launch.bind``), and from then on a call allocates the outputs and
    runs the bound launches, the same kernels with the same arguments. ``__call__`` returns
    the tensor fields, or None where the bound path does not take the call (the caller then
    quantizes the usual way)."""

    def __init__(self, quantizer, shape: torch.Size, dtype: torch.dtype, device: torch.device,
                 rowwise: bool, columnwise: bool) -> None:
        self.quantizer = quantizer
        self.settings = self._settings()
        self.shape, self.dtype = shape, dtype
        self.device = torch.empty(0, device=device).device  # with its index
        self.m, self.k = shape.numel() // shape[-1], shape[-1]
        self.rowwise, self.columnwise = rowwise, columnwise
        #: None before the first call, True before the second, then the bound launches
        #: with the number of tensors each takes (False: none could be bound)
        self.launches = None

    def _settings(self) -> tuple:
        q = self.quantizer
        return (q.fp8_dtype, q.block_scaling_dim, q.force_pow_2_scales, q.amax_epsilon)

    def __call__(self, x: torch.Tensor) -> dict | None:
        bound = self.launches
        if (bound is None or bound is False or self._settings() != self.settings
                or x.shape != self.shape or x.dtype != self.dtype or x.device != self.device
                or not x.is_contiguous() or x.data_ptr() % 16
                or self.device.index != torch.cuda.current_device()
                or not fast_launches() or _tracing((x,))):
            if bound is None:
                self.launches = True
            return None
        fp8_dtype, dim, pow2, eps = self.settings
        x2d = x.view(self.m, self.k)
        outs = empty_outputs(x2d, dim, self.rowwise, self.columnwise)
        if bound is True:
            calls = _quantize_calls(x2d, outs, dim, fp8_dtype, pow2, eps, self.rowwise,
                                    self.columnwise, 0, [])
            made = tuple(bind(kernel, grid, len(tensors), *tensors, *rest, **kwargs)
                         for kernel, grid, tensors, rest, kwargs in calls)
            # each launch's tensors as places among (x, *outputs), which every call makes anew
            places = {id(t): i for i, t in enumerate((x2d, *outs))}
            self.launches = False if None in made else tuple(
                (b, tuple(places[id(t)] for t in tensors))
                for b, (_, _, tensors, _, _) in zip(made, calls))
            if not self.launches:
                return None
            bound = self.launches
        now = (x2d, *outs)
        for launch_, places in bound:
            launch_(*(now[i] for i in places))
        return _fields(fp8_dtype, dim, self.rowwise, self.columnwise, outs)
