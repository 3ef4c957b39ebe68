"""Training stability of one ``lowprec compare`` run: loss spikes, NaN/Inf, divergence.

A comparison of held-out losses means something only when both runs trained smoothly: a
run knocked off course by a loss spike ends wherever its recovery happened to take it, so
its loss difference to another run measures the spike, not the recipe. :func:`check` reads
a run's per-step training losses and says whether it can be compared; :func:`verdict` turns
two runs (and the reseeded bf16 noise floor) into one line of plain words.

The rules, with the thresholds below:

* **Spike.** Step ``i`` is a spike when its loss exceeds the median ``m`` of the (up to)
  ``SPIKE_WINDOW`` unflagged steps before it by more than ``SPIKE_SIGMAS`` robust standard
  deviations of the step-to-step noise *and* by more than ``SPIKE_REL`` of ``m``. The noise
  is estimated from the first differences of the last ``NOISE_WINDOW`` unflagged steps
  (1.4826 x their median absolute deviation / sqrt 2), not from the losses themselves, so
  the steady fall of early training does not pass for noise. Until ``SPIKE_FULL_HISTORY``
  unflagged steps came before, there is no noise estimate: from step 2, a loss more than
  ``SPIKE_EARLY_REL`` above the lowest loss yet is a spike (a fresh model starts near
  ln(vocab) and only falls from there). Flagged steps stay out of later references, so a
  loss that jumps and stays up is one spike lasting until it comes back down, and
  consecutive flagged steps form one spike, named by its first step.
* **NaN/Inf.** A non-finite loss (status ``nan``) diverged at that step.
* **Divergence.** A run diverged when the median of its last ``SPIKE_WINDOW`` steps (none
  from before the spike) is still more than ``RECOVER_REL`` above the median before a
  spike (not recovered; diverged at that spike), or when it ends above where it started
  (median of the last steps above the median of the first ``START_STEPS``; diverged at the
  first step after its lowest loss whose loss is back above that start).

A run with any spike or a divergence is ``unstable``; the noise of a batch of a few hundred
tokens moves the loss by 40% now and then (the tiny preset), which the noise term absorbs.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field

SPIKE_WINDOW = 10        # recent steps whose median a step is compared with
NOISE_WINDOW = 30        # recent steps whose step-to-step changes give the noise
SPIKE_FULL_HISTORY = 5   # earlier steps from which the noise estimate is trusted
SPIKE_SIGMAS = 8.0       # robust standard deviations of step-to-step noise
SPIKE_REL = 0.15         # and at least this fraction above the recent median
SPIKE_EARLY_REL = 0.3    # before that: this fraction above the lowest loss yet
RECOVER_REL = 0.1        # still this far above the pre-spike median at the end: not recovered
START_STEPS = 3          # steps whose median is "where the run started"

#: 1.4826 x MAD estimates a normal standard deviation; a difference of two steps has sqrt(2)
#: times the noise of one.
_MAD_TO_SIGMA = 1.4826 / math.sqrt(2.0)


@dataclass
class Spike:
    """One loss spike: ``step`` is its first flagged step, ``last_step`` its last
    consecutive one, ``peak`` the highest loss in between, ``before`` the loss it jumped
    from (the median of the recent steps; in the first steps, the lowest loss yet)."""

    step: int
    last_step: int
    peak: float
    before: float


@dataclass
class Stability:
    """What :func:`check` found in one run."""

    name: str
    spike_steps: list[int] = field(default_factory=list)
    diverged_step: int | None = None
    unstable: bool = False
    #: one short line, "" when the run is stable
    reason: str = ""
    spikes: list[Spike] = field(default_factory=list)

    def short(self) -> str:
        """A table cell: "ok", "spike at 27", "spikes at 3, 27", "diverged at 30"."""
        if not self.unstable:
            return "ok"
        parts = []
        if self.spike_steps:
            parts.append(f"spike{'s' if len(self.spike_steps) > 1 else ''} at "
                         f"{_steps_text(self.spike_steps)}")
        if self.diverged_step in self.spike_steps:
            parts.append("not recovered")
        elif self.diverged_step is not None:
            parts.append(f"diverged at {self.diverged_step}")
        return ", ".join(parts) or "unstable"


def _steps_text(steps: list[int], most: int = 5) -> str:
    text = ", ".join(str(s) for s in steps[:most])
    return text + (f" (+{len(steps) - most} more)" if len(steps) > most else "")


def _noise_sigma(window: list[float]) -> float:
    """Robust standard deviation of one step's loss noise, from first differences."""
    diffs = [b - a for a, b in zip(window, window[1:])]
    if len(diffs) < 2:
        return 0.0
    mid = statistics.median(diffs)
    return _MAD_TO_SIGMA * statistics.median(abs(d - mid) for d in diffs)


