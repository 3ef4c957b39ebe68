"""FSDP2 all-gathers of lowprec weights in their quantized format.

``quantized_all_gather(model, recipe)`` (before ``fully_shard``) wraps the high-precision
weights of the model's lowprec modules in :class:`QuantizedGatherWeight`. The wrapper is
the weight to everything else (the optimizer, the state dict, ``reset_parameters``): every
op runs on the high-precision tensor inside. FSDP2 finds its ``fsdp_pre_all_gather`` /
``fsdp_post_all_gather`` hooks and lets it choose what to gather: each rank quantizes its
own shard with the module's weight quantizer under ``recipe``, exactly as a quantize of the
whole weight quantizes those rows (``Quantizer.quantize_part``; a per-tensor amax is
all-reduced over the FSDP mesh first), and the ranks gather the codes and scales. The
unsharded parameter is then a quantized tensor, which the module's GEMMs consume as they
consume a ``quantized_model_init`` weight.

What each format gathers (a shard is a block of whole rows):

* Per-tensor FP8 (current scaling): the rowwise FP8 data, with one scale from the
  all-reduced amax; dgrad's transposed copy is made in backward (one layer at a time).
* Block FP8 with 128x128 weight blocks, MXFP8 with 32x32 blocks, NVFP4 with 16x16 tiles
  (2-D): the rowwise data and block scales; the columnwise side derives from them.
* MXFP8 (1x32), NVFP4 (1x16), block FP8 with 1x128 weight blocks: the rowwise data and
  scales for forward and, when FSDP reshards after forward, the columnwise ones for
  backward's own gather (both in forward otherwise).
* NVFP4's global scale comes from the all-reduced amax.
* 3-D expert weights (``GroupedExperts``, torchtitan's experts): FP8 codes and one scale an
  expert under FP8 current scaling, each rank quantizing its own whole experts
  (:mod:`.experts_gather`); high precision under other recipes.
* High precision (the parameter's FSDP dtype), where the quantized bytes would depend on
  the shard boundary or on more than the shard: delayed scaling (its scales come from the
  amax history), NVFP4 weights with stochastic rounding or a Hadamard transform, hybrid
  formats, shards that do not split the rows evenly or not on block boundaries (except
  per-tensor FP8, whose one input FSDP pads), a world of one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn

from ..formats import QuantizedTensor, Quantizer
from ..recipe import BackwardMode
from . import gather_codec
from .experts_gather import wrap_expert_weights
from .gather_wrapper import GatherWrapper

aten = torch.ops.aten



@dataclass
class _GatherPlan:
    """What one weight gathers, fixed at its first gather (FSDP sizes its buffers then)."""

    quantizer: Quantizer | None  # None: high precision
    derivable: bool = True  # columnwise derives from rowwise: gather rowwise only
    padded: bool = False  # one input, padded by FSDP's rule for uneven shards
    backward_mode: str = "default"
    #: (usages, shard kind) -> the quantizer's prepared ``quantize_part`` (the same shard
    #: is quantized every step: its launches are bound once)
    parts: dict = field(default_factory=dict, repr=False, compare=False)

    def quantize_part(self, shard: torch.Tensor, statistic, rowwise: bool,
                      columnwise: bool) -> QuantizedTensor:
        """``quantizer.quantize_part(shard, statistic)`` with these usages."""
        key = (rowwise, columnwise, shard.shape, shard.dtype, shard.device)
        quantize = self.parts.get(key)
        if quantize is None:
            quantize = self.parts[key] = self.quantizer.prepare_part(
                shard.shape, shard.dtype, shard.device, rowwise=rowwise, columnwise=columnwise)
        return quantize(shard, statistic)

    def usages(self, backward: bool, reshard: bool) -> tuple[bool, bool]:
        """(rowwise, columnwise) to gather in this phase."""
        if self.derivable or self.backward_mode != BackwardMode.DEFAULT:
            return True, False
        if backward:
            return False, True
        return True, not reshard

    def columnwise_in_backward(self, backward: bool, reshard: bool) -> bool:
        """Whether this phase's gather is rowwise and the backward's brings the columnwise
        data into the same buffers."""
        return self.usages(backward, reshard) == (True, False) and self.usages(True, reshard) \
            == (False, True)


class _GatherSpec:
    """The module and GEMM a wrapped weight belongs to, and the recipe it gathers under.
    ``master``: the wrapped tensor is the fp32 master of a ``quantized_model_init`` weight
    of dtype ``master`` (quantized from fp32, as ``QuantizedWeightOptimizer`` does)."""

    def __init__(self, module: nn.Module, index: int, recipe,
                 master: torch.dtype | None = None) -> None:
        self.module, self.index, self.recipe, self.master = module, index, recipe, master
        self._plans: dict = {}
        self._group = None

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_plans"] = {}  # quantizers of this process's recipe state
        state["_group"] = None  # this process's FSDP state
        return state

    def fsdp_group(self):
        """The FSDP parameter group of this weight (found once)."""
        if self._group is None:
            self._group = _fsdp_param_group(self.module, self.module._weight_names()[self.index])
        return self._group

    def plan(self, device, dtype, shape: tuple[int, int], world: int) -> _GatherPlan:
        key = (device, dtype, shape, world)
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = self._make_plan(device, shape, world)
        return plan

    def _make_plan(self, device, shape, world) -> _GatherPlan:
        state = self.module._state("forward", self.recipe, device)
        if state.delayed is not None or world == 1:
            return _GatherPlan(None)
        q = state.quantizers[3 * self.index + 1].copy()
        q.set_usage(rowwise=True, columnwise=True)
        if not q.can_quantize_part():
            return _GatherPlan(None)
        rows, k = shape
        local = math.ceil(rows / world)
        probe = q.row_multiple(rowwise=True, columnwise=True)  # rows any block accepts
        derivable = gather_codec.derives_columnwise(q, probe, k)
        probe_inputs = _inputs_meta(q, probe, k, rowwise=True, columnwise=False)
        single = (derivable and len(probe_inputs) == 1 and probe_inputs[0].shape == (probe, k)
                  and q.row_multiple(rowwise=True, columnwise=False) == 1)
        mode = self.recipe.backward_mode
        plan = _GatherPlan(q, derivable, padded=single, backward_mode=mode)
        if single:
            return plan
        if rows % world or local % q.row_multiple(rowwise=True, columnwise=not derivable):
            return _GatherPlan(None)  # uneven or straddling shards: FSDP's padding rule
        if not derivable and mode == BackwardMode.DEFAULT:
            row_inputs = _inputs_meta(q, local, k, rowwise=True, columnwise=False)
            col_inputs = _inputs_meta(q, local, k, rowwise=False, columnwise=True)
            if gather_codec.signature(row_inputs) != gather_codec.signature(col_inputs):
                return _GatherPlan(None)  # the two phases must fill the same buffers
        return plan


def _inputs_meta(q: Quantizer, m: int, k: int, *, rowwise: bool, columnwise: bool):
    with q.usages(rowwise=rowwise, columnwise=columnwise):
        empty = q.make_empty((m, k), dtype=torch.float32, device="meta")
    return gather_codec.pack(empty, m)[0]


def _fsdp_param_group(module: nn.Module, name: str):
    """FSDP2's parameter group holding ``module.<name>`` (FSDP hands the hooks the module
    that owns the parameter, which need not be the one ``fully_shard`` was applied to), or
    None where this torch keeps its states otherwise."""
    try:
        from torch.distributed._composable_state import _module_state_mapping
        for ref in list(_module_state_mapping.values()):
            group = getattr(ref(), "_fsdp_param_group", None)
            for fsdp_param in getattr(group, "fsdp_params", ()):
                info = fsdp_param._module_info
                if info.module is module and info.param_name == name:
                    return group
    except (ImportError, AttributeError):
        pass
    return None


def _fsdp_phase(group) -> tuple[bool, bool]:
    """(in backward, resharding after forward) of FSDP parameter group ``group``; unknown
    reads as forward without resharding, which gathers every direction a step needs."""
    try:
        backward = group._training_state.name in ("PRE_BACKWARD", "POST_BACKWARD")
        return backward, bool(group._reshard_after_forward)
    except AttributeError:
        return False, False


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    short = rows - t.shape[0]
    return torch.cat([t, t.new_zeros(short, *t.shape[1:])]) if short else t


class QuantizedGatherWeight(GatherWrapper):
    """A high-precision weight that FSDP2 all-gathers quantized (see the module doc)."""

    @staticmethod
    def __new__(cls, data: torch.Tensor, spec: _GatherSpec):
        self = GatherWrapper.__new__(cls, data, spec)
        #: (plan, dtype, process group) of the last quantized gather
        self._last_gather = None
        #: (dtype, whether a forward's gather has read it, statistic): from
        #: ``precompute_gather_statistics`` for the next forward, or the forward's own,
        #: which its backward's gather reads (the weight is the same until the optimizer
        #: steps; a version counter cannot tell, the wrapper's tensor being one of FSDP's
        #: views of the parameter, which the optimizer writes through another)
        self._statistic = None
        #: (FSDP's mesh, its size, its process group), asked of the mesh once
        self._mesh = None
        return self

    # ---- FSDP2 all-gather extension -----------------------------------------------------
    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        dtype = mp_policy.param_dtype or self.dtype
        master = getattr(self._spec, "master", None)
        if master is not None and dtype != master:
            raise TypeError(
                f"this weight was built under quantized_model_init as {master} and is kept as "
                f"an fp32 master shard; FSDP2 must compute in {master}: fully_shard(..., "
                f"mp_policy=MixedPrecisionPolicy(param_dtype={master})) (got {dtype})")
        seen = self._mesh
        if seen is None or seen[0] is not mesh:  # asked once: each costs host time a gather
            seen = self._mesh = (mesh, mesh.size(), mesh.get_group())
        _, world, group = seen
        rows, k = outer_size
        padded_rows = math.ceil(rows / world)
        # a master quantizes from its fp32 values; a high-precision weight from the values
        # the GEMM would read (the compute dtype)
        shard = self._source(dtype)
        plan = self._spec.plan(shard.device, dtype, (rows, k), world)
        if plan.quantizer is None:
            return (_pad_rows(shard.to(dtype), padded_rows),), None
        backward, reshard = _fsdp_phase(self._spec.fsdp_group())
        rowwise, columnwise = plan.usages(backward, reshard)
        self._last_gather = (plan, dtype, group)
        statistic = self._whole_statistic(plan.quantizer, shard, dtype, group, backward)
        part = plan.quantize_part(shard, statistic, rowwise, columnwise)
        return gather_codec.pack(part, rows, padded_rows if plan.padded else None,
                                 plan.columnwise_in_backward(backward, reshard))

    def _source(self, dtype) -> torch.Tensor:
        """The values a gather quantizes: a master's own fp32 values, a high-precision
        weight's in the compute dtype (the values its GEMM would read)."""
        data = self._data
        return data if data.dtype == dtype or getattr(self._spec, "master", None) is not None \
            else data.to(dtype)

    def _whole_statistic(self, quantizer, shard, dtype, group, backward: bool):
        """The whole weight's per-tensor statistic: in a forward, the one precomputed for
        it or else an all-reduce of the shards' (with those of the other weights of its
        FSDP parameter group, :func:`_reduce_with_layer`); in a backward, its forward's
        (every rank takes the same branch: the same steps)."""
        kept = self._statistic
        if kept is not None and kept[0] == dtype and (backward or not kept[1]):
            self._statistic = (dtype, True, kept[2])
            return kept[2]
        statistic = quantizer.part_statistic(shard)
        if statistic is not None:
            others = [] if backward else _waiting_layer_weights(self, dtype, group)
            if others:
                statistic = _reduce_with_layer(self, statistic, others, dtype, group)
            else:
                torch.distributed.all_reduce(statistic, op=torch.distributed.ReduceOp.MAX,
                                             group=group)
        self._statistic = (dtype, True, statistic) if statistic is not None else None
        return statistic

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        if metadata is None:  # high precision: the parameter is a view of the gather
            if out is None:
                return all_gather_outputs[0], tuple(all_gather_outputs)
            return None
        if out is not None:
            local = getattr(out, "_local_tensor", out)  # a DTensor parameter under TP
            gather_codec.refill(local, all_gather_outputs, metadata)
            return None
        shape = (metadata.rows, self.shape[1])
        qt = gather_codec.unpack(all_gather_outputs, metadata, shape, param_dtype)
        return qt, tuple(all_gather_outputs)


