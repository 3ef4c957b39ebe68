"""lowprec on torch.distributed: FSDP2 all-gathers of quantized weights."""

from .fsdp import QuantizedGatherWeight, quantized_all_gather

__all__ = ["QuantizedGatherWeight", "quantized_all_gather"]
