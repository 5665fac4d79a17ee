"""Prompt wake-ups for the coordinator, whose timers pace the hardware mode's forwards, and for
the ranks' threads.

In SGLang a prefill forward is GPU time: the next one starts when the last ends, whatever the
host's cores are doing. The hardware mode's coordinator stands in for that clock with timers,
on the same cores as the ranks' gathers, scatters and byte checks. On Linux's EEVDF scheduler
(6.6 and later) a task that wakes while every core is busy waits until the running task has
used its slice (1.4 ms on the 2-core development host) unless it asked for a shorter one: with
three busy ranks on two cores, about one forward in eight came more than a millisecond late
(docs/hardware.md). So the coordinator's loop thread asks for a 0.1 ms slice (``sched_attr``'s
``sched_runtime`` for a normal task, Linux 6.12 and later: a waking task with a shorter slice
preempts) and a 1 ns timer slack (a sleep of under a millisecond ends on time, not up to the
default 50 us later). Each rank, once warm, asks for the same slice on each of its threads
(``short_slices``: its loop, its transfer engine's and workers' threads), so that a thread
waking for a frame or a WRITE does not wait behind another rank's kernel either: SGLang's
ranks have cores of their own. Neither needs privileges; a kernel that takes neither (another
OS, an older kernel, which ignores the slice) leaves the timers as they were.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys
from collections.abc import Callable
from typing import Any

SLICE_S = 1e-4
TIMER_SLACK_NS = 1
_PR_SET_TIMERSLACK, _PR_GET_TIMERSLACK = 29, 30
_SCHED_OTHER = 0
#: (sched_setattr, sched_getattr) by machine
_SYSCALLS = {"x86_64": (314, 315), "aarch64": (274, 275)}


class _SchedAttr(ctypes.Structure):
    _fields_ = [("size", ctypes.c_uint32), ("sched_policy", ctypes.c_uint32),
                ("sched_flags", ctypes.c_uint64), ("sched_nice", ctypes.c_int32),
                ("sched_priority", ctypes.c_uint32), ("sched_runtime", ctypes.c_uint64),
                ("sched_deadline", ctypes.c_uint64), ("sched_period", ctypes.c_uint64),
                ("sched_util_min", ctypes.c_uint32), ("sched_util_max", ctypes.c_uint32)]


def _libc() -> Any:
    return ctypes.CDLL(None, use_errno=True)


def _slice(libc: Any, calls: tuple[int, int], runtime_ns: int | None, tid: int = 0
           ) -> int | None:
    """Set thread ``tid``'s slice request (0: this thread; ``runtime_ns`` None: only read it);
    the one before, or None where the kernel refuses (or the thread is not a normal task)."""
    old = _SchedAttr()
    if libc.syscall(calls[1], tid, ctypes.byref(old), ctypes.sizeof(old), 0) != 0 or \
            old.sched_policy != _SCHED_OTHER:
        return None
    if runtime_ns is not None:
        new = _SchedAttr(size=ctypes.sizeof(_SchedAttr), sched_policy=_SCHED_OTHER,
                         sched_nice=old.sched_nice, sched_runtime=runtime_ns)
        if libc.syscall(calls[0], tid, ctypes.byref(new), 0) != 0:
            return None
    return int(old.sched_runtime)


def short_slices() -> int:
    """Ask for the short slice (``SLICE_S``) on every thread of this process that exists now
    (a rank after its warm-up: its loop, its transfer engine's and workers' threads); how many
    took it."""
    calls = _SYSCALLS.get(os.uname().machine) if sys.platform.startswith("linux") else None
    if calls is None:
        return 0
    libc = _libc()
    runtime = int(SLICE_S * 1e9)
    return sum(_slice(libc, calls, runtime, int(tid)) is not None
               for tid in os.listdir("/proc/self/task"))


def prompt_wakeups() -> tuple[dict[str, Any], Callable[[], None]]:
    """Ask for prompt wake-ups on this thread (module docstring). Returns what was applied
    (``{"slice_s": seconds or None, "timer_slack_ns": ns or None}``, None where kept) and a
    function that restores what the thread had."""
    applied: dict[str, Any] = {"slice_s": None, "timer_slack_ns": None}
    undo: list[Callable[[], None]] = []
    if not sys.platform.startswith("linux"):
        return applied, lambda: None
    try:
        libc = _libc()
        slack = libc.prctl(_PR_GET_TIMERSLACK, 0, 0, 0, 0)
        if slack > 0 and libc.prctl(_PR_SET_TIMERSLACK, TIMER_SLACK_NS, 0, 0, 0) == 0:
            applied["timer_slack_ns"] = TIMER_SLACK_NS
            undo.append(lambda: libc.prctl(_PR_SET_TIMERSLACK, slack, 0, 0, 0))
        calls = _SYSCALLS.get(os.uname().machine)
        # An older kernel takes the call and ignores the slice: read back what holds.
        if calls is not None and _slice(libc, calls, int(SLICE_S * 1e9)) is not None and \
                _slice(libc, calls, None) == int(SLICE_S * 1e9):
            applied["slice_s"] = SLICE_S
            undo.append(lambda: _slice(libc, calls, 0))  # 0: the kernel's default again
    except (OSError, AttributeError):
        pass

    def restore() -> None:
        for fn in reversed(undo):
            with contextlib.suppress(OSError, AttributeError):
                fn()
    return applied, restore
