"""Outputs of ``lowprec compare``: results.csv, loss.png, report.md and the terminal table."""

from __future__ import annotations

import csv
import math
import os
import statistics
from dataclasses import dataclass

from . import stability
from .probe import SQNRRecord
from .recipes import BASELINE, NOISE_FLOOR
from .stability import Stability
from .train import RunResult, TrainSettings

CSV_COLUMNS = ("recipe", "step", "loss", "tokens_per_s", "step_ms")
MAIN_COLUMNS = ("recipe", "status", "held-out loss", "delta vs bf16", "stability",
                "train loss (last 10%)", "tokens/s", "speedup vs bf16", "step ms (median)",
                "peak mem", "saved for bwd")


@dataclass
class RunInfo:
    """What the report says about the setup."""

    command: str
    device: str
    device_name: str
    torch_version: str
    model: str
    model_desc: str
    corpus: str
    steps: int
    seed: int
    backward_mode: str
    emulated: bool
    backends: list
    compiled: bool = False
    #: CUDA graphs: compiled in mode "reduce-overhead", or eager Linears' own
    cuda_graphs: bool = False
    #: compiled with inductor's C++ wrapper
    cpp_wrapper: bool = False
    #: peak learning rate and warm-up steps the runs used (None: not known), for the
    #: suggested fix when a run is unstable
    lr: float | None = None
    warmup: int | None = None


# ---- numbers ---------------------------------------------------------------------------
def _mib(n: int | None) -> str:
    return "n/a" if n is None else f"{n / 2**20:.1f} MiB"


def reference(results: list[RunResult]) -> RunResult | None:
    """The bf16 run when there is one (and it finished), else None."""
    for r in results:
        if r.name == BASELINE and r.ok:
            return r
    return None


def baseline_run(results: list[RunResult]) -> RunResult | None:
    """The bf16 run whatever its status (its stability decides every comparison)."""
    return next((r for r in results if r.name == BASELINE), None)


def assess(results: list[RunResult]) -> dict[int, Stability]:
    """Stability of every run, keyed by ``id(run)``."""
    return {id(r): stability.check(r) for r in results}


def _base_stab(results: list[RunResult], stabs: dict[int, Stability]) -> Stability | None:
    base = baseline_run(results)
    return None if base is None else stabs[id(base)]


def delta_cell(r: RunResult, ref: RunResult | None, stab: Stability,
               base_stab: Stability | None) -> str:
    """The delta column: a number only when both runs are stable."""
    if r.name == BASELINE and base_stab is not None and base_stab.unstable:
        return "unstable (reference)"
    if r is ref:
        return "0 (reference)"
    if stab.unstable:
        return "diverged" if stab.diverged_step is not None else "unstable"
    if base_stab is not None and base_stab.unstable:
        return "unstable (baseline)"
    d = delta_vs(ref, r)
    return "n/a" if d is None else f"{d[0]:+.4f} ± {d[1]:.4f}"


def noise_delta(results: list[RunResult],
                stabs: dict[int, Stability] | None = None) -> tuple[float, float] | None:
    """The reseeded bf16 run's held-out delta to bf16, only when both trained stably."""
    stabs = assess(results) if stabs is None else stabs
    noise = next((r for r in results if r.name == NOISE_FLOOR and r.ok), None)
    base = baseline_run(results)
    if noise is None or base is None or stabs[id(noise)].unstable or stabs[id(base)].unstable:
        return None
    return delta_vs(reference(results), noise)


