"""Replay with the trace read in a forked process.

The sequential replay (``Replayer.run_here``) spends most of its time reading: checking every
line's envelope and passing over the effect lines. ``run`` forks a reader that opens its own
``TraceReader`` of the same file (every check of the sequential reader, in the same order) and
sends, in msgpack batches, each input's payload text with the payload text of the effect lines
recorded after it, and the driver records the replay follows. This process decodes each input
into its class, feeds the cores, and compares the text of the effects they return with the
recorded text, while the reader reads on.

An error the reader meets (a ``TraceError``) is raised here, as the sequential replay raises
it. Whatever this path leaves to the sequential one raises ``Fallback``: effects whose text
differs from the recording (a divergence, or a hand-edited line), an input about a room not
introduced, and a reader that failed otherwise. The replay then starts over with fresh cores
in this process, so a divergence and its report are always the sequential replay's.
"""

from __future__ import annotations

import contextlib
import gc
import os
import signal
from typing import TYPE_CHECKING, Any

import msgspec

from twin.replay.feeding import feed_batch
from twin.runtime.signals import held_for_safe_points
from twin.trace.codec import TraceError
from twin.trace.encoder import can_fork, open_pipe, read_frame, write_frame
from twin.trace.format import INPUT_NAMES, TraceReader

if TYPE_CHECKING:
    from twin.replay import Replayer, ReplayResult

__all__ = ["MIN_BYTES", "Fallback", "can_run", "run"]

MIN_BYTES = 1 << 20
"""Smaller trace files are replayed in one process (forking would cost more than it saves)."""
BATCH = 500
"""Inputs per message from the reader."""
_pack = msgspec.msgpack.Encoder().encode
_unpack = msgspec.msgpack.Decoder().decode


class Fallback(Exception):  # noqa: N818 - a signal to the caller, not an error
    """Replay this trace sequentially instead."""


def can_run(replayer: Replayer) -> bool:
    """Whether ``replayer``'s trace can be replayed with a forked reader: an unread, whole,
    lazy reader of a file of at least ``MIN_BYTES``, in a process that may fork."""
    trace = replayer.trace
    if (not isinstance(trace, TraceReader) or trace.partial or not trace.lazy
            or trace.started or not can_fork()):
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
    introduced: set[int] = set()
    try:
        with held_for_safe_points() as noted:  # a signal is acted on between two batches
            while True:
                payload = read_frame(src)
                if noted.signum:  # (before judging the read: it may have ended the reader)
                    noted.deliver()
                if payload is None:
                    raise Fallback("the trace reader ended early")
                msg = _unpack(payload)
                if msg[0] == "items":
                    _replay(replayer, trace.name, msg[1], introduced)
                elif msg[0] == "end":
                    _, outcome, warnings, truncated, counts, first_t, last_t = msg
                    break
                elif msg[0] == "error":  # a TraceError, as the sequential replay raises it
                    raise TraceError(*msg[1])
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


def _replay(replayer: Replayer, name: str, items: list[Any], introduced: set[int]) -> None:
    """Feed one batch (``twin.replay.feeding.feed_batch``); ``Fallback`` when it could not
    vouch for it."""
    why = feed_batch(replayer, name, items, introduced)
    if why is not None:
        raise Fallback(why)


def read_batches(path: str, replayed: frozenset[str], ship: Any) -> TraceReader:
    """Read the trace at ``path`` as the forked reader does: its inputs for nodes in
    ``replayed`` with their effect lines' payload text, and the followed driver records, in
    batches of about ``BATCH`` inputs handed to ``ship(items)``; the reader, read to its end.
    Raises what the reader raises."""
    from twin.replay import _FOLLOWED

    reader = TraceReader(path, select=INPUT_NAMES)
    items: list[list[Any]] = []
    texts: list[bytes] = []  # the effect payloads after the latest input
    current: list[Any] | None = None  # that input's item (None: not replayed)

    def close_input() -> None:
        if current is not None:
            current.append(b"\n".join(texts))
        texts.clear()

    reader.passed_effects = texts.append
    inputs = 0
    for rec in reader:
        if rec.dir == "sys":
            if rec.type in _FOLLOWED:
                items.append([2, rec.type, rec.data])
            continue
        close_input()
        current = None
        if rec.node in replayed:
            current = [1, rec.line, rec.t, rec.node, rec.body + b"}"]
            items.append(current)
            inputs += 1
        if inputs >= BATCH and current is not None:
            continue_from = current
            items.remove(continue_from)  # it ships with its effects, in the next batch
            ship(items)
            items = [continue_from]
            inputs = 1
    close_input()
    ship(items)
    return reader


def _reader(path: str, replayed: frozenset[str], w: int) -> None:
    """The forked reader: ``read_batches`` to ``w``, then the end or the error."""
    code = 0
    try:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the replaying process decides
        gc.freeze()
        try:
            reader = read_batches(path, replayed,
                                  lambda items: write_frame(w, _pack(("items", items))))
            write_frame(w, _pack((
                "end", reader.outcome, reader.warnings, reader.truncated,
                [(*k, n) for k, n in reader.counts.items()], reader.first_t, reader.last_t)))
        except TraceError as exc:  # raised there at once
            write_frame(w, _pack(("error", [exc.where, exc.detail, exc.field])))
        except Exception as exc:  # noqa: BLE001 - the replaying process decides
            write_frame(w, _pack(("failed", f"{type(exc).__name__}: {exc}")))
    except BaseException:  # noqa: BLE001 - a closed pipe: the replay is over
        code = 1
    finally:
        os._exit(code)
