"""The per-layer SQNR picture of ``lowprec compare``: the table sorted worst first and the
sqnr.png heatmap (layers x tensor role and direction, per recipe)."""

from __future__ import annotations

import math

import pytest

from lowprec.compare import report
from lowprec.compare.probe import SQNRRecord
from lowprec.compare.train import RunResult


def _run(name: str, values: dict) -> RunResult:
    r = RunResult(name, name)
    for (layer, role), (row, col) in values.items():
        r.sqnr.append(SQNRRecord(layer, role, row, col, "E4M3", "E4M3", (128, 128)))
    return r


RUNS = [
    _run("a", {("l0", "input"): (30.0, 31.0), ("l1", "input"): (29.0, None),
               ("l1", "grad_output"): (12.0, 25.0)}),
    _run("b", {("l0", "input"): (8.0, 20.0), ("l1", "input"): (33.0, 34.0)}),
]


def test_sqnr_rows_worst_first():
    """Rows sort by the lowest SQNR any recipe and direction reached there."""
    header, rows = report.sqnr_rows(RUNS)
    assert header[:2] == ["layer", "role"]
    assert [(r[0], r[1]) for r in rows] == [("l0", "input"), ("l1", "grad_output"),
                                            ("l1", "input")]
    assert rows[1][3] == "not quantized"  # b has no grad_output record there


def test_sqnr_grid_marks_unquantized_directions():
    layers, columns, grid = report.sqnr_grid(RUNS[0])
    assert layers == ["l0", "l1"]
    assert columns == ["input row", "input col", "grad_output row", "grad_output col"]
    assert grid[1][:3] == [29.0, pytest.approx(math.nan, nan_ok=True), 12.0]
    assert math.isnan(grid[0][2])  # l0 has no grad_output record


def test_plot_sqnr_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "sqnr.png"
    assert report.plot_sqnr(str(path), RUNS) is None
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert report.plot_sqnr(str(tmp_path / "none.png"), [RunResult("bf16", "bf16")]) is not None
