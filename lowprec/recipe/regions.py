"""autocast (quantized compute) and quantized_model_init (quantized parameters)."""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, field

import torch

from ..kernels import CUDAGRAPH_UNSAFE, graph_op, register_ordered
from .first_step import first_step_eagerly
from .recipes import DelayedScaling, Recipe
from .state_batch import update_states

#: the device types whose torch.autocast lowprec follows (``torch.amp.is_autocast_available``
#: is not traced by dynamo before torch 2.13)
_AUTOCAST_DEVICES = ("cuda", "cpu", "xpu")


def torch_autocast_dtype(x) -> "torch.dtype | None":
    """The ``torch.autocast`` dtype for ``x``'s device where torch's autocast is on there,
    else None. Under it lowprec modules compute as ``torch.nn`` ones would: GEMM operands
    in that dtype (and quantized from it), norms in fp32 with their output in that dtype."""
    device_type = x.device.type
    if device_type in _AUTOCAST_DEVICES and torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return None


def torch_autocast_off(device_type: str):
    """``torch.autocast`` disabled on ``device_type``, for lowprec's own math (which runs as
    it would without torch's autocast); nothing to disable where lowprec does not follow
    torch's autocast (``meta``: shape inference, FLOP counters)."""
    if device_type in _AUTOCAST_DEVICES and torch.is_autocast_enabled(device_type):
        return torch.autocast(device_type, enabled=False)
    return _NOTHING  # (it is off already: entering torch.autocast costs host time)


_NOTHING = contextlib.nullcontext()


def default_recipe() -> Recipe:
    """The recipe used when autocast is given none (as Transformer Engine: delayed scaling)."""
    return DelayedScaling()


@dataclass
class _Region:
    recipe: Recipe
    group: object = None
    delayed_states: list = field(default_factory=list)
    cache_weights: bool = False
    #: eager Linear calls replay CUDA graphs (``lowprec.linear.graphed``)
    cuda_graphs: bool = False
    #: the last input quantize a Linear made, for the next ones that read the same input
    #: (``lowprec.linear.shared_input``)
    shared_input: object = None
    #: entered while torch.compile traced (the region lives in the compiled graph), rather
    #: than around the compiled call
    traced: bool = field(default_factory=torch.compiler.is_compiling)
    #: a traced region's opaque calls (``lowprec::call``) inside it: their tokens by their
    #: region's key, whose states its exit updates (:func:`enter_deferred`)
    deferred: dict = field(default_factory=dict)


class _Local(threading.local):
    def __init__(self) -> None:
        self.regions: list = []       # autocast stack; None entries are disabled regions
        self.init_recipes: list = []  # quantized_model_init stack
        self.deferred: dict = {}      # region key -> the region opaque calls share


_LOCAL = _Local()


def _check_recipe(recipe) -> Recipe:
    if recipe is None:
        return default_recipe()
    if not isinstance(recipe, Recipe):
        raise TypeError(f"recipe must be a lowprec.recipe recipe, got {type(recipe).__name__}")
    return recipe


@contextlib.contextmanager
def autocast(enabled: bool = True, recipe: Recipe | None = None, amax_reduction_group=None,
             *, cache_weights: bool = False, cuda_graphs: bool = False):
    """Run lowprec modules inside this region with quantized GEMMs per ``recipe``.

    ``cache_weights=True``: a module reuses its quantized weight while the weight is
    unchanged, so with gradient accumulation each weight is quantized once per optimizer
    step rather than once per micro-batch (``lowprec.linear.weight_cache``; each weight then
    holds its quantized copy between steps).

    ``cuda_graphs=True``: an eager Linear call on CUDA is captured, forward and backward, in
    CUDA graphs on its second call of a kind (shapes, dtypes, gradient flags), and later
    calls of that kind replay them: the same kernels and bits without the host time of
    launching them, for about one step's activations more memory per Linear
    (``lowprec.linear.graphed`` says what runs eagerly instead, with a warning).

    ``amax_reduction_group`` is the process group over which delayed-scaling
    amaxes are reduced; it is passed to the state where it is used and never
    stored on a quantizer. Forward amaxes of delayed scaling enter the
    history when the region exits (all of the region's states together, see
    ``lowprec.recipe.state_batch``).
    """
    check_region_flags(cache_weights, cuda_graphs, enabled=enabled)
    check_group(amax_reduction_group)
    region = (_Region(_check_recipe(recipe), amax_reduction_group, cache_weights=cache_weights,
                      cuda_graphs=cuda_graphs)
              if enabled else None)
    # delayed scaling's first step eagerly, where it would be compiled twice (first_step.py)
    stance = first_step_eagerly(region.recipe if region is not None else None)
    _LOCAL.regions.append(region)
    try:
        if stance is None:
            yield
        else:
            with stance:
                yield
    finally:
        _LOCAL.regions.pop()
        if region is not None:
            _exit(region)


