"""Quantization formats: one sub-package per format (quantizer, tensor, reference)."""

from .base import Quantizer, QuantizedTensor, register_safe_globals
from .float8 import Float8CurrentScalingQuantizer, Float8Quantizer, Float8Tensor

register_safe_globals(Float8Quantizer, Float8CurrentScalingQuantizer, Float8Tensor)

__all__ = ["Quantizer", "QuantizedTensor", "Float8Quantizer", "Float8CurrentScalingQuantizer",
           "Float8Tensor"]
