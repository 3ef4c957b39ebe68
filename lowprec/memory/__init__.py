"""Memory: activation checkpointing that replays lowprec's quantizer state
(``checkpointing``) and CPU offload of saved activations (``offload``)."""

from .checkpointing import checkpoint
from .offload import cpu_offload

__all__ = ["checkpoint", "cpu_offload"]

# The rest of lowprec enters the package here (internal names, not in __all__).
from .checkpointing import (
    check_not_recomputing,
    current_frame,
    record,
    register_thread_setting,
    replay_states,
    replayed,
    replaying_frame,
)
