"""The Linear family of modules."""

from .experts import GroupedExperts
from .grouped_linear import GroupedLinear
from .layernorm_linear import LayerNormLinear
from .layernorm_mlp import LayerNormMLP
from .linear import Linear
from .norms import LayerNorm, RMSNorm

__all__ = ["Linear", "LayerNormLinear", "LayerNormMLP", "GroupedLinear", "GroupedExperts",
           "LayerNorm", "RMSNorm"]

# The rest of lowprec enters the package here (internal names, not in __all__).
from .activations import get_activation
from .base import LowprecModule
from .experts import TorchtitanGroupedExperts
from .norms import apply_norm
from .params import add_linear_params, check_parallel_args
