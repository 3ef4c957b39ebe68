"""Memory: activation checkpointing that replays lowprec's quantizer state
(``checkpointing``) and CPU offload of saved activations (``offload``)."""

from .checkpointing import checkpoint
from .offload import cpu_offload

__all__ = ["checkpoint", "cpu_offload"]
