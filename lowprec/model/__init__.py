"""Whole-model operations: ``convert`` swaps a model's ``nn.Linear`` (and friends) for
lowprec modules; ``attach`` attaches a recipe to a model so that its forward runs under it."""

from .attach import attach_recipe, attached_recipe, detach_recipe, init_scaling_state
from .convert import convert_model

__all__ = ["convert_model", "attach_recipe", "attached_recipe", "detach_recipe",
           "init_scaling_state"]

# The rest of lowprec enters the package here (internal names, not in __all__).
from .convert import recipe_rejection