def verdicts(results: list[RunResult]) -> list[tuple[str, str]]:
    """(recipe, one line of plain words) for every run but the baseline; empty without a
    bf16 run to compare with."""
    base = baseline_run(results)
    if base is None:
        return []
    stabs = assess(results)
    base_stab = stabs[id(base)]
    ref = reference(results)
    noise = noise_delta(results, stabs)
    no_noise = ("the noise-floor run has no stable result to measure it with"
                if any(r.name == NOISE_FLOOR for r in results)
                else "run the same command without --no-noise-floor to measure it")
    out = []
    for r in results:
        if r is base:
            continue
        st = stabs[id(r)]
        failed = r.status_detail if r.status == "error" else ""
        if r.name == NOISE_FLOOR and not failed and not st.unstable and not base_stab.unstable:
            d = delta_vs(ref, r)
            text = ("noise reference: bf16 from other initial weights differs by "
                    f"{d[0]:+.4f} ± {d[1]:.4f}, what seed-to-seed variation alone does here"
                    if d is not None else "noise reference: no held-out loss")
        else:
            text = stability.verdict(st, delta_vs(ref, r), baseline=BASELINE,
                                     base_stab=base_stab, base_ok=ref is not None,
                                     noise=None if r.name == NOISE_FLOOR else noise,
                                     noise_name=NOISE_FLOOR, failed=failed,
                                     no_noise=no_noise)
        out.append((r.name, text))
    return out


def _default_warmup(steps: int) -> int:
    return TrainSettings(steps=steps, seed=0, device=None, lr=0.0).warmup_steps()


def stability_notes(info: RunInfo, results: list[RunResult]) -> list[str]:
    """The runs' spikes and divergences, the rule behind them and, when a run is unstable,
    the fix to try."""
    stabs = assess(results)
    bad = [(r, stabs[id(r)]) for r in results if stabs[id(r)].unstable]
    out = [f"Stability: a step is a loss spike when its loss is more than "
           f"{stability.SPIKE_SIGMAS:g} robust standard deviations of the step-to-step noise "
           f"and {stability.SPIKE_REL:.0%} above the median of the {stability.SPIKE_WINDOW} "
           f"steps before it (in the first steps, before the noise can be estimated: "
           f"{stability.SPIKE_EARLY_REL:.0%} above the lowest loss yet); a run diverged when "
           f"its loss became NaN/Inf, did not come back within {stability.RECOVER_REL:.0%} of "
           f"its pre-spike level by the end, or ends above where it started. "
           + ("Every run trained stably." if not bad else
              "An unstable run's held-out loss says where a spike left it, not what its "
              "recipe does, so no delta involving one is given.")]
    for r, st in bad:
        out.append(f"{r.name}: {st.reason}.")
    if bad:
        known = info.warmup is not None
        warm = info.warmup if known else _default_warmup(info.steps)
        lr = (f"--lr {info.lr / 2:.3g} (half of {info.lr:.3g})" if info.lr
              else "a lower --lr (half the current one, say)")
        early = any(st.spike_steps and st.spike_steps[0] <= max(warm, 1) for _, st in bad)
        where = (f"this run warmed up over {warm} step{'s' if warm != 1 else ''}" if known else
                 f"without --warmup, {info.steps} steps warm up over {warm}")
        out.append(f"To fix: rerun with {lr} or a longer warm-up, --warmup "
                   f"{max(2 * warm, 20)} ({where}" +
                   ("; a spike came in the first steps, where the warm-up is" if early else "")
                   + ").")
    return out