def active_region() -> _Region | None:
    """The innermost enabled autocast region, or None outside (or in a disabled one)."""
    return _LOCAL.regions[-1] if _LOCAL.regions else None


def any_region() -> bool:
    """Whether an autocast region, enabled or disabled, encloses this point."""
    return bool(_LOCAL.regions)


def check_region_flags(cache_weights=False, cuda_graphs=False, *, enabled=True) -> None:
    """The autocast options that take a bool (TypeError naming the one that is not)."""
    for name, value in (("enabled", enabled), ("cache_weights", cache_weights),
                        ("cuda_graphs", cuda_graphs)):
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be a bool, got {value!r}")


def check_group(group) -> None:
    """Raise unless ``group`` is a process group or None (an amax reduction group)."""
    if group is not None and not isinstance(group, getattr(torch.distributed, "ProcessGroup",
                                                           ())):
        raise TypeError(f"amax_reduction_group must be a torch.distributed ProcessGroup or "
                        f"None, got {group!r}")


def push_region(recipe: Recipe | None, group=None, *, cache_weights: bool = False,
                cuda_graphs: bool = False):
    """Enter a region (None: a disabled one) without a ``with`` block; returns the token
    for ``pop_region``. For calls that run a region's body elsewhere (compiled calls, a
    model's attached recipe)."""
    region = (_Region(recipe, group, cache_weights=cache_weights, cuda_graphs=cuda_graphs)
              if recipe is not None else None)
    _LOCAL.regions.append(region)
    return [region]


def pop_region(token, *, update: bool = True) -> None:
    """Leave the region ``push_region`` (or :func:`enter_deferred`) entered, updating its
    delayed-scaling states unless ``update`` is False (a deferred region's states wait for
    ``lowprec::exit_deferred``)."""
    region = token[0]
    if not _LOCAL.regions or _LOCAL.regions[-1] is not region:
        raise RuntimeError("autocast regions were left out of order")
    _LOCAL.regions.pop()
    if region is not None and update:
        _exit(region)


def _exit(region: _Region) -> None:
    update_states(region.delayed_states, region.group)
    for key, tokens in region.deferred.items():
        torch.ops.lowprec.exit_deferred(tokens, key)


def enter_deferred(key: int, recipe: Recipe, group):
    """Enter the region an opaque compiled call (``lowprec::call``) traced inside a region
    of the compiled function runs in: one region per ``key`` (recipe and group) that every
    such call shares until ``lowprec::exit_deferred``, which the traced region's exit runs,
    updates its delayed-scaling states. So a module called twice in that region quantizes
    both calls with one scale and pushes one history row, as in eager. Returns the token
    for ``pop_region(token, update=False)``."""
    region = _LOCAL.deferred.get(key)
    if region is None:
        region = _LOCAL.deferred[key] = _Region(recipe, group)
    _LOCAL.regions.append(region)
    return [region]


@graph_op("exit_deferred", tags=CUDAGRAPH_UNSAFE)
def _exit_deferred(tokens: list[torch.Tensor], key: int) -> None:
    # ``tokens``, the opaque calls' outputs, order this after them; an ordered effect keeps
    # the compiler from dropping it (it returns nothing)
    region = _LOCAL.deferred.pop(key, None)
    if region is not None:
        update_states(region.delayed_states, region.group)


@torch.library.register_fake("lowprec::exit_deferred")
def _exit_deferred_fake(tokens, key):
    return None


register_ordered(_exit_deferred)


def register_delayed_state(state) -> None:
    """Ask the active region to update ``state`` (forward amaxes) when it exits."""
    region = active_region()
    if region is not None and state not in region.delayed_states:
        region.delayed_states.append(state)


@contextlib.contextmanager
def quantized_model_init(enabled: bool = True, recipe: Recipe | None = None):
    """Modules built inside keep their weights as quantized tensors (no high-precision copy).

    Train them with :class:`lowprec.optim.QuantizedWeightOptimizer`, which
    keeps fp32 master weights and re-quantizes after each step.
    """
    check_region_flags(enabled=enabled)
    _LOCAL.init_recipes.append(_check_recipe(recipe) if enabled else None)
    try:
        yield
    finally:
        _LOCAL.init_recipes.pop()


def init_recipe() -> Recipe | None:
    """The recipe of the innermost enabled quantized_model_init, or None."""
    return _LOCAL.init_recipes[-1] if _LOCAL.init_recipes else None