def precompute_gather_statistics(model: nn.Module) -> None:
    """Compute the per-tensor statistics (amaxes) the next quantized all-gathers need, for
    every weight of ``model`` wrapped by :func:`quantized_all_gather`, in one all-reduce per
    process group, instead of one small all-reduce per layer inside its forward's gathers
    (where it waits behind the gradient reduce-scatters). Call it after
    ``optimizer.step()``, on every rank, once the weights hold the values the next forward
    reads: each statistic serves the next forward's gather (and its backward's), and is not
    checked against the values (write the weights after it, by loading a checkpoint say,
    and call it again). A missed call costs time, never correctness: a forward with no
    fresh statistics all-reduces its own. The gathered bytes are the same either way."""
    pending: dict = {}
    for p in model.parameters():
        local = getattr(p, "_local_tensor", p)
        if not isinstance(local, QuantizedGatherWeight) or local._last_gather is None:
            continue  # not wrapped, or not gathered quantized yet (sized at the first gather)
        plan, dtype, group = local._last_gather
        statistic = plan.quantizer.part_statistic(local._source(dtype))
        if statistic is not None:
            pending.setdefault(group, []).append((local, dtype, statistic))
    for group, items in pending.items():
        _reduce_and_keep(items, group)


def _reduce_and_keep(items: list, group) -> torch.Tensor:
    """All-reduce the shards' statistics of ``items`` ((weight, dtype, statistic) each)
    over ``group`` in one collective; each weight keeps its whole statistic for its next
    forward's gather (and that gather's backward). Returns the reduced rows, in order."""
    rows = _aligned_rows([s for *_, s in items])
    torch.distributed.all_reduce(rows, op=torch.distributed.ReduceOp.MAX, group=group)
    for (local, dtype, s), row in zip(items, rows):
        local._statistic = (dtype, False, row[:s.numel()])
    return rows


