"""Recipes and the state built from them.

* ``recipes``: the recipe dataclasses (which quantizer each tensor role gets), the one
  recipe-name table, backward modes and the operand-usage rule;
* ``roles``: :class:`QuantizerRole`, the role a quantizer serves in a module;
* ``factories``: picklable quantizer factories for :class:`CustomRecipe`;
* ``state``: a module's per-recipe quantizers and scaling state, decided once from the recipe;
* ``state_batch``: delayed-scaling updates of every module batched once per step;
* ``backward_pass``: the backward states' updates, once per backward pass;
* ``regions``: the ``lowprec.autocast`` / ``quantized_model_init`` regions (and the one
  region a compiled function's opaque calls share at run time);
* ``handles``: CPU tensors that name modules and states to compiled graphs' host ops.

This is the one place that switches on a recipe's type; the rest of lowprec reads the
quantizers the state hands out. ``lowprec.recipe.<Name>`` is the public spelling of every
recipe class.
"""

from .recipes import (
    BACKWARD_MODES,
    RECIPE_ALIASES,
    BackwardMode,
    CustomRecipe,
    DelayedScaling,
    Float8BlockScaling,
    Float8CurrentScaling,
    Format,
    MMParams,
    MXFP8BlockScaling,
    NVFP4BlockScaling,
    OperandUsages,
    Recipe,
    operand_usages,
)
from .roles import QuantizerRole

__all__ = ["Format", "Recipe", "DelayedScaling", "Float8CurrentScaling", "Float8BlockScaling",
           "MXFP8BlockScaling", "NVFP4BlockScaling", "CustomRecipe", "BACKWARD_MODES",
           "RECIPE_ALIASES", "BackwardMode", "OperandUsages", "operand_usages", "QuantizerRole",
           "MMParams"]

# The rest of lowprec enters the package here (internal names, not in __all__).
from .backward_pass import for_running as for_running_backward_pass
from .backward_pass import join as join_backward_pass
from .backward_pass import running as running_backward_pass
from .first_step import first_step_eagerly
from .handles import new_handle
from .handles import resolve as resolve_handle
from .recipes import gemm_fast_accum, normalize_backward_mode, recipe_from_key, recipe_of_value
from .regions import (
    active_region,
    any_region,
    autocast,
    check_group,
    check_region_flags,
    enter_deferred,
    init_recipe,
    pop_region,
    push_region,
    quantized_model_init,
    register_delayed_state,
    torch_autocast_dtype,
    torch_autocast_off,
)
from .roles import check_num_quantizers, gemm_roles
from .state import (
    RecipeState,
    delayed_stand_ins,
    push_amaxes,
    reads_role_names,
    state_of_key,
    stateful,
    stateless_quantizers,
)
