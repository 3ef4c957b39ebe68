"""The Linear family of modules."""

from .experts import GroupedExperts
from .grouped_linear import GroupedLinear
from .layernorm_linear import LayerNormLinear
from .layernorm_mlp import LayerNormMLP
from .linear import Linear
from .norms import LayerNorm, RMSNorm

__all__ = ["Linear", "LayerNormLinear", "LayerNormMLP", "GroupedLinear", "GroupedExperts",
           "LayerNorm", "RMSNorm"]
