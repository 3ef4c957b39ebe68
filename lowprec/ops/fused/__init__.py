"""Fused pieces, chosen by pattern at a Sequential's forward (registration order = priority)."""

from .linear_bias_activation import LinearBiasActivation, match_linear_bias_activation  # noqa: I001
from .activation_bias_backward import BiasActivation, bias_activation, match_bias_activation

__all__ = ["LinearBiasActivation", "BiasActivation", "bias_activation",
           "match_linear_bias_activation", "match_bias_activation"]
