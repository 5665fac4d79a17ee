"""One verdict for every run: simulation, hardware and replay.

``RunStatus`` names how a run ended and ``exit_code`` maps it to the process exit status that
every ``twin`` command shares. ``decide`` is the single rule that turns what a run found into a
status, so the three modes cannot disagree about what counts as a wedge or a clean run.

The rule, first match wins:

===============  ====  =================================================================
status           exit  when
===============  ====  =================================================================
``crashed``      1     a rank process or the driver raised (hardware mode, a trace)
``corrupted``    4     a byte or integrity check failed
``wedged``       3     requests in flight and no progress (or nothing left to happen)
``interrupted``  1     stopped by Ctrl-C, SIGTERM or SIGHUP (or ``--timeout``) with work in
                       flight
``failed``       5     at least one request ended ``Failed`` (an injected fault, an abort, a
                       timeout); the others completed or, with ``--until``, were still in
                       flight
``until``        0     ``--until`` stopped the run (simulated time in ``twin sim``, wall clock
                       in ``twin hw``) with work in flight, nothing failed
``completed``    0     every request ended ``Success``
===============  ====  =================================================================

So exit 0 means every request that ended succeeded: a run in which nothing succeeded never
exits 0 unless nothing ended at all because ``--until`` stopped it first.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any


class RunStatus(str, Enum):
    """How a run ended (the ``status`` field of summaries and of the trace's ``Outcome``)."""

    COMPLETED = "completed"      # every request ended with Success; no wedge, no corruption
    FAILED = "failed"            # some request ended Failed; no wedge, no corruption
    WEDGED = "wedged"            # requests in flight and no progress (or nothing left to happen)
    CORRUPTED = "corrupted"      # a byte or integrity check failed
    CRASHED = "crashed"          # a rank process or the driver raised
    INTERRUPTED = "interrupted"  # stopped early (Ctrl-C, signal, timeout) with work in flight
    UNTIL = "until"              # --until stopped the run with work in flight

    def __str__(self) -> str:
        return self.value


EXIT_OK = 0
EXIT_ERROR = 1
EXIT_BAD_INPUT = 2
EXIT_WEDGE = 3
EXIT_CORRUPTION = 4
EXIT_FAILED = 5

_EXIT = {
    RunStatus.COMPLETED: EXIT_OK,
    RunStatus.FAILED: EXIT_FAILED,
    RunStatus.WEDGED: EXIT_WEDGE,
    RunStatus.CORRUPTED: EXIT_CORRUPTION,
    RunStatus.CRASHED: EXIT_ERROR,
    RunStatus.INTERRUPTED: EXIT_ERROR,
    RunStatus.UNTIL: EXIT_OK,
}

#: One line per exit status, for ``--help`` texts and docs.
EXIT_CODES_HELP = ("0 every request that ended succeeded (or --until stopped the run first), "
                   "1 error or interrupted (a rank died, Ctrl-C, SIGTERM), 2 bad input, "
                   "3 wedge, 4 corruption, 5 requests failed (no wedge, no corruption).")


def exit_code(status: RunStatus | str) -> int:
    """The process exit status for ``status`` (shared by ``twin sim``, ``hw`` and ``replay``)."""
    return _EXIT[RunStatus(status)]


def decide(*, corrupted: bool, wedged: bool, unfinished: int, failed: int = 0,
           crashed: bool = False, stopped: RunStatus = RunStatus.INTERRUPTED) -> RunStatus:
    """The status of a run (the table in the module docstring).

    ``stopped`` is what a run that ended with requests in flight but no wedge is called:
    ``INTERRUPTED`` (a signal, a timeout; it outranks failed requests) or ``UNTIL``
    (``--until``; failed requests outrank it).
    """
    if crashed:
        return RunStatus.CRASHED
    if corrupted:
        return RunStatus.CORRUPTED
    if wedged:
        return RunStatus.WEDGED
    if unfinished and stopped == RunStatus.INTERRUPTED:
        return RunStatus.INTERRUPTED
    if failed:
        return RunStatus.FAILED
    return RunStatus.COMPLETED if unfinished == 0 else stopped


@dataclass(frozen=True)
class Verdict:
    """What a run concluded, in the same shape for every mode: status, counts, explanation."""

    status: RunStatus
    requests: int
    completed: int
    failed: int
    unfinished: int
    diagnosis: list[str] = field(default_factory=list)
    corruption: list[str] = field(default_factory=list)

    @property
    def exit_code(self) -> int:
        return exit_code(self.status)

    def record(self, note: str = "") -> dict[str, Any]:
        """The trace's closing ``Outcome`` record, with the status the console prints (a run
        stopped by ``--until`` is ``until``, not ``interrupted``) and ``note`` (where it
        stopped) after the diagnosis."""
        status = self.status
        diagnosis = [*self.diagnosis, *([note] if note else [])]
        return {"status": status.value, "completed": self.completed, "failed": self.failed,
                "requests": self.requests, "diagnosis": diagnosis,
                "corruption": self.corruption}
