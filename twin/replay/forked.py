"""Replay with the trace read in a forked process.

The sequential replay (``Replayer.run_here``) spends more than half its time reading: checking
every line's envelope and decoding every input's payload. ``run`` forks a reader that opens its
own ``TraceReader`` of the same file (every check of the sequential reader, in the same order),
reduces each input to a row (``twin.trace.rows``) and sends, in batches, each input with the
payload text of the effect lines recorded after it, and the driver records the replay follows.
The reader's native pass (``twin.trace.scan``) makes the rows and collects the text of most
lines without a record per line (``TraceReader.collect``). This process rebuilds the inputs,
feeds the cores and writes the text of every effect (``twin.replay.feeding``), and compares it
with the recorded text, as the sequential replay does, while the reader reads on.

An error the reader meets (a ``TraceError``) is raised here, as the sequential replay raises
it (which would have fed the inputs before it first, to no visible end). Whatever this path
leaves to the sequential one raises ``Fallback``: effects whose text differs from the recording
(a divergence, or a hand-edited line) and a reader that failed otherwise. The replay then
starts over with fresh cores in this process, so a divergence and its report are always the
sequential replay's.
"""

from __future__ import annotations

import contextlib
import gc
import marshal
import os
import signal
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from twin.replay.feeding import feed_batch
from twin.trace.encoder import (
    can_fork,
    error_from_bytes,
    error_to_bytes,
    open_pipe,
    read_frame,
    write_frame,
)
from twin.trace.format import FORMAT_VERSION, INPUT_NAMES, TraceReader
from twin.trace.scan import Collector

if TYPE_CHECKING:
    from twin.replay import Replayer, ReplayResult

__all__ = ["MIN_BYTES", "Fallback", "can_run", "run"]

MIN_BYTES = 1 << 20
"""Smaller trace files are replayed in one process (forking would cost more than it saves)."""
BATCH = 500
"""Inputs per message from the reader."""


class Fallback(Exception):  # noqa: N818 - a signal to the caller, not an error
    """Replay this trace sequentially instead."""


def can_run(replayer: Replayer) -> bool:
    """Whether ``replayer``'s trace can be replayed with a forked reader: an unread, whole,
    lazy reader of a current-format file of at least ``MIN_BYTES``, in a process that may fork."""
    trace = replayer.trace
    if (not isinstance(trace, TraceReader) or trace.partial or not trace.lazy
            or trace._started or replayer.version != FORMAT_VERSION or not can_fork()):
        return False
    try:
        return os.path.getsize(trace.path) >= MIN_BYTES
    except OSError:
        return False


def run(replayer: Replayer) -> ReplayResult:
    """Replay ``replayer``'s whole trace with a forked reader (module docstring)."""
    trace = replayer.trace
    assert isinstance(trace, TraceReader)
    r, w = open_pipe()
    pid = os.fork()
    if pid == 0:  # the reader: never returns
        os.close(r)
        _reader(str(trace.path), frozenset(replayer.ranks), w)
    os.close(w)
    src = os.fdopen(r, "rb")
    try:
        while True:
            payload = read_frame(src)
            if payload is None:
                raise Fallback("the trace reader ended early")
            msg = marshal.loads(payload)
            if msg[0] == "items":
                _replay(replayer, msg[1], msg[2])
            elif msg[0] == "end":
                _, outcome, warnings, truncated, counts, first_t, last_t = msg
                break
            elif msg[0] == "error":
                # a TraceError, as the sequential replay raises it
                raise error_from_bytes(msg[1], "the trace reader failed")
            else:
                raise Fallback(f"the trace reader failed: {msg[1]}")
    finally:
        src.close()
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)  # gone already unless we stop early
        os.waitpid(pid, 0)
    # what the reader learnt, on the reader the caller holds (outcome, warnings, counts)
    trace.outcome = outcome
    trace.warnings += warnings
    trace.truncated = truncated
    trace.counts.update({(n, d, t): k for n, d, t, k in counts})
    trace.first_t, trace.last_t = first_t, last_t
    return replayer._result()


def _replay(replayer: Replayer, items: list[tuple[Any, ...]], recorded: bytes) -> None:
    """Feed one batch (``feeding.feed_batch``); its effects' text must be ``recorded``, the
    text the reader collected (``twin.trace.scan.Collector``). One comparison per batch: on a
    difference the replay starts over sequentially anyway, which finds the input."""
    try:
        text = feed_batch(replayer, items)
    except Exception as exc:  # the sequential replay raises it again, or finds a divergence
        raise Fallback(f"{type(exc).__name__}: {exc}") from exc
    if text.encode() != recorded:
        raise Fallback("not the recorded effects")


def read_batches(path: str, replayed: frozenset[str], ship: Callable[[Collector], None]
                 ) -> TraceReader:
    """Read the trace at ``path`` as the forked reader does: its inputs for nodes in
    ``replayed`` (rows, with their effect lines' payload text) and the followed driver records,
    in batches of at least ``BATCH`` inputs handed to ``ship`` (the last one maybe smaller);
    the reader, read to its end. Raises what the reader raises."""
    from twin.replay import _FOLLOWED

    reader = TraceReader(path, select=INPUT_NAMES)
    col = reader.collect(replayed, _FOLLOWED, BATCH, lambda: ship(col))
    add_input, add_sys = col.add_input, col.add_sys
    for rec in reader:  # what the native pass left: inputs and driver records
        if rec.dir == "in":
            add_input(rec.t, rec.node, rec.row if rec.node in replayed else None)
        else:
            add_sys(rec.type, rec.data)
    col.end_input()
    ship(col)
    return reader


def _reader(path: str, replayed: frozenset[str], w: int) -> None:
    """The forked reader: ``read_batches`` to ``w``, then the end or the error."""
    code = 0
    try:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the replaying process decides
        gc.freeze()

        def ship(col: Collector) -> None:
            write_frame(w, marshal.dumps(("items", col.items, b"\n".join(col.text))))
            col.reset()

        try:
            reader = read_batches(path, replayed, ship)
            write_frame(w, marshal.dumps((
                "end", reader.outcome, reader.warnings, reader.truncated,
                [(*k, n) for k, n in reader.counts.items()], reader.first_t, reader.last_t)))
        except Exception as exc:  # noqa: BLE001 - the replaying process decides
            from twin.trace.codec import TraceError

            if isinstance(exc, TraceError):  # raised there at once: nothing replayed since
                # shows (the sequential replay would have fed the inputs before it, unseen)
                write_frame(w, marshal.dumps(("error", error_to_bytes(exc))))
            else:
                write_frame(w, marshal.dumps(("failed", f"{type(exc).__name__}: {exc}")))
    except BaseException:  # noqa: BLE001 - a closed pipe: the replay is over
        code = 1
    finally:
        os._exit(code)
