# Sourced by the other scripts: create and activate .venv with CPU torch first (so pip never
# pulls CUDA wheels), then lowprec installed editable with the extras named in $1.
python3 -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
python -m pip install -q torch==2.13.0
python -m pip install -q -e ".[$1]"
