"""Measurements taken during one training step: quantization SQNR and memory saved for backward.

:class:`SQNRProbe` hooks the quantizers of every lowprec module's recipe state
(``module._recipe_states['forward'|'backward'].quantizers``, roles from
``get_quantizer_roles``) for one step. Each time a quantizer quantizes a tensor
(a GEMM's input, weight or output gradient), through ``quantize`` or, for an
operand only a GEMM reads, ``_quantize_exact`` (exact values without codes: dY
on Hopper), it records, for every direction the GEMMs consume (rowwise for
fprop/dgrad's gradient, columnwise for wgrad and dgrad's weight),
``10 log10(||x||^2 / ||x - dequant(q(x))||^2)`` computed on the
tensor the step actually quantized. Nothing is re-quantized, so the numbers are
those of the GEMMs that ran and the random streams (stochastic rounding) are
untouched.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..formats.base import QuantizedTensor
from ..formats.hybrid import HybridQuantizer
from ..linear import grad_split
from ..modules.base import LowprecModule


def sqnr_db(x: torch.Tensor, approx: torch.Tensor) -> float:
    """``10 log10(sum x^2 / sum (x - approx)^2)`` in float64; inf for an exact match."""
    x64, a64 = x.detach().double(), approx.detach().double()
    signal = float((x64 * x64).sum())
    noise = float(((x64 - a64) ** 2).sum())
    if not math.isfinite(noise) or not math.isfinite(signal):
        return float("nan")
    if noise == 0.0:
        return float("inf") if signal > 0 else float("nan")
    if signal == 0.0:
        return float("-inf")
    return 10.0 * math.log10(signal / noise)


@dataclass
class SQNRRecord:
    layer: str        # the role's name: the GEMM (e.g. "blocks.0.mlp.fc1")
    role: str         # input | weight | grad_output (| output | grad_input when used)
    rowwise_db: float | None
    columnwise_db: float | None
    rowwise_format: str | None
    columnwise_format: str | None
    shape: tuple


def _format_of(q, usage: str) -> str:
    if isinstance(q, HybridQuantizer):
        q = q.rowwise_quantizer if usage == "rowwise" else q.columnwise_quantizer
    name = getattr(q, "format_name", type(q).__name__)
    fp8 = getattr(q, "fp8_dtype", None)
    if fp8 is not None:
        name += {torch.float8_e4m3fn: "(e4m3)", torch.float8_e5m2: "(e5m2)"}.get(fp8, f"({fp8})")
    extras = [tag for tag, on in (("rht", getattr(q, "with_rht", False) and usage == "columnwise"),
                                  ("2d", getattr(q, "with_2d_quantization", False)),
                                  ("sr", getattr(q, "stochastic_rounding", False))) if on]
    return name + (f"+{'+'.join(extras)}" if extras else "")


class SQNRProbe:
    """Records the SQNR of every quantization of every lowprec module while armed."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.records: dict[tuple[str, str], SQNRRecord] = {}
        self._wrapped: list = []
        self._whole = None

    def arm(self, recipe, device) -> None:
        """Hook the quantizers ``recipe`` gives every module (creating the states if needed)."""
        for module in self.model.modules():
            if not isinstance(module, LowprecModule):
                continue
            for mode in ("forward", "backward"):
                state = module._state(mode, recipe, device)
                for q, role in zip(state.quantizers, state.roles):
                    if role is None:
                        continue  # unset boundary slot: never used for compute
                    self._wrap(q, role)

    def _wrap(self, q, role) -> None:
        original = q.quantize  # the bound method of the class
        probe = self

        def quantize(x, _original=original, _q=q, _role=role):
            qt = _original(x)
            probe._record(_q, _role, x, qt)
            return qt

        q.quantize = quantize
        exact_only = q._quantize_exact  # codes=False operands (dY on Hopper) skip quantize()

        def quantize_exact(x, _original=exact_only, _q=q, _role=role):
            qt = _original(x)
            if qt is not None:
                probe._record(_q, _role, x, qt)
            return qt

        q._quantize_exact = quantize_exact
        self._wrapped.append(q)
        if self._whole is None:
            # A slice is not the tensor: while armed, dY and the weights are quantized whole
            # (both usages in one quantize call), so each SQNR is the whole tensor's.
            self._whole = grad_split.unsliced()
            self._whole.__enter__()

    def disarm(self) -> None:
        for q in self._wrapped:
            for name in ("quantize", "_quantize_exact"):
                q.__dict__.pop(name, None)  # back to the class's methods; pickles again
        self._wrapped.clear()
        if self._whole is not None:
            self._whole.__exit__(None, None, None)
            self._whole = None

    def _record(self, q, role, x: torch.Tensor, qt: torch.Tensor) -> None:
        if not isinstance(qt, QuantizedTensor):
            return
        with torch.no_grad():
            vals = {}
            for usage in ("rowwise", "columnwise"):
                if qt.has_usage(usage):
                    approx = qt.dequantize(dtype=torch.float32, usage=usage)
                    vals[usage] = sqnr_db(x.float(), approx)
        key = (role.name, role.tensor_type)
        old = self.records.get(key)
        row, col = vals.get("rowwise"), vals.get("columnwise")
        if old is not None:  # keep a direction recorded by an earlier call of this step
            row = old.rowwise_db if row is None else row
            col = old.columnwise_db if col is None else col
        self.records[key] = SQNRRecord(
            layer=role.name, role=role.tensor_type, rowwise_db=row, columnwise_db=col,
            rowwise_format=_format_of(q, "rowwise") if row is not None else None,
            columnwise_format=_format_of(q, "columnwise") if col is not None else None,
            shape=tuple(x.shape))

    def results(self) -> list[SQNRRecord]:
        return list(self.records.values())


class SavedTensorMeter:
    """Bytes of the tensors autograd keeps for backward during a forward (activations and
    quantized operands; parameters themselves are not counted). Use as a context manager
    around the forward."""

    def __init__(self, model: torch.nn.Module) -> None:
        self._params = {self._key(p) for p in model.parameters()
                        if not isinstance(p, QuantizedTensor)}
        self._seen: set = set()
        self.bytes = 0
        self._ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    @staticmethod
    def _key(t: torch.Tensor):
        return (t.device, t.untyped_storage().data_ptr())

    def _count(self, t: torch.Tensor) -> None:
        if isinstance(t, QuantizedTensor):
            for inner in t.inner_tensors().values():
                if inner is not None:
                    self._count(inner)
            return
        if t.device.type == "meta":
            return
        key = self._key(t)
        if key in self._params or key in self._seen:
            return
        self._seen.add(key)
        self.bytes += t.untyped_storage().nbytes()

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        self._count(t)
        return t

    def __enter__(self) -> "SavedTensorMeter":
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._ctx.__exit__(*exc)
