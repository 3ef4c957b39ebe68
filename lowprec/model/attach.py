"""A recipe that travels with the model: each call of the model runs under it.

Training loops written for plain PyTorch (Hugging Face Trainer, accelerate,
torchtitan, Lightning) call ``model(...)`` and know nothing of
``lowprec.autocast``. :func:`attach_recipe` gives the model's root module a
forward pre-hook that enters an autocast region with the recipe and a forward
hook that leaves it, so every forward quantizes as it would inside
``with lowprec.autocast(recipe=...)``: delayed-scaling forward amaxes enter the
history when the forward returns, backward amaxes at the end of the backward
pass. An explicit ``lowprec.autocast`` (enabled or disabled) around the call
wins: the hooks then do nothing.

The hooks are methods of a small picklable object, so the model pickles,
deep-copies and compiles with them (dynamo traces the hooks as it traces
``autocast`` inside a compiled function).
"""

from __future__ import annotations

import threading

from torch import nn

from ..recipe import (
    Recipe,
    any_region,
    check_group,
    check_region_flags,
    first_step_eagerly,
    pop_region,
    push_region,
)


class _Tokens(threading.local):
    def __init__(self) -> None:
        self.stack: list = []


_TOKENS = _Tokens()


class AttachedRecipe:
    """The recipe (and autocast options) a model runs under (``attached_recipe(model)``)."""

    def __init__(self, recipe: Recipe, amax_reduction_group=None,
                 cache_weights: bool = False, cuda_graphs: bool = False) -> None:
        self.recipe = recipe
        self.amax_reduction_group = amax_reduction_group
        self.cache_weights = cache_weights
        self.cuda_graphs = cuda_graphs

    def enter(self, module, args) -> None:
        token = stance = None
        if not any_region():
            token = push_region(self.recipe, self.amax_reduction_group,
                                cache_weights=self.cache_weights,
                                cuda_graphs=self.cuda_graphs)
            # around compiled layers (the root itself not compiled): delayed scaling's first
            # step eagerly, as lowprec.autocast's (lowprec.recipe.first_step); the forward
            # hook runs even where the forward raises
            stance = first_step_eagerly(self.recipe)
        _TOKENS.stack.append((token, stance))

    def exit(self, module, args, output) -> None:
        token, stance = _TOKENS.stack.pop()
        if stance is not None:
            stance.__exit__(None, None, None)
        if token is not None:
            pop_region(token)

    def __getstate__(self):
        # a process group does not pickle; a copy in another process sets its own
        state = dict(self.__dict__)
        state["amax_reduction_group"] = None
        return state

    def __repr__(self) -> str:
        return f"AttachedRecipe({self.recipe!r})"


def attached_recipe(model: nn.Module) -> AttachedRecipe | None:
    """What :func:`attach_recipe` attached to ``model``, or None."""
    for hook in model._forward_pre_hooks.values():
        owner = getattr(hook, "__self__", None)
        if isinstance(owner, AttachedRecipe):
            return owner
    return None


def detach_recipe(model: nn.Module) -> None:
    """Remove the recipe :func:`attach_recipe` attached to ``model`` (nothing if none)."""
    for hooks in (model._forward_pre_hooks, model._forward_hooks):
        for key in [k for k, h in hooks.items()
                    if isinstance(getattr(h, "__self__", None), AttachedRecipe)]:
            del hooks[key]
            model._forward_hooks_always_called.pop(key, None)


def attach_recipe(model: nn.Module, recipe: Recipe | None, *, amax_reduction_group=None,
                  cache_weights: bool = False, cuda_graphs: bool = False) -> nn.Module:
    """Make every call of ``model`` run under ``lowprec.autocast(recipe=recipe, ...)``
    without an autocast block in the training loop; returns ``model``.

    An explicit ``lowprec.autocast`` around a call wins (its recipe, or high precision
    when disabled). ``recipe=None`` detaches. Under ``DelayedScaling`` each lowprec module
    creates its scaling state now (:func:`init_scaling_state`), so a fresh model's state
    dict already holds extra states of the saved sizes and ``torch.distributed.checkpoint``
    loads into it before its first forward. Attaching to a model that has a recipe
    replaces it. ``amax_reduction_group`` does not survive pickling (a process group
    belongs to its process): attach again after unpickling in another process.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"attach_recipe expects a torch.nn.Module, got {type(model).__name__}")
    if recipe is not None and not isinstance(recipe, Recipe):
        raise TypeError(f"recipe must be a lowprec recipe or None, got {type(recipe).__name__}")
    check_region_flags(cache_weights, cuda_graphs)
    check_group(amax_reduction_group)
    detach_recipe(model)
    if recipe is None:
        return model
    attached = AttachedRecipe(recipe, amax_reduction_group, cache_weights, cuda_graphs)
    model.register_forward_pre_hook(attached.enter)
    model.register_forward_hook(attached.exit, always_call=True)
    init_scaling_state(model, recipe)
    return model


def init_scaling_state(model: nn.Module, recipe: Recipe) -> nn.Module:
    """Make every lowprec module's state for ``recipe`` now rather than at its first
    forward; returns ``model``. Under ``DelayedScaling`` the modules' ``_extra_state``
    tensors then have the sizes a trained model's have, which is what
    ``torch.distributed.checkpoint`` needs to load saved state into a fresh model in
    place (a module without state has an empty one). Other recipes hold no state.

    The model's lowprec modules also become one group: under ``torch.compile`` the first
    traced call makes the recipe state of all of them (delayed scaling's, a
    ``CustomRecipe`` factory's quantizers), so that layers compiled one by one share one
    compiled code (``convert_model`` groups the modules it makes the same way)."""
    if not isinstance(recipe, Recipe):
        raise TypeError(f"recipe must be a lowprec recipe, got {type(recipe).__name__}")
    from ..modules import LowprecModule  # the modules import this package's autocast
    mods = [m for m in model.modules() if isinstance(m, LowprecModule)]
    LowprecModule.new_group(mods)
    for mod in mods:
        mod.init_scaling_state(recipe)
    return model
