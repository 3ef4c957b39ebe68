"""Loss-spike and divergence detection, verdicts and how the report shows them.

Synthetic runs stand in for training: a smooth decaying curve with seeded noise, into which
a spike or a divergence is planted at a known step, so every expectation comes from how the
curve was built, not from the detector.
"""

from __future__ import annotations

import math
import random
import re

import pytest

from lowprec.compare import report, stability
from lowprec.compare.recipes import BASELINE, NOISE_FLOOR
from lowprec.compare.train import RunResult, StepRecord, TrainSettings, lr_at

NUMBER = re.compile(r"[+-]?\d+\.\d+")


def curve(n: int, seed: int = 0, noise: float = 0.03, start: float = 5.5, end: float = 2.5):
    """A training-loss curve: exponential decay from ``start`` towards ``end`` with
    multiplicative Gaussian noise of relative size ``noise``."""
    rng = random.Random(seed)
    return [(end + (start - end) * math.exp(-i / (n / 5))) * (1 + noise * rng.gauss(0, 1))
            for i in range(n)]


def run(name: str, losses, val: float = 2.5, status: str = "ok", detail: str = "",
        val_spread: float = 0.01, seed: int = 0) -> RunResult:
    """A RunResult with per-step ``losses`` and 16 held-out batch losses around ``val``."""
    rng = random.Random(seed)
    r = RunResult(name, f"{name} (synthetic)", status=status, status_detail=detail,
                  tokens_per_step=512)
    r.steps = [StepRecord(i + 1, float(l), 1000.0, 10.0) for i, l in enumerate(losses)]
    if status == "ok":
        # Each batch's loss: a per-batch difficulty shared by all runs (same seed 99) plus
        # a small per-run wobble, so paired differences have a small standard error.
        shared = random.Random(99)
        r.val_losses = [val + 0.3 * shared.gauss(0, 1) + val_spread * rng.gauss(0, 1)
                        for _ in range(16)]
        r.val_loss = sum(r.val_losses) / len(r.val_losses)
    return r


def info(steps: int = 40, lr: float | None = 6e-4, warmup: int | None = 4) -> report.RunInfo:
    return report.RunInfo(command="lowprec compare (synthetic)", device="cpu", device_name="CPU",
                          torch_version="x", model="large", model_desc="synthetic",
                          corpus="synthetic", steps=steps, seed=0, backward_mode="default",
                          emulated=True, backends=[], lr=lr, warmup=warmup)


# ---- detection ------------------------------------------------------------------------------
@pytest.mark.parametrize("n,seed", [(20, 0), (40, 1), (120, 2), (300, 3)])
def test_smooth_curve_has_no_spike(n, seed):
    st = stability.check(run("bf16", curve(n, seed)))
    assert st.spike_steps == [] and st.diverged_step is None
    assert not st.unstable and st.reason == "" and st.short() == "ok"


def test_noisy_small_batch_curve_has_no_spike():
    # Heavy-tailed batch noise as a 128-token batch gives (tiny preset): 15% Gaussian noise
    # plus a +45% outlier batch every 30 steps; none of it is an instability.
    losses = curve(120, seed=4, noise=0.15)
    for i in (33, 63, 93):
        losses[i] = sorted(losses[i - 10:i])[5] * 1.45
    assert stability.check(run("bf16", losses)).spike_steps == []


@pytest.mark.parametrize("at", [3, 27, 90])
def test_planted_spike_is_found_at_its_step(at):
    losses = curve(120, seed=5)
    before = losses[at - 2]
    losses[at - 1] = 2.0 * before           # one step at twice the loss...
    for k in range(at, min(at + 3, 120)):   # ...then a recovery over three steps
        losses[k] = before * (1.6 - 0.2 * (k - at))
    st = stability.check(run("bf16", losses))
    assert st.spike_steps == [at]
    assert st.spikes[0].last_step >= at and st.spikes[0].peak == pytest.approx(2 * before)
    assert st.unstable and st.diverged_step is None  # it came back down
    assert f"loss spike at step {at}" in st.reason


def test_unrecovered_spike_is_a_divergence():
    # The bf16 run: 3.2 -> 6.6 at step 27, still far above 3.2 at step 40.
    losses = curve(40, seed=6, end=3.1)
    losses[26:] = [6.6, 6.2, 5.9, 5.5, 5.3, 5.0, 4.8, 4.7, 4.6, 4.5, 4.4, 4.4, 4.3, 4.3]
    st = stability.check(run("bf16", losses))
    assert st.spike_steps == [27] and st.diverged_step == 27 and st.unstable
    assert "not recovered from the spike at step 27 by step 40" in st.reason
    assert st.short() == "spike at 27, not recovered"


