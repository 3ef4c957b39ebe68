"""What ran in which format, and what stayed in high precision and why.

:class:`RunLog` collects, on the steps the recorder hooks, every lowprec module call
(quantized under which recipe and backward mode, or outside autocast) and the format of
each quantized role and direction. :func:`build_report` joins it with ``convert_model``'s
report (``model.lowprec_conversion``: what was converted, fused, and skipped with the
reason) into a :class:`RunReport`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from ..modules import LowprecModule
from ..recipe import active_region

#: why a module ran without quantization
OUTSIDE_AUTOCAST = "ran outside lowprec.autocast (no recipe active)"


@dataclass
class ModuleRun:
    """One lowprec module on the hooked steps: calls quantized and outside autocast, the
    recipes and backward modes of its quantized calls, and per GEMM (``layer``), role and
    direction the format it was quantized in (``identity``: kept in high precision)."""

    path: str
    kind: str
    quantized_calls: int = 0
    high_precision_calls: int = 0
    recipes: list[str] = field(default_factory=list)
    backward_modes: list[str] = field(default_factory=list)
    formats: dict[tuple[str, str, str], str] = field(default_factory=dict)


class RunLog:
    """Module calls and operand formats seen while the hooks are installed."""

    def __init__(self) -> None:
        self.modules: dict[str, ModuleRun] = {}
        #: module calls seen, all modules together
        self.calls = 0

    def _run(self, path: str, module: nn.Module) -> ModuleRun:
        run = self.modules.get(path)
        if run is None:
            run = self.modules[path] = ModuleRun(path, type(module).__name__)
        return run

    def on_call(self, path: str, module: nn.Module, quantizers, backward_mode: str) -> None:
        self.calls += 1
        run = self._run(path, module)
        if quantizers is None:
            run.high_precision_calls += 1
            return
        run.quantized_calls += 1
        region = active_region()
        # a checkpoint recompute replays its call's recipe with no region of its own
        recipe = type(region.recipe).__name__ if region is not None else None
        if recipe is not None and recipe not in run.recipes:
            run.recipes.append(recipe)
        if backward_mode not in run.backward_modes:
            run.backward_modes.append(backward_mode)

    def on_format(self, module_path: str | None, layer: str, role: str, usage: str,
                  fmt: str) -> None:
        run = self.modules.get(module_path) if module_path is not None else None
        if run is not None:
            run.formats[(layer, role, usage)] = fmt


@dataclass
class RunReport:
    """What ran in which format (see the module docstring).

    * ``quantized``: lowprec modules with a quantized call on a hooked step, by path;
    * ``high_precision``: lowprec modules whose hooked calls all ran in high precision,
      with the reason;
    * ``not_run``: lowprec modules with no call on a hooked step;
    * ``unconverted``: ``nn.Linear`` modules of the model, with the reason they were not
      converted (``convert_model``'s, where it ran);
    * ``converted`` / ``fused``: ``convert_model``'s lists (empty where it did not run);
    * ``steps``: the hooked steps that ran a lowprec module.
    """

    quantized: dict[str, ModuleRun]
    high_precision: dict[str, str]
    not_run: list[str]
    unconverted: dict[str, str]
    converted: list[str]
    fused: list[tuple[str, str]]
    steps: list[int]

    def __str__(self) -> str:
        steps = ", ".join(map(str, self.steps[:10])) + (" ..." if len(self.steps) > 10 else "")
        lines = [f"lowprec run report (hooked steps: {steps or 'none'})"]
        lines.append(f"ran quantized ({len(self.quantized)}):")
        for run in self.quantized.values():
            lines += _module_lines(run)
        lines.append(f"ran in high precision ({len(self.high_precision)}):")
        lines += [f"  {p or '<model>'}: {why}" for p, why in self.high_precision.items()]
        lines.append(f"not run on a hooked step ({len(self.not_run)}):")
        lines += [f"  {p or '<model>'}" for p in self.not_run]
        lines.append(f"nn.Linear not converted ({len(self.unconverted)}):")
        lines += [f"  {p or '<model>'}: {why}" for p, why in self.unconverted.items()]
        return "\n".join(lines)


def _module_lines(run: ModuleRun) -> list[str]:
    recipes = ", ".join(run.recipes) or "replayed recipe"
    head = (f"  {run.path or '<model>'} ({run.kind}): {run.quantized_calls} quantized call(s) "
            f"under {recipes}, backward_mode {', '.join(run.backward_modes)}")
    if run.high_precision_calls:
        head += f"; {run.high_precision_calls} call(s) outside lowprec.autocast"
    lines = [head]
    if "high_precision" in run.backward_modes:
        lines.append("    dgrad and wgrad in high precision (backward_mode='high_precision')")
    by_role: dict[tuple[str, str], list[str]] = {}
    for (layer, role, usage), fmt in run.formats.items():
        shown = "high precision (identity)" if fmt.startswith("identity") else fmt
        by_role.setdefault((layer, role), []).append(f"{usage} {shown}")
    for (layer, role), parts in by_role.items():
        lines.append(f"    {layer} {role}: {', '.join(parts)}")
    return lines


def build_report(model: nn.Module, log: RunLog, steps: list[int]) -> RunReport:
    """The :class:`RunReport` of ``model`` from what ``log`` saw on ``steps``."""
    quantized, high, not_run = {}, {}, []
    for path, module in model.named_modules():
        if not isinstance(module, LowprecModule):
            continue
        run = log.modules.get(path)
        if run is None:
            not_run.append(path)
        elif run.quantized_calls:
            quantized[path] = run
        else:
            high[path] = OUTSIDE_AUTOCAST
    conversion = getattr(model, "lowprec_conversion", None)
    conversion = conversion if isinstance(conversion, dict) else {}
    return RunReport(quantized, high, not_run, _unconverted(model, conversion),
                     list(conversion.get("converted", [])), list(conversion.get("fused", [])),
                     list(steps))


def _unconverted(model: nn.Module, conversion: dict) -> dict[str, str]:
    """Every ``nn.Linear`` still in ``model``, with ``convert_model``'s reason."""
    skipped = dict(conversion.get("skipped", {}))
    out = {}
    for path, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        if path in skipped:
            out[path] = skipped[path]
        elif conversion:
            out[path] = "not in convert_model's report (added to the model after conversion?)"
        else:
            out[path] = "convert_model was not run on this model"
    return out
