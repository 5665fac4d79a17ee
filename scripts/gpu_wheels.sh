#!/usr/bin/env bash
# Download the wheels the one-GPU check needs and its GPU image lacks (scripts/gpu-wheels.txt)
# into .whl/ (ignored by git), for CPython 3.12 on x86_64 manylinux, with no dependencies.
# Checks that each requirement got exactly one wheel, that the wheels plus the tracked tree fit
# the 64 MiB that may travel with the work tree, and lists them with their declared needs.
#
#   scripts/gpu_wheels.sh            # then: scripts/gpu_check.sh on the GPU host
#   WHEEL_DIR=/tmp/w scripts/gpu_wheels.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
DIR=${WHEEL_DIR:-.whl}
LIMIT_MIB=${WHEEL_LIMIT_MIB:-64}
REQS=scripts/gpu-wheels.txt

rm -rf "$DIR"
mkdir -p "$DIR"
"$PY" -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
  --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_26_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
  -d "$DIR" -r "$REQS"

"$PY" - "$DIR" "$REQS" "$LIMIT_MIB" <<'PY'
import re
import subprocess
import sys
import zipfile
from pathlib import Path

wheel_dir, reqs, limit_mib = Path(sys.argv[1]), Path(sys.argv[2]), float(sys.argv[3])
norm = lambda name: re.sub(r"[-_.]+", "_", name).lower()  # noqa: E731
wanted = {}
for line in reqs.read_text().splitlines():
    line = line.split("#", 1)[0].strip()
    if line:
        name, version = line.split("==")
        wanted[norm(name)] = version.strip()
wheels = sorted(wheel_dir.glob("*.whl"))
found = {}
for w in wheels:
    name, version = w.name.split("-")[:2]
    found.setdefault(norm(name), []).append((version, w))
problems = []
for name, version in wanted.items():
    got = found.get(name, [])
    if len(got) != 1 or got[0][0] != version:
        problems.append(f"{name}=={version}: found {[w.name for _, w in got]}")
for name in set(found) - set(wanted):
    problems.append(f"unexpected wheel {name}")
print(f"{'wheel':<72} {'MiB':>7}  declared needs")
total = 0
for w in wheels:
    size = w.stat().st_size
    total += size
    with zipfile.ZipFile(w) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        needs = [line.split(":", 1)[1].strip() for line in z.read(meta).decode().splitlines()
                 if line.startswith("Requires-Dist:") and "extra ==" not in line]
    print(f"{w.name:<72} {size / 2**20:7.2f}  {', '.join(needs) or '-'}")
tracked = subprocess.run(["git", "ls-files", "-z"], capture_output=True, check=True).stdout
tree = sum(Path(p).stat().st_size for p in tracked.decode().split("\0") if p and Path(p).is_file())
print(f"{'total':<72} {total / 2**20:7.2f}  (+ {tree / 2**20:.2f} MiB tracked tree, "
      f"limit {limit_mib:g} MiB)")
if (total + tree) / 2**20 > limit_mib:
    problems.append(f"wheels and tree take {(total + tree) / 2**20:.1f} MiB > {limit_mib:g} MiB")
if problems:
    sys.exit("gpu_wheels: " + "; ".join(problems))
print(f"ready: {len(wheels)} wheels in {wheel_dir}/")
PY