def find_spikes(losses: list[float], steps: list[int] | None = None) -> list[Spike]:
    """Loss spikes in a sequence of per-step training losses (rule in the module docstring).

    ``steps``: the step number of each loss (default 1, 2, ...). Non-finite losses are
    skipped here; :func:`check` reports them."""
    steps = list(range(1, len(losses) + 1)) if steps is None else list(steps)
    history: list[float] = []   # finite, unflagged losses so far
    spikes: list[Spike] = []
    prev_flagged = False
    for step, loss in zip(steps, losses):
        if not math.isfinite(loss):
            prev_flagged = False
            continue
        flagged = False
        if len(history) >= SPIKE_FULL_HISTORY:
            med = statistics.median(history[-SPIKE_WINDOW:])
            jump = loss - med
            flagged = (jump > SPIKE_SIGMAS * _noise_sigma(history[-NOISE_WINDOW:])
                       and jump > SPIKE_REL * abs(med))
        elif history:
            # Too few steps for a noise estimate. Early training only falls, from about
            # ln(vocab) for a fresh model, so a loss well above the lowest yet is a spike.
            med = min(history)
            flagged = loss - med > SPIKE_EARLY_REL * abs(med)
        if flagged:
            if prev_flagged:
                spikes[-1].last_step = step
                spikes[-1].peak = max(spikes[-1].peak, loss)
            else:
                spikes.append(Spike(step, step, loss, med))
        else:
            history.append(loss)
        prev_flagged = flagged
    return spikes


def check(run) -> Stability:
    """Spikes, NaN/Inf and divergence of one run (a :class:`~.train.RunResult`, or anything
    with ``name``, ``status`` and ``steps`` of objects with ``step`` and ``loss``)."""
    out = Stability(run.name)
    steps = [s.step for s in run.steps]
    losses = [float(s.loss) for s in run.steps]
    out.spikes = find_spikes(losses, steps)
    out.spike_steps = [s.step for s in out.spikes]
    reasons = []
    if out.spikes:
        first = out.spikes[0]
        more = (f" and at step{'s' if len(out.spikes) > 2 else ''} "
                f"{_steps_text(out.spike_steps[1:])}" if len(out.spikes) > 1 else "")
        reasons.append(f"loss spike at step {first.step} ({first.before:.2f} -> "
                       f"{first.peak:.2f}){more}")

    bad = next(((s, l) for s, l in zip(steps, losses) if not math.isfinite(l)), None)
    finite = [(s, l) for s, l in zip(steps, losses) if math.isfinite(l)]
    if bad is not None:
        out.diverged_step = bad[0]
        reasons.append(f"loss became {bad[1]} at step {bad[0]}")
    elif run.status == "nan":
        # Every training loss finite, the held-out loss not: it blew up at the end.
        out.diverged_step = steps[-1] if steps else None
        reasons.append(getattr(run, "status_detail", "") or "loss became NaN")
    else:
        div = _divergence(finite, out.spikes)
        if div is not None:
            out.diverged_step, why = div
            reasons.append(why)
    out.unstable = bool(out.spikes) or out.diverged_step is not None or run.status == "nan"
    out.reason = "; ".join(reasons)
    return out


