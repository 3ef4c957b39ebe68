"""MXFP8: FP8 elements with one E8M0 (power-of-two) scale per block of 32.

Layout (M = prod(shape[:-1]), K = shape[-1]; scales are uint8 biased
exponents e + 127, 255 = NaN):

* rowwise: data (M, K) fp8, scale (M, K/32), 1x32 blocks along K;
* columnwise: data (K, M) fp8, scale (K, M/32): the rowwise quantization of
  the transposed matrix, i.e. 32x1 blocks of the original;
* ``with_2d_quantization``: 32x32 blocks, rowwise scale (M/32, K/32);
  columnwise data/scale are the transposes of the rowwise data/scale.
"""

from .quantizer import MXFP8Quantizer
from .tensor import MXFP8Tensor

__all__ = ["MXFP8Quantizer", "MXFP8Tensor"]

# The rest of lowprec enters the package here (internal names, not in __all__).
from .dequantize import MX_DEQUANT_CONFIG, mxfp8_dequantize_bf16, mxfp8_dequantize_bf16_torch
from .reference import BLOCK, block_exponents
