"""lowprec on torch.distributed: FSDP2 all-gathers of quantized weights."""

from .fsdp import QuantizedGatherWeight, precompute_gather_statistics, quantized_all_gather

__all__ = ["QuantizedGatherWeight", "precompute_gather_statistics", "quantized_all_gather"]