def test_run_ending_above_its_start_diverged():
    down = curve(30, seed=7, start=4.0, end=3.0)
    # Then a slow noisy climb back past the start, no single step of it a spike.
    rng = random.Random(7)
    up = [(down[-1] + 0.04 * k) * (1 + 0.02 * rng.gauss(0, 1)) for k in range(1, 41)]
    st = stability.check(run("mxfp8", down + up))
    assert st.spike_steps == [] and st.unstable
    assert st.diverged_step is not None and 30 < st.diverged_step < 70
    assert "above its start" in st.reason


def test_nan_loss_diverged_at_that_step():
    losses = curve(12, seed=8) + [float("nan")]
    st = stability.check(run("nvfp4", losses, status="nan"))
    assert st.diverged_step == 13 and st.unstable and "nan at step 13" in st.reason
    assert stability.problem(st) == "diverged at step 13"


def test_nan_before_any_step_is_unstable_without_a_step():
    st = stability.check(run("nvfp4", [], status="nan", detail="loss became nan"))
    assert st.unstable and st.diverged_step is None and stability.problem(st) == "diverged"


# ---- schedule -------------------------------------------------------------------------------
@pytest.mark.parametrize("steps,warm", [(1, 1), (3, 1), (20, 10), (40, 10), (120, 12),
                                        (300, 30)])
def test_default_warmup_rule(steps, warm):
    # max(10 steps, 10% of the run), at most half of it.
    s = TrainSettings(steps=steps, seed=0, device=None, lr=1e-3)
    assert s.warmup_steps() == warm
    assert lr_at(warm, s) == pytest.approx(1e-3)          # the peak ends the warm-up
    assert lr_at(1, s) == pytest.approx(1e-3 / warm**2)   # quadratic: far below it at first
    lrs = [lr_at(k, s) for k in range(1, steps + 1)]
    assert lrs[:warm] == sorted(lrs[:warm])               # rises, then
    assert lrs[warm - 1:] == sorted(lrs[warm - 1:], reverse=True)  # decays
    assert steps < 20 or lrs[-1] < 1e-3 * 0.05            # nearly to zero


def test_explicit_warmup():
    s = TrainSettings(steps=40, seed=0, device=None, lr=1e-3, warmup=25)
    assert s.warmup_steps() == 25 and lr_at(5, s) == pytest.approx(1e-3 / 25)
    s = TrainSettings(steps=40, seed=0, device=None, lr=1e-3, warmup=0)
    assert s.warmup_steps() == 0
    assert lr_at(1, s) == pytest.approx(1e-3 * 0.5 * (1 + math.cos(math.pi / 41)))


# ---- verdicts and the report ----------------------------------------------------------------
def spiking_baseline_results():
    base = curve(40, seed=6, end=3.1)
    base[26:] = [6.6, 6.2, 5.9, 5.5, 5.3, 5.0, 4.8, 4.7, 4.6, 4.5, 4.4, 4.4, 4.3, 4.3]
    return [run(BASELINE, base, val=3.3, seed=1),
            run(NOISE_FLOOR, curve(40, seed=9, end=3.1), val=2.87, seed=2),
            run("fp8_current", curve(40, seed=10, end=3.1), val=2.87, seed=3),
            run("mxfp8", curve(40, seed=11, end=3.1), val=2.86, seed=4)]


def test_unstable_baseline_makes_every_delta_unstable():
    results = spiking_baseline_results()
    rows = {row[0]: dict(zip(report.MAIN_COLUMNS, row)) for row in report.main_rows(results)}
    assert rows[BASELINE]["delta vs bf16"] == "unstable (reference)"
    assert rows[BASELINE]["stability"] == "spike at 27, not recovered"
    for name in (NOISE_FLOOR, "fp8_current", "mxfp8"):
        assert rows[name]["delta vs bf16"] == "unstable (baseline)"
        assert rows[name]["stability"] == "ok"
    judged = dict(report.verdicts(results))
    assert set(judged) == {NOISE_FLOOR, "fp8_current", "mxfp8"}
    for text in judged.values():
        assert text == "bf16 baseline diverged at step 27: no comparison"


def test_report_text_with_a_spiking_baseline_shows_no_numeric_delta(tmp_path):
    results = spiking_baseline_results()
    path = tmp_path / "report.md"
    report.write_markdown(str(path), info(), results, plot_note="skipped in this test")
    md = path.read_text()
    term = report.terminal_summary(info(), results, str(tmp_path), "skipped in this test")
    for text in (md, term):
        assert "bf16 baseline diverged at step 27: no comparison" in text
        assert "not recovered from the spike at step 27 by step 40" in text
        assert "--lr 0.0003" in text and "--warmup 20" in text
        # The "0.434 ± 0.016 lower" must not come back: no delta with its ± anywhere,
        # and no verdict line with a number in it.
        assert not re.search(r"\d ± \d", text)
        for line in text.splitlines():
            if "no comparison" in line:
                assert not NUMBER.search(line), line
    assert "| fp8_current | ok |" in md and "unstable (baseline)" in md


