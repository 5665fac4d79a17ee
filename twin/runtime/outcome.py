"""One verdict for every run: simulation, hardware and replay.

``RunStatus`` names how a run ended and ``exit_code`` maps it to the process exit status that
every ``twin`` command shares. ``decide`` is the single rule that turns what a run found into a
status, so the three modes cannot disagree about what counts as a wedge or a clean run.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any


class RunStatus(str, Enum):
    """How a run ended (the ``status`` field of summaries and of the trace's ``Outcome``)."""

    COMPLETED = "completed"      # every request ended; no wedge, no corruption
    WEDGED = "wedged"            # requests in flight and no progress (or nothing left to happen)
    CORRUPTED = "corrupted"      # a byte or integrity check failed
    CRASHED = "crashed"          # a rank process or the driver raised
    INTERRUPTED = "interrupted"  # stopped early (Ctrl-C, signal, --until) with work in flight
    UNTIL = "until"              # simulation only: reached --until with work in flight

    def __str__(self) -> str:
        return self.value


EXIT_OK = 0
EXIT_ERROR = 1
EXIT_BAD_INPUT = 2
EXIT_WEDGE = 3
EXIT_CORRUPTION = 4

_EXIT = {
    RunStatus.COMPLETED: EXIT_OK,
    RunStatus.WEDGED: EXIT_WEDGE,
    RunStatus.CORRUPTED: EXIT_CORRUPTION,
    RunStatus.CRASHED: EXIT_ERROR,
    RunStatus.INTERRUPTED: EXIT_ERROR,
    RunStatus.UNTIL: EXIT_OK,
}


def exit_code(status: RunStatus | str) -> int:
    """The process exit status for ``status`` (shared by ``twin sim``, ``hw`` and ``replay``)."""
    return _EXIT[RunStatus(status)]


def decide(*, corrupted: bool, wedged: bool, unfinished: int, crashed: bool = False,
           stopped: RunStatus = RunStatus.INTERRUPTED) -> RunStatus:
    """The status of a run: a crash outranks corruption, corruption a wedge; a run that stopped
    with requests in flight and no wedge ends as ``stopped``."""
    if crashed:
        return RunStatus.CRASHED
    if corrupted:
        return RunStatus.CORRUPTED
    if wedged:
        return RunStatus.WEDGED
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
        """The trace's closing ``Outcome`` record. A simulation stopped by ``--until`` is
        recorded as interrupted, with ``note`` saying where it stopped."""
        status = RunStatus.INTERRUPTED if self.status is RunStatus.UNTIL else self.status
        diagnosis = [*self.diagnosis, *([note] if note else [])]
        return {"status": status.value, "completed": self.completed, "failed": self.failed,
                "requests": self.requests, "diagnosis": diagnosis,
                "corruption": self.corruption}
