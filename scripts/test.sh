#!/usr/bin/env bash
# Set up a virtual environment (CPU torch first, so pip never pulls CUDA wheels), lint with
# ruff (configured in pyproject.toml), and run the tests (PYTEST_WORKERS: how many workers,
# default one a logical CPU).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/setup_venv.sh test
ruff check .
# One worker a logical CPU (pytest-xdist, in the test extra): the CPU suite is mostly
# single-threaded compiles; work stealing keeps the long compile tests from ending the run on
# one worker.
python -m pytest -q -n "${PYTEST_WORKERS:-logical}" --dist worksteal "$@"
