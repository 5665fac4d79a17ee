"""Trace files as a sequence of independently readable blocks (plain, gzip or zstd).

The writer hands over whole blocks of lines. Each block is compressed so that reading can start
at it: a gzip trace is one gzip member in which every block ends with a ``Z_FULL_FLUSH`` (the
compressor forgets its history there, so raw deflate decoding can start at the next byte); a
zstd trace is one zstd frame per block; a plain trace is just the text. After each block the
file is flushed, so a killed writer leaves every finished block readable. Compression and file
writes run in a background thread (zlib and zstd release the GIL while they compress), and the
optional ``on_block`` callback learns each block's byte range (the index uses it). A zstd frame
carries a checksum of its content, so a damaged block is found (older traces have none).

``BlockSource`` reads the decompressed bytes back, from the start or from a block's offset,
sets ``cut`` when a compressed stream ends early (a writer killed mid-run: the file is a
prefix of a good stream) and ``corrupt`` when it cannot be decoded (damaged data).
"""

from __future__ import annotations

import os
import queue
import threading
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any, NamedTuple

__all__ = ["CODECS", "BlockSink", "BlockSource", "Corrupt", "codec_for_name", "sniff_codec"]

CODECS = ("none", "gzip", "zstd")
GZIP_MAGIC = b"\x1f\x8b"
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
DEFAULT_LEVEL = {"gzip": 3, "zstd": 1}
"""gzip 3 compresses three times as fast as gzip's default 6 (for a third more bytes); zstd 1
compresses four times as fast as gzip 3, into fewer bytes than gzip 6."""
READ_SIZE = 1 << 18
HOLD_SIZE = 1 << 24
"""A zstd frame's output is handed on when the frame is complete (its checksum checked), or
in pieces of this size for a file compressed otherwise, as one huge frame."""


def codec_for_name(name: str) -> str:
    """The codec a trace file name asks for: ``.gz`` gzip, ``.zst`` zstd, anything else none."""
    if name.endswith(".gz"):
        return "gzip"
    if name.endswith(".zst"):
        return "zstd"
    return "none"


def sniff_codec(head: bytes) -> str:
    """The codec of a file from its first bytes (magic numbers), whatever its name."""
    if head[:2] == GZIP_MAGIC:
        return "gzip"
    if head[:4] == ZSTD_MAGIC:
        return "zstd"
    return "none"


def _zstd() -> Any:
    try:
        import zstandard
    except ImportError:  # pragma: no cover - a declared dependency
        raise RuntimeError("reading or writing .zst traces needs the 'zstandard' package "
                           "(pip install zstandard)") from None
    return zstandard


# ---------------------------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------------------------
class _Compressor:
    def __init__(self, codec: str, level: int | None) -> None:
        self.codec = codec
        level = DEFAULT_LEVEL.get(codec, 0) if level is None else level
        if codec == "gzip":
            self._z = zlib.compressobj(level, zlib.DEFLATED, 31)  # 31: a gzip header
        elif codec == "zstd":
            self._z = _zstd().ZstdCompressor(level=level, write_checksum=True)

    def block(self, data: bytes) -> bytes:
        if self.codec == "gzip":
            return self._z.compress(data) + self._z.flush(zlib.Z_FULL_FLUSH)
        if self.codec == "zstd":
            return self._z.compress(data)
        return data

    def finish(self) -> bytes:
        return self._z.flush(zlib.Z_FINISH) if self.codec == "gzip" else b""


