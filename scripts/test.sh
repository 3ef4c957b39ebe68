#!/usr/bin/env bash
# Set up a virtual environment (CPU torch first, so pip never pulls CUDA wheels) and run the tests.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/setup_venv.sh test
python -m pytest -q "$@"
