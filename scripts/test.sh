#!/usr/bin/env bash
# Set up a virtual environment (CPU torch first, so pip never pulls CUDA wheels), lint with
# ruff (configured in pyproject.toml), and run the tests.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/setup_venv.sh test
ruff check .
python -m pytest -q "$@"
