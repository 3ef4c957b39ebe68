"""The NaN/Inf check: the first layer, role and step where a quantized operand, or the
high-precision value it was quantized from, held a non-finite value.

Each quantize leaves device scalars (:class:`FiniteProbe`, or the recorded statistics);
nothing is read back until the step ends, when the recorder fetches every call's scalars
at once and reports the first call, in quantize order, that held a NaN/Inf."""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import torch

from ..formats import QuantizedTensor
from .scaling import stored_values
from .stats import Pending

#: accepted values of ``check_finite`` and what they mean
POLICIES = {True: "warn", "warn": "warn", "raise": "raise", False: None, None: None}


class NonFiniteError(FloatingPointError):
    """A quantized operand, or its high-precision source, held NaN or Inf
    (``Recorder(check_finite="raise")``). ``event`` says where."""

    def __init__(self, event: "NonFiniteEvent") -> None:
        super().__init__(event.message())
        self.event = event


@dataclass(frozen=True)
class NonFiniteEvent:
    """Where a non-finite value was first seen in a step. ``where`` is ``"input"`` (the
    high-precision tensor before quantization) or the direction (``"rowwise"``,
    ``"columnwise"``) whose quantized values alone were non-finite."""

    step: int
    layer: str
    role: str
    where: str
    module: str | None = None

    def message(self) -> str:
        what = ("the high-precision value quantized" if self.where == "input"
                else f"the {self.where} quantized values (the high-precision value was finite)")
        module = f" (module {self.module!r})" if self.module and self.module != self.layer else ""
        return (f"lowprec.debug: first NaN/Inf of step {self.step} in layer {self.layer!r}"
                f"{module}, role {self.role!r}: {what}")


def check_policy(value) -> str | None:
    """``check_finite``'s value as "warn", "raise" or None (off); ValueError otherwise."""
    if isinstance(value, (bool, str, type(None))) and value in POLICIES:
        return POLICIES[value]
    raise ValueError(f"check_finite={value!r}: use True or 'warn' (warn), 'raise' (raise "
                     f"NonFiniteError) or False (no check)")


class FiniteProbe(Pending):
    """One quantize's min and max of x and of each direction's dequantized values, as
    device scalars (a NaN/Inf makes them non-finite); :meth:`where` reads them after the
    fetch."""

    def __init__(self, x: torch.Tensor, qt: QuantizedTensor, usages) -> None:
        super().__init__()
        self.usages = list(usages)
        for t in (x.detach(), *(stored_values(qt, u) for u in self.usages)):
            for v in torch.aminmax(t):
                self.add_float(v)

    def where(self) -> str | None:
        """``"input"`` if x held NaN/Inf, else the first direction whose dequantized values
        did, else None (after :func:`lowprec.debug.stats.fetch`)."""
        v = self.host_floats
        ok = [math.isfinite(v[i]) and math.isfinite(v[i + 1]) for i in range(0, len(v), 2)]
        if not ok[0]:
            return "input"
        return next((u for u, fine in zip(self.usages, ok[1:]) if not fine), None)


class FiniteCheck:
    """Keeps the first non-finite event of each step (``events``) and warns or raises on it."""

    def __init__(self, policy: str) -> None:
        self.policy = policy
        self.events: list[NonFiniteEvent] = []
        self._step_seen: int | None = None

    def seen_this_step(self, step: int) -> bool:
        return self._step_seen == step

    def report(self, event: NonFiniteEvent, stacklevel: int = 2) -> None:
        if self.seen_this_step(event.step):
            return  # what follows the first is its consequence
        self._step_seen = event.step
        self.events.append(event)
        if self.policy == "raise":
            raise NonFiniteError(event)
        warnings.warn(event.message(), RuntimeWarning, stacklevel=stacklevel)
