"""Handles name live objects to compiled graphs' host-side ops."""

from __future__ import annotations

import gc

import pytest
import torch

import lowprec
from lowprec.compile.call import HANDLE_ATTR, _module_of
from lowprec.recipe.handles import new_handle, resolve
from lowprec.recipe.recipes import DelayedScaling
from lowprec.recipe.state import state_of_key


class _Thing:
    pass


def test_a_handle_names_its_object_while_it_lives():
    thing, other = _Thing(), _Thing()
    handle, second = new_handle(thing), new_handle(other)
    assert handle.device.type == "cpu" and handle.dtype == torch.int64 and handle.dim() == 0
    assert resolve(handle, "thing") is thing and resolve(second, "thing") is other
    del thing
    gc.collect()
    with pytest.raises(RuntimeError, match="names a thing that no longer exists"):
        resolve(handle, "thing")


def test_modules_and_states_share_the_registry_and_stay_on_the_cpu():
    """A module made under a meta default device still gets a CPU handle, and a module's
    handle and its delayed-scaling states' keys name each their own object."""
    with torch.device("meta"):
        meta = lowprec.Linear(16, 8, name="m")
    assert getattr(meta, HANDLE_ATTR).device.type == "cpu"
    module = lowprec.Linear(16, 8, name="l")
    lowprec.init_scaling_state(module, DelayedScaling())
    assert _module_of(getattr(module, HANDLE_ATTR)) is module
    for mode in ("forward", "backward"):
        state = module._recipe_states[mode].delayed
        assert state_of_key(state.key) is state
    assert len({int(getattr(module, HANDLE_ATTR)), int(getattr(meta, HANDLE_ATTR)),
                *(int(module._recipe_states[m].delayed.key)
                  for m in ("forward", "backward"))}) == 4