def train_tail_loss(r: RunResult) -> float | None:
    vals = [s.loss for s in r.steps]
    if not vals or not r.ok:
        return None
    n = max(1, len(vals) // 10)
    return sum(vals[-n:]) / n


def delta_vs(ref: RunResult | None, r: RunResult) -> tuple[float, float] | None:
    """Held-out loss difference to the reference and its paired standard error over the
    held-out batches (both runs see the same batches)."""
    if ref is None or not r.ok or r.val_loss is None or ref.val_loss is None:
        return None
    diffs = [a - b for a, b in zip(r.val_losses, ref.val_losses)]
    se = statistics.stdev(diffs) / math.sqrt(len(diffs)) if len(diffs) > 1 else float("nan")
    return r.val_loss - ref.val_loss, se


def main_rows(results: list[RunResult]) -> list[list[str]]:
    ref = reference(results)
    ref_ms = ref.median_step_ms() if ref is not None else None
    stabs = assess(results)
    base_stab = _base_stab(results, stabs)
    rows = []
    for r in results:
        ms = r.median_step_ms() if r.ok else None
        status = {"ok": "ok", "nan": f"NaN (step {len(r.steps)})" if r.steps else "NaN",
                  "error": "FAILED"}.get(r.status, r.status)
        st = stabs[id(r)]
        delta = delta_cell(r, ref, st, base_stab)
        tail = train_tail_loss(r)
        tok_s = f"{r.tokens_per_step / (ms / 1e3):,.0f}" if ms else "n/a"
        speed = f"{ref_ms / ms:.2f}x" if (ms and ref_ms) else "n/a"
        rows.append([r.name, status,
                     f"{r.val_loss:.4f}" if r.ok and r.val_loss is not None else "n/a",
                     delta, st.short(), f"{tail:.4f}" if tail is not None else "n/a", tok_s,
                     speed,
                     f"{ms:.1f}" if ms else "n/a", _mib(r.peak_mem_bytes), _mib(r.saved_bytes)])
    return rows


# ---- tables ----------------------------------------------------------------------------
def markdown_table(header, rows) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def text_table(header, rows) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    fmt = "  ".join("{:<%d}" % w for w in widths)
    out = [fmt.format(*header), fmt.format(*("-" * w for w in widths))]
    out += [fmt.format(*row) for row in rows]
    return "\n".join(out)


def _db(v: float | None) -> str:
    if v is None:
        return "-"
    if math.isinf(v):
        return "exact" if v > 0 else "-inf"
    if math.isnan(v):
        return "nan"
    return f"{v:.1f}"


ROLE_ORDER = {"input": 0, "weight": 1, "output": 2, "grad_output": 3, "grad_input": 4}


def _worst_db(rec: SQNRRecord | None) -> float:
    vals = [] if rec is None else [v for v in (rec.rowwise_db, rec.columnwise_db)
                                   if v is not None and not math.isnan(v)]
    return min(vals) if vals else math.inf


def sqnr_rows(results: list[RunResult]) -> tuple[list[str], list[list[str]]]:
    """Per (layer, role) rows of every quantized recipe's last-step SQNR, the worst first
    (the lowest SQNR any recipe and direction reached), so the layer that hurts leads."""
    quantized = [r for r in results if r.sqnr]
    keys: list[tuple[str, str]] = []
    for r in quantized:
        for rec in r.sqnr:
            if (rec.layer, rec.role) not in keys:
                keys.append((rec.layer, rec.role))
    layer_order = {}
    for layer, _ in keys:
        layer_order.setdefault(layer, len(layer_order))

    def record(r, layer, role):
        return next((x for x in r.sqnr if (x.layer, x.role) == (layer, role)), None)

    keys.sort(key=lambda k: (min((_worst_db(record(r, *k)) for r in quantized), default=math.inf),
                             layer_order[k[0]], ROLE_ORDER.get(k[1], 9)))
    header = ["layer", "role"] + [f"{r.name} (row / col dB)" for r in quantized]
    rows = []
    for layer, role in keys:
        row = [layer, role]
        for r in quantized:
            rec = record(r, layer, role)
            row.append("not quantized" if rec is None else
                       f"{_db(rec.rowwise_db)} / {_db(rec.columnwise_db)}")
        rows.append(row)
    return header, rows


def sqnr_grid(r: RunResult) -> tuple[list[str], list[str], list[list[float]]]:
    """(layers in model order, columns "role row|col", SQNR dB values with NaN where a
    direction was not quantized) of one recipe's last step: what sqnr.png draws."""
    layers: list[str] = []
    for rec in r.sqnr:
        if rec.layer not in layers:
            layers.append(rec.layer)
    roles = sorted({rec.role for rec in r.sqnr}, key=lambda x: ROLE_ORDER.get(x, 9))
    columns = [f"{role} {d}" for role in roles for d in ("row", "col")]
    grid = []
    for layer in layers:
        row = []
        for role in roles:
            rec = next((x for x in r.sqnr if (x.layer, x.role) == (layer, role)), None)
            for attr in ("rowwise_db", "columnwise_db"):
                v = None if rec is None else getattr(rec, attr)
                row.append(math.nan if v is None else v)
        grid.append(row)
    return layers, columns, grid


def plot_sqnr(path: str, results: list[RunResult]) -> str | None:
    """Write sqnr.png: per quantized recipe, a heatmap of the last step's SQNR per layer
    (rows) and tensor role and direction (columns), on one colour scale, the worst cell of
    each recipe outlined; returns None on success or the reason it was skipped."""
    quantized = [r for r in results if r.sqnr]
    if not quantized:
        return "no quantized recipe finished"
    try:
        from matplotlib.figure import Figure
        from matplotlib.patches import Rectangle
    except Exception as err:  # noqa: BLE001 - the plot is optional
        return (f"matplotlib is not importable ({type(err).__name__}: {err}); install it with "
                f"pip install 'lowprec[compare]'")
    grids = [(r, *sqnr_grid(r)) for r in quantized]
    finite = [v for *_, g in grids for row in g for v in row if math.isfinite(v)]
    lo, hi = (min(finite), max(finite)) if finite else (0.0, 1.0)
    n_layers = max(len(layers) for _, layers, _, _ in grids)
    fig = Figure(figsize=(3.2 + 2.6 * len(grids), 1.6 + 0.28 * n_layers))
    axes = fig.subplots(1, len(grids), squeeze=False)[0]
    image = None
    for ax, (r, layers, columns, grid) in zip(axes, grids):
        image = ax.imshow(grid, aspect="auto", cmap="viridis", vmin=lo, vmax=hi,
                          interpolation="nearest")
        ax.set_title(r.name, fontsize=9)
        ax.set_xticks(range(len(columns)), columns, rotation=60, ha="right", fontsize=7)
        ax.set_yticks(range(len(layers)), layers if ax is axes[0] else [""] * len(layers),
                      fontsize=7)
        cells = [(v, i, j) for i, row in enumerate(grid) for j, v in enumerate(row)
                 if math.isfinite(v)]
        if cells:
            _, i, j = min(cells)
            ax.add_patch(Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, edgecolor="red",
                                   linewidth=1.5))
    if image is not None:
        fig.colorbar(image, ax=list(axes), label="SQNR (dB), higher is better", shrink=0.8)
    fig.suptitle("Quantization SQNR per layer at the last step (worst cell outlined; blank: "
                 "not quantized)", fontsize=9)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    return None


