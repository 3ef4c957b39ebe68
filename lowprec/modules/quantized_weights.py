"""Quantized weights of a GEMM module (``LowprecModule``'s share of them):
``quantized_model_init``'s weights, their quantizer, their re-quantize on ``copy_``, and
their place in state dicts (plain values, with the exact bytes in ``_extra_state``)."""

from __future__ import annotations

import math

import torch
from torch import nn

from ..formats import REQUANTIZE_ATTR, QuantizedTensor
from ..recipe import init_recipe, push_amaxes
from . import extra_state


class _WeightSlot:
    """Re-quantizes high-precision values into quantized weight ``index`` of ``module``
    (the parameter's ``REQUANTIZE_ATTR``). Holds the module itself, so a deepcopy or a
    pickle of the module carries a link to the copy."""

    def __init__(self, module: nn.Module, index: int) -> None:
        self.module, self.index = module, index

    def __call__(self, src: torch.Tensor, dst: QuantizedTensor) -> None:
        q = self.module.weight_quantizer(self.index, dst.device, values=src, copied=True)
        q.update_quantized(src, dst)



def _plain_values(w: QuantizedTensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A quantized weight's values as a plain tensor of ``dtype`` (default: its own): the
    rowwise representation (what the forward GEMM reads), the columnwise one where that is
    all the weight holds."""
    if w.is_meta:
        return torch.empty(w.shape, dtype=dtype or w.dtype, device="meta")
    usage = "rowwise" if w.has_usage("rowwise") else "columnwise"
    return w.dequantize(dtype, usage=usage).detach()


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors hold the same bits (NaNs included)."""
    if a.dtype != b.dtype or a.shape != b.shape or a.device != b.device:
        return False
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    as_int = ints[a.element_size()]
    return torch.equal(a.contiguous().view(as_int), b.contiguous().view(as_int))


class QuantizedWeightsMixin:
    """The quantized-weight methods of ``LowprecModule``."""

    def _weight_names(self) -> list[str]:
        return ["weight"]

    def _expert_weights(self) -> dict[str, range]:
        """The 3-D expert weights (parameter name -> the GEMM slots of its experts, one an
        expert), for FSDP2's quantized all-gathers; none here."""
        return {}

    def _link_quantized_weights(self) -> None:
        """Let each quantized weight re-quantize high-precision values copied into it
        (``param.copy_(hp)``, ``load_state_dict`` of a high-precision checkpoint) with this
        module's weight quantizer. Set again whenever the parameters are replaced."""
        if getattr(self, "_init_recipe", None) is None:
            return
        for i, pname in enumerate(self._weight_names()):
            w = getattr(self, pname, None)
            if isinstance(w, QuantizedTensor):
                setattr(w, REQUANTIZE_ATTR, _WeightSlot(self, i))

    def _maybe_quantize_weights(self) -> None:
        """Under quantized_model_init, replace each weight by a quantized tensor (both usages)."""
        recipe = init_recipe()
        if recipe is None:
            return
        self._init_recipe = recipe
        for i, pname in enumerate(self._weight_names()):
            w = getattr(self, pname)
            q = self.weight_quantizer(i, w.device)
            setattr(self, pname, nn.Parameter(q.quantize(w.detach()),
                                              requires_grad=w.requires_grad))
        self._link_quantized_weights()

    def weight_quantizer(self, gemm_index: int, device=None, values: torch.Tensor | None = None,
                         *, copied: bool = False):
        """The quantizer (both usages on) for GEMM ``gemm_index``'s weight under the
        quantized_model_init recipe; used to (re)quantize quantized weights.

        Under delayed scaling a weight slot that no training step has updated yet is
        seeded from ``values``, the high-precision values about to be quantized into it
        (default: the weight, when it is still high precision); ``copied``: values from
        outside the module (``copy_``, ``fill_``, ``load_state_dict``). See
        :meth:`_seed_slot`."""
        recipe = getattr(self, "_init_recipe", None)
        if recipe is None:
            raise RuntimeError(f"{type(self).__name__} was not built under quantized_model_init")
        state = self._state("forward", recipe, device)
        q = state.quantizers[3 * gemm_index + 1]
        if state.delayed is not None:
            name = self._weight_names()[gemm_index]
            w = values if values is not None else getattr(self, name)
            slot = 3 * gemm_index + 1
            if (not isinstance(w, QuantizedTensor) and w.device.type != "meta"
                    and self._slot_takes_seed(state.delayed, slot)):
                self._seed_slot(state.delayed, slot, w.detach().to(getattr(self, name).dtype),
                                power_of_two=copied)
        q.set_usage(rowwise=True, columnwise=True)
        return q

    def _slot_takes_seed(self, delayed, slot: int) -> bool:
        """Whether delayed-scaling weight ``slot`` holds no history of training yet: empty,
        or still exactly the seed :meth:`_seed_slot` wrote (no update has rolled it since).
        Reading the state syncs with the device, so a slot known to be past its seed is
        remembered on the host and not read again: an optimizer's re-quantize of every
        step costs nothing. Captured or compiled code never seeds."""
        if torch.compiler.is_compiling() or (
                delayed.scale.is_cuda and torch.cuda.is_current_stream_capturing()):
            return False
        seeds = self.__dict__.setdefault("_weight_seeds", {})
        held = seeds.get(slot)
        column = delayed.amax_history[:, slot]
        if held is None or held[0] is not delayed:  # a state this slot has not seen
            empty = bool(column.abs().sum() == 0)
            if not empty:
                seeds[slot] = (delayed, None)
            return empty
        if held[1] is None:
            return False
        amax, scale = held[1]
        expected = torch.zeros_like(column)
        expected[0] = amax
        still = bool(torch.equal(column, expected) and float(delayed.scale[slot]) == scale)
        if not still:
            seeds[slot] = (delayed, None)
        return still

    def _seed_slot(self, delayed, slot: int, values: torch.Tensor, *,
                   power_of_two: bool) -> None:
        """Make ``values``' amax the only history of delayed-scaling weight ``slot``, and its
        scale the one that amax calls for: the recipe's ``fp8_max / amax / 2**margin``, or
        with ``power_of_two`` the largest power of two at most that.

        Seeded, not Transformer Engine's placeholder scale 1: initial weights of a wide
        layer (amax ~0.02) would fall among the format's subnormals at scale 1, and the
        master weights of QuantizedWeightOptimizer start from what init quantized. Values
        copied in before training (a checkpoint, TE's test values) seed the slot again,
        or any larger than the initial weights would saturate. Their scale is a power of
        two because such values often lie on the format's grid at some power-of-two scale
        (TE quantizes a fresh weight at scale 1), and a power of two only moves exponents:
        they keep their exact values. The slot's first update then takes the recipe's
        scale from the amax the quantize records."""
        seeds = self.__dict__.setdefault("_weight_seeds", {})
        amax = values.abs().amax().float() if values.numel() else torch.zeros(())
        amax_host = float(amax)
        if not (math.isfinite(amax_host) and amax_host > 0):
            seeds.pop(slot, None)  # nothing to seed from: looked at again next time
            return
        device = delayed.scale.device
        if power_of_two:
            ratio = delayed.fp8_maxima[slot] / amax_host / 2.0 ** delayed.recipe.margin
            exponent = min(max(math.frexp(ratio)[1] - 1, -126), 127)  # a normal fp32
            scale = torch.tensor(math.ldexp(1.0, exponent), device=device)
        else:
            # the recipe's update on a history of this one amax (every algorithm's amax)
            current = amax.to(device).reshape(1)
            scale = delayed.scale[slot:slot + 1].clone()
            push_amaxes(torch.zeros_like(delayed.amax_history[:, slot:slot + 1]),
                        current.clone(), scale, delayed.fp8_max[slot:slot + 1], current, "max",
                        delayed.recipe.margin)
        with torch.no_grad():
            delayed.amax_history[:, slot].zero_()
            delayed.amax_history[0, slot] = amax.to(device)
            delayed.scale[slot] = scale.reshape(())
            delayed.amax_current[slot] = 0.0
        seeds[slot] = (delayed, (amax_host, float(delayed.scale[slot])))

    def _held_quantized_weights(self) -> dict:
        """``{param name: quantized weight}`` of this module's weights that are quantized."""
        return {pname: w for pname in self._weight_names()
                if isinstance(w := self._parameters.get(pname), QuantizedTensor)}

    def _save_to_state_dict(self, destination, prefix, keep_vars) -> None:
        """A quantized weight enters the state dict as plain high-precision values: its
        dequantized (rowwise) values in its dtype, what the module computes with, so that
        tensor-only formats (safetensors, ``save_pretrained``, Trainer checkpoints) save it,
        an unconverted model (``from_pretrained``) loads it, and ``load_state_dict``
        re-quantizes it. The quantized bytes travel in ``_extra_state``: loading the state
        dict into a module of the same format restores them exactly
        (``_exact_saved_weights``). ``keep_vars=True`` keeps the quantized parameters."""
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if keep_vars:
            return
        for pname, w in self._held_quantized_weights().items():
            if prefix + pname in destination:
                destination[prefix + pname] = _plain_values(w)

    def _exact_saved_weights(self, state_dict, prefix: str) -> dict:
        """``{key: quantized tensor}``: the quantized weights this state dict's
        ``_extra_state`` holds the bytes of, for each weight whose high-precision entry is
        still exactly those bytes' dequantized values (the state dict as saved, perhaps in
        another dtype) and whose layout (format, shape, usages) is this module's weight's.
        Another entry (an edited weight, a checkpoint of another recipe or of a plain model)
        is re-quantized instead."""
        extra = state_dict.get(prefix + "_extra_state")
        held = self._held_quantized_weights()
        if not held or not isinstance(extra, torch.Tensor) or extra.dtype != torch.uint8:
            return {}
        saved = extra_state.decode_weights(extra)
        out = {}
        for pname, w in held.items():
            hp, entry = state_dict.get(prefix + pname), saved.get(pname)
            # plain tensors only (a quantized one is copied as it is, a DTensor left to torch)
            if (entry is None or type(hp) not in (torch.Tensor, nn.Parameter) or hp.is_meta
                    or not hp.is_floating_point() or hp.shape != w.shape):
                continue
            # compared where the weight lives (where it was saved from, as a rule), so that
            # a device's own dequantize reproduces the saved values
            device = hp.device if w.is_meta else w.device
            exact = extra_state.weight_from_bytes(entry, w, device)
            if exact is None:
                continue
            if _same_bits(_plain_values(exact, hp.dtype), hp.detach().to(device)):
                # on the entry's device, where assign=True puts it
                out[prefix + pname] = (exact if hp.device == device else
                                       extra_state.weight_from_bytes(entry, w, hp.device))
        return out

    def _quantize_assigned_weights(self, state_dict, prefix: str, local_metadata,
                                   exact: dict) -> dict:
        """``load_state_dict(assign=True)``: a high-precision tensor for a quantized weight is
        assigned quantized by the weight quantizer, with the usages the weight holds (else
        the module would silently keep a high-precision weight), or as the exact quantized
        weight the state dict saved (``exact``). Without assign, the exact weights are
        copied in (``copy_`` of quantized tensors copies their bytes). Rewrites those
        entries of ``state_dict``; returns the originals to put back."""
        originals = {}
        for key, qt in exact.items():
            originals[key] = state_dict[key]
            state_dict[key] = qt
        if (not local_metadata.get("assign_to_params_buffers", False)
                or getattr(self, "_init_recipe", None) is None):
            return originals
        for i, pname in enumerate(self._weight_names()):
            w, key = self._parameters.get(pname), prefix + pname
            hp = state_dict.get(key)
            # a wrong shape is left to torch, which reports it as a size mismatch
            if (isinstance(w, QuantizedTensor) and isinstance(hp, torch.Tensor)
                    and not isinstance(hp, QuantizedTensor) and hp.shape == w.shape):
                q = self.weight_quantizer(i, hp.device, values=hp, copied=True)
                with q.usages(rowwise=w.has_usage("rowwise"),
                              columnwise=w.has_usage("columnwise")):
                    state_dict[key] = q.quantize(hp.detach().to(w.dtype))
                originals[key] = hp
        return originals

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        # A high-precision tensor for a quantized weight: the exact bytes _extra_state saved
        # with it where they are its values; else copy_ re-quantizes it in place
        # (_WeightSlot), and assign=True assigns it quantized.
        exact = self._exact_saved_weights(state_dict, prefix)
        originals = self._quantize_assigned_weights(state_dict, prefix, local_metadata, exact)
        try:
            super()._load_from_state_dict(state_dict, prefix, local_metadata, strict,
                                          missing_keys, unexpected_keys, error_msgs)
        finally:
            state_dict.update(originals)
        # A checkpoint from before conversion (torch.nn.Linear) has no scaling state; starting
        # it fresh is what loading such a checkpoint means, so it is not a missing key.
        key = prefix + "_extra_state"
        if key in missing_keys:
            missing_keys.remove(key)
        self._link_quantized_weights()  # load_state_dict(assign=True) swaps parameters in
