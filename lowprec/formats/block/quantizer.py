"""Float8BlockQuantizer: FP8 with current scaling per 1x128 or 128x128 block."""

from __future__ import annotations

import torch

from ...kernels import use_kernels
from ..base import (
    QuantizedTensor,
    Quantizer,
    check_amax_epsilon,
    check_bool_option,
    check_divisible,
    columnwise_from_backward,
)
from ..casting import check_fp8_dtype
from . import graph, launch
from .reference import BLOCK, quantize_blocks
from .tensor import Float8BlockwiseTensor


class Float8BlockQuantizer(Quantizer):
    """Block-scaled FP8: every block is scaled like per-tensor current scaling.

    ``block_scaling_dim=1``: rowwise blocks are 1x128 along K, columnwise
    blocks 128x1 along M (the 1x128 quantization of the transposed matrix).
    ``block_scaling_dim=2``: 128x128 blocks shared by both directions.

    Per block: ``scale = fp8_max / max(amax, amax_epsilon)`` in fp32; amax 0
    gives 1; an infinite scale becomes the fp32 max; ``force_pow_2_scales``
    rounds the scale down to a power of two; a block holding NaN/Inf gets a
    NaN scale. A blocked dimension that is not a multiple of 128 ends in a
    partial block with its own scale (``Quantizer.quantize``).
    ``amax_epsilon`` must be a real number in ``[0, fp32 max]`` and
    ``force_pow_2_scales`` a bool, else ValueError.
    """

    # every block scales itself: a part quantizes alone (quantize_part)
    blocks_are_independent = True

    format_name = "fp8_block"
    stateless = True

    def __init__(self, fp8_dtype: torch.dtype = torch.float8_e4m3fn, *, block_scaling_dim: int = 2,
                 force_pow_2_scales: bool = True, amax_epsilon: float = 0.0) -> None:
        super().__init__()
        self.fp8_dtype = check_fp8_dtype(fp8_dtype)
        if isinstance(block_scaling_dim, bool) or block_scaling_dim not in (1, 2):
            raise ValueError(f"block_scaling_dim={block_scaling_dim!r} is not supported; use 1 "
                             f"(1x128 blocks) or 2 (128x128 blocks)")
        self.block_scaling_dim = int(block_scaling_dim)
        self.force_pow_2_scales = check_bool_option(type(self).__name__, "force_pow_2_scales",
                                                    force_pow_2_scales)
        self.amax_epsilon = check_amax_epsilon(type(self).__name__, amax_epsilon)

    def _tensor_class(self):
        return Float8BlockwiseTensor

    def _check_shape(self, shape, m: int, k: int) -> None:
        what = f"Float8BlockQuantizer(block_scaling_dim={self.block_scaling_dim})"
        if self.block_scaling_dim == 2:
            check_divisible(shape, m, k, row_block=BLOCK, col_block=BLOCK, what=what)
            return
        if self.rowwise_usage:
            check_divisible(shape, m, k, row_block=BLOCK, col_block=1, what=what + " rowwise")
        if self.columnwise_usage:
            check_divisible(shape, m, k, row_block=1, col_block=BLOCK, what=what + " columnwise")

    def row_multiple(self, *, rowwise: bool, columnwise: bool) -> int:
        return BLOCK if (self.block_scaling_dim == 2 or columnwise) else 1

    def col_multiple(self, *, rowwise: bool, columnwise: bool) -> int:
        return BLOCK if (self.block_scaling_dim == 2 or rowwise) else 1

    def _quantize(self, x2d: torch.Tensor, dim: int):
        return quantize_blocks(x2d, self.fp8_dtype, dim, pow2=self.force_pow_2_scales,
                               eps=self.amax_epsilon)

    def slice_quantizer(self, x2d):
        # Every block lies inside one slice (slices start at multiples of 128): no shared state.
        return self._slicer(self._quantize_2d)

    def _quantize_2d_fused(self, x2d, prologue):
        return self._pow2_records(launch.quantize_block(self, x2d, prologue))

    def _pow2_records(self, fields: dict) -> dict:
        """Notes on each scale made with ``force_pow_2_scales`` that it is a power of two, so
        a GEMM backend that needs that need not read the scales back to the host (a sync,
        and impossible under CUDA graph capture)."""
        if self.force_pow_2_scales:
            for usage in ("rowwise", "columnwise"):
                scale = fields.get(f"{usage}_scale")
                if scale is not None:
                    fields[f"_pow2_{usage}"] = QuantizedTensor.derived_record(scale, True)
        return fields

    def _quantize_2d(self, x2d):
        return self._pow2_records(self._quantize_2d_plain(x2d))

    def _prepared(self, shape, dtype, device, rowwise, columnwise):
        prepared = launch.PreparedBlock(self, shape, dtype, device, rowwise, columnwise)

        def fields(x):
            got = prepared(x)
            return None if got is None else self._pow2_records(got)
        return fields

    def _quantize_2d_plain(self, x2d):
        if use_kernels(x2d):
            return launch.quantize_block(self, x2d)
        fields = {"rowwise_data": None, "rowwise_scale": None, "columnwise_data": None,
                  "columnwise_scale": None, "fp8_dtype": self.fp8_dtype,
                  "block_scaling_dim": self.block_scaling_dim}
        if self.block_scaling_dim == 2:
            # One set of 128x128 blocks serves both directions: columnwise is its transpose.
            data, scale = self._quantize(x2d, 2)
            if self.rowwise_usage:
                fields.update(rowwise_data=data, rowwise_scale=scale)
            if self.columnwise_usage:
                fields.update(columnwise_data=data.t().contiguous(),
                              columnwise_scale=scale.t().contiguous())
            return fields
        if self.rowwise_usage:
            fields["rowwise_data"], fields["rowwise_scale"] = self._quantize(x2d, 1)
        if self.columnwise_usage:
            fields["columnwise_data"], fields["columnwise_scale"] = self._quantize(x2d.t(), 1)
        return fields

    def _empty_fields(self, m, k, device):
        data = lambda *s: torch.empty(s, dtype=self.fp8_dtype, device=device)  # noqa: E731
        scale = lambda *s: torch.ones(s, dtype=torch.float32, device=device)  # noqa: E731
        if self.block_scaling_dim == 2:
            row_scale, col_scale = (m // BLOCK, k // BLOCK), (k // BLOCK, m // BLOCK)
        else:
            row_scale, col_scale = (m, k // BLOCK), (k, m // BLOCK)
        row, col = self.rowwise_usage, self.columnwise_usage
        return {"rowwise_data": data(m, k) if row else None,
                "rowwise_scale": scale(*row_scale) if row else None,
                "columnwise_data": data(k, m) if col else None,
                "columnwise_scale": scale(*col_scale) if col else None,
                "fp8_dtype": self.fp8_dtype, "block_scaling_dim": self.block_scaling_dim}

    def graph_operand(self, t, *, grad=False):
        if not self._quantizes_as(Float8BlockQuantizer):
            return super().graph_operand(t, grad=grad)
        if isinstance(t, Float8BlockwiseTensor):  # a weight that arrives quantized
            dim = t.block_scaling_dim
            later = dim == 1 and columnwise_from_backward(t)
            if (dim != self.block_scaling_dim or t.rowwise_data is None
                    or t.fp8_dtype != self.fp8_dtype
                    or not (dim == 2 or later or t.columnwise_data is not None)):
                return ("a block FP8 weight that is not this format's blocks, with its "
                        "columnwise data where it does not derive")
            return graph.GivenBlocks(self.fp8_dtype, dim, later)
        return graph.Blockwise(self.fp8_dtype, self.block_scaling_dim, self.force_pow_2_scales,
                               self.amax_epsilon, kernel=use_kernels(t))

    def _repr_params(self):
        return {"fp8_dtype": self.fp8_dtype, "block_scaling_dim": self.block_scaling_dim,
                "force_pow_2_scales": self.force_pow_2_scales, "amax_epsilon": self.amax_epsilon}