def sqnr_summary_rows(results: list[RunResult]) -> tuple[list[str], list[list[str]]]:
    """Mean SQNR over layers, per role and direction (the terminal's short version)."""
    quantized = [r for r in results if r.sqnr]
    roles = sorted({rec.role for r in quantized for rec in r.sqnr},
                   key=lambda x: ROLE_ORDER.get(x, 9))
    header = ["recipe"] + [f"{role} (row / col dB)" for role in roles]
    rows = []
    for r in quantized:
        row = [r.name]
        for role in roles:
            cells = []
            for attr in ("rowwise_db", "columnwise_db"):
                vals = [getattr(x, attr) for x in r.sqnr if x.role == role
                        and getattr(x, attr) is not None and math.isfinite(getattr(x, attr))]
                cells.append(_db(sum(vals) / len(vals)) if vals else "-")
            row.append(" / ".join(cells))
        rows.append(row)
    return header, rows


def format_legend(r: RunResult) -> str:
    parts = []
    for role in sorted({x.role for x in r.sqnr}, key=lambda x: ROLE_ORDER.get(x, 9)):
        fmts = set()
        for x in r.sqnr:
            if x.role == role:
                fmts.add(f"{x.rowwise_format or '-'} / {x.columnwise_format or '-'}")
        parts.append(f"{role}: {' | '.join(sorted(fmts))}")
    return "; ".join(parts)


# ---- files -----------------------------------------------------------------------------
def write_csv(path: str, results: list[RunResult]) -> None:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(CSV_COLUMNS)
        for r in results:
            for s in r.steps:
                w.writerow([r.name, s.step, repr(float(s.loss)), f"{s.tokens_per_s:.1f}",
                            f"{s.step_ms:.3f}"])


def _smooth(vals: list[float], window: int) -> list[float]:
    out, acc, q = [], 0.0, []
    for v in vals:
        q.append(v)
        acc += v
        if len(q) > window:
            acc -= q.pop(0)
        out.append(acc / len(q))
    return out