class BlockSink:
    """Writes blocks to ``path`` (see the module docstring).

    ``write(data, meta)`` queues one block; ``on_block(meta, offset, end)`` is called after it is
    in the file (``offset`` is where reading can start for it). ``flush()`` waits until every
    queued block is written; ``close()`` finishes the stream. With ``threaded=False`` blocks
    are written at once, in the caller's thread.
    """

    def __init__(self, path: str | os.PathLike[str], codec: str, *, level: int | None = None,
                 threaded: bool = True,
                 on_block: Callable[[Any, int, int], None] | None = None) -> None:
        if codec not in CODECS:
            raise ValueError(f"unknown codec {codec!r}; one of {CODECS}")
        self.codec = codec
        self._c = _Compressor(codec, level)
        self._f: IO[bytes] = open(path, "wb")  # noqa: SIM115 - closed in close()
        self._pos = 0
        self._on_block = on_block
        self._error: BaseException | None = None
        self._closed = False
        self._queue: queue.Queue[tuple[bytes, Any] | None] | None = None
        self._thread: threading.Thread | None = None
        if threaded:
            self._queue = queue.Queue(maxsize=4)
            self._thread = threading.Thread(target=self._run, name="trace-writer", daemon=True)
            self._thread.start()

    def _put(self, data: bytes, meta: Any) -> None:
        out = self._c.block(data)
        offset = self._pos
        if self.codec == "gzip" and offset == 0:
            offset = len(out)  # never a restart point: the gzip header comes first
        self._f.write(out)
        self._f.flush()
        self._pos += len(out)
        if self._on_block is not None and meta is not None:
            self._on_block(meta, offset, self._pos)

    def _run(self) -> None:
        assert self._queue is not None
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                if self._error is None:
                    self._put(*item)
            except BaseException as exc:  # reported to the caller on its next call
                self._error = exc
            finally:
                self._queue.task_done()

    def _check(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def write(self, data: bytes, meta: Any = None) -> None:
        """Queue (or, unthreaded, write) one block."""
        if self._closed:
            raise ValueError("write to a closed trace file")
        self._check()
        if self._queue is None:
            self._put(data, meta)
        else:
            self._queue.put((data, meta))

    def flush(self) -> None:
        """Return when every block given so far is in the file."""
        if self._queue is not None:
            self._queue.join()
        self._check()

    def close(self) -> None:
        """Write what is queued, end the compressed stream and close the file."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._queue is not None and self._thread is not None:
                self._queue.put(None)
                self._thread.join()
            tail = self._c.finish()
            if tail:
                self._f.write(tail)
        finally:
            self._f.close()
        self._check()


# ---------------------------------------------------------------------------------------------
# Reading
# ---------------------------------------------------------------------------------------------
class Corrupt(NamedTuple):
    """Where a compressed stream could not be decoded."""

    codec: str
    offset: int
    """The file offset of the frame (zstd) or of the bytes (gzip) that failed to decode."""
    block: int | None
    """The zstd frame's number, counted from ``BlockSource.first_block`` (a trace's block);
    a gzip trace's block is found in its index by the reader."""
    detail: str

    def __str__(self) -> str:
        if self.codec == "zstd":
            where = f"in block {self.block} (its frame starts at byte {self.offset})"
        else:
            where = f"at byte {self.offset}" + (f", in block {self.block}"
                                                if self.block is not None else "")
        return f"{self.codec} data corrupt {where}: {self.detail}"


