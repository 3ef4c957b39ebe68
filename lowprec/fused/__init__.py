"""Fused producer + quantize: a norm or an activation whose output goes straight into the
next GEMM's quantized input without being written in high precision (GPU with Triton;
per-tensor FP8, block FP8 and MXFP8 quantizers; everything else runs the producer and the
quantizer apart). See docs/fused.md for the passes each case makes.

:class:`unfused` switches the fusion off on its thread (``switch.enabled()`` reads it;
benchmarks and tests compare both).
"""

from .activation_quantize import activation_then_quantize
from .norm_quantize import norm_then_quantize
from .prologue import Prologue, activation_prologue, apply_prologue, norm_prologue
from .switch import can_fuse, unfused

__all__ = ["Prologue", "activation_prologue", "activation_then_quantize", "apply_prologue",
           "can_fuse", "norm_prologue", "norm_then_quantize", "unfused"]

# The rest of lowprec enters the package here (internal names, not in __all__).
from .graph import graph_activation, graph_norm, graph_norm_of, producer_kernel
from .norm_math import norm_backward, norm_fp32, norm_gamma
