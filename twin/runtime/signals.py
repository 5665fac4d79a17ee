"""SIGTERM and SIGHUP end a run the way Ctrl-C does.

``kill``, ``docker stop``, batch schedulers and a closed terminal send SIGTERM or SIGHUP, not
SIGINT. Inside ``signals_interrupt()`` both raise ``KeyboardInterrupt`` in the main thread, so a
run stops through the same path as Ctrl-C: its verdict says ``interrupted``, the trace gets its
``Outcome`` and rank processes are stopped.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from typing import Any

HANDLED = tuple(s for s in (getattr(signal, "SIGTERM", None), getattr(signal, "SIGHUP", None))
                if s is not None)


class Interrupted(KeyboardInterrupt):
    """A ``KeyboardInterrupt`` raised for a signal other than SIGINT.

    Its one argument is the signal's name, and it can be built again from that argument:
    SimPy re-raises an exception from a process as ``type(exc)(*exc.args)`` and pickling does
    the same, so ``Interrupted("SIGTERM")`` must mean what ``Interrupted(15)`` means.
    """

    def __init__(self, signum: int | str) -> None:
        sig = signal.Signals[signum] if isinstance(signum, str) else signal.Signals(signum)
        super().__init__(sig.name)
        self.signum = int(sig)


def _raise(signum: int, frame: Any) -> None:
    raise Interrupted(signum)


@contextlib.contextmanager
def signals_handled(handler: Any, signums: tuple[int, ...] = HANDLED) -> Iterator[None]:
    """Within the block, ``handler`` handles ``signums`` (then the previous handlers return).
    Outside the main thread it does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.signal(s, handler) for s in signums}
    try:
        yield
    finally:
        for s, old in previous.items():
            signal.signal(s, old)


STOPPING = (signal.SIGINT, *HANDLED)
"""The signals that end a run: Ctrl-C, and those ``signals_interrupt`` turns into it."""


def interrupt_for(signum: int) -> KeyboardInterrupt:
    """The exception a run raises for a stopping signal it noted: ``KeyboardInterrupt`` for
    SIGINT, ``Interrupted`` for the others."""
    return KeyboardInterrupt() if signum == signal.SIGINT else Interrupted(signum)


class Noted:
    """A handler that only notes the first stopping signal (``signum``, 0 while none).

    A loop that feeds compiled code installs it (``signals_handled(noted, STOPPING)``) and
    checks ``signum`` between two steps: an exception a handler raised inside compiled code
    could be left pending where that code expects none (the process then aborts)."""

    __slots__ = ("signum",)

    def __init__(self) -> None:
        self.signum = 0

    def __call__(self, signum: int, frame: Any) -> None:
        if not self.signum:
            self.signum = signum

    def check(self) -> None:
        """Raise ``interrupt_for`` the noted signal, if there is one."""
        if self.signum:
            raise interrupt_for(self.signum)


def signals_interrupt() -> contextlib.AbstractContextManager[None]:
    """Within the block, SIGTERM and SIGHUP raise ``Interrupted`` (a ``KeyboardInterrupt``).
    Outside the main thread it does nothing."""
    return signals_handled(_raise)
