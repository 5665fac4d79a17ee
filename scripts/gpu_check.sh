#!/usr/bin/env bash
# The one-GPU hardware check: installs the wheels prepared by scripts/gpu_wheels.sh (if .whl/
# holds any) into /tmp/site, then runs each step with its own time limit inside an 8-minute
# budget: environment report, CUDA kernel byte-equality (torch and Triton), NIXL VRAM transfers
# between two processes on the GPU, a prefill TP2 -> decode TP1 `twin hw` run on that GPU whose
# JSON verdict must show every request completed and byte-verified, its replay, the kernel /
# transfer / staged-chunk benchmarks, a PP2 `twin hw` run on the Mooncake transfer engine (its
# CUDA build on a GPU host; skipped, without failing the check, where the engine does not
# import), VRAM to VRAM between two processes through that engine, byte-checked, with its
# bandwidth (skipped with the reason where the engine cannot register VRAM: a build without
# CUDA, a protocol that does not move it, or --device cpu), and a cost-model calibration on the first run (`twin calibrate`)
# checked against a second run on another workload. Writes summary.json, steps.log,
# steps.tar.gz, the runs' traces and costs.toml to $OUT (or --out DIR, else a temporary folder). Exit 0 only if every step passed.
#
#   scripts/gpu_check.sh                  # on the GPU host, from the work tree
#   scripts/gpu_check.sh --device cpu     # the same steps without CUDA (DRAM, torch kernels)
#   scripts/gpu_check.sh --steps twin-hw  # one step again (install and environment always run)
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ -z "${PYTHON:-}" ] && [ -x .venv/bin/python ]; then PY=.venv/bin/python; fi
exec "$PY" scripts/gpu_check.py "$@"
