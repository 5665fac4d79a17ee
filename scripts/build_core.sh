#!/usr/bin/env bash
# Build the compiled core (twin compile: the protocol core, runtime and simulator with mypyc)
# where a C compiler and Python's headers are, and say so in one line; otherwise say in one
# line why the pure-Python core runs. Never fails the set-up: pure Python is always a working
# path. Runs the `python` on PATH (scripts/setup.sh activates .venv first).
set -uo pipefail
cd "$(dirname "$0")/.."
cc="${CC:-}"
cc="${cc%% *}"
if [ -n "$cc" ]; then
  cc=$(command -v "$cc" || true)
else
  cc=$(command -v cc || command -v gcc || command -v clang || true)
fi
if [ -z "$cc" ]; then
  echo "core: pure Python: no C compiler found (install gcc or clang, then run twin compile)"
  exit 0
fi
include=$(python -c 'import sysconfig; print(sysconfig.get_paths()["include"])')
if [ ! -f "$include/Python.h" ]; then
  echo "core: pure Python: no Python.h in $include (install the Python development headers," \
       "then run twin compile)"
  exit 0
fi
if python -c 'from twin import compiled; raise SystemExit(0 if compiled.current() else 1)'; then
  echo "core: compiled (already built for these sources; twin compile rebuilds it," \
       "TWIN_PURE_PYTHON=1 runs pure Python)"
  exit 0
fi
if ! out=$(python -m twin compile 2>&1); then
  echo "core: pure Python: twin compile failed ($(printf '%s\n' "$out" | grep -v '^\s*$' |
        tail -n 1 | cut -c1-160)); twin compile --verbose shows why"
  exit 0
fi
built=$(printf '%s\n' "$out" | grep -o 'built [0-9]* extension(s) in [0-9]* s' || true)
echo "core: compiled with mypyc (${built:-built}; twin compile rebuilds it," \
     "TWIN_PURE_PYTHON=1 runs pure Python)"
