"""Optimizers for low-precision training: :class:`AdamW` with bf16 moments and optional
fp32 master weights, and :class:`QuantizedWeightOptimizer` for quantized weights."""

from .adamw import AdamW
from .quantized_weights import QuantizedWeightOptimizer

__all__ = ["AdamW", "QuantizedWeightOptimizer"]
