"""``NVFP4Experts``: a 3-D expert weight held as NVFP4 codes (16x16 blocks) with one global
scale an expert.

The grouped NVFP4 path quantizes each expert of a (E, N, K) weight on its own (its global
encode scale ``S``, its 16x16 blocks) and multiplies the exact bf16 ``q * d`` values. A
weight that arrives quantized so (the unsharded parameter of an FSDP2 quantized
all-gather, :mod:`lowprec.distributed.experts_gather`) is an ``NVFP4Experts``: the GEMMs
read its exact values and scales instead of quantizing the weight again (the same bits).
It is made only by nearest rounding without a Hadamard transform, so each expert's
columnwise blocks are its rowwise ones transposed (the same block amaxes and ``S``). What
it supports and refuses: :class:`lowprec.formats.experts.QuantizedExperts`.
"""

from __future__ import annotations

import torch

from ...kernels import use_kernels
from ..casting import pack_e2m1, unpack_e2m1
from ..experts import QuantizedExperts
from .grouped import group_scales
from .launch import _idx64, _launch_row, dequantize_unscaled_bf16
from .quantizer import NVFP4Quantizer
from .reference import BLOCK, SCALE_DTYPE
from .tensor import NVFP4Tensor


def quantize_experts(w3d: torch.Tensor, quantizer: NVFP4Quantizer):
    """(codes (E * N, K / 2) uint8, decode scales (E * N / 16, K / 16) E4M3, global encode
    scales (E,) fp32) of each expert of ``w3d`` quantized by ``quantizer`` on its own
    (rowwise, 16x16 blocks, nearest rounding, no Hadamard transform): on a GPU in two
    launches for all of them, elsewhere one quantize an expert."""
    if not (quantizer.with_2d_quantization and not quantizer.with_rht
            and not quantizer.stochastic_rounding):
        raise ValueError(f"NVFP4 experts are quantized in 16x16 blocks, rounded to nearest, "
                         f"without RHT; got {quantizer!r}")
    e, n, k = w3d.shape
    if n % BLOCK or k % BLOCK:
        raise ValueError(f"NVFP4 experts need N and K multiples of {BLOCK}, got shape "
                         f"{tuple(w3d.shape)}")
    if use_kernels(w3d) and e * n and k:
        return experts_by_kernels(w3d)
    q = quantizer.copy()
    q.set_usage(rowwise=True, columnwise=False)
    parts = [q.quantize(w) for w in w3d]
    return (torch.cat([p.rowwise_data for p in parts]),
            torch.cat([p.rowwise_scale for p in parts]),
            torch.cat([p.rowwise_global for p in parts]))


def experts_by_kernels(w3d: torch.Tensor):
    """:func:`quantize_experts`' result in two launches for every expert: each expert's S
    (the grouped path's own pass), then the row kernel's codes and scales with each 16-row
    block's S."""
    e, n, k = w3d.shape
    w2d = w3d.contiguous().view(e * n, k)
    blocks = torch.arange(e * n // BLOCK, device=w3d.device, dtype=torch.int32) // (n // BLOCK)
    s = group_scales(w2d, blocks, e, False)[:, 0].contiguous()
    codes = torch.empty((e * n, k // 2), dtype=torch.uint8, device=w3d.device)
    scales = torch.empty((e * n // BLOCK, k // BLOCK), dtype=torch.uint8, device=w3d.device)
    _launch_row(w2d, k, codes, scales, s[blocks].contiguous(), None, 0, None, True, True,
                _idx64(e * n, k), grouped=True)
    return codes, scales.view(SCALE_DTYPE), s


class NVFP4Experts(QuantizedExperts):
    """(E, N, K) experts as NVFP4 ``codes`` (E * N, K / 2) uint8 (two E2M1 codes a byte),
    E4M3 decode ``scales`` (E * N / 16, K / 16), one a 16x16 block, and fp32 global encode
    scales ``globals`` (E,): expert e's value is ``q * d / globals[e]``. ``dtype``: the
    weight's high-precision dtype (its gradient's)."""

    _inner = ("codes", "scales", "globals")
    _block = BLOCK

    @staticmethod
    def __new__(cls, shape, dtype: torch.dtype, codes: torch.Tensor, scales: torch.Tensor,
                globals: torch.Tensor, requires_grad: bool = False):
        return QuantizedExperts.__new__(cls, shape, dtype, requires_grad=requires_grad,
                                        codes=codes, scales=scales, globals=globals)

    def _layout(self, e: int, n: int, k: int) -> dict:
        return {"codes": ((torch.uint8,), torch.uint8, (e * n, k // 2)),
                "scales": ((SCALE_DTYPE,), SCALE_DTYPE, (e * n // BLOCK, k // BLOCK)),
                "globals": ((torch.float32,), torch.float32, (e,))}

    def _rows(self, codes, scales, s, rows: int) -> NVFP4Tensor:
        return NVFP4Tensor((rows, self.shape[2]), self.dtype, rowwise_data=codes,
                           rowwise_scale=scales, rowwise_global=s, columnwise_data=None,
                           columnwise_scale=None, columnwise_global=None, with_rht=False,
                           with_2d_quantization=True)

    def exact(self) -> torch.Tensor:
        """Every expert's exact bf16 ``q * d`` (E, N, K) (without its global scale), in one
        pass on a GPU."""
        ones = torch.ones(1, dtype=torch.float32, device=self.device)
        e, n, k = self.shape
        values, _ = dequantize_unscaled_bf16(self._rows(self.codes, self.scales, ones, e * n))
        return values.view(e, n, k)

    def expert(self, g: int, columnwise: bool = False) -> NVFP4Tensor:
        """Expert ``g``'s (N, K) weight as its own quantize makes it: rowwise, and
        ``columnwise`` (its rowwise blocks transposed: NVFP4 derives no direction from the
        other, so a GEMM that needs it must be given it)."""
        n = self.shape[1]
        codes = self.codes[g * n:(g + 1) * n]
        scales = self.scales[g * n // BLOCK:(g + 1) * n // BLOCK]
        s = self.globals[g:g + 1]
        t = self._rows(codes, scales, s, n)
        if not columnwise:
            return t
        t.columnwise_data = pack_e2m1(unpack_e2m1(codes).t().contiguous())
        t.columnwise_scale = scales.t().contiguous()
        t.columnwise_global = s
        return t

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The experts' values ``q * d / S`` as a plain tensor (the weight's dtype)."""
        values = self.exact().to(torch.float32) / self.globals[:, None, None]
        return values.to(dtype or self.dtype)