def _waiting_layer_weights(weight: QuantizedGatherWeight, dtype, group) -> list:
    """Where ``weight`` is the first wrapped weight of its FSDP parameter group (a
    layer's), the group's other wrapped weights that gathered before in ``dtype`` over
    ``group`` and hold no statistic for this forward: FSDP gathers them right after
    ``weight`` (in the group's order), so their statistics can travel in ``weight``'s
    all-reduce, one a layer instead of one a weight. Empty otherwise."""
    fsdp_group = weight._spec.fsdp_group()
    wrapped = []
    for fsdp_param in getattr(fsdp_group, "fsdp_params", ()):
        param = getattr(fsdp_param, "sharded_param", None)
        local = getattr(param, "_local_tensor", param)
        if isinstance(local, QuantizedGatherWeight) and local._last_gather is not None:
            wrapped.append(local)
    if not wrapped or wrapped[0] is not weight:
        return []
    others = []
    for local in wrapped[1:]:
        plan, last_dtype, last_group = local._last_gather
        kept = local._statistic
        if (last_dtype == dtype and last_group is group
                and not (kept is not None and kept[0] == dtype and not kept[1])):
            others.append((local, plan))
    return others


def _reduce_with_layer(weight: QuantizedGatherWeight, statistic: torch.Tensor, others: list,
                       dtype, group) -> torch.Tensor:
    """``weight``'s ``statistic`` all-reduced together with the statistics of ``others``
    (weights and their gather plans, :func:`_waiting_layer_weights`), which each keep
    theirs for their next forward's gather, as ``precompute_gather_statistics`` leaves
    them."""
    items = [(weight, dtype, statistic)] + [
        (local, dtype, plan.quantizer.part_statistic(local._source(dtype)))
        for local, plan in others]
    return _reduce_and_keep(items, group)[0, :statistic.numel()]


