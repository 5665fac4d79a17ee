#!/usr/bin/env bash
# One-GPU hardware check, under 5 minutes: kernel byte-equality on CUDA (torch and Triton),
# kernel and transfer benchmarks against the device's copy bandwidth, and a prefill TP2 ->
# decode TP1 run with both sides on that GPU (VRAM staging, NIXL, byte-verified), and a cost-model
# calibration on that run checked against a second workload. Prints a summary.
set -uo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] && . .venv/bin/activate
export NIXL_LOG_LEVEL=WARN
out=$(mktemp -d)
status=0
step() { echo; echo "== $1"; }

step "device"
python - <<'PY' || exit 1
import torch
assert torch.cuda.is_available(), "no CUDA device visible"
p = torch.cuda.get_device_properties(0)
print(f"{p.name}, {p.total_memory / 2**30:.0f} GiB, torch {torch.__version__}, CUDA {torch.version.cuda}")
PY

step "kernel byte-equality on CUDA (torch and Triton)"
timeout 150 python -m pytest -q tests/hw/test_kernels.py tests/hw/test_triton_kernels.py \
  tests/hw/test_kvpattern.py -k "cuda or triton" -p no:cacheprovider 2>&1 | tail -3 || status=1

step "gather/scatter vs device copy"
timeout 60 python benchmarks/bench_kernels.py --device cuda --repeat 20 2>&1 | tail -8 || status=1

step "staged chunk vs raw NIXL WRITE (VRAM to VRAM)"
timeout 90 python benchmarks/bench_staged.py --device cuda --repeat 10 2>&1 | tail -6 || status=1

step "prefill TP2 -> decode TP1 on one GPU, byte-verified"
timeout 120 twin hw --config examples/tp2-tp1-small.toml --device cuda --prefill-gpus 0,0 \
  --decode-gpus 0 --workload "poisson:n=24,rate=40,input=1500,output=4,seed=5" \
  --trace-out "$out/gpu-tp2-tp1.jsonl.gz" || status=1
twin replay "$out/gpu-tp2-tp1.jsonl.gz" | tail -4

step "calibrate the simulator on that run, check it on a second workload"
timeout 120 twin hw --config examples/tp2-tp1-small.toml --device cuda --prefill-gpus 0,0 \
  --decode-gpus 0 --workload "poisson:n=24,rate=20,input=800,output=4,seed=7" \
  --trace-out "$out/gpu-tp2-tp1-b.jsonl.gz" || status=1
timeout 120 twin calibrate "$out/gpu-tp2-tp1.jsonl.gz" -o "$out/costs.toml" || status=1
twin replay "$out/gpu-tp2-tp1-b.jsonl.gz" --config "$out/costs.toml" | tail -2

echo
if [ $status -eq 0 ]; then echo "GPU CHECK: PASS (trace in $out)"; else echo "GPU CHECK: FAIL"; fi
exit $status
