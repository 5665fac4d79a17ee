"""The trace encoder in a forked child: ``EncoderProcess`` runs a ``LineEncoder``
(``twin.trace.lines``) on another core, fed the writer's batches as msgpack through a pipe, so
that a simulation pays for collecting its events and not for their text. Also the plumbing it
shares with other forked helpers: framed pipes, errors carried as JSON (never pickled), and
``sigint_deferred``."""

from __future__ import annotations

import contextlib
import gc
import json
import os
import signal
import struct
import threading
from typing import Any

from twin.runtime.signals import Noted, held_for_safe_points
from twin.trace.lines import DRIVER, JSON_TEXT, LineEncoder

__all__ = ["DRIVER", "JSON_TEXT", "EncoderProcess", "LineEncoder", "can_fork"]

# ---------------------------------------------------------------------------------------------
# The encoder in a child process
# ---------------------------------------------------------------------------------------------
_LEN = struct.Struct("<I")
_FLUSH = b"F"
_PIPE_SIZE = 1 << 20


def can_fork() -> bool:
    """Whether this process may fork an encoder: POSIX, and no other thread that could hold a
    lock the child would need."""
    return hasattr(os, "fork") and threading.active_count() == 1


class EncoderProcess:
    """Runs ``encoder`` in a forked child, fed batches of items through a pipe.

    The child ignores SIGINT (an interrupted run still writes its outcome through it) and ends
    when the pipe does: on ``close()``, or when this process dies, after writing every whole
    batch it received (a batch the dying process was still writing is dropped). An error in the child (a full disk, say) is raised here on the next ``feed``,
    ``flush`` or ``close``; the exception is carried over by pickle.
    """

    def __init__(self, encoder: LineEncoder) -> None:
        data_r, data_w = open_pipe()  # room for about 20 batches
        res_r, res_w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: never returns
            os.close(data_w)
            os.close(res_r)
            _child(encoder, data_r, res_w)
        os.close(data_r)
        os.close(res_w)
        self.pid = pid
        self._w = data_w
        self._r = os.fdopen(res_r, "rb")
        self._done = False
        self._error: BaseException | None = None  # the child's, raised once

    def feed(self, data: bytes) -> None:
        """Send a batch (``twin.trace.lines.pack_batch``'s bytes) to the child as one frame."""
        self._send(_LEN.pack(len(data)), data)

    def flush(self) -> None:
        self._send(_LEN.pack(len(_FLUSH)), _FLUSH)
        reply = self._r.read(1)
        if reply != _FLUSH:
            self._fail(reply + self._r.read())

    def close(self) -> None:
        """Let the child finish (every item sent is written) and raise its error, if any."""
        if self._done:
            return
        self._done = True
        os.close(self._w)
        try:
            if self._error is None:  # an error already raised is not raised again
                self._fail(self._r.read())
        finally:
            self._r.close()
            os.waitpid(self.pid, 0)

    abandon = close

    def _send(self, *parts: bytes) -> None:
        if self._error is not None:
            raise self._error
        if self._done:
            raise ValueError("trace encoder is closed")
        try:
            _write_all(self._w, *parts)
        except BrokenPipeError:
            self._fail(self._r.read())

    def _fail(self, reply: bytes) -> None:
        """Raise what the child reported (nothing when it reported success)."""
        if reply == b"ok":
            return
        if reply[:1] == b"E":
            exc = error_from_bytes(reply[1:], "the trace encoder failed")
        else:
            exc = RuntimeError(f"the trace encoder process ended early ({reply[:40]!r})")
        self._error = exc
        raise exc


def open_pipe() -> tuple[int, int]:
    """A pipe (read end, write end) with room for about a megabyte where Linux allows it."""
    r, w = os.pipe()
    with contextlib.suppress(OSError):
        import fcntl  # POSIX, as fork is

        fcntl.fcntl(w, getattr(fcntl, "F_SETPIPE_SZ", 1031), _PIPE_SIZE)
    return r, w


def write_frame(fd: int, payload: bytes) -> None:
    """Write ``payload`` as one length-prefixed frame (``read_frame`` reads it)."""
    _write_all(fd, _LEN.pack(len(payload)), payload)


