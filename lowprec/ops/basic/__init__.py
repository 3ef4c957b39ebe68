"""The basic ops."""

from .activations import GEGLU, GELU, QGELU, Activation, ReLU, SiLU, SReLU, SwiGLU
from .bias import Bias
from .grouped_linear import GroupedLinear
from .linear import BasicLinear, Linear
from .norms import LayerNorm, RMSNorm
from .quantize import Quantize

__all__ = ["BasicLinear", "Linear", "Bias", "Activation", "GELU", "ReLU", "SiLU", "SwiGLU",
           "GEGLU", "SReLU", "QGELU", "LayerNorm", "RMSNorm", "Quantize", "GroupedLinear"]