class BlockSource:
    """Decompressed bytes of a trace file in chunks, from ``start`` (a block offset; 0 = the
    beginning; ``first_block`` is that block's number) up to ``end`` (a block end offset;
    None = the end of the file).

    ``cut`` becomes True when a compressed stream ends without its end marker (a writer killed
    mid-run) or only zero bytes follow where decoding failed (a file system that zero-filled
    an unfinished write); ``corrupt`` (a ``Corrupt``) is set when decoding fails anywhere else.
    Either way the chunks stop at the last byte that decoded (for zstd: the last whole frame).
    """

    def __init__(self, path: str | os.PathLike[str], *, start: int = 0,
                 end: int | None = None, first_block: int = 0) -> None:
        self.path = Path(path)
        self.start = start
        self.end = end
        self.first_block = first_block
        self.cut = False
        self.corrupt: Corrupt | None = None
        self.codec = "none"

    def __iter__(self) -> Iterator[bytes]:
        with open(self.path, "rb") as raw:
            self.codec = sniff_codec(raw.read(4))
            raw.seek(self.start)
            left = None if self.end is None else self.end - self.start

            def read() -> bytes:
                nonlocal left
                if left is None:
                    return raw.read(READ_SIZE)
                data = raw.read(min(READ_SIZE, left))
                left -= len(data)
                return data

            if self.codec == "none":
                while chunk := read():
                    yield chunk
            elif self.codec == "gzip":
                yield from self._gzip(read)
            else:
                yield from self._zstd(read)

    def _failed(self, offset: int, block: int | None, detail: str, decoded_from: int) -> None:
        """Decoding failed at ``offset``. A ``cut`` when the file (up to ``end``) ends in zero
        bytes and what comes before them, from ``decoded_from`` (where this decoder began a
        stream or frame), decodes without error: an unfinished write a file system filled with
        zeros. Otherwise the data is ``corrupt``."""
        zeros = self._zero_tail()
        if zeros is not None and zeros >= decoded_from:
            before = BlockSource(self.path, start=decoded_from, end=zeros,
                                 first_block=self.first_block)
            for _ in before:
                pass
            if before.corrupt is None:
                self.cut = True
                return
        self.corrupt = Corrupt(self.codec, offset, block, detail)

    def _zero_tail(self) -> int | None:
        """Where the run of zero bytes that ends the file (or the range up to ``end``) starts;
        None when it ends in another byte."""
        with open(self.path, "rb") as f:
            end = f.seek(0, os.SEEK_END) if self.end is None else self.end
            at = end
            while at > self.start:
                n = min(READ_SIZE, at - self.start)
                f.seek(at - n)
                data = f.read(n)
                stripped = len(data.rstrip(b"\0"))
                if stripped:
                    at = at - n + stripped
                    break
                at -= n
        return at if at < end else None

    def _gzip(self, read: Callable[[], bytes]) -> Iterator[bytes]:
        # From a block offset the data is raw deflate; from 0 it is gzip (maybe several members).
        d = zlib.decompressobj(-15 if self.start else 47)
        raw_deflate = bool(self.start)
        skip = 0  # bytes of a member trailer still to skip (after raw deflate)
        fed = False
        pos = self.start  # the file offset of ``data``
        while True:
            data = read()
            if not data:
                break
            while data:
                if skip:
                    n = min(skip, len(data))
                    data, skip, pos = data[n:], skip - n, pos + n
                    continue
                fed = True
                before = d.copy()
                try:
                    out = d.decompress(data)
                except zlib.error as exc:
                    at, out = _gzip_until_error(before, data)
                    if out:
                        yield out  # what decoded before the error
                    self._failed(pos + at, None, str(exc), self.start)
                    return
                if out:
                    yield out
                if not d.eof:
                    pos += len(data)
                    break
                pos += len(data) - len(d.unused_data)
                data = d.unused_data
                if raw_deflate:  # the raw deflate ended: skip its member's trailer
                    skip, raw_deflate = 8, False
                fed = False
                d = zlib.decompressobj(47)
        if self.end is not None:
            return  # a block range: the stream goes on after it
        if fed and not d.eof:
            self.cut = True

    def _zstd(self, read: Callable[[], bytes]) -> Iterator[bytes]:
        zstandard = _zstd()
        dctx = zstandard.ZstdDecompressor()
        d = dctx.decompressobj()
        fed = False
        pos = frame_at = self.start  # the file offsets of ``data`` and of the frame
        frame = self.first_block
        held: list[bytes] = []  # the frame's output, handed on once its checksum is checked
        held_size = 0
        while True:
            data = read()
            if not data:
                break
            while data:
                fed = True
                try:
                    out = d.decompress(data)
                except zstandard.ZstdError as exc:
                    self._failed(frame_at, frame, str(exc).removeprefix(
                        "zstd decompressor error: "), frame_at)
                    return
                if out:
                    held.append(out)
                    held_size += len(out)
                    if held_size >= HOLD_SIZE:
                        yield b"".join(held)
                        held, held_size = [], 0
                if not d.eof:
                    pos += len(data)
                    break
                pos += len(data) - len(d.unused_data)
                if held:
                    yield b"".join(held)
                    held, held_size = [], 0
                data = d.unused_data
                fed = False
                frame, frame_at = frame + 1, pos
                d = dctx.decompressobj()
        if held:
            yield b"".join(held)  # an unfinished last frame (a killed writer's)
        if fed and not d.eof:
            self.cut = True


def _gzip_until_error(d: Any, data: bytes, step: int = 64) -> tuple[int, bytes]:
    """Where in ``data`` decompressor ``d`` (a copy from before ``data``) fails, to ``step``
    bytes, and what it decodes before."""
    out: list[bytes] = []
    for i in range(0, len(data), step):
        try:
            out.append(d.decompress(data[i:i + step]))
        except zlib.error:
            return i, b"".join(out)
        if d.eof:
            break
    return 0, b"".join(out)
