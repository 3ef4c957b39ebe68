"""Quantization formats: one sub-package per format (quantizer, tensor, reference)."""

from .base import QuantizedTensor, Quantizer, register_safe_globals
from .block import Float8BlockQuantizer, Float8BlockwiseTensor
from .exact import ExactTensor
from .float8 import Float8CurrentScalingQuantizer, Float8Quantizer, Float8Tensor
from .hybrid import HybridQuantizedTensor, HybridQuantizer
from .identity import IdentityQuantizer, IdentityTensor
from .mxfp8 import MXFP8Quantizer, MXFP8Tensor
from .nvfp4 import NVFP4Quantizer, NVFP4Tensor

__all__ = ["Quantizer", "QuantizedTensor",
           "Float8Quantizer", "Float8CurrentScalingQuantizer", "Float8Tensor",
           "Float8BlockQuantizer", "Float8BlockwiseTensor",
           "MXFP8Quantizer", "MXFP8Tensor",
           "NVFP4Quantizer", "NVFP4Tensor",
           "IdentityQuantizer", "IdentityTensor",
           "HybridQuantizer", "HybridQuantizedTensor", "ExactTensor"]

register_safe_globals(*(globals()[name] for name in __all__
                        if name not in ("Quantizer", "QuantizedTensor")))
