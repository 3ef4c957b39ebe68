"""NVFP4: E2M1 values in 16-element blocks, E4M3 block scales, one fp32 global scale."""

from ..rht import rht_forward, rht_inverse, rht_matrix
from .quantizer import NVFP4Quantizer
from .tensor import NVFP4Tensor

__all__ = ["NVFP4Quantizer", "NVFP4Tensor", "rht_forward", "rht_inverse", "rht_matrix"]

# The rest of lowprec enters the package here (internal names, not in __all__).
from .compiled import draw_keys
from .draws import draw_key
from .experts import NVFP4Experts, quantize_experts
from .grouped import group_scales, grouped_exact
from .reference import BLOCK, block_decode_scales
