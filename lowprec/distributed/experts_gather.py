"""FSDP2 all-gathers of 3-D expert weights in FP8 (``quantized_all_gather`` over MoE models).

FSDP2 shards a (E, N, K) expert weight along the experts, so each rank holds whole experts.
Under FP8 current scaling every expert is quantized on its own (its amax, its scale: what
the grouped path does to the whole weight, :func:`lowprec.formats.float8.grouped.
quantize_experts`), so a rank quantizes its own experts with nothing to agree on with the
others, and the ranks gather the codes (one byte an element instead of two) and one scale
an expert. The unsharded parameter is then a :class:`Float8Experts`, whose codes and scales
the grouped GEMMs read as they are: the same bits as quantizing the gathered weight.

Experts are gathered in high precision (as before wrapping) where that quantize is not the
one the GEMMs would make: any other recipe, quantizers of several settings or hooked ones
(``lowprec.debug``, ``lowprec compare``), experts that do not split evenly over the ranks,
a world of one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..formats.float8.experts import Float8Experts
from ..formats.float8.grouped import quantize_experts
from ..linear.grouped_current import same_current
from .gather_wrapper import GatherWrapper


@dataclass
class _ExpertsPlan:
    quantizer: object | None  # a Float8CurrentScalingQuantizer; None: high precision


class ExpertsGatherSpec:
    """The module a wrapped expert weight belongs to, the GEMM slots of its experts (one a
    expert) and the recipe it gathers under."""

    def __init__(self, module, slots: range, recipe) -> None:
        self.module, self.slots, self.recipe = module, slots, recipe
        self._plans: dict = {}

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_plans"] = {}  # quantizers of this process's recipe state
        return state

    def plan(self, device, num_experts: int, world: int) -> _ExpertsPlan:
        key = (device, num_experts, world)
        if key not in self._plans:
            self._plans[key] = self._make_plan(device, num_experts, world)
        return self._plans[key]

    def _make_plan(self, device, num_experts, world) -> _ExpertsPlan:
        if world == 1 or num_experts % world:
            return _ExpertsPlan(None)
        state = self.module._state("forward", self.recipe, device)
        if state.delayed is not None:
            return _ExpertsPlan(None)
        weights = [state.quantizers[3 * j + 1] for j in self.slots]
        inputs = [state.quantizers[3 * j] for j in self.slots]
        if not (same_current(weights) and same_current(inputs)):
            return _ExpertsPlan(None)
        return _ExpertsPlan(weights[0])


class QuantizedGatherExperts(GatherWrapper):
    """A high-precision (E, N, K) expert weight that FSDP2 all-gathers in FP8 where its
    recipe allows (see the module doc); everything else sees the tensor inside."""

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        dtype = mp_policy.param_dtype or self.dtype
        plan = self._spec.plan(self._data.device, outer_size[0], mesh.size())
        if plan.quantizer is None:
            return (self._data.to(dtype).contiguous(),), None
        # the values the GEMMs read: torchtitan's experts compute in bf16 over fp32 weights
        compute = getattr(self._spec.module, "_experts_compute_dtype", lambda d: d)(dtype)
        codes, scales = quantize_experts(self._data.to(compute).contiguous(), plan.quantizer)
        # fp8 travels as bytes (not every backend reduces or gathers float8)
        return (codes.view(torch.uint8), scales), codes.dtype

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        if metadata is None:  # high precision: the parameter is the gathered tensor
            if out is None:
                return all_gather_outputs[0], tuple(all_gather_outputs)
            return None
        codes, scales = all_gather_outputs
        codes = codes.view(metadata)
        if out is not None:
            if not isinstance(out, Float8Experts):
                raise TypeError(f"FSDP all-gather: the unsharded expert weight is a "
                                f"{type(out).__name__}, the gather brought FP8 experts")
            out.codes, out.scales = codes, scales
            return None
        return Float8Experts(codes, scales, param_dtype), tuple(all_gather_outputs)


def wrap_expert_weights(module, recipe) -> None:
    """Wrap the 3-D expert weights of ``module`` (``module._expert_weights()``: parameter
    name -> the GEMM slots of its experts) for FP8 all-gathers under ``recipe``."""
    for name, slots in module._expert_weights().items():
        w = module._parameters.get(name)
        if w is None or isinstance(w, GatherWrapper):
            continue
        if type(w.data) is not torch.Tensor or w.dim() != 3:
            raise TypeError(f"quantized_all_gather: {type(module).__name__}.{name} must be a "
                            f"plain 3-D tensor (call it before fully_shard), got "
                            f"{type(w.data).__name__} of shape {tuple(w.shape)}")
        wrapped = QuantizedGatherExperts(w.detach(), ExpertsGatherSpec(module, slots, recipe))
        module._parameters[name] = torch.nn.Parameter(wrapped, requires_grad=w.requires_grad)
