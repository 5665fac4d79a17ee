"""A rank process lives no longer than its coordinator, and writes its stderr to its own log.

``rank_setup(node)`` runs first thing in every rank process (``rank_main``):

* ``prctl(PR_SET_PDEATHSIG, SIGKILL)`` makes the kernel kill the rank when the coordinator
  dies, even by SIGKILL; a watchdog thread checks the parent pid once a second as well (other
  platforms, and a parent that died before ``prctl`` ran);
* with ``TWIN_HW_RANK_LOG_DIR`` set, the process's stdout and stderr (Python tracebacks, NIXL
  and UCX messages) go to ``DIR/NODE.log`` instead of the coordinator's terminal, which gets one
  line per rank error.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import sys
import threading
import time

PARENT_ENV = "TWIN_HW_PARENT_PID"
LOG_ENV = "TWIN_HW_RANK_LOG_DIR"
PR_SET_PDEATHSIG = 1
WATCHDOG_PERIOD_S = 1.0


def _pdeathsig(sig: int) -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _watchdog(parent: int) -> None:
    while True:
        time.sleep(WATCHDOG_PERIOD_S)
        if os.getppid() != parent:
            os._exit(1)


def rank_log_path(log_dir: str, node: str) -> str:
    return os.path.join(log_dir, f"{node}.log")


def rank_setup(node: str) -> None:
    """Tie this process's life to the coordinator's and route its output to its log."""
    parent = int(os.environ.get(PARENT_ENV, "0") or 0) or os.getppid()
    _pdeathsig(signal.SIGKILL)
    if os.getppid() != parent:  # the coordinator died before prctl took effect
        os._exit(1)
    threading.Thread(target=_watchdog, args=(parent,), name="twin-lifeline",
                     daemon=True).start()
    log_dir = os.environ.get(LOG_ENV)
    if log_dir:
        try:
            fd = os.open(rank_log_path(log_dir, node), os.O_WRONLY | os.O_CREAT | os.O_APPEND,
                         0o644)
        except OSError:
            return
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
