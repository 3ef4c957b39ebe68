"""Every CSV under ``benchmarks/`` parses with the ``csv`` module: a header, and every row
as many fields as the header (a note with an unquoted comma would add one)."""

from __future__ import annotations

import csv
import importlib.util
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
FILES = sorted(BENCHMARKS.rglob("*.csv"))


def _harness():
    spec = importlib.util.spec_from_file_location("bench_harness", BENCHMARKS / "harness.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_there_are_data_files():
    assert BENCHMARKS / "results.csv" in FILES


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(BENCHMARKS)))
def test_every_row_has_the_header_s_fields(path):
    with path.open(newline="") as f:
        rows = list(csv.reader(f))
    assert rows, f"{path} is empty"
    header = rows[0]
    assert len(set(header)) == len(header) and all(header), header
    bad = [i + 1 for i, row in enumerate(rows) if len(row) != len(header)]
    assert not bad, f"{path}: lines {bad[:10]} do not have {len(header)} fields"
    if path.name == "results.csv":
        assert header == _harness().FIELDS  # the shared harness writes it