def _aligned_rows(statistics: list[torch.Tensor]) -> torch.Tensor:
    """The int32 ``statistics`` as the rows of one tensor, each row padded with zeros to a
    multiple of 16 bytes: a gather's kernel then reads its statistic from a 16-byte
    aligned address, as from a tensor of its own, and takes its bound launch."""
    n = statistics[0].numel()
    width = -(-max(s.numel() for s in statistics) // 4) * 4
    if all(s.numel() == n for s in statistics):  # one stack and one pad for them all
        return torch.nn.functional.pad(torch.stack([s.reshape(n) for s in statistics]),
                                       (0, width - n))
    return torch.stack([torch.nn.functional.pad(s.reshape(-1), (0, width - s.numel()))
                        for s in statistics])


def quantized_all_gather(model: nn.Module, recipe) -> nn.Module:
    """Let FSDP2 all-gather the weights of ``model``'s lowprec modules quantized in
    ``recipe``'s weight format (see the module doc for what each format gathers). Call it
    on the unsharded model, before ``fully_shard``; returns ``model``.

    Forwards under ``lowprec.autocast(recipe=recipe)`` compute exactly what they compute
    without FSDP. The gathered weight is the module's weight for any forward: under
    another recipe or outside autocast its GEMMs use the gathered values, as they use a
    ``quantized_model_init`` weight.

    Weights built under ``quantized_model_init`` (which FSDP2 cannot split) become fp32
    master shards, starting from their dequantized values, gathered in the format of the
    recipe they were built under: what ``QuantizedWeightOptimizer`` does on one process
    (its fp32 masters, re-quantized after each step), with the master sharded and a plain
    torch optimizer. Their modules then need FSDP2 to compute in the weight's dtype
    (``MixedPrecisionPolicy(param_dtype=...)`` where that is not fp32)."""
    from ..modules import LowprecModule
    from ..recipe import Recipe
    if not isinstance(recipe, Recipe):
        raise TypeError(f"quantized_all_gather: recipe must be a lowprec Recipe, got "
                        f"{type(recipe).__name__}")
    for module in model.modules():
        if not isinstance(module, LowprecModule):
            continue
        wrap_expert_weights(module, recipe)
        for i, name in enumerate(module._weight_names()):
            w = module._parameters.get(name)
            if w is None or isinstance(w, GatherWrapper):
                continue
            if isinstance(w, QuantizedTensor):
                if w.dim() != 2 or getattr(module, "_init_recipe", None) is None:
                    raise TypeError(f"quantized_all_gather: {type(module).__name__}.{name} is a "
                                    f"quantized tensor not made by quantized_model_init")
                master = w.dequantize(torch.float32).detach()
                spec = _GatherSpec(module, i, module._init_recipe, master=w.dtype)
                wrapped = QuantizedGatherWeight(master, spec)
                module._parameters[name] = nn.Parameter(wrapped, requires_grad=w.requires_grad)
                continue
            if type(w.data) is not torch.Tensor:
                raise TypeError(f"quantized_all_gather: {type(module).__name__}.{name} is a "
                                f"{type(w.data).__name__}; call it before fully_shard")
            if w.dim() != 2:
                raise ValueError(f"quantized_all_gather: {name} must be 2-D, got shape "
                                 f"{tuple(w.shape)}")
            wrapped = QuantizedGatherWeight(w.detach(), _GatherSpec(module, i, recipe))
            module._parameters[name] = nn.Parameter(wrapped, requires_grad=w.requires_grad)
    return model
