"""Per-tensor FP8: delayed scaling (Float8Quantizer) and current scaling."""

from .quantizer import Float8CurrentScalingQuantizer, Float8Quantizer
from .tensor import Float8Tensor

__all__ = ["Float8Quantizer", "Float8CurrentScalingQuantizer", "Float8Tensor"]

# The rest of lowprec enters the package here (internal names, not in __all__).
from .experts import Float8Experts
from .grouped import quantize_experts
from .launch import UPDATE_MAX_HISTORY, fp8_delayed_update, fp8_delayed_update_many
from .reference import FirstScale, delayed_scale, inv_margin, seeded_scale
