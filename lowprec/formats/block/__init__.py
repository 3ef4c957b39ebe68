"""Block-scaled FP8: one fp32 scale per 1x128 (``block_scaling_dim=1``) or 128x128 block.

Layout, with ``M = prod(shape[:-1])`` and ``K = shape[-1]``:

* rowwise: data (M, K) fp8; scale (M, K/128) for 1x128 blocks along K, or
  (M/128, K/128) for 128x128 blocks.
* columnwise: data (K, M) fp8 (contiguous, M-contiguous rows); scale
  (K, M/128) for 1D (128x1 blocks along M, i.e. the 1x128 quantization of
  the transpose), or (K/128, M/128) for 2D (the same 128x128 blocks as
  rowwise, transposed).

Scales are fp32 *encode* scales (``data = cast_fp8(x * scale)``,
``dequant = data / scale``), each block scaled like per-tensor current scaling.
"""

from .quantizer import Float8BlockQuantizer
from .reference import BLOCK
from .tensor import Float8BlockwiseTensor

__all__ = ["Float8BlockQuantizer", "Float8BlockwiseTensor", "BLOCK"]

# The rest of lowprec enters the package here (internal names, not in __all__).
from .experts import Float8BlockExperts
