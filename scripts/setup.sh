#!/usr/bin/env bash
# Create .venv (if missing) and install staging-twin with everything the tests, the hardware
# mode (NIXL and Mooncake) and the Ray executor need (as root, also the system's rdma-core
# libraries the Mooncake transfer engine links), then build the compiled core where a C
# compiler is (scripts/build_core.sh; pure Python otherwise). Safe to run again. torch is
# pinned first so pip takes the small CPU build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# The Mooncake transfer engine links the system's libibverbs even for TCP. As root on a Debian
# or Ubuntu host, install rdma-core's libraries; elsewhere say what is missing. (With them on
# the host, UCX's InfiniBand modules would crash NIXL processes at exit: twin's NIXL endpoints
# keep those modules out where there are no RDMA devices, twin/hw/netutil.py.)
RDMA_PKGS="libibverbs1 ibverbs-providers libnl-3-200 libnl-route-3-200"
if ldconfig -p 2>/dev/null | grep -q 'libibverbs\.so\.1 '; then
  echo "system packages: libibverbs1 present (Mooncake transfer engine can load)"
elif [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  echo "system packages: installing $RDMA_PKGS (the Mooncake transfer engine needs libibverbs1)"
  if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $RDMA_PKGS; } \
      >/tmp/twin-setup-apt.log 2>&1; then
    echo "system packages: apt-get failed (its output: /tmp/twin-setup-apt.log); twin hw on" \
         "Mooncake falls back to NIXL until $RDMA_PKGS are installed"
  fi
else
  echo "system packages: libibverbs1 missing and not root (or no apt-get): install $RDMA_PKGS" \
       "for twin hw on Mooncake; the NIXL backend and the simulator do not need them"
fi
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
python -m pip install --quiet --upgrade pip
python -m pip install --quiet "torch==2.13.0"
python -m pip install --quiet -e ".[hw,mooncake,triton,ray,dev,fast]"
echo "staging-twin is installed in .venv (activate with: . .venv/bin/activate)"
scripts/build_core.sh   # the compiled core where a C compiler is, else one line saying why not
