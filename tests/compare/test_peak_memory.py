"""``lowprec compare``'s peak memory: the training steps' peak, with the last step (eager,
SQNR probe) measured apart. The CUDA peak reading is replaced by one that reports which
phase of the run it saw, so the bookkeeping runs on the CPU."""

from __future__ import annotations

import pytest
import torch

from lowprec.compare import train
from lowprec.compare.data import Batches, load_corpus
from lowprec.compare.model import PRESETS
from lowprec.compare.probe import SQNRProbe
from lowprec.compare.recipes import NAMED_RECIPES, RecipeSpec

#: what the fake reads after training steps alone, the probe step alone, or both
TRAINING, PROBE, BOTH = 100, 700, 800


@pytest.fixture
def phases(monkeypatch):
    """Each peak reading says what ran since the one before: training steps (a batch drawn
    with the probe off), the probe step, or both; the readings are listed."""
    state = {"armed": False, "batches": 0, "reads": []}
    arm, draw = SQNRProbe.arm, Batches.train_batch

    def armed(self, *a, **kw):
        state["armed"] = True
        return arm(self, *a, **kw)

    def batch(self):
        state["batches"] += not state["armed"]
        return draw(self)

    def peak(device):
        got = (BOTH if state["batches"] else PROBE) if state["armed"] else TRAINING
        state["armed"], state["batches"] = False, 0
        state["reads"].append(got)
        return got

    monkeypatch.setattr(SQNRProbe, "arm", armed)
    monkeypatch.setattr(Batches, "train_batch", batch)
    monkeypatch.setattr(train, "_peak_bytes", peak)
    return state


def _run(steps: int):
    cfg = PRESETS["tiny"]
    spec = RecipeSpec("fp8_current", NAMED_RECIPES["fp8_current"].build(), "")
    settings = train.TrainSettings(steps=steps, seed=0, device=torch.device("cpu"), lr=1e-3,
                                   eval_batches=2)
    return train.train_one(spec, cfg, load_corpus(max_bytes=1 << 18), settings)


def test_probe_step_peak_is_kept_apart(phases):
    r = _run(3)
    assert r.ok, r.status_detail
    assert r.peak_mem_bytes == TRAINING
    assert r.probe_peak_bytes == PROBE
    assert PROBE in phases["reads"]  # the fake saw the probe step: the test can fail


def test_one_step_run_reports_its_step_as_both(phases):
    r = _run(1)
    assert r.ok, r.status_detail
    assert r.peak_mem_bytes == r.probe_peak_bytes == PROBE