def by(text: str, word: str) -> float:
    """X of a verdict "<word> by X (N standard errors...)"."""
    m = re.fullmatch(rf"{word} by (\d+\.\d+) \((\d+\.\d) standard errors.*\)", text)
    assert m, text
    assert float(m.group(2)) > stability.SIGNIFICANT_SE
    return float(m.group(1))


def test_stable_pair_verdict_follows_the_noise_floor():
    # Held-out batches nearly identical between runs (paired standard error ~0.0004), so
    # the noise floor decides.
    def r(name, seed, val):
        return run(name, curve(40, seed=seed), val=val, seed=seed, val_spread=0.001)

    base, close, far, better = (r(BASELINE, 20, 2.50), r("mxfp8", 21, 2.51),
                                r("nvfp4", 22, 2.70), r("fp8_block", 23, 2.40))
    # A quiet noise floor (0.002): the 0.01 difference is several standard errors.
    judged = dict(report.verdicts([base, r(NOISE_FLOOR, 24, 2.502), close, far, better]))
    assert by(judged["mxfp8"], "worse") == pytest.approx(0.01, abs=0.001)
    assert by(judged["nvfp4"], "worse") == pytest.approx(0.2, abs=0.001)
    assert by(judged["fp8_block"], "better") == pytest.approx(0.1, abs=0.001)
    assert "standard errors, bf16_reseeded seed noise included)" in judged["mxfp8"]
    assert judged[NOISE_FLOOR].startswith("noise reference")
    # A loud one (0.05): the same 0.01 is noise, the 0.2 still a difference.
    loud = [base, r(NOISE_FLOOR, 24, 2.55), close, far, better]
    judged = dict(report.verdicts(loud))
    assert judged["mxfp8"].startswith("indistinguishable from bf16 at this run's noise")
    assert by(judged["nvfp4"], "worse") == pytest.approx(0.2, abs=0.001)
    rows = {row[0]: row for row in report.main_rows(loud)}
    d, se = report.delta_vs(base, close)
    assert rows["mxfp8"][3] == f"{d:+.4f} ± {se:.4f}"  # stable pair: the number stays


def test_unstable_recipe_against_a_stable_baseline():
    base = run(BASELINE, curve(40, seed=30), seed=1)
    spiky = curve(40, seed=31)
    spiky[14] *= 2.0
    diverging = curve(12, seed=32) + [float("nan")]
    results = [base, run("nvfp4", spiky, seed=2),
               run("poison", diverging, status="nan", detail="loss became nan at step 13")]
    judged = dict(report.verdicts(results))
    assert judged["nvfp4"] == "unstable (spike at step 15): no comparison"
    assert judged["poison"] == "diverged at step 13"
    rows = {row[0]: row for row in report.main_rows(results)}
    assert rows["nvfp4"][3] == "unstable" and rows["poison"][3] == "diverged"
    assert rows[BASELINE][3] == "0 (reference)"


def test_plot_marks_spikes(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "loss.png"
    assert report.plot(str(path), spiking_baseline_results()) is None
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_without_a_noise_floor_no_verdict_says_better_or_worse():
    """--no-noise-floor: the paired standard error leaves seed-to-seed noise out, so even a
    delta of many paired standard errors gets no better/worse; the verdict gives the delta,
    its paired standard error, and what would measure the noise."""
    def r(name, seed, val):
        return run(name, curve(40, seed=seed), val=val, seed=seed, val_spread=0.001)

    base, far, better = r(BASELINE, 20, 2.50), r("nvfp4", 22, 2.70), r("fp8_block", 23, 2.40)
    judged = dict(report.verdicts([base, far, better]))
    for name, other in (("nvfp4", far), ("fp8_block", better)):
        text = judged[name]
        assert "worse" not in text and "better" not in text, text
        d, se = report.delta_vs(base, other)
        assert text.startswith(f"{d:+.4f} ± {se:.4f} (paired standard error"), text
        assert "seed-to-seed noise not measured" in text
        assert "without --no-noise-floor" in text
    # a noise-floor run without a stable result: no verdict either, and it says why
    spiky = curve(40, seed=24)
    spiky[14] *= 2.0
    judged = dict(report.verdicts([base, run(NOISE_FLOOR, spiky, seed=24), far]))
    assert "worse" not in judged["nvfp4"]
    assert "noise-floor run has no stable result" in judged["nvfp4"]