def read_frame(src: Any) -> bytes | None:
    """The next frame's payload from the binary file ``src``; None at the end of the pipe (or
    a frame cut short by a writer that died)."""
    head = src.read(4)
    if len(head) < 4:
        return None
    n = _LEN.unpack(head)[0]
    payload = src.read(n)
    return payload if len(payload) == n else None


def sigint_deferred() -> contextlib.AbstractContextManager[Noted]:
    """Hold a Ctrl-C (SIGINT) off for the block, then act on it as the handler before would
    have (``KeyboardInterrupt`` by default): ``held_for_safe_points`` for SIGINT alone. An
    interrupt raised between bytecodes could otherwise land between a write and the
    bookkeeping of what it wrote (a batch sent twice, or dropped). Outside the main thread the
    block runs as is; inside another such block, the inner one hands the signal on to it."""
    return held_for_safe_points(signums=(signal.SIGINT,))


def _write_all(fd: int, *parts: bytes) -> None:
    """Write all of ``parts``, one after another, with as few copies and calls as the pipe
    allows; a Ctrl-C meanwhile is raised once the frame is whole (the child ignores SIGINT and
    goes on reading), so the interrupted run can still write its outcome."""
    with sigint_deferred():
        done = os.writev(fd, parts)
        if done == sum(len(p) for p in parts):
            return
        view = memoryview(b"".join(parts))[done:]  # the pipe took part of it: the rest
        while view:
            view = view[os.write(fd, view):]


def _child(encoder: LineEncoder, data_r: int, res_w: int) -> None:
    code = 0
    try:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        gc.freeze()  # the inherited heap is never traversed (nor copied page by page)
        src = os.fdopen(data_r, "rb")
        out = os.fdopen(res_w, "wb", buffering=0)
        try:
            while True:
                payload = read_frame(src)
                if payload is None:  # the pipe's end, or a frame a killed writer cut short
                    break
                if payload == _FLUSH:
                    encoder.flush()
                    out.write(_FLUSH)
                    continue
                encoder.feed_packed(payload)
            encoder.close()
            out.write(b"ok")
        except BaseException as exc:  # noqa: BLE001 - reported to the parent
            code = 1
            encoder.abandon()
            with contextlib.suppress(OSError):
                out.write(b"E" + error_to_bytes(exc))
    finally:
        os._exit(code)


def error_to_bytes(exc: BaseException) -> bytes:
    """An exception as JSON data (its type's name, text, and what rebuilds a ``TraceError`` or
    an ``OSError``), for a forked child to report to its parent: never pickled."""
    from twin.trace.codec import TraceError

    d: dict[str, object] = {"type": type(exc).__name__, "text": str(exc)[:2000]}
    if isinstance(exc, TraceError):
        d["trace"] = [exc.where, exc.detail, exc.field]
    elif isinstance(exc, OSError) and exc.errno is not None:
        d["os"] = [exc.errno, exc.strerror, exc.filename if isinstance(exc.filename, str)
                   else None]
    return json.dumps(d).encode()


_PLAIN_ERRORS: dict[str, type[Exception]] = {
    e.__name__: e for e in (TypeError, ValueError, OverflowError, RuntimeError, MemoryError,
                            KeyError, IndexError, UnicodeError)}


def error_from_bytes(data: bytes, context: str) -> BaseException:
    """The exception :func:`error_to_bytes` described: a ``TraceError`` or ``OSError`` as it
    was, a plain built-in error of its type, anything else a ``RuntimeError`` naming its type;
    ``context`` if ``data`` is bad."""
    from twin.trace.codec import TraceError

    try:
        d = json.loads(data)
        if "trace" in d:
            where, detail, field = d["trace"]
            return TraceError(str(where), str(detail), None if field is None else str(field))
        if "os" in d:
            errno, strerror, filename = d["os"]
            return OSError(int(errno), str(strerror), *([filename] if filename else []))
        kind = _PLAIN_ERRORS.get(d["type"])
        if kind is not None:
            return kind(str(d["text"]))
        return RuntimeError(f"{context}: {d['type']}: {d['text']}")
    except (ValueError, KeyError, TypeError):
        return RuntimeError(context)
