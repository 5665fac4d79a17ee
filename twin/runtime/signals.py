"""SIGTERM and SIGHUP end a run the way Ctrl-C does.

``kill``, ``docker stop``, batch schedulers and a closed terminal send SIGTERM or SIGHUP, not
SIGINT. Inside ``signals_interrupt()`` both raise ``KeyboardInterrupt`` in the main thread, so a
run stops through the same path as Ctrl-C: its verdict says ``interrupted``, the trace gets its
``Outcome`` and rank processes are stopped.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Callable, Iterator
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


class Noted:
    """Stopping signals held for a safe point (``held_for_safe_points``): ``signum`` is the
    first one noted (0 while none); ``on_note(signum)``, if given, is told at once (a compiled
    loop's own flag). ``deliver`` hands it to the handler from before the block."""

    __slots__ = ("signum", "previous", "on_note")

    def __init__(self, on_note: Callable[[int], None] | None = None) -> None:
        self.signum = 0
        self.previous: dict[int, Any] = {}
        self.on_note = on_note

    def __call__(self, signum: int, frame: Any) -> None:
        if not self.signum:
            self.signum = signum
            if self.on_note is not None:
                self.on_note(signum)

    def deliver(self) -> None:
        """Act on the noted signal as the previous handler would have, here: it may raise
        (``KeyboardInterrupt``, ``Interrupted``) or return, and then the loop goes on. With
        the default action the process gets the signal again, as it would have."""
        signum, self.signum = self.signum, 0
        old = self.previous.get(signum)
        if callable(old):
            old(signum, None)
        elif old == signal.SIG_DFL:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)


@contextlib.contextmanager
def held_for_safe_points(on_note: Callable[[int], None] | None = None,
                         signums: tuple[int, ...] = STOPPING) -> Iterator[Noted]:
    """Within the block, the stopping signals only note themselves; the loop inside calls
    ``noted.deliver()`` between two steps, where no compiled code is running (an exception a
    handler raised inside compiled code could be left pending where that code expects none,
    and the process then aborts). A signal still noted when the block ends is delivered then.
    Ignored signals stay ignored; outside the main thread nothing changes."""
    noted = Noted(on_note)
    if threading.current_thread() is not threading.main_thread():
        yield noted
        return
    for s in signums:
        old = signal.getsignal(s)
        if old != signal.SIG_IGN:
            noted.previous[s] = signal.signal(s, noted)
    try:
        yield noted
    finally:
        for s, old in noted.previous.items():
            signal.signal(s, old)
    if noted.signum:
        noted.deliver()


def signals_interrupt() -> contextlib.AbstractContextManager[None]:
    """Within the block, SIGTERM and SIGHUP raise ``Interrupted`` (a ``KeyboardInterrupt``).
    Outside the main thread it does nothing."""
    return signals_handled(_raise)
