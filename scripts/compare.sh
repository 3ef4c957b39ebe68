#!/usr/bin/env bash
# Set up a virtual environment (CPU torch first) and run the default `lowprec compare`.
# Extra arguments go to the command, e.g. `bash scripts/compare.sh --recipes bf16,mxfp8 --steps 60`.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/setup_venv.sh compare
lowprec compare "$@"
