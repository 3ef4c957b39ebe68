"""lowprec: low-precision (FP8, MXFP8, NVFP4) training for PyTorch."""

from . import debug, fused, ops, optim, recipe  # noqa: F401 - subpackages as attributes of lowprec
from .formats import *  # noqa: F401,F403
from .formats import __all__ as _formats_all
from .memory import checkpoint, cpu_offload
from .model import attach_recipe, attached_recipe, convert_model, detach_recipe, init_scaling_state
from .modules import (
    GroupedExperts,
    GroupedLinear,
    LayerNorm,
    LayerNormLinear,
    LayerNormMLP,
    Linear,
    RMSNorm,
)
from .recipe import (
    BackwardMode,
    CustomRecipe,
    DelayedScaling,
    Float8BlockScaling,
    Float8CurrentScaling,
    Format,
    MXFP8BlockScaling,
    NVFP4BlockScaling,
    QuantizerRole,
    Recipe,
    autocast,
    quantized_model_init,
)

__version__ = "0.1.0"
__all__ = [*_formats_all, "recipe", "ops", "optim", "autocast", "checkpoint", "convert_model",
           "attach_recipe", "attached_recipe", "detach_recipe", "init_scaling_state",
           "cpu_offload", "quantized_model_init", "QuantizerRole",
           "Format", "DelayedScaling", "Float8CurrentScaling", "Float8BlockScaling",
           "MXFP8BlockScaling", "NVFP4BlockScaling", "CustomRecipe", "Recipe", "BackwardMode",
           "Linear", "LayerNormLinear", "LayerNormMLP", "GroupedLinear", "GroupedExperts",
           "LayerNorm", "RMSNorm"]
