"""Delayed scaling's first training step runs eagerly where torch.compile would compile it
twice.

Under ``DelayedScaling(first_scale="current")`` a slot without a history quantizes with its
tensor's own amax, so a graph traced before the first update differs from the steady one
(which casts with the state's scales without waiting for the amaxes): compiled from the
start, a model compiles its whole graph twice, once for the first step and once after it
(on "1b" 26 s more than the one compile of current scaling). An autocast region entered
around compiled code under such a recipe, with gradients on, while no delayed-scaling slot
made under an equal recipe holds a scale, runs its code under ``torch.compiler.set_stance
("force_eager")``: the first step runs eagerly (lowprec's calls give the bits their compiled
forms give), seeds the states, and the next step compiles the steady graph once. At most
``MAX_EAGER_REGIONS`` regions a thread run so: one that seeds nothing (an evaluation entered
before ``no_grad``, code without lowprec modules) does not keep the compiler off. Where the
region is entered inside the compiled function the compiler traces it, and the first step
compiles as before.
"""

from __future__ import annotations

import logging
import threading

import torch

from .handles import _LIVE
from .recipes import Recipe
from .state import DelayedScalingState, stateful

log = logging.getLogger(__name__)


#: how many regions of a thread may run eagerly while no slot holds a scale (an evaluation
#: entered before ``no_grad``, then the first training step)
MAX_EAGER_REGIONS = 2


class _Taken(threading.local):
    def __init__(self) -> None:
        self.count = 0


_TAKEN = _Taken()


def _any_slot_seeded(recipe: Recipe) -> bool:
    """Whether a live delayed-scaling state made under a recipe equal to ``recipe`` has a
    slot known to hold a scale (its note cleared by an update; a loaded state counts as
    unseeded until its next update)."""
    for obj in list(_LIVE.values()):
        if (isinstance(obj, DelayedScalingState) and obj.firsts is not None
                and obj.recipe == recipe and any(not first.unseeded for first in obj.firsts)):
            return True
    return False


def first_step_eagerly(recipe: Recipe | None):
    """The context a region under ``recipe`` (None: a disabled region) runs its code in:
    ``force_eager`` for the first training step of delayed scaling (see the module
    docstring), else None."""
    # not while the compiler traces the region (first, so a trace reads nothing else)
    if (torch.compiler.is_compiling() or _TAKEN.count >= MAX_EAGER_REGIONS
            or not stateful(recipe) or recipe.first_scale != "current"
            or not torch.is_grad_enabled() or torch.is_inference_mode_enabled()
            or _any_slot_seeded(recipe)):
        return None
    _TAKEN.count += 1
    log.info("lowprec: delayed scaling's first step runs eagerly (torch.compiler.set_stance"
             "('force_eager')); the next step compiles")
    return torch.compiler.set_stance("force_eager")
