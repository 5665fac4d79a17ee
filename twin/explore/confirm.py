"""Confirming findings on real ranks: each finding's shrunk trace replayed with ``twin replay
--mode hw`` (``twin.hw.replay.replay_hw``).

The replay starts real rank processes (zmq sockets, NIXL agents, the torch kernels) and feeds
every rank its recorded inputs in order, holding each real frame and completion until it is
the rank's next recorded input: the recorded interleaving is made to happen on real sockets,
as delays make an order happen in ``twin hw``. A finding is *confirmed* when the replay
follows the whole recording and ends with the recorded outcome (status, counts and, for a
wedge, the same diagnosis); the byte check on the decode ranks then agrees with the integrity
model. It is *diverged* when real sockets never delivered what the recording says came next
(an order real sockets cannot produce), *not confirmed* when the replay followed it but ended
otherwise, and has *no trace* when only a loopback schedule shows it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

CONFIRMED = "confirmed"
INJECTED_ONLY = frozenset({"fail-transfer", "crash", "restart", "dup", "corrupt"})
"""Fault kinds a replay cannot make happen: the recorded run saw a failed transfer, a rank die
or come back, a frame twice or rewritten, none of which the replayed ranks do by themselves
(each diverged when tried). A dropped, delayed or reordered frame is only an order, which
the replay makes by holding frames (a dropped one is held for good); a failed send is a
recorded input the replay feeds its rank."""


def confirm_on_hardware(folder: Path, options: Any = None) -> str:
    """Replay ``folder/repro.jsonl.gz`` on real ranks; what came of it, in a few words."""
    from twin.hw.launcher import HwOptions, LaunchError, PoolError
    from twin.hw.replay import replay_hw
    from twin.hw.run import HwInputError
    from twin.trace.format import read_trace

    path = folder / "repro.jsonl.gz"
    if not path.is_file():
        return "no trace (only a loopback schedule shows it)"
    trace = read_trace(path)
    needs = sorted({f.split(":", 1)[0] for rec in trace.events
                    if rec.dir == "sys" and rec.type == "FaultInjected"
                    for f in str(rec.data.get("fault", "")).split(";")} & INJECTED_ONLY)
    if needs:
        return (f"unsupported on hardware: its run needs {', '.join(needs)}, which real "
                f"sockets and transfers do not do by themselves")
    try:
        result = replay_hw(trace, options or HwOptions())
    except HwInputError as exc:
        return f"unsupported on hardware: {_short(exc)}"
    except (LaunchError, PoolError) as exc:
        return f"not run: {_short(exc)}"
    if result.divergence is not None:
        return f"diverged: {_short(result.divergence.got)}"
    if result.same_outcome:
        return CONFIRMED
    return f"not confirmed: hardware ended {result.status}"


def _short(text: object, n: int = 120) -> str:
    line = " ".join(str(text).split())
    return line if len(line) <= n else line[: n - 3] + "..."
