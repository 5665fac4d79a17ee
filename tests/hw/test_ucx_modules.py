"""Exit codes stay true on a host with the system's rdma-core installed.

The NIXL wheel bundles its own rdma-core and libnl; with the system's ``libibverbs1`` and
``ibverbs-providers`` on the library path, UCX's ``ib`` modules load the system's
``libnl-route-3`` beside the bundled one and every process that created a UCX agent dies at
exit with SIGSEGV (``rtnl_tc_unregister`` in ``_dl_fini``). ``NixlEndpoint`` therefore keeps
UCX's InfiniBand modules out where the host has no RDMA devices (``netutil.choose_ucx_modules``)
and keeps them where it has some.

The system's rdma-core is found on the loader's path (``scripts/setup.sh`` installs it when run
as root) or in the directories ``TWIN_RDMA_CORE_LIBDIRS`` names (``:``-separated; a private
copy: ``apt-get download libibverbs1 ibverbs-providers libnl-3-200 libnl-route-3-200`` and
``dpkg -x`` each into one root, then its ``usr/lib/x86_64-linux-gnu`` and ``lib/x86_64-linux-gnu``).
"""

from __future__ import annotations

import ctypes.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from twin.hw.netutil import choose_ucx_modules, has_rdma_devices

pytest.importorskip("nixl._api", reason="the NIXL wheel is not installed")

LIBDIRS = [d for d in os.environ.get("TWIN_RDMA_CORE_LIBDIRS", "").split(":") if d]


def _rdma_core_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "UCX_MODULES"}
    if LIBDIRS:
        assert all((Path(d)).is_dir() for d in LIBDIRS), LIBDIRS
        assert any((Path(d) / "libefa.so.1").exists() for d in LIBDIRS), \
            f"no libefa.so.1 (ibverbs-providers) in {LIBDIRS}"
        env["LD_LIBRARY_PATH"] = ":".join([*LIBDIRS, env.get("LD_LIBRARY_PATH", "")])
    return env


needs_rdma_core = pytest.mark.skipif(
    not LIBDIRS and ctypes.util.find_library("efa") is None,
    reason="the system's rdma-core (libibverbs1, ibverbs-providers) is not installed and "
           "TWIN_RDMA_CORE_LIBDIRS names no copy of it: the crash cannot be reproduced here")

RAW_AGENT = ("from nixl._api import nixl_agent, nixl_agent_config; "
             "nixl_agent('raw', nixl_agent_config(backends=['UCX']))")
ENDPOINT = ("import os\n"
            "from twin.hw.nixl_transport import NixlEndpoint\n"
            "e = NixlEndpoint('ep')\n"
            "print(e.ucx_modules)\n"
            "print('UCX_MODULES=' + os.environ.get('UCX_MODULES', ''))\n"
            "e.close()\n"
            "raise SystemExit(7)\n")


def _run(code: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=180, check=False)


@needs_rdma_core
def test_endpoint_exit_status_is_true_with_the_system_rdma_core_loaded() -> None:
    env = _rdma_core_env()
    ep = _run(ENDPOINT, env)
    # The process's own exit status (7), not SIGSEGV at exit.
    assert ep.returncode == 7, (ep.returncode, ep.stderr[-2000:])
    if has_rdma_devices():
        assert "ib modules kept" in ep.stdout and "UCX_MODULES=\n" in ep.stdout
        return
    assert "UCX_MODULES=^ib" in ep.stdout
    # The control: the same environment without the choice does crash at exit, so the
    # test above exercised the failure and not a host where it cannot happen.
    raw = _run(RAW_AGENT, env)
    assert raw.returncode == -11, (raw.returncode, raw.stderr[-2000:])


def test_choice_keeps_a_given_setting_and_ib_on_rdma_hosts(monkeypatch: pytest.MonkeyPatch) -> None:
    env = {"UCX_MODULES": "^cma"}
    assert "from the environment" in choose_ucx_modules(env) and env == {"UCX_MODULES": "^cma"}
    import twin.hw.netutil as netutil

    monkeypatch.setattr(netutil, "has_rdma_devices", lambda: False)
    env = {}
    assert choose_ucx_modules(env).startswith("UCX_MODULES=^ib") and env == {"UCX_MODULES": "^ib"}
    monkeypatch.setattr(netutil, "has_rdma_devices", lambda: True)
    monkeypatch.setattr(netutil.os, "listdir", lambda path: ["mlx5_0"])
    env = {}
    assert "kept" in choose_ucx_modules(env) and "mlx5_0" in choose_ucx_modules(env)
    assert env == {}  # a real IB transport is never dropped
