"""lowprec on torch.distributed: FSDP2 all-gathers of quantized weights, tensor-parallel
styles for ``parallelize_module``."""

from .experts_gather import QuantizedGatherExperts
from .fsdp import QuantizedGatherWeight, precompute_gather_statistics, quantized_all_gather
from .tp_styles import ColwiseParallel, RowwiseParallel

__all__ = ["ColwiseParallel", "QuantizedGatherExperts", "QuantizedGatherWeight", "RowwiseParallel",
           "precompute_gather_statistics", "quantized_all_gather"]

# The rest of lowprec enters the package here (internal names, not in __all__).
from .gather_codec import derives_columnwise
