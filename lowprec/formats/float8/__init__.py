"""Per-tensor FP8: delayed scaling (Float8Quantizer) and current scaling."""

from .quantizer import Float8CurrentScalingQuantizer, Float8Quantizer
from .tensor import Float8Tensor

__all__ = ["Float8Quantizer", "Float8CurrentScalingQuantizer", "Float8Tensor"]
