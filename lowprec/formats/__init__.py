"""Quantization formats: one sub-package per format (quantizer, tensor, reference)."""

from .base import QuantizedTensor, Quantizer, register_safe_globals
from .block import Float8BlockQuantizer, Float8BlockwiseTensor
from .exact import ExactTensor
from .float8 import Float8CurrentScalingQuantizer, Float8Quantizer, Float8Tensor
from .hybrid import HybridQuantizedTensor, HybridQuantizer
from .identity import IdentityQuantizer, IdentityTensor
from .mxfp8 import MXFP8Quantizer, MXFP8Tensor
from .nvfp4 import NVFP4Quantizer, NVFP4Tensor

__all__ = ["Quantizer", "QuantizedTensor",
           "Float8Quantizer", "Float8CurrentScalingQuantizer", "Float8Tensor",
           "Float8BlockQuantizer", "Float8BlockwiseTensor",
           "MXFP8Quantizer", "MXFP8Tensor",
           "NVFP4Quantizer", "NVFP4Tensor",
           "IdentityQuantizer", "IdentityTensor",
           "HybridQuantizer", "HybridQuantizedTensor", "ExactTensor"]

register_safe_globals(*(globals()[name] for name in __all__
                        if name not in ("Quantizer", "QuantizedTensor")))

# The rest of lowprec enters the package here (internal names, not in __all__).
from .base import (
           COLUMNWISE_IN_BACKWARD_ATTR,
           REQUANTIZE_ATTR,
           USAGES,
           check_bool_option,
           check_int_option,
           check_usage,
           columnwise_from_backward,
           contiguous_data,
           flatten_2d,
           keep_quantized,
           rows_fit,
           user_attributes,
)
from .block import BLOCK
from .casting import E2M1_MAX, E8M0_BIAS, E8M0_NAN, FP8_MAX, FP32_MAX, exp2_int
from .experts import QuantizedExperts
from .graph import (
           Blocks,
           Exact,
           Fp8,
           GraphOperand,
           Kind,
           Plain,
           PlainOperand,
           as_output,
           decode_scale,
           drawn_after,
           plain_kind,
           scale_in_use,
)
from .quantized_tensor import DequantizeFunction
from .rht import rht_forward, rht_inverse
