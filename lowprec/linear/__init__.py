"""The quantized-linear engine shared by every module and op.

* ``plan``: what one eager call pads, quantizes with which usages and slices, decided once
  per (quantizers, backward mode, slicing mode, operand shapes and kinds) and cached
  (``LinearPlan``);
* ``function``: the eager autograd Function that runs a plan;
* ``traced``: the form ``torch.compile`` traces (torch ops and custom ops the compiler
  schedules), bit-identical to ``function``;
* ``grad_split`` / ``exact_split``: the sliced backward (and forward) for a lower peak;
* ``weight_cache``: quantized weights reused across micro-batches.
"""

from .function import LinearQuantizers, quantized_linear
from .grad_split import sliced, unsliced

__all__ = ["LinearQuantizers", "quantized_linear", "sliced", "unsliced"]
