"""The quantized-linear engine shared by every module and op.

* ``plan``: what one eager call pads, quantizes with which usages and slices, decided once
  per (quantizers, backward mode, slicing mode, operand shapes and kinds) and cached
  (``LinearPlan``);
* ``function``: ``quantized_linear``, every eager call's entry, and the eager autograd
  Function that runs the calls the traced plan declines;
* ``traced``: the one plan of a call decided from its quantizers' forms, and the
  Function that runs it, traced by ``torch.compile``; bit-identical to ``function``
  (``traced_delayed``: its delayed-scaling records and update);
* ``eager_plan``: eager calls that run that Function where the forms launch eager's
  kernels;
* ``decided``: a compiled call's decisions made once per kind of call, outside dynamo's
  interpretation;
* ``padding``: zeros that make a call's operands whole blocks, in both forms;
* ``grad_split`` / ``exact_split``: the sliced backward (and forward) for a lower peak;
* ``grouped`` / ``grouped_engine``: the experts of an MoE layer, one autograd Function over
  a plan whose scheme (``grouped_current``, ``grouped_blocks``, ``grouped_nvfp4``) the
  quantizers pick;
* ``weight_cache``: quantized weights reused across micro-batches;
* ``graphed``: eager calls captured in CUDA graphs and replayed
  (``lowprec.autocast(cuda_graphs=True)``).
"""

from .eager_plan import eager_plans_off
from .function import LinearQuantizers, quantized_linear
from .grad_split import sliced, unsliced

__all__ = ["LinearQuantizers", "eager_plans_off", "quantized_linear", "sliced", "unsliced"]

# The rest of lowprec enters the package here (internal names, not in __all__).
from .decided import decided_delayed_linear, decided_linear
from .function import EagerLinearFunction, eager_plan_of, graph_kept
from .grouped import (
    ExpertWeightsFunction,
    check_sizes,
    group_alignment_for,
    grouped_linear,
    grouped_refusal,
    per_group_equivalent,
)
from .grouped_blocks import one_setting
from .grouped_current import same_current
from .grouped_engine import GroupedFunction, GroupedPlan
from .grouped_parts import hooked
from .padding import feature_padding
from .traced import TracedLinear, reads_recipe_weights