def plot(path: str, results: list[RunResult]) -> str | None:
    """Write loss.png; returns None on success or the reason it was skipped."""
    try:
        import matplotlib
        import matplotlib.ticker
        from matplotlib.figure import Figure  # no pyplot: leaves the caller's backend alone
    except Exception as err:  # noqa: BLE001 - the plot is optional
        return (f"matplotlib is not importable ({type(err).__name__}: {err}); install it with "
                f"pip install 'lowprec[compare]'")
    fig = Figure(figsize=(9, 8))
    ax1, ax2 = fig.subplots(2, 1, sharex=True, gridspec_kw={"height_ratios": [3, 2]})
    ref = reference(results) or next((r for r in results if r.ok and r.steps), None)
    n_steps = max((len(r.steps) for r in results), default=1)
    window = max(1, n_steps // 20)
    # Black is the reference and gray the noise run: the recipes take the other colors.
    import matplotlib.colors
    colors = [c for c in matplotlib.rcParams["axes.prop_cycle"].by_key()["color"]
              if matplotlib.colors.to_hex(c) not in ("#7f7f7f", "#808080", "#000000")]
    colors += ["#393b79", "#8c6d31", "#843c39", "#7b4173", "#3182bd"]
    ref_loss = {s.step: s.loss for s in ref.steps} if ref is not None else {}
    stabs = assess(results)
    marked = set()

    def mark(r: RunResult, color: str) -> None:
        # Spikes as open triangles on the per-step curve; a divergence as a dotted line.
        st = stabs[id(r)]
        loss_at = {s.step: s.loss for s in r.steps}
        if st.spike_steps:
            ax1.plot(st.spike_steps, [loss_at[k] for k in st.spike_steps], "^",
                     markersize=9, markerfacecolor="none", markeredgecolor=color,
                     markeredgewidth=1.5, label=None if "spike" in marked else "loss spike")
            marked.add("spike")
        if st.diverged_step is not None and r.status != "nan":
            ax1.axvline(st.diverged_step, color=color, linestyle=":", linewidth=1.2,
                        label=None if "div" in marked else "diverged")
            marked.add("div")

    recipe_index = 0
    for r in results:
        if not r.steps:
            continue
        c = "black" if r is ref else colors[recipe_index % len(colors)]
        if r is not ref and r.name != NOISE_FLOOR:
            recipe_index += 1
        if r.name == NOISE_FLOOR:
            # Shown dashed above and as its held-out delta (dotted band) below.
            vals = [(s.step, s.loss) for s in r.steps if math.isfinite(s.loss)]
            ax1.plot([v[0] for v in vals], _smooth([v[1] for v in vals], window), color="gray",
                     linestyle="--", linewidth=1.0, label=f"{r.name} (noise reference)")
            mark(r, "gray")
            d = noise_delta(results, stabs)
            if d is not None:
                for sign in (1, -1):
                    ax2.axhline(sign * abs(d[0]), color="gray", linestyle=":", linewidth=1.0,
                                label="noise floor (held-out delta of "
                                      f"{NOISE_FLOOR})" if sign > 0 else None)
            continue
        steps = [s.step for s in r.steps if math.isfinite(s.loss)]
        losses = [s.loss for s in r.steps if math.isfinite(s.loss)]
        label = r.name if r.ok else f"{r.name} ({r.status}: stopped at step {len(r.steps)})"
        ax1.plot(steps, losses, color=c, alpha=0.25, linewidth=0.8)
        ax1.plot(steps, _smooth(losses, window), color=c, linewidth=1.6, label=label)
        if not r.ok and steps:
            ax1.plot(steps[-1], losses[-1], "x", color=c, markersize=10)
        mark(r, c)
        if ref is not None and r is not ref:
            pairs = [(s, l - ref_loss[s]) for s, l in zip(steps, losses) if s in ref_loss]
            if pairs:
                ds = [p[1] for p in pairs]
                ax2.plot([p[0] for p in pairs], _smooth(ds, window), color=c, linewidth=1.6,
                         label=r.name)
    ax1.set_ylabel("training loss (nats/token)")
    ax1.set_title("training loss" if window == 1 else
                  f"training loss (faint: per step; solid: mean of {window} steps)")
    ax1.legend(fontsize=8)
    ax1.grid(alpha=0.3)
    ax2.axhline(0.0, color="black", linewidth=0.8)
    ref_name = ref.name if ref is not None else "reference"
    ax2.set_ylabel(f"loss - {ref_name} loss")
    ax2.set_xlabel("step")
    ax2.set_title(f"difference to {ref_name} (same batches" +
                  (")" if window == 1 else f"; mean of {window} steps)") +
                  (f"; {ref_name} unstable: not a recipe effect"
                   if ref is not None and stabs[id(ref)].unstable else ""))
    ax2.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    if any(line.get_label() and not line.get_label().startswith("_") for line in ax2.lines):
        ax2.legend(fontsize=8)
    ax2.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return None


def notes(info: RunInfo, results: list[RunResult]) -> list[str]:
    out = []
    if info.emulated:
        out.append("The quantized recipes' GEMMs ran through lowprec's exact emulation (operands "
                   "quantized, dequantized, multiplied in fp32) on this device, so tokens/s and "
                   "speedup measure the cost of emulation, not FP8/FP4 hardware; the losses and "
                   "SQNRs are those the real formats give.")
    else:
        out.append(f"Native GEMM backends available: {', '.join(info.backends)}; formats without "
                   f"one run through the exact emulation.")
    options = " and ".join(name for name, on in (
        ("CUDA graphs (mode 'reduce-overhead')", info.cuda_graphs),
        ("inductor's C++ wrapper", info.cpp_wrapper)) if on)
    options = f" with {options}" if options else ""
    eager_graphs = (", the quantized recipes' Linears replaying CUDA graphs (bf16's and "
                    "every last step, which measures SQNR, without them: speedups over bf16 "
                    "include the host time the graphs save)" if info.cuda_graphs else "")
    out.append(f"Every recipe's model, bf16 included, ran under torch.compile{options} (the "
               "first step, which compiles, and the last, which measures SQNR eagerly, are "
               "left out of the step time)." if info.compiled else
               f"Every recipe's model, bf16 included, ran eagerly (--no-compile){eager_graphs}.")
    out.append("Held-out loss: mean over fixed held-out batches, evaluated with each recipe's own "
               "quantized forward. The delta's ± is the paired standard error over those "
               "batches; a delta within about two of it is not a measurable difference, and a "
               "different --seed moves every run.")
    d = noise_delta(results)
    if d is not None:
        out.append(f"{NOISE_FLOOR} is bf16 again on the same batches from other initial "
                   f"weights (seed + 1): its delta ({d[0]:+.4f}) is what seed-to-seed variation "
                   f"alone does here. A recipe's delta of about that size or less is not a "
                   f"difference this run can show; one well beyond it is. The verdicts add it "
                   f"to the ± as an independent error, sqrt(±² + {NOISE_FLOOR} delta²), and "
                   f"call a difference only beyond {stability.SIGNIFICANT_SE:g} of those.")
    elif any(r.name == NOISE_FLOOR for r in results):
        stabs = assess(results)
        shaky = [r.name for r in results if r.name in (BASELINE, NOISE_FLOOR)
                 and (stabs[id(r)].unstable or not r.ok)]
        out.append(f"{' and '.join(shaky) or NOISE_FLOOR} did not train stably, so this run "
                   f"has no noise floor.")
    out += stability_notes(info, results)
    out.append("Step time: median over steps, the first left out; tokens/s = tokens per step / "
               "that median.")
    out.append("Saved for bwd: bytes autograd kept from the forward for the backward "
               "(activations and quantized operands, parameters excluded), measured at the last "
               "step; peak mem is torch.cuda.max_memory_allocated over the training steps and "
               "the held-out evaluation (n/a on CPU), the last step left out when there are "
               "several: it runs eagerly with the SQNR probe, which dequantizes each operand.")
    probe = [f"{r.name} {_mib(r.probe_peak_bytes)}" for r in results
             if r.probe_peak_bytes is not None and r.probe_peak_bytes != r.peak_mem_bytes]
    if probe:
        out.append("Peak of that measurement step: " + ", ".join(probe) + ".")
    for r in results:
        if r.status == "nan":
            out.append(f"{r.name}: {r.status_detail}; its rows in results.csv stop there and it "
                       f"has no held-out loss or SQNR.")
        elif r.status == "error":
            out.append(f"{r.name} failed: {r.status_detail}")
    return out


def write_markdown(path: str, info: RunInfo, results: list[RunResult],
                   plot_note: str | None, sqnr_note: str | None = "not drawn") -> None:
    lines = ["# lowprec compare", "",
             f"`{info.command}`", "",
             f"- device: {info.device} ({info.device_name}), torch {info.torch_version}",
             f"- model: `{info.model}`: {info.model_desc}",
             f"- data: {info.corpus}",
             f"- steps: {info.steps}, seed: {info.seed}, backward mode: {info.backward_mode}",
             "", "## Results", "", markdown_table(MAIN_COLUMNS, main_rows(results)), ""]
    judged = verdicts(results)
    if judged:
        lines += [f"Verdicts (held-out loss against {BASELINE}):", ""]
        lines += [f"- `{name}`: {text}" for name, text in judged]
        lines.append("")
    lines += ["Notes:", ""] + [f"- {n}" for n in notes(info, results)]
    lines += ["", "Recipes:", ""]
    for r in results:
        lines.append(f"- `{r.name}`: {r.description} (wall {r.wall_s:.1f} s, CPU {r.cpu_s:.1f} s)")
    lines += ["", "## Loss curves", ""]
    lines.append("![loss curves](loss.png)" if plot_note is None
                 else f"loss.png skipped: {plot_note}")
    header, rows = sqnr_rows(results)
    lines += ["", "## Quantization SQNR at the last step", "",
              "Per layer (GEMM) and tensor role: 10·log10(‖x‖² / ‖x − dequant(q(x))‖²) in dB of "
              "the tensor each quantizer quantized in the last training step, for the rowwise "
              "direction (fprop; dgrad's gradient) and the columnwise one (wgrad; dgrad's weight). "
              "Higher is more accurate; each bit of mantissa is about 6 dB. '-' means that "
              "direction was not quantized; 'exact' means no error. Rows are sorted worst "
              "first: by the lowest SQNR any recipe and direction reached.", ""]
    if sqnr_note is None and rows:
        lines += ["![SQNR per layer](sqnr.png)", ""]
    elif rows:
        lines += [f"sqnr.png skipped: {sqnr_note}", ""]
    if rows:
        lines += [markdown_table(header, rows), "", "Formats (rowwise / columnwise):", ""]
        lines += [f"- `{r.name}`: {format_legend(r)}" for r in results if r.sqnr]
    else:
        lines.append("No quantized recipe finished, so there is nothing to show.")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def terminal_summary(info: RunInfo, results: list[RunResult], out_dir: str,
                     plot_note: str | None) -> str:
    parts = ["", f"lowprec compare: {info.model} ({info.model_desc}), {info.steps} steps on "
             f"{info.device}", "", text_table(MAIN_COLUMNS, main_rows(results)), ""]
    judged = verdicts(results)
    if judged:
        width = max(len(name) for name, _ in judged)
        parts += [f"Verdicts (held-out loss against {BASELINE}):"]
        parts += [f"  {name:<{width}}  {text}" for name, text in judged]
        parts.append("")
    header, rows = sqnr_summary_rows(results)
    if rows:
        parts += ["Mean quantization SQNR over layers at the last step (per-layer detail in "
                  "report.md and sqnr.png):", text_table(header, rows), ""]
    parts += [f"* {n}" for n in notes(info, results)]
    files = ["results.csv", "report.md"] + (["loss.png"] if plot_note is None else [])
    if plot_note is None and any(r.sqnr for r in results):
        files.append("sqnr.png")  # drawn with matplotlib too, when a quantized run finished
    parts += ["", f"wrote {', '.join(os.path.join(out_dir, f) for f in files)}"]
    if plot_note is not None:
        parts.append(f"loss.png skipped: {plot_note}")
    return "\n".join(parts)
