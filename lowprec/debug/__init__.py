"""Precision debugging in your own training run: which layer goes wrong, and how.

* :class:`Recorder`: every N steps, per GEMM, tensor role and direction, the amax, scales,
  saturated and flushed-to-zero fractions and SQNR of what the step really quantized, to
  CSV and TensorBoard; a NaN/Inf check naming the first layer, role and step; a report of
  what ran in which format (:class:`RunReport`).
* :mod:`.hooks`: the quantizer hooks it records through (shared with ``lowprec compare``).

Nothing is hooked unless a :class:`Recorder` is made. See docs/debugging.md.
"""

from .finite import NonFiniteError, NonFiniteEvent
from .recorder import Recorder
from .report import ModuleRun, RunReport
from .sinks import COLUMNS

__all__ = ["Recorder", "RunReport", "ModuleRun", "NonFiniteError", "NonFiniteEvent", "COLUMNS"]

# The rest of lowprec enters the package here (internal names, not in __all__).
from .describe import format_of
from .hooks import QuantizerHooks
from .stats import sqnr_db
