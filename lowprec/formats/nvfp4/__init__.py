"""NVFP4: E2M1 values in 16-element blocks, E4M3 block scales, one fp32 global scale."""

from ..rht import rht_forward, rht_inverse, rht_matrix
from .quantizer import NVFP4Quantizer
from .tensor import NVFP4Tensor

__all__ = ["NVFP4Quantizer", "NVFP4Tensor", "rht_forward", "rht_inverse", "rht_matrix"]
