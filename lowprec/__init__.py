"""lowprec: low-precision (FP8, MXFP8, NVFP4) training for PyTorch."""

from .formats import *  # noqa: F401,F403
from .formats import __all__ as _formats_all

__version__ = "0.1.0"
__all__ = list(_formats_all)
