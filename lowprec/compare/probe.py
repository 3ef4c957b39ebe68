"""Measurements taken during one training step: quantization SQNR and memory saved for backward.

:class:`SQNRProbe` hooks the quantizers of every lowprec module's recipe state
(``module._recipe_states['forward'|'backward'].quantizers``, roles from
``get_quantizer_roles``) for one step, through the hooks ``lowprec.debug`` records with
(:mod:`lowprec.debug.hooks`). Each time a quantizer quantizes a tensor (a GEMM's input,
weight or output gradient), through ``quantize``, ``_quantize_exact`` (an operand only a
GEMM reads, kept as exact values without codes: dY on Hopper) or ``quantize_fused`` (a
norm's output quantized as it is computed, on GPU; its high-precision value is computed
apart), it records, for every direction the GEMMs consume (rowwise for fprop/dgrad's
gradient, columnwise for wgrad and dgrad's weight),
``10 log10(||x||^2 / ||x - dequant(q(x))||^2)`` computed on the tensor the step actually
quantized. Nothing is re-quantized, so the numbers are those of the GEMMs that ran and
the random streams (stochastic rounding) are untouched.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..debug import QuantizerHooks, format_of, sqnr_db
from ..formats import QuantizedTensor

__all__ = ["SQNRProbe", "SQNRRecord", "SavedTensorMeter", "sqnr_db"]


@dataclass
class SQNRRecord:
    layer: str        # the role's name: the GEMM (e.g. "blocks.0.mlp.fc1")
    role: str         # input | weight | grad_output (| output | grad_input when used)
    rowwise_db: float | None
    columnwise_db: float | None
    rowwise_format: str | None
    columnwise_format: str | None
    shape: tuple


class SQNRProbe:
    """Records the SQNR of every quantization of every lowprec module while armed (the
    hooks are ``lowprec.debug.hooks.QuantizerHooks``)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.records: dict[tuple[str, str], SQNRRecord] = {}
        self._hooks = QuantizerHooks(model, self._record)

    @property
    def _wrapped(self) -> list:
        return self._hooks.wrapped

    def arm(self, recipe, device) -> None:
        """Hook the quantizers ``recipe`` gives every module (creating the states if needed)."""
        self._hooks.hook_states(recipe, device)

    def disarm(self) -> None:
        self._hooks.remove()

    def _record(self, site, q, x: torch.Tensor, qt: torch.Tensor) -> None:
        if not isinstance(qt, QuantizedTensor):
            return
        with torch.no_grad():
            vals = {}
            for usage in ("rowwise", "columnwise"):
                if qt.has_usage(usage):
                    # one float32 copy alive at a time (1 GiB for an 8192 x 32000 head's dY)
                    approx = qt.dequantize(dtype=torch.float32, usage=usage)
                    vals[usage] = sqnr_db(x, approx)
                    del approx
        key = (site.layer, site.role)
        old = self.records.get(key)
        row, col = vals.get("rowwise"), vals.get("columnwise")
        if old is not None:  # keep a direction recorded by an earlier call of this step
            row = old.rowwise_db if row is None else row
            col = old.columnwise_db if col is None else col
        self.records[key] = SQNRRecord(
            layer=site.layer, role=site.role, rowwise_db=row, columnwise_db=col,
            rowwise_format=format_of(q, "rowwise") if row is not None else None,
            columnwise_format=format_of(q, "columnwise") if col is not None else None,
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
