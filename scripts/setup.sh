#!/usr/bin/env bash
# Create .venv (if missing) and install staging-twin with everything the tests, the hardware
# mode and the Ray executor need, then build the compiled core where a C compiler is
# (scripts/build_core.sh; pure Python otherwise). Safe to run again. torch is pinned first so
# pip takes the small CPU build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
python -m pip install --quiet --upgrade pip
python -m pip install --quiet "torch==2.13.0"
python -m pip install --quiet -e ".[hw,triton,ray,dev,fast]"
echo "staging-twin is installed in .venv (activate with: . .venv/bin/activate)"
scripts/build_core.sh   # the compiled core where a C compiler is, else one line saying why not
