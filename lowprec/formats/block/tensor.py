"""Float8BlockwiseTensor: FP8 data with one fp32 scale per 1x128 or 128x128 block."""

from __future__ import annotations

import torch

from ...kernels.transpose import transpose_contiguous
from ..base import QuantizedTensor
from ..graph import Kind
from .dequant import dequantize_bf16
from .reference import BLOCK, dequantize_blocks


class Float8BlockwiseTensor(QuantizedTensor):
    """Block-scaled FP8 (1x128 blocks for ``block_scaling_dim=1``, 128x128 for 2).

    With ``M = prod(shape[:-1])`` and ``K = shape[-1]``:

    * ``rowwise_data`` (M, K) fp8; ``rowwise_scale`` fp32, (M, K/128) for
      dim 1 and (M/128, K/128) for dim 2.
    * ``columnwise_data`` (K, M) fp8; ``columnwise_scale`` fp32, (K, M/128)
      for dim 1 (blocks run 128x1 along M) and (K/128, M/128) for dim 2.

    A dimension that is not a multiple of 128 rounds its scale count up: the last block
    is partial (``partial(usage)``), scaled by the values it holds.

    Scales are the *encode* scales used at quantize time (data was cast from
    ``x * scale``; dequantization is ``data / scale``). A block that held
    NaN/Inf has a NaN scale and dequantizes to NaN. For 128x128 blocks the
    two directions share their blocks, so either derives from the other by a
    transpose; 1x128 blocks cannot be re-derived without the original values.
    """

    _inner = ("rowwise_data", "rowwise_scale", "columnwise_data", "columnwise_scale")
    _meta = ("fp8_dtype", "block_scaling_dim")
    #: per usage, ``(scale, scale._version, decode)`` as the quantize kernel wrote it, or None
    #: (``decode`` as ``decode_scale`` returns it); and ``(scale, scale._version, True)`` when
    #: the quantizer forced the scales to powers of two (see ``pow2_scales``).
    _derived = ("_decode_rowwise", "_decode_columnwise", "_pow2_rowwise", "_pow2_columnwise")

    def pow2_scales(self, usage: str) -> bool:
        """Whether ``usage``'s scales are known to be powers of two (or NaN/Inf) without
        looking at them: the quantizer forced them so and they have not been written since.
        False means unknown, not that some scale is not a power of two."""
        return bool(self._read_derived(f"_pow2_{usage}", getattr(self, f"{usage}_scale")))

    def decode_scale(self, usage: str) -> torch.Tensor:
        """``1 / scale`` of ``usage``'s blocks (fp32), laid out as cuBLAS reads block scales:
        for 1x128 blocks transposed and contiguous, (K/128, M) rowwise and (M/128, K)
        columnwise; for 128x128 blocks contiguous in the scale's own shape. The quantize
        kernel's copy while the scale is the same, unmodified tensor; else computed here."""
        s = getattr(self, f"{usage}_scale")
        rec = self._read_derived(f"_decode_{usage}", s)
        if rec is not None:
            return rec
        s = s.to(torch.float32)
        if self.block_scaling_dim == 2:
            return torch.reciprocal(s).contiguous()
        # reciprocal and transpose in one pass (one launch)
        out = torch.empty((s.shape[1], s.shape[0]), dtype=torch.float32, device=s.device)
        return torch.reciprocal(s.t(), out=out)

    def _gemm_kind(self, usage: str, read: bool) -> Kind:
        # data / scale is exact in bf16 only for power-of-two scales
        return Kind("blocks", self.fp8_dtype, self.block_scaling_dim,
                    pow2=self.pow2_scales(usage) or (read and self._read_pow2(usage)))

    def _read_pow2(self, usage: str) -> bool:
        scale = getattr(self, f"{usage}_scale")
        if scale.is_cuda and torch.cuda.is_current_stream_capturing():
            return False  # the scales cannot be read back under capture
        mant, _ = torch.frexp(scale.to(torch.float32))  # reads the scales back: synchronizes
        return bool(((mant == 0.5) | ~torch.isfinite(scale)).all())

    def bf16_operand(self, usage: str) -> tuple[torch.Tensor, None]:
        return dequantize_bf16(getattr(self, f"{usage}_data"), getattr(self, f"{usage}_scale"),
                               self.block_scaling_dim), None

    def _stored_block(self, usage: str) -> tuple[int, int]:
        return (BLOCK, BLOCK) if self.block_scaling_dim == 2 else (1, BLOCK)

    def _dequantize_2d(self, usage: str) -> torch.Tensor:
        return dequantize_blocks(getattr(self, f"{usage}_data"), getattr(self, f"{usage}_scale"),
                                 self.block_scaling_dim)

    def _derive(self, usage: str) -> dict[str, torch.Tensor]:
        if self.block_scaling_dim != 2:
            return super()._derive(usage)
        other = "columnwise" if usage == "rowwise" else "rowwise"
        scale = transpose_contiguous(getattr(self, f"{other}_scale"))
        fields = {f"{usage}_data": transpose_contiguous(getattr(self, f"{other}_data")),
                  f"{usage}_scale": scale}
        if self.pow2_scales(other):  # the transposed scales are the same powers of two
            fields[f"_pow2_{usage}"] = self.derived_record(scale, True)
        return fields
