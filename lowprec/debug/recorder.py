"""``Recorder``: per layer, role and direction, what quantization did to the operands of a
user's own training run, every N steps (see docs/debugging.md)."""

from __future__ import annotations

import contextlib
import numbers
import warnings

import torch
from torch import nn

from ..formats import USAGES, QuantizedTensor
from ..modules import LowprecModule
from .describe import format_of
from .finite import FiniteCheck, FiniteProbe, NonFiniteEvent, check_policy
from .hooks import QuantizerHooks, Site
from .report import RunLog, RunReport, build_report
from .sinks import CsvSink, check_path, open_tensorboard
from .stats import OperandStats, StepStats, fetch, operand_stats


def _check_every(name: str, value, *, optional: bool = False) -> int | None:
    if optional and value is None:
        return None
    if isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= 1:
        return int(value)
    raise ValueError(f"{name}={value!r}: expected a positive int (every N-th step, N >= 1)"
                     + (" or None" if optional else ""))


class Recorder:
    """Records, on every ``every``-th step (steps 0, N, 2N, ...), per GEMM (``layer``),
    tensor role and direction, what quantization did to the operands the step really
    quantized: amax, scales, the fraction of values that saturated and that flushed to
    zero, and the SQNR; rows go to ``rows``, to ``csv_path`` and to ``tensorboard_dir``
    (when TensorBoard is installed). Columns: ``lowprec.debug.COLUMNS``.

    Args:
        model: the model whose lowprec modules are recorded (``lowprec.Linear`` & co, or
            a model converted with ``lowprec.convert_model``).
        every: record every N-th step.
        csv_path: a CSV file to write (created anew; flushed after each recorded step).
        tensorboard_dir: a TensorBoard log folder; skipped, with a warning, where
            TensorBoard is not installed.
        check_finite: on checked steps, name the first layer, role and step where a
            quantized operand or its high-precision value held NaN/Inf: ``True``/``"warn"``
            warns, ``"raise"`` raises :class:`NonFiniteError`, ``False`` does not check.
            Either happens when the step ends (:meth:`step`, the end of
            :meth:`step_scope`, :meth:`close`), after its rows are written: the check
            reads nothing back while the step runs. Events: ``nonfinite``.
        check_every: check every N-th step (default: the recorded steps only). Steps that
            are checked but not recorded run only the check.

    Call :meth:`step` once per optimizer step, after it (or run each step inside
    ``with rec.step_scope():``), :meth:`close` at the end (or use the recorder as a
    context manager around the run), :meth:`report` for what ran in which format.

    Hooks exist only on recorded or checked steps: the recorder installs them when such a
    step begins and removes them when it ends (:meth:`step`); other steps pay a counter.
    On a hooked step each quantize adds a few reductions whose results stay on the device;
    they are read back together, in one transfer, when the step ends.
    Recording changes no result (the same bits, random draws included); on hooked steps
    dY and the weights are quantized whole rather than in slices, and Linears reading
    one input quantize it each (the same values), which may raise those steps' peak
    memory. Eager calls only: code compiled by ``torch.compile`` is not seen.
    """

    def __init__(self, model: nn.Module, *, every: int = 100, csv_path=None,
                 tensorboard_dir=None, check_finite=True, check_every: int | None = None
                 ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        self.model = model
        self.every = _check_every("every", every)
        self.check_every = _check_every("check_every", check_every, optional=True)
        policy = check_policy(check_finite)
        csv_path = check_path("csv_path", csv_path)
        tensorboard_dir = check_path("tensorboard_dir", tensorboard_dir)
        if not any(isinstance(m, LowprecModule) for m in model.modules()):
            warnings.warn("lowprec.debug.Recorder: the model holds no lowprec module, so no "
                          "operand will be recorded (convert it with lowprec.convert_model)",
                          RuntimeWarning, stacklevel=2)
        #: every recorded row (dicts with the ``COLUMNS`` keys), in order
        self.rows: list[dict] = []
        self._finite = FiniteCheck(policy) if policy is not None else None
        self._csv = CsvSink(csv_path) if csv_path is not None else None
        self._tb = open_tensorboard(tensorboard_dir) if tensorboard_dir is not None else None
        self._log = RunLog()
        self._hooked_steps: list[int] = []
        self._step = 0
        #: the hooked step's quantize calls: (site, device scalars, formats by direction
        #: and shape where recorded, else None), read back when the step ends
        self._pending: list[tuple[Site, OperandStats | FiniteProbe, dict | None, tuple]] = []
        self._hooks: QuantizerHooks | None = None
        self._recording = False
        self._calls_before = 0
        self._closed = False
        self._arm()

    # ---- public API ---------------------------------------------------------------------
    @property
    def step_index(self) -> int:
        """The index of the step now running (0 until the first :meth:`step`)."""
        return self._step

    @property
    def nonfinite(self) -> list[NonFiniteEvent]:
        """The first non-finite event of each checked step that had one."""
        return list(self._finite.events) if self._finite is not None else []

    def step(self) -> None:
        """End the current step: write its rows and remove its hooks; hook the next step if
        it is recorded or checked."""
        self._check_open()
        try:
            self._finish()
        finally:
            self._step += 1
            self._arm()

    @contextlib.contextmanager
    def step_scope(self):
        """``with rec.step_scope(): <one training step>``: :meth:`step` at the end (also
        when the step raises, so its rows so far are written)."""
        self._check_open()
        try:
            yield self
        finally:
            if not self._closed:
                self.step()

    def report(self) -> RunReport:
        """What ran in which format on the hooked steps, what stayed in high precision and
        why, and which ``nn.Linear`` were not converted (``lowprec.debug.RunReport``)."""
        return build_report(self.model, self._log, self._hooked_steps)

    def close(self) -> None:
        """Write the rows of a step in progress, remove the hooks, close the files."""
        if self._closed:
            return
        try:
            self._finish()
        finally:
            self._closed = True
            for sink in (self._csv, self._tb):
                if sink is not None:
                    sink.close()

    def __enter__(self) -> "Recorder":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- steps --------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this lowprec.debug.Recorder is closed")

    def _arm(self) -> None:
        self._recording = self._step % self.every == 0
        checking = self._finite is not None and (
            self._recording if self.check_every is None else self._step % self.check_every == 0)
        if not (self._recording or checking):
            return
        self._hooks = QuantizerHooks(self.model, self._on_quantize, on_call=self._log.on_call,
                                     every_operand=True)
        self._hooks.follow_calls()
        self._calls_before = self._log.calls

    def _finish(self) -> None:
        if self._hooks is None:
            return
        self._hooks.remove()
        self._hooks = None
        if self._log.calls > self._calls_before:
            self._hooked_steps.append(self._step)
        pending, self._pending = self._pending, []
        fetch([p for _, p, _, _ in pending])  # the step's one device-to-host transfer
        stats: dict[tuple[str, str, str], StepStats] = {}
        event = None
        for site, p, formats, shape in pending:
            if formats is None:  # checked, not recorded
                where = p.where()
            else:
                where = None
                for usage, s in p.resolve().items():
                    stats.setdefault((site.layer, site.role, usage), StepStats()).add(
                        s, formats[usage], shape)
                    if s.nonfinite:
                        where = "input"
                    elif s.nonfinite_quantized and where is None:
                        where = usage
            if event is None and where is not None:
                event = NonFiniteEvent(self._step, site.layer, site.role, where, site.module)
        rows = [{"step": self._step, "layer": layer, "role": role, "direction": usage,
                 **st.row()} for (layer, role, usage), st in stats.items()]
        if rows:
            self.rows += rows
            for sink in (self._csv, self._tb):
                if sink is not None:
                    sink.write(rows)
        if event is not None and self._finite is not None:
            self._finite.report(event, stacklevel=4)  # warns at the caller of step()/close()

    # ---- one quantize -------------------------------------------------------------------
    def _on_quantize(self, site: Site, q, x: torch.Tensor, qt) -> None:
        if not isinstance(qt, QuantizedTensor) or x.numel() == 0:
            return
        with torch.no_grad():
            usages = [u for u in USAGES if qt.has_usage(u)]
            formats = {u: format_of(q, u) for u in usages}
            for usage in usages:
                self._log.on_format(site.module, site.layer, site.role, usage, formats[usage])
            if self._recording:
                self._pending.append((site, operand_stats(x, qt, usages, q), formats,
                                      tuple(x.shape)))
            elif self._finite is not None:
                self._pending.append((site, FiniteProbe(x, qt, usages), None, ()))
