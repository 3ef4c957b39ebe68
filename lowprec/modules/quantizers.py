"""The quantizers a GEMM module's call reads (``LowprecModule``'s share of them): per GEMM,
from the recipe state under the active autocast for an eager call (``gemm_quantizers``,
which also refuses quantized weights of another format than the recipe's), from the
recipe's rule for the module's roles for a compiled one (``traced_quantizers``), or none
where a compiled call traces the high-precision path (``traced_plain_call``)."""

from __future__ import annotations

import warnings

import torch
from torch import nn

from ..formats import QuantizedTensor
from ..kernels import use_kernels
from ..linear import LinearQuantizers, decided_linear
from ..memory import current_frame
from ..recipe import (
    BackwardMode,
    active_region,
    gemm_fast_accum,
    reads_role_names,
    stateful,
    stateless_quantizers,
    torch_autocast_dtype,
)
from .scaling import GROUP_ATTR, prepare_group


class CallQuantizersMixin:
    """The per-call quantizer methods of ``LowprecModule``."""

    def traced_plain_call(self, x: torch.Tensor, *weights: torch.Tensor) -> bool:
        """Whether a compiled call runs no recipe and traces as the torch ops of its high
        precision path: outside autocast and checkpointing, plain input and weights of one
        dtype (under torch.autocast, which casts torch's linear's operands as eager's
        high-precision path casts them)."""
        return (active_region() is None and current_frame() is None
                and type(x) is torch.Tensor
                and all(type(w) in (torch.Tensor, nn.Parameter) and w.dtype == x.dtype
                        for w in weights))

    def traced_quantizers(self, x: torch.Tensor, *weights: torch.Tensor,
                          gemms: int | None = None):
        """(per-GEMM ``LinearQuantizers``, backward mode, delayed-scaling states or None)
        that a compiled call traces its GEMMs with (``lowprec.linear.traced``), or the
        reason (a string) it stays one opaque call.

        The quantizers come from the recipe's rule for this module's roles, as its state
        would hold them (``state.stateless_quantizers``), so that tracing them reads the
        quantizers' settings alone: same-shaped layers whose quantizers agree share one
        compiled code, whatever their names or states. Delayed scaling reads the state
        the module keeps (:meth:`traced_delayed_states`), which joins the autocast region's
        update, and in a grouped module (a model's, ``convert_model``) a ``CustomRecipe``
        the quantizers its factory gave the module's roles (``prepare_state``): both are
        made for the whole group as the first of its modules is traced, so the trace reads
        no role names. A module of no group asks the factory in the trace, and makes its
        own delayed-scaling state there. ``gemms``: the first so many GEMMs'
        quantizers only (a recipe without state)."""
        region = active_region()
        if region is None:
            return "outside lowprec.autocast"
        if current_frame() is not None:
            # its recompute replays the eager call's record (lowprec.checkpoint)
            return "inside an eagerly run activation checkpoint"
        if self.output_quantizer_role is not None or self.grad_input_quantizer_role is not None:
            return "a quantized output or input gradient (boundary roles)"
        if type(x) is not torch.Tensor or not x.is_floating_point():
            return f"an input of type {type(x).__name__}"
        for w in weights:
            if type(w) not in (torch.Tensor, nn.Parameter) and not isinstance(w, QuantizedTensor):
                return f"a weight of type {type(w).__name__}"
        recipe = region.recipe
        delayed = None
        if stateful(recipe) or reads_role_names(recipe):
            # the state this trace reads, made for the whole model now (the modules never
            # grouped count as one model): each layer's own made as it is traced would
            # fail the next layer's guards
            prepare_group(self.__dict__.get(GROUP_ATTR))
        if stateful(recipe):
            states = self.traced_delayed_states(recipe)
            if states is None:
                return "delayed scaling before its state exists, or checkpointed"
            held = self.__dict__["_recipe_states"]
            fq, bq = held["forward"].quantizers, held["backward"].quantizers
            fwd_state, bwd_state, handle, records = states
            qs = self._linear_quantizers(fq, bq, recipe)
            if use_kernels(x) and _seeds(qs):
                return "delayed scaling's first step (a slot without a scale yet)"
            # the name of the group the backward state's update all-reduces its amaxes over,
            # as eager's ("" for none): the traced backward's join op takes it by name
            group = region.group.group_name \
                if recipe.reduce_amax and region.group is not None else ""
            delayed = (fwd_state, bwd_state, handle, recipe, records, group)
            return qs, recipe.backward_mode, delayed
        if reads_role_names(recipe):
            held = self.held_quantizers(recipe)
            if held is not None:  # the factory's choices, made outside the trace
                qs = self._linear_quantizers(*held, recipe)
                return (qs if gemms is None else qs[:gemms]), recipe.backward_mode, None
        return self._stateless_gemms(recipe, gemms), recipe.backward_mode, None

    def traced_decision(self, x: torch.Tensor, weight: torch.Tensor,
                        bias: torch.Tensor | None, input_grad: bool | None = None):
        """The ``Decision`` (quantizers, backward mode, plan, padding) of a compiled one-GEMM
        call under a built-in recipe without state, decided once per kind of call outside
        dynamo's interpretation (``lowprec.linear.decided``); None where
        :meth:`traced_quantizers` decides in the trace (outside an autocast region, in an
        eagerly run checkpoint, boundary roles, delayed scaling, a ``CustomRecipe``
        factory that may read role names, symbolic shapes, quantized operands)."""
        region = active_region()
        if (region is None or current_frame() is not None
                or self.output_quantizer_role is not None
                or self.grad_input_quantizer_role is not None
                or stateful(region.recipe) or reads_role_names(region.recipe)):
            return None
        return decided_linear(region.recipe, x, weight, bias, input_grad)

    def _stateless_gemms(self, recipe, gemms: int | None = None) -> list[LinearQuantizers]:
        """The first ``gemms`` GEMMs' quantizers (all: None) under a recipe without state:
        only the slots a GEMM without boundary roles reads, its input, weight and dY
        (each quantizer built costs a compiled call tracing time)."""
        fwd_roles, bwd_roles = self._roles()
        if gemms is not None:
            fwd_roles, bwd_roles = fwd_roles[:3 * gemms], bwd_roles[:2 * gemms]
        fq = stateless_quantizers(recipe, "forward", fwd_roles[0::3] + fwd_roles[1::3])
        bq = stateless_quantizers(recipe, "backward", bwd_roles[0::2])
        n = len(bq)
        fast = gemm_fast_accum(recipe)
        return [LinearQuantizers(input=fq[i], weight=fq[n + i], output=None, grad_output=bq[i],
                                 grad_input=None, fast_accum=fast) for i in range(n)]

    def traced_grouped_quantizers(self, x: torch.Tensor, *weights: torch.Tensor):
        """(quantizers, backward mode) a compiled call of a grouped module (experts,
        ``GroupedLinear``) traces its grouped GEMMs with: None outside ``lowprec.autocast``;
        one ``LinearQuantizers`` for every GEMM under a built-in recipe, whose rule reads
        a role's tensor type, never its name (a module of 128 experts then traces one set,
        not 256); else :meth:`traced_quantizers`' list, one set a GEMM (a ``CustomRecipe``
        factory may read the names). Or the reason (a string) the call stays one opaque op
        (delayed scaling, whose grouped calls run one Linear a group)."""
        region = active_region()
        if region is None:
            if current_frame() is not None:
                return "inside an eagerly run activation checkpoint"
            # plain operands of one dtype, or any under torch.autocast (which casts them): a
            # quantized weight dequantizes in eager's high-precision call, which the traced
            # torch ops would not mirror
            amp = type(x) is torch.Tensor and torch_autocast_dtype(x) is not None
            if type(x) is not torch.Tensor or not all(
                    type(w) in (torch.Tensor, nn.Parameter) and (amp or w.dtype == x.dtype)
                    for w in weights):
                return "no recipe, and an input or weight that is not a plain tensor of one dtype"
            return None, BackwardMode.DEFAULT
        if stateful(region.recipe):
            return "delayed scaling: its grouped GEMMs run one Linear a group"
        shared = not reads_role_names(region.recipe)
        got = self.traced_quantizers(x, *weights, gemms=1 if shared else None)
        if isinstance(got, str):
            return got
        qs, mode, _ = got
        return (qs[0] if shared else qs), mode

    def gemm_quantizers(self, device) -> tuple[list[LinearQuantizers] | None, str, object]:
        """Per-GEMM quantizers under the active autocast (None outside), the backward mode,
        and a callback for the end of the backward pass."""
        active = self.active_states(device, backward_calls=len(self._gemm_names()))
        if active is None:
            return None, "default", None
        recipe, fwd, bwd, callback = active
        out_role, gi_role = self.output_quantizer_role, self.grad_input_quantizer_role
        kept = self.__dict__.get("_gemm_quantizers_of")
        if kept is None:
            kept = self._gemm_quantizers_of = {}
        cached = kept.get(id(fwd))
        if cached is not None:
            k = cached[0]
            if k[0] is fwd and k[1] is bwd and k[2] is out_role and k[3] is gi_role:
                return cached[1], recipe.backward_mode, callback
        key = (fwd, bwd, out_role, gi_role)
        out = self._linear_quantizers(fwd.quantizers, bwd.quantizers, recipe)
        self._check_quantized_weights(recipe, out)
        # Reused while the states are: the quantizers are the states' own objects, and
        # which slots a module quantizes does not change between calls. One entry a
        # forward state: a checkpointed delayed-scaling call alternates between the state
        # and its replay twin.
        if len(kept) >= 4:
            kept.clear()
        kept[id(fwd)] = (key, out)
        return out, recipe.backward_mode, callback

    def _check_quantized_weights(self, recipe, gemms: list[LinearQuantizers]) -> None:
        """Refuse a weight quantized in another format than ``recipe``'s weight quantizer
        makes (``quantized_model_init`` under one recipe, autocast under another): its
        GEMMs would read a format the recipe never asked for. Under a recipe of the same
        format but other settings, warn: the weights stay quantized, and are re-quantized
        after each optimizer step, under the recipe they were made with."""
        quantized = False
        for name, q in zip(self._weight_names(), gemms):
            w = getattr(self, name, None)
            if not isinstance(w, QuantizedTensor) or q.weight is None:
                continue
            quantized = True
            if not q.weight.makes_form_of(w):
                raise RuntimeError(
                    f"Recipe mismatch for {type(self).__name__} {self.name!r}: its {name} is a "
                    f"{w.form()}, but {type(recipe).__name__}'s weight quantizer "
                    f"({type(q.weight).__name__}) makes {q.weight.tensor_form()}; run it under "
                    f"the recipe its weights were quantized with, or quantize them under this "
                    f"one (lowprec.quantized_model_init(recipe=...))")
        init = getattr(self, "_init_recipe", None)
        if quantized and init is not None and init is not recipe and init != recipe:
            warnings.warn(
                f"Quantizer is being updated, this may affect model behavior: "
                f"{type(self).__name__} {self.name!r} runs under {recipe!r}, its weights stay "
                f"quantized (and are re-quantized after each optimizer step) under {init!r}, "
                f"the recipe of their quantized_model_init", UserWarning, stacklevel=4)

    def _linear_quantizers(self, fq: list, bq: list, recipe) -> list[LinearQuantizers]:
        """Per-GEMM quantizers from the forward slots ``fq`` and backward slots ``bq`` of
        ``recipe`` (whose ``fp8_gemm_*`` say how their FP8 GEMMs accumulate)."""
        fast = gemm_fast_accum(recipe)
        # The GEMMs are counted from the slots, and the boundary slots asked for only where
        # a boundary role is set: both read the GEMMs' names, which a compiled call would
        # guard on (same-shaped layers would then not share code).
        boundary = (self.output_quantizer_role is not None
                    or self.grad_input_quantizer_role is not None)
        out = []
        for i in range(len(fq) // 3):
            f, b = fq[3 * i:3 * i + 3], bq[2 * i:2 * i + 2]
            out.append(LinearQuantizers(
                input=f[0], weight=f[1],
                output=f[2] if boundary and self._boundary(i, True) is not None else None,
                grad_output=b[0],
                grad_input=(b[1] if boundary and self._boundary(i, False) is not None
                            else None), fast_accum=fast))
        return out


def _seeds(qs) -> bool:
    """Whether the kernel path's traced form of a slot these delayed-scaling GEMMs read
    would seed a missing scale (``Float8Quantizer.graph_first_margin``: the slot may
    still be without one). Such a call stays the opaque op on the GPU, whose eager
    quantizes seed the slot: a traced call that seeds casts only once the tensor's amax is
    known, which takes delayed scaling's head start (the cast fused into the pass that
    makes the tensor) for every later step of the compiled graph. The first update clears
    the notes (one read of the scales), and the compiler traces the next call (the notes
    are its guards): a first compile of the model with its Linears opaque, which is cheap,
    and a second with their traced forms."""
    return any(slot is not None and slot.graph_first_margin(True) is not None
               for q in qs for slot in (q.input, q.weight, q.grad_output))
