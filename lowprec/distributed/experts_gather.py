"""FSDP2 all-gathers of 3-D expert weights in FP8 (``quantized_all_gather`` over MoE models).

FSDP2 shards a (E, N, K) expert weight along the experts, so each rank holds whole experts.
Where the recipe quantizes every expert on its own, a rank quantizes its own experts with
nothing to agree on with the others, and the ranks gather the codes (one byte an element,
or half of one, instead of two) and the scales:

* FP8 current scaling: each expert's amax and scale (what the grouped path does to the
  whole weight, :func:`lowprec.formats.float8.grouped.quantize_experts`); the unsharded
  parameter is a :class:`Float8Experts`;
* FP8 block scaling with 128x128 weight blocks (the DeepSeek-V3 recipe), N and K
  multiples of 128: the rowwise codes and one scale a block (no block straddles two
  experts, so the local quantize is the whole weight's); the unsharded parameter is a
  :class:`Float8BlockExperts`, whose columnwise codes derive from the rowwise ones;
* NVFP4 with 16x16 weight blocks rounded to nearest (the recipe's weights): each expert's
  global scale, the E2M1 codes (half a byte an element) and one E4M3 scale a block; the
  unsharded parameter is an :class:`NVFP4Experts`.

The grouped GEMMs read those codes and scales as they are: the same bits as quantizing the
gathered weight. Experts are gathered in high precision (as before wrapping) where that
quantize is not the one the GEMMs would make, or saves no bytes: any other recipe (MXFP8's
rowwise and columnwise blocks differ, two bytes an element together; the per-phase gathers
of 2-D MXFP8 weights are not built for experts), 1x128 weight
blocks, NVFP4 weights with stochastic rounding or a Hadamard transform, quantizers of
several settings or hooked ones (``lowprec.debug``, ``lowprec compare``), experts that do
not split evenly over the ranks, a world of one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..formats import BLOCK, Float8BlockQuantizer, NVFP4Quantizer, QuantizedExperts
from ..formats.block import Float8BlockExperts
from ..formats.float8 import Float8Experts, quantize_experts
from ..formats.nvfp4 import BLOCK as NVFP4_BLOCK
from ..formats.nvfp4 import NVFP4Experts
from ..formats.nvfp4 import quantize_experts as quantize_nvfp4_experts
from ..linear import hooked, one_setting, same_current
from .gather_wrapper import GatherWrapper

#: the unsharded parameter each kind of quantized gather makes
_EXPERTS = {"current": Float8Experts, "block": Float8BlockExperts, "nvfp4": NVFP4Experts}


@dataclass
class _ExpertsPlan:
    #: "current" (a Float8CurrentScalingQuantizer), "block" (a Float8BlockQuantizer of
    #: 128x128 blocks, rowwise usage only), "nvfp4" (an NVFP4Quantizer of 16x16 blocks,
    #: nearest rounding, no RHT) or None: high precision
    kind: str | None
    quantizer: object | None = None


def _block_weights(qs) -> bool:
    """Whether every quantizer is FP8 block scaling of 128x128 blocks, one setting, none
    hooked."""
    first = one_setting(qs)
    return type(first) is Float8BlockQuantizer and first.block_scaling_dim == 2


def _nvfp4_weights(qs) -> bool:
    """Whether every quantizer is NVFP4 of 16x16 blocks rounded to nearest without RHT (the
    recipe's weights; no draws, so their generators do not matter), none hooked."""
    return all(type(q) is NVFP4Quantizer and not hooked(q) and q.with_2d_quantization
               and not q.with_rht and not q.stochastic_rounding for q in qs)


def _pick(weights, inputs, n: int, k: int) -> _ExpertsPlan:
    if same_current(weights) and same_current(inputs):
        return _ExpertsPlan("current", weights[0])
    if _block_weights(weights) and n % BLOCK == 0 and k % BLOCK == 0:
        q = weights[0].copy()
        q.set_usage(rowwise=True, columnwise=False)
        return _ExpertsPlan("block", q)
    if _nvfp4_weights(weights) and n % NVFP4_BLOCK == 0 and k % NVFP4_BLOCK == 0:
        return _ExpertsPlan("nvfp4", weights[0])
    return _ExpertsPlan(None)


def _quantize(plan: _ExpertsPlan, local: torch.Tensor):
    """(all-gather inputs, metadata) of the local experts (E_local, N, K); float8 travels as
    bytes (not every backend reduces or gathers float8)."""
    if plan.kind == "current":
        codes, scales = quantize_experts(local, plan.quantizer)
        return (codes.view(torch.uint8), scales), (plan.kind, codes.dtype)
    if plan.kind == "block":
        part = plan.quantizer.quantize(local.view(-1, local.shape[-1]))
        codes = part.rowwise_data
        return ((codes.view(torch.uint8), part.rowwise_scale),
                (plan.kind, codes.dtype, plan.quantizer.force_pow_2_scales))
    codes, scales, globals_ = quantize_nvfp4_experts(local, plan.quantizer)
    return (codes, scales.view(torch.uint8), globals_), (plan.kind, scales.dtype)


def _fields(outputs, metadata) -> dict:
    """The inner tensors of the unsharded experts from the gathered ``outputs``."""
    kind, dtype = metadata[:2]
    if kind == "nvfp4":
        codes, scales, globals_ = outputs
        return {"codes": codes, "scales": scales.view(dtype), "globals": globals_}
    codes, scales = outputs
    return {"codes": codes.view(dtype), "scales": scales}


def _experts(metadata, fields: dict, n: int, k: int, dtype: torch.dtype):
    kind = metadata[0]
    if kind == "current":
        return Float8Experts(fields["codes"], fields["scales"], dtype)
    shape = (fields["codes"].shape[0] // n, n, k)
    if kind == "block":
        return Float8BlockExperts(shape, dtype, **fields, pow2=metadata[2])
    return NVFP4Experts(shape, dtype, **fields)


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

    def plan(self, device, shape: tuple[int, int, int], world: int) -> _ExpertsPlan:
        """What the (E, N, K) weight ``shape`` gathers as over ``world`` ranks."""
        key = (device, shape, world)
        if key not in self._plans:
            self._plans[key] = self._make_plan(device, shape, world)
        return self._plans[key]

    def _make_plan(self, device, shape, world) -> _ExpertsPlan:
        num_experts, n, k = shape
        if world == 1 or num_experts % world:
            return _ExpertsPlan(None)
        state = self.module._state("forward", self.recipe, device)
        if state.delayed is not None:
            return _ExpertsPlan(None)
        weights = [state.quantizers[3 * j + 1] for j in self.slots]
        inputs = [state.quantizers[3 * j] for j in self.slots]
        return _pick(weights, inputs, n, k)


class QuantizedGatherExperts(GatherWrapper):
    """A high-precision (E, N, K) expert weight that FSDP2 all-gathers in FP8 where its
    recipe allows (see the module doc); everything else sees the tensor inside."""

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        dtype = mp_policy.param_dtype or self.dtype
        plan = self._spec.plan(self._data.device, tuple(outer_size), mesh.size())
        if plan.kind is None:
            return (self._data.to(dtype).contiguous(),), None
        # the values the GEMMs read: torchtitan's experts compute in bf16 over fp32 weights
        compute = getattr(self._spec.module, "_experts_compute_dtype", lambda d: d)(dtype)
        return _quantize(plan, self._data.to(compute).contiguous())

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        if metadata is None:  # high precision: the parameter is the gathered tensor
            if out is None:
                return all_gather_outputs[0], tuple(all_gather_outputs)
            if isinstance(out, QuantizedExperts):
                raise TypeError(f"FSDP all-gather: the unsharded expert weight is a "
                                f"{type(out).__name__}, the gather brought high precision")
            return None
        fields = _fields(all_gather_outputs, metadata)
        if out is not None:
            cls = _EXPERTS[metadata[0]]
            if type(out) is not cls:
                raise TypeError(f"FSDP all-gather: the unsharded expert weight is a "
                                f"{type(out).__name__}, the gather brought a {cls.__name__}")
            for name, t in fields.items():
                setattr(out, name, t)
            return None
        n, k = self.shape[1:]
        return _experts(metadata, fields, n, k, param_dtype), tuple(all_gather_outputs)


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
