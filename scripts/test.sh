#!/usr/bin/env bash
# The whole test suite, as CI runs it. Tests that start no rank processes of their own run in
# parallel (pytest-xdist, a test file per worker); the hardware-mode tests (marked hw: real rank
# processes, sockets and NIXL agents, some of them timing-sensitive) then run alone, one after
# another, as they would on a quiet host. Arguments go to both pytest runs.
# `python -m pytest` runs everything in one process.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pytest -m "not hw" -n auto --maxprocesses 4 --dist loadfile "$@"
python -m pytest -m hw "$@"
