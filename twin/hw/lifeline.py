"""A rank process lives no longer than its coordinator, and writes its stderr to its own log.

``rank_setup(node)`` runs first thing in every rank process (``rank_main``):

* a thread waits on the coordinator's pidfd and exits the rank the moment the coordinator
  ends, even by SIGKILL (a rank forked from the coordinator's forkserver, ``twin.hw.procs``,
  has the server as its parent, and the server lives as long as any rank it forked); without
  pidfds it polls the coordinator once a second;
* ``prctl(PR_SET_PDEATHSIG, SIGKILL)`` makes the kernel kill the rank when its parent dies;
* with ``TWIN_HW_RANK_LOG_DIR`` set, the process's stdout and stderr (Python tracebacks, NIXL
  and UCX messages) go to ``DIR/NODE.log`` instead of the coordinator's terminal, which gets one
  line per rank error.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import select
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


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _watch_pid(pid: int) -> None:
    """Exit this process as soon as process ``pid`` ends: its pidfd becomes readable then;
    without pidfds (other platforms), poll it once a second."""
    try:
        fd = os.pidfd_open(pid)
    except (AttributeError, OSError):
        fd = -1
    if fd >= 0:
        select.select([fd], [], [])
        os._exit(1)
    while _alive(pid):
        time.sleep(WATCHDOG_PERIOD_S)
    os._exit(1)


def rank_log_path(log_dir: str, node: str) -> str:
    return os.path.join(log_dir, f"{node}.log")


def rank_setup(node: str) -> None:
    """Tie this process's life to the coordinator's and route its output to its log.

    The coordinator is ``TWIN_HW_PARENT_PID`` (else the parent): a spawned rank's parent, or
    for a forked rank the grandparent (its parent is the forkserver, which lives on while any
    rank it forked holds its end of the server's alive pipe), so the rank watches the
    coordinator itself."""
    coordinator = int(os.environ.get(PARENT_ENV, "0") or 0) or os.getppid()
    _pdeathsig(signal.SIGKILL)  # dies with its parent, whichever that is
    if not _alive(coordinator):  # the coordinator died before prctl took effect
        os._exit(1)
    threading.Thread(target=_watch_pid, args=(coordinator,), name="twin-lifeline",
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