def _divergence(finite: list[tuple[int, float]], spikes: list[Spike]) -> tuple[int, str] | None:
    """(step, reason) when the run did not recover from a spike or ends above its start."""
    if not finite:
        return None
    steps = [s for s, _ in finite]
    losses = [l for _, l in finite]
    last = steps[-1]
    for sp in spikes:
        # The end of the run, but nothing from before this spike.
        tail = [l for s, l in finite[-SPIKE_WINDOW:] if s >= sp.step]
        end = statistics.median(tail)
        if end > sp.before * (1.0 + RECOVER_REL):
            return sp.step, (f"not recovered from the spike at step {sp.step} by step {last} "
                             f"(loss {end:.2f} at the end, {sp.before:.2f} before it)")
    if len(losses) < 2 * START_STEPS:
        return None
    start = statistics.median(losses[:START_STEPS])
    end = statistics.median(losses[-min(SPIKE_WINDOW, len(losses) // 2):])
    if end > start:
        low = min(range(len(losses)), key=losses.__getitem__)
        turn = next((steps[i] for i in range(low + 1, len(losses)) if losses[i] > start),
                    steps[min(low + 1, len(losses) - 1)])
        return turn, (f"loss ends at {end:.2f}, above its start {start:.2f} "
                      f"(back above it from step {turn})")
    return None


# ---- verdicts ---------------------------------------------------------------------------
#: A difference of at most this many standard errors is not one this run can show.
SIGNIFICANT_SE = 2.0


def problem(stab: Stability) -> str:
    """A short phrase for an unstable run: "diverged at step 30", "unstable (spike at
    step 27)"; "" for a stable one."""
    if not stab.unstable:
        return ""
    if stab.diverged_step is not None:
        return f"diverged at step {stab.diverged_step}"
    steps = stab.spike_steps
    if not steps:
        return "diverged"  # NaN before any step was recorded
    s = "s" if len(steps) > 1 else ""
    return f"unstable (spike{s} at step{s} {_steps_text(steps)})"


def verdict(stab: Stability, delta: tuple[float, float] | None, *,
            baseline: str, base_stab: Stability | None, base_ok: bool = True,
            noise: tuple[float, float] | None = None, noise_name: str = "",
            failed: str = "", no_noise: str = "") -> str:
    """One line of plain words on a recipe against the baseline.

    ``delta``: (held-out loss difference to the baseline, its paired standard error), as
    the report's delta column has it; ``noise``: that pair for the reseeded baseline (the
    seed-to-seed noise floor), or None when there is none or it is unstable; ``failed``:
    why the run failed, if it did. The noise floor's delta is one draw of what a recipe
    that changes nothing shows against the baseline, so it enters the standard error as
    one more independent term: se = sqrt(paired_se^2 + noise_delta^2). No number is given
    when either run is unstable. Without a noise floor the verdict says better or worse
    on nothing: the paired standard error leaves seed-to-seed noise out, so it gives the
    delta and its paired standard error, says the noise was not measured and
    ``no_noise``, what would measure it."""
    own = problem(stab)
    if failed:
        return f"failed ({failed}): no comparison"
    if base_stab is not None and base_stab.unstable:
        base = problem(base_stab)
        if own:
            verb = "" if base.startswith("diverged") else "is "
            return f"{own}; the {baseline} baseline {verb}{base} too: no comparison"
        return f"{baseline} baseline {base}: no comparison"
    if own:
        return own if own.startswith("diverged") else f"{own}: no comparison"
    if base_stab is None or not base_ok or delta is None:
        return f"no finished {baseline} baseline: no comparison"
    d, se = delta
    if noise is None:
        return (f"{d:+.4f} ± {se:.4f} (paired standard error over the held-out batches); "
                f"seed-to-seed noise not measured, so no verdict"
                + (f": {no_noise}" if no_noise else ""))
    total = math.sqrt((se if math.isfinite(se) else 0.0) ** 2 + noise[0] ** 2)
    what = f"standard errors, {noise_name} seed noise included"
    if total <= 0.0:
        n_se = math.inf if d else 0.0
    else:
        n_se = abs(d) / total
    if n_se <= SIGNIFICANT_SE:
        return (f"indistinguishable from {baseline} at this run's noise ({d:+.4f}, "
                f"{n_se:.1f} {what})")
    word = "worse" if d > 0 else "better"
    n_text = "no noise estimate" if math.isinf(n_se) else f"{n_se:.1f} {what}"
    return f"{word} by {abs(d):.4f} ({n_text})"
