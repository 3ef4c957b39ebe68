"""Composable ops: build a block from basic ops; a ``Sequential`` fuses what pays.

``Sequential(LayerNorm(h), Linear(h, f), GELU(), Linear(f, h))`` computes
what ``lowprec.LayerNormMLP`` computes: each linear's bias is added in its
GEMM, the activation and its backward (dact + dbias) run as one step, and
the norm and activation hand the following linear its input already
quantized. ``Sequential(..., fuse=False)`` runs the ops one by one.
"""

from . import fused  # noqa: F401  (registers the fusion patterns)
from .base import BasicOperation, Sequential, register_fusion
from .basic import (
                    GEGLU,
                    GELU,
                    QGELU,
                    Activation,
                    BasicLinear,
                    Bias,
                    GroupedLinear,
                    LayerNorm,
                    Linear,
                    Quantize,
                    ReLU,
                    RMSNorm,
                    SiLU,
                    SReLU,
                    SwiGLU,
)

__all__ = ["BasicOperation", "Sequential", "register_fusion", "BasicLinear", "Linear", "Bias",
           "Activation", "GELU", "ReLU", "SiLU", "SwiGLU", "GEGLU", "SReLU", "QGELU",
           "LayerNorm", "RMSNorm", "Quantize", "GroupedLinear"]
