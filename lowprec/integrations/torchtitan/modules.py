"""lowprec's modules as torchtitan 0.3 components: built from a config, ``Module`` protocol.

torchtitan builds its model from a tree of ``Configurable.Config`` objects and checks
that every submodule is a ``torchtitan.protocols.module.Module``
(``BaseModel.verify_module_protocol``); ``Module.init_states`` initializes a module's own
parameters with its config's ``param_init`` and ``Module.parallelize`` places them as its
``sharding_config`` says. The classes here are lowprec's modules with that protocol mixed
in. Their configs subclass torchtitan's (``Linear.Config``, ``GroupedExperts.Config``), so
torchtitan's config passes (sharding, ``traverse``) treat them as the originals; the
parameters keep torchtitan's names and shapes, so every ``param_init`` and
``state_shardings`` entry applies unchanged. The modules hold no buffers: delayed-scaling
state is ``_extra_state`` (``get_extra_state``), which the sharding protocol does not
place.

Importing this module also registers lowprec's autograd functions with ``spmd_types``
(torchtitan's default ``spmd_backend``) as local: each computes on the local shards it
is given and communicates nothing (FSDP's gathers, amax all-reduces of quantized gathers
and of delayed scaling run outside them), so its type checker
(``--debug.spmd_typechecking``) propagates types through them by its local rule.
"""

from __future__ import annotations

from dataclasses import dataclass

import spmd_types as spmd
import torch
from torch import nn
from torchtitan.models.common.linear import Linear as TitanLinear
from torchtitan.models.common.moe import GroupedExperts as TitanGroupedExperts
from torchtitan.protocols.module import Module

import lowprec
from lowprec.compile import ExpertsStandIn
from lowprec.formats import DequantizeFunction
from lowprec.linear import (
    EagerLinearFunction,
    ExpertWeightsFunction,
    GroupedFunction,
    TracedLinear,
)
from lowprec.modules import LowprecModule, TorchtitanGroupedExperts

__all__ = ["LowprecGroupedExperts", "LowprecLinear", "LOCAL_AUTOGRAD_FUNCTIONS"]

#: the autograd functions a converted Linear or experts module runs (eager and compiled)
LOCAL_AUTOGRAD_FUNCTIONS = (EagerLinearFunction, TracedLinear, ExpertsStandIn, DequantizeFunction,
                            ExpertWeightsFunction, GroupedFunction)
for _fn in LOCAL_AUTOGRAD_FUNCTIONS:
    spmd.register_local_autograd_function(_fn)


class LowprecLinear(lowprec.Linear, Module):
    """``lowprec.Linear`` built from a torchtitan ``Linear.Config``: ``weight`` (out, in)
    and ``bias`` as torchtitan's ``Linear`` has them, initialized by ``param_init``."""

    @dataclass(kw_only=True, slots=True)
    class Config(TitanLinear.Config):
        name: str = ""
        """The module's fully qualified name: the ``name`` of its quantizer roles."""

    def __init__(self, config: Config):
        lowprec.Linear.__init__(self, config.in_features, config.out_features,
                                bias=config.bias, name=config.name)


class LowprecGroupedExperts(TorchtitanGroupedExperts, Module):
    """torchtitan's routed experts (``w1_EFD``, ``w2_EDF``, ``w3_EFD``;
    ``forward(x, num_tokens_per_expert)``) with lowprec's grouped GEMMs
    (:class:`lowprec.modules.experts.TorchtitanGroupedExperts`), computing in bf16 as
    torchtitan's grouped-mm path does."""

    @dataclass(kw_only=True, slots=True)
    class Config(TitanGroupedExperts.Config):
        name: str = ""
        """The module's fully qualified name: the ``name`` of its quantizer roles."""

    def __init__(self, config: Config):
        LowprecModule.__init__(self, config.name)
        e, f, d = config.num_experts, config.hidden_dim, config.dim
        self.param_names = TorchtitanGroupedExperts.NAMES[1]
        self.w1_EFD = nn.Parameter(torch.empty(e, f, d))
        self.w2_EDF = nn.Parameter(torch.empty(e, d, f))
        self.w3_EFD = nn.Parameter(torch.empty(e, f, d))
        self.num_experts = e
        self.in_bf16 = True
        self._source_init = None
