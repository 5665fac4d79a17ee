"""The staging-twin trace: versioned JSON Lines (plain, or gzip), one writer, one reader.

Line 1 is the header; every later line is one event::

    {"format": "staging-twin-trace", "version": 1, "mode": "sim", "config": {...}, ...}
    {"seq": 0, "t": 0.0, "node": "driver", "dir": "sys", "type": "RequestArrived", ...}
    {"seq": 1, "t": 0.0, "node": "d0g0r0", "dir": "in", "type": "DecodeRoomInit", ...}
    {"seq": 2, "t": 0.0, "node": "d0g0r0", "dir": "out", "type": "SetTimer", "at": 300.0}
    ...
    {"seq": 93, "t": 0.41, "node": "driver", "dir": "sys", "type": "Outcome", ...}

``dir`` is ``"in"`` (an input a rank handled), ``"out"`` (an effect it returned) or ``"sys"`` (a
driver record, ``SYS_TYPES``). A complete trace ends with an ``Outcome`` record. ``TraceWriter``
streams and flushes so that a killed run leaves a readable prefix; ``read_trace`` /
``iter_trace`` validate everything and name ``file:line`` and the field on error. The rules are
documented in ``docs/trace-format.md`` (whose tables ``markdown_event_tables`` generates).

The classes are the schema (``twin.trace.codec``): a new field needs nothing else to be written,
read, replayed and exported. Its documentation does: ``python -m twin.trace.format docs``
rewrites ``schema.json`` and the field tables of ``docs/trace-format.md`` from the classes
(tests fail until both are in sync).
"""

from __future__ import annotations

import contextlib
import importlib.resources
import itertools
import json
import math
import os
import platform
import re
import sys
from collections import Counter
from collections.abc import Callable, Container, Generator, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

from twin.core import events as ev
from twin.core.config import ConfigError, TwinConfig
from twin.core.defects import CATALOG
from twin.trace.blocks import BlockSink, BlockSource, Corrupt, codec_for_name
from twin.trace.codec import (
    EFFECT_NAMES,
    INPUT_NAMES,
    MESSAGE_KINDS,
    TraceError,
    decode_event,
    encode,
    event_from_json,
    field_specs,
)
from twin.trace.compat import recorded_config
from twin.trace.encoder import EncoderProcess, can_fork, sigint_deferred
from twin.trace.index import Block, IndexWriter, index_path
from twin.trace.lines import DRIVER, JSON_TEXT, Batch, LineEncoder
from twin.trace.records import (
    OUTCOME_STATUSES,
    SYS_DOCS,
    SYS_TYPES,
    check_record,
)
from twin.trace.rooms import room_of

try:
    from orjson import loads as _fast_loads
except ImportError:  # pragma: no cover - a declared dependency; the standard parser also works
    _fast_loads = json.loads  # type: ignore[assignment]


def _loads(raw: bytes) -> Any:
    """``orjson.loads``, falling back to ``json.loads`` (integers beyond 64 bits)."""
    try:
        return _fast_loads(raw)
    except ValueError:
        return json.loads(raw)


__all__ = [
    "DRIVER",
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "OUTCOME_STATUSES",
    "SYS_TYPES",
    "Record",
    "RecordStream",
    "Trace",
    "TraceError",
    "TraceReader",
    "TraceWriter",
    "build_schema",
    "iter_trace",
    "make_header",
    "open_trace",
    "markdown_event_tables",
    "node_id",
    "read_trace",
    "software_versions",
]

FORMAT_NAME = "staging-twin-trace"
FORMAT_VERSION = 4
# DRIVER (from twin.trace.encoder): the pseudo node of run-level records (``dir`` "sys")
MODES = ("sim", "hw")
ROLES = ("prefill", "decode")
DIRS = ("in", "out", "sys")
SCHEMA_PATH = Path(str(importlib.resources.files("twin.trace").joinpath("schema.json")))

_NODE_RE = re.compile(r"^[pd]\d+g\d+(s\d+)?r\d+$")
_ENVELOPE = ("seq", "t", "node", "dir")


def node_id(role: str, instance: int, dp: int, rank: int) -> str:
    """Canonical node id, e.g. ``node_id("prefill", 0, 1, 2) == "p0g1r2"``."""
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, got {role!r}")
    return f"{role[0]}{instance}g{dp}r{rank}"


def software_versions() -> dict[str, str]:
    """Versions of the twin, Python and (when installed) simpy, torch and nixl; imports nothing."""
    from importlib import metadata  # here: 20 ms to import, wanted only by writers

    from twin import __version__

    out = {"twin": __version__, "python": platform.python_version()}
    for dist in ("simpy", "torch", "nixl"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            out[dist] = metadata.version(dist)
    return out


def make_header(mode: str, config: TwinConfig, nodes: Sequence[Mapping[str, Any]], *,
                defects: Iterable[str] = (), faults: Iterable[str] = (), seed: int | None = None,
                workload: Mapping[str, Any] | None = None, created: str | None = None
                ) -> dict[str, Any]:
    """A complete header dict for ``TraceWriter`` (software versions filled in)."""
    header: dict[str, Any] = {
        "format": FORMAT_NAME, "version": FORMAT_VERSION, "mode": mode,
        "config": config.to_dict(), "defects": sorted(defects), "faults": list(faults),
        "seed": seed, "workload": dict(workload or {}), "nodes": [dict(n) for n in nodes],
        "software": software_versions(),
    }
    if created is not None:
        header["created"] = created
    return header


# ---------------------------------------------------------------------------------------------
# Header validation (shared by writer and reader)
# ---------------------------------------------------------------------------------------------
_HEADER_KEYS = ("format", "version", "mode", "config", "defects", "faults", "seed", "workload",
                "nodes", "software", "created", "agents")


def _check_header(h: Any, where: str, warnings: list[str] | None = None
                  ) -> tuple[TwinConfig, dict[str, dict[str, Any]]]:
    """Validate a header; return its config and nodes by id. Raises ``TraceError``."""
    if type(h) is not dict or h.get("format") != FORMAT_NAME:
        raise TraceError(where, f"not a staging-twin trace (line 1 has no "
                         f'"format": "{FORMAT_NAME}")')
    version = h.get("version")
    if type(version) is not int or version < 1:
        raise TraceError(where, f"expected a positive integer, got {version!r}", "version")
    if version > FORMAT_VERSION:
        raise TraceError(where, f"written by a newer staging-twin (version {version}); "
                         f"this reader supports {FORMAT_VERSION}")
    if h.get("mode") not in MODES:
        raise TraceError(where, f"expected one of {MODES}, got {h.get('mode')!r}", "mode")
    cfg_data = h.get("config")
    if type(cfg_data) is not dict:
        raise TraceError(where, "expected an object", "config")
    if "disaggregation_transfer_backend" not in cfg_data:
        # Written before the backend was a config field: the twin modelled NIXL's path.
        cfg_data = {**cfg_data, "disaggregation_transfer_backend": "nixl"}
    try:
        config = TwinConfig.from_dict(cfg_data, source="config")
        config = recorded_config(h["version"], config, cfg_data)
    except ConfigError as exc:
        found = re.search(r"field '([^']+)': (.*)", str(exc), re.DOTALL)
        if found is None:
            raise TraceError(where, f"invalid config: {exc}", "config") from None
        raise TraceError(where, f"invalid config: {found[2]}", f"config.{found[1]}") from None
    for key in ("defects", "faults"):
        value = h.get(key)
        if type(value) is not list or not all(type(x) is str for x in value):
            raise TraceError(where, "expected a list of strings", key)
    unknown = [d for d in h["defects"] if d not in CATALOG]
    if unknown and warnings is not None:
        warnings.append(f"{where}: unknown defect switch(es): {', '.join(unknown)}")
    if "seed" not in h or (h["seed"] is not None and type(h["seed"]) is not int):
        raise TraceError(where, "expected an integer or null", "seed")
    if type(h.get("workload")) is not dict:
        raise TraceError(where, "expected an object", "workload")
    software = h.get("software")
    if type(software) is not dict or not all(type(v) is str for v in software.values()):
        raise TraceError(where, "expected an object of version strings", "software")
    if "created" in h and type(h["created"]) is not str:
        raise TraceError(where, "expected a string", "created")
    nodes_data = h.get("nodes")
    if type(nodes_data) is not list:
        raise TraceError(where, "expected a list of node objects", "nodes")
    nodes: dict[str, dict[str, Any]] = {}
    for i, n in enumerate(nodes_data):
        path = f"nodes[{i}]"
        if type(n) is not dict:
            raise TraceError(where, "expected an object", path)
        nid = n.get("id")
        if type(nid) is not str or not _NODE_RE.match(nid):
            raise TraceError(where, f"expected an id like 'p0g0r0', got {nid!r}", f"{path}.id")
        if nid in nodes:
            raise TraceError(where, f"duplicate node id {nid!r}", f"{path}.id")
        if n.get("role") not in ROLES:
            raise TraceError(where, f"expected one of {ROLES}, got {n.get('role')!r}",
                             f"{path}.role")
        for key in ("instance", "dp", "rank"):
            if type(n.get(key)) is not int or n[key] < 0:
                raise TraceError(where, f"expected a non-negative integer, got {n.get(key)!r}",
                                 f"{path}.{key}")
        nodes[nid] = n
    extra = [k for k in h if k not in _HEADER_KEYS]
    if extra and warnings is not None:
        warnings.append(f"{where}: unknown header key(s) ignored: {', '.join(extra)}")
    return config, nodes


# ---------------------------------------------------------------------------------------------
# Writer
# ---------------------------------------------------------------------------------------------
class TraceWriter:
    """Streams one trace to ``path``: gzip when the name ends in ``.gz``, zstd for ``.zst``,
    plain text otherwise; and its index beside it (``PATH.idx``, ``twin.trace.index``).

    The header is validated and written at once. Each record is checked as it comes (times
    finite and non-decreasing, nodes declared in the header, events of the core's classes,
    driver records by ``SYS_TYPES``) and collected into a batch of items
    (``twin.trace.lines``); the batches become text, blocks and index in a ``LineEncoder``.
    ``encoder="process"`` runs it in a forked child process (the batches cross as msgpack),
    so that the caller pays for collecting, not for encoding; ``"inline"`` runs it here;
    ``"auto"`` (the default) forks when ``can_fork()`` (no other threads) and otherwise runs
    inline. Both write the same bytes. A block ends every ``flush_every`` lines (after an
    input's effects, so an input and its effects share a block; ``2 * flush_every`` lines at
    most) and on ``flush``/``close``; each block is compressed (zstd level 1 or gzip level 3
    unless ``level`` says otherwise), written and flushed: a killed process leaves a readable
    trace that ends a few thousand lines early at most (the items not yet handed to the
    encoder and the encoder's unfinished block; a forked encoder outlives its writer and writes
    what it was handed; a partial last line or block is tolerated by the reader).
    ``threaded=True`` compresses and writes in a background thread (inline only), which only
    pays when the caller leaves the GIL free. ``index=False`` writes no index (and removes a
    stale one). Used as a context manager, an exception inside the block writes an
    ``Outcome`` with status ``"crashed"`` (``"interrupted"`` for ``KeyboardInterrupt``) and is
    re-raised.
    """

    def __init__(self, path: str | os.PathLike[str], header: Mapping[str, Any], *,
                 flush_every: int = 1000, level: int | None = None, index: bool = True,
                 threaded: bool = False, encoder: str = "auto") -> None:
        if encoder not in ("auto", "inline", "process"):
            raise ValueError(f"encoder must be 'auto', 'inline' or 'process', not {encoder!r}")
        if encoder == "process" and threaded:
            raise ValueError("threaded=True compresses in a thread of this process, which a "
                             "forked encoder would not have: use encoder='inline'")
        # decided before the sink starts a thread of its own (threaded=True)
        self.encoder = "process" if encoder == "process" or (
            encoder == "auto" and not threaded and can_fork()) else "inline"
        self.path = Path(path)
        self.header = dict(header)
        self.config, nodes = _check_header(self.header, f"{self.path}: header")
        self.flush_every = max(1, flush_every)
        self._nodes = nodes
        self._codes = {nid: i for i, nid in enumerate(nodes)}
        self._decode_nodes = {nid for nid, v in nodes.items() if v["role"] == "decode"}
        self._closed = False
        self.requests = 0
        self._batch = Batch(str(self.path), self._codes, self._decode_nodes, self.flush_every,
                            self._ship, self._check_sys, packed=self.encoder == "process")
        codec = codec_for_name(self.path.name)
        header_line = (JSON_TEXT(self.header) + "\n").encode("utf-8")
        if index:
            index_writer: IndexWriter | None = IndexWriter(self.path, codec, header_line)
        else:
            index_writer = None
            index_path(self.path).unlink(missing_ok=True)  # an older trace's index
        try:
            sink = BlockSink(self.path, codec, level=level, threaded=threaded,
                             on_block=index_writer.block if index_writer else None)
            sink.write(header_line)
            sink.flush()
        except BaseException:
            if index_writer is not None:
                index_writer.close()
            raise
        back = LineEncoder(sink, index_writer, nodes, self.flush_every)
        self._back: LineEncoder | EncoderProcess = (
            EncoderProcess(back) if self.encoder == "process" else back)

    # -- hot path (twin.trace.lines.Batch) -------------------------------------------------
    @property
    def record(self) -> Callable[[float, str, Any, Iterable[Any]], None]:
        """``record(t, node, event, effects)``: ``node`` handled input ``event`` at time ``t``
        and returned ``effects`` (the runtime's one call per input)."""
        return self._batch.record

    def write_input(self, t: float, node: str, event: Any) -> None:
        """Record that ``node`` handled input ``event`` at time ``t`` (its effects follow with
        ``write_effects``)."""
        self._batch.add_input(t, node, event)

    def write_effects(self, t: float, node: str, effects: Iterable[Any]) -> None:
        """Record the effects ``node`` returned for its last input, in order."""
        self._batch.add_effects(t, node, effects)

    @property
    def succeeded(self) -> set[int]:
        """Rooms a decode node concluded with ``Success`` so far."""
        return self._batch.succeeded

    @property
    def failed(self) -> set[int]:
        """Rooms a decode node concluded otherwise so far."""
        return self._batch.failed

    @property
    def write_sys(self) -> Callable[[float, str, Mapping[str, Any]], None]:
        """``write_sys(t, node, record)``: a driver record (``twin.trace.records``); ``node``
        is a node id or ``"driver"``."""
        return self._batch.write_sys

    def _check_sys(self, rec: dict[str, Any]) -> None:
        """``Batch.check_sys``: a record other than ``ForwardStart``/``ForwardEnd``."""
        rtype = check_record(rec, "", self._nodes)
        if len(rec) > len(SYS_TYPES[rtype]) + 1:  # keys of the driver's own: plain data?
            try:
                JSON_TEXT(rec)
            except (TypeError, ValueError) as exc:
                raise TypeError(f"a trace record holds a value that is not plain data: {exc}"
                                ) from None
        if rtype == "RequestArrived":
            self.requests += 1

    # -- blocks and closing --------------------------------------------------------------------
    def _ship(self) -> None:
        """Hand the batch to the encoder."""
        if self._closed:
            raise ValueError(f"{self.path}: trace writer is closed")
        with sigint_deferred():  # a Ctrl-C here would drop the batch or send it twice
            batch = self._batch.take()
            if batch is not None:
                self._back.feed(batch)

    def flush(self) -> None:
        """Write everything buffered and wait until it is in the file."""
        self._ship()
        self._back.flush()

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self, outcome: Mapping[str, Any] | None = None) -> None:
        """Write ``outcome`` (an ``Outcome`` record, ``type`` optional) if given, then close.

        Without an outcome the trace stays "incomplete". Closing twice is a no-op.
        """
        if self._closed:
            return
        try:
            if outcome is not None:
                self._batch.write_sys(self._batch.t, DRIVER, {"type": "Outcome", **outcome})
            self._ship()
        finally:
            self._closed = True
            self._back.close()

    def abort_outcome(self, exc: BaseException) -> dict[str, Any]:
        """The ``Outcome`` written when the run raised ``exc``."""
        status = "interrupted" if isinstance(exc, KeyboardInterrupt) else "crashed"
        text = f"{type(exc).__name__}: {exc}".rstrip(": ")
        return {"status": status, "completed": len(self.succeeded - self.failed),
                "failed": len(self.failed), "requests": self.requests, "diagnosis": [text],
                "corruption": []}

    def __enter__(self) -> TraceWriter:
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        if exc is None or self._closed:
            self.close()
            return
        try:
            self.close(self.abort_outcome(exc))
        except Exception:  # the run's own exception matters more than a trace error
            self._closed = True
            with contextlib.suppress(Exception):
                self._back.abandon()


_INPUT_CLASSES = frozenset(ev.INPUT_TYPES)
_EFFECT_CLASSES = frozenset(ev.EFFECT_TYPES)


# ---------------------------------------------------------------------------------------------
# Reader
# ---------------------------------------------------------------------------------------------
_PAYLOAD_EVENTS = 4096
"""How many decoded payloads a lazy reader keeps (``TraceReader.payload_events``): a frame
sent to several ranks, a timer and a transfer completion repeat within a few hundred lines."""


class Record:
    """One event line: the envelope, the payload dict (``type`` + fields) and, for ``in`` and
    ``out`` lines, the decoded core event (``None`` for ``sys`` records).

    A record from a lazy reader keeps its line's bytes and decodes ``data`` and ``event`` the
    first time they are asked for (``event`` then checks the payload as the strict reader
    does); ``raw`` is the line's bytes (None for records read strictly) and ``body`` the
    payload's JSON text, for cheap comparisons.
    """

    __slots__ = ("_body_at", "_data", "_event", "_src", "dir", "line", "node", "raw", "seq",
                 "t", "type")

    def __init__(self, seq: int, t: float, node: str, dir: str, type: str,  # noqa: A002
                 data: dict[str, Any] | None, event: Any, line: int, raw: bytes | None = None,
                 body_at: int = 0, src: TraceReader | None = None) -> None:
        self.seq = seq
        self.t = t
        self.node = node
        self.dir = dir
        self.type = type
        self._data = data
        self._event = event
        self.line = line
        self.raw = raw
        self._body_at = body_at
        self._src = src

    @property
    def data(self) -> dict[str, Any]:
        d = self._data
        if d is None:
            try:
                d = _loads(cast(bytes, self.raw))
            except ValueError:
                src = self._src
                raise TraceError(f"{src.name if src else '?'}:{self.line}",
                                 "not valid JSON") from None
            for key in _ENVELOPE:
                del d[key]
            self._data = d
        return d

    @property
    def event(self) -> Any:
        if self._event is None and self.dir != "sys":
            src = self._src
            if src is None:
                self._event = self._decode()
                return self._event
            if self._body_at:  # the same payload decodes the same: look it up
                cache = src.payload_events
                key = self.raw[self._body_at:]  # type: ignore[index]
                known = cache.get(key)
                if known is None:
                    event = self._decode()
                    known = event, room_of(event)
                    if len(cache) >= _PAYLOAD_EVENTS:
                        cache.clear()
                    cache[key] = known
                event, room = known
            else:
                event = self._decode()
                room = room_of(event)
            if room is not None and room not in src.rooms and not src.partial:
                raise TraceError(f"{src.name}:{self.line}", f"room {room} was never "
                                 "introduced by a RequestArrived record", "room")
            self._event = event
        return self._event

    def _decode(self) -> Any:
        """The core event of this in/out line, checked as the strict reader checks it:
        straight from the payload's text when the line is as the writer writes it, else from
        the parsed object (fields in another order, an older format version)."""
        src = self._src
        where = f"{src.name if src else '?'}:{self.line}"
        if self._body_at and self.raw is not None:
            return decode_event(b"{" + self.raw[self._body_at:], where=where,
                                direction=self.dir)
        return event_from_json(self.data, where=where)

    @property
    def body(self) -> bytes:
        """The payload as written: ``"type":"Name",...`` without the closing brace."""
        if self.raw is not None and self._body_at:
            return self.raw[self._body_at:-1]
        return _dumps_body(self.data)

    def to_json(self) -> dict[str, Any]:
        """The line as written (envelope then payload)."""
        return {"seq": self.seq, "t": self.t, "node": self.node, "dir": self.dir, **self.data}

    def __repr__(self) -> str:
        return (f"Record(seq={self.seq}, t={self.t!r}, node={self.node!r}, dir={self.dir!r}, "
                f"type={self.type!r}, line={self.line})")

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Record):
            return NotImplemented
        return (self.seq, self.t, self.node, self.dir, self.data) == (
            other.seq, other.t, other.node, other.dir, other.data)

    __hash__ = None  # type: ignore[assignment]


def _dumps_body(d: Mapping[str, Any]) -> bytes:
    return json.dumps(d, separators=(",", ":"), allow_nan=False)[1:-1].encode("utf-8")


@dataclass
class Trace:
    """A whole trace in memory (see ``read_trace``); fine for small traces. Large ones are
    read with ``iter_trace`` (the views in ``twin.trace.inspect``, the Perfetto export and the
    replay all stream)."""

    path: str
    header: dict[str, Any]
    config: TwinConfig
    nodes: dict[str, dict[str, Any]]
    events: list[Record]
    outcome: dict[str, Any] | None
    truncated: bool
    warnings: list[str] = field(default_factory=list)

    @property
    def complete(self) -> bool:
        """An ``Outcome`` was read and nothing was cut off."""
        return self.outcome is not None and not self.truncated

    @property
    def status(self) -> str:
        """The outcome status, or ``"incomplete"``."""
        return self.outcome["status"] if self.outcome is not None else "incomplete"

    @property
    def name(self) -> str:
        return self.path

    def __iter__(self) -> Iterator[Record]:
        return iter(self.events)


def _corruption(source: BlockSource) -> Corrupt | None:
    """``source.corrupt`` as it is now (a call: a check of it before does not narrow it)."""
    return source.corrupt


def _batches(source: BlockSource) -> Generator[tuple[list[bytes], bool], None, None]:
    """The lines of ``source`` in batches (one per decompressed chunk): ``(lines, True)``, and
    at the end ``([last], False)`` for a last line without a newline."""
    rest = b""
    for chunk in source:
        parts = chunk.split(b"\n")
        if rest:
            parts[0] = rest + parts[0]
        rest = parts.pop()
        if parts:
            yield parts, True
    if rest:
        yield [rest], False


def _unbatch(batches: Iterator[tuple[list[bytes], bool]]) -> Iterator[tuple[bytes, bool]]:
    for lines, ended in batches:
        for line in lines:
            yield line, ended


_ENV_RE = re.compile(rb'\{"seq":(\d+),"t":([-+.0-9eE]+),'
                     rb'("node":"[A-Za-z0-9_-]+","dir":"(?:in|out|sys)","type":"[A-Za-z_]+")[,}]')
"""The envelope as the writer writes it: seq, t, and node/dir/type as one group."""
_NUMBER_RE = re.compile(rb"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][-+]?[0-9]+)?\Z")
"""A JSON number, whole."""
_NESTED = frozenset(cls.__name__ for cls in (*ev.INPUT_TYPES, *ev.EFFECT_TYPES)
                    if any(f.spec[0] in ("msg", "event") or f.spec[-1][0] == "event"
                           for f in field_specs(cls)))
"""Input and effect types with objects inside (a message, targets), last in their lines: a
whole line ends in ``}}`` or ``]}`` (``TraceReader._whole``)."""
_KEY_RE = re.compile(rb'"node":"([^"]+)","dir":"([a-z]+)","type":"([A-Za-z_]+)"')


class TraceReader:
    """Streams a trace: ``header``/``config``/``nodes`` at once, records by iterating.

    After iteration ``outcome``, ``truncated`` and ``warnings`` are final. By default every
    check described in ``docs/trace-format.md`` is applied as lines are read; the first
    violation raises ``TraceError``. With ``lazy=True`` each line's envelope is checked (JSON
    shape, ``seq``, ``t``, ``node``, ``dir``, ``type``) and driver records fully, while input
    and effect payloads are decoded (and checked) only when a record's ``data``/``event`` is
    used: the views and the replay read this way.

    ``span`` (a ``twin.trace.index.Block`` range: ``(first, last)``) reads only those blocks of
    an indexed trace; such a reader is ``partial`` (no room or Outcome expectations). With
    ``of`` (another reader of the same file: ``part``) it takes that reader's header instead
    of reading it again.
    ``select`` (a set of type names; implies ``lazy``) yields only records of those types and of
    driver records; the others are checked as in lazy mode and counted in ``counts``.
    """

    header_line: bytes
    header: dict[str, Any]
    version: int
    config: TwinConfig
    nodes: dict[str, dict[str, Any]]

    def __init__(self, path: str | os.PathLike[str], *, lazy: bool = False,
                 span: tuple[Block, Block | None] | None = None,
                 select: Container[str] | None = None, of: TraceReader | None = None) -> None:
        self._setup(path, lazy or select is not None, select)
        if of is not None and span is not None:  # ``part``: the header is ``of``'s
            self.header_line, self.header, self.version = of.header_line, of.header, of.version
            self.config, self.nodes = of.config, of.nodes
            self._open_span(span)
            return
        try:
            self._source = BlockSource(self.path)
            self._gen = _batches(self._source)
            self._it: Iterator[tuple[list[bytes], bool]] = self._gen
            batch = next(self._it, None)
        except FileNotFoundError:
            raise TraceError(self.name, "no such file") from None
        first = None
        if batch is not None:
            first = (batch[0][0], batch[1])
            if len(batch[0]) > 1:
                self._it = itertools.chain([(batch[0][1:], batch[1])], self._it)
        where = f"{self.name}:1"
        if first is None or not first[0].strip():
            bad = self._source.corrupt
            if bad is not None:
                raise TraceError(where, f"not a staging-twin trace ({bad.codec} data that "
                                 f"cannot be decoded from byte {bad.offset}: {bad.detail})")
            if first is None and self._source.cut:
                raise TraceError(where, f"not a staging-twin trace (the {self._source.codec} "
                                 "stream ends before its first line)")
            raise TraceError(where, "not a staging-twin trace ("
                             + ("empty file" if first is None else "line 1 is empty") + ")")
        self.header_line = first[0]
        try:
            header = json.loads(first[0])
        except ValueError:
            raise TraceError(where, "not a staging-twin trace (line 1 is not JSON"
                             + ("; truncated" if not first[1] else "") + ")") from None
        self.config, self.nodes = _check_header(header, where, self.warnings)
        self.header = header
        self.version = header["version"]
        if span is not None:
            self._gen.close()
            self._open_span(span)

    def _setup(self, path: str | os.PathLike[str], lazy: bool,
               select: Container[str] | None) -> None:
        self.path = Path(path)
        self.name = str(path)
        self.lazy = lazy
        self.select = select
        self.counts: Counter[tuple[str, str, str]] = Counter()
        """Lines read so far by (node, dir, type); final after iteration."""
        self.first_t: float | None = None
        self.last_t: float | None = None
        self.warnings: list[str] = []
        self.outcome: dict[str, Any] | None = None
        self.truncated = False
        self.rooms: set[int] = set()
        self.payload_events: dict[bytes, tuple[Any, int | None]] = {}
        """Recently decoded events and the rooms they name, by their lines' payload text
        (``Record.event``)."""
        self.partial = False
        self.passed_effects: Callable[[bytes], None] | None = None
        """Set before iterating a select reader: called with the payload text
        (``Record.body``) of every effect line it passes over, in order (a list's
        ``append``, say: it is called for most lines of a trace)."""
        self._span: tuple[Block, Block | None] | None = None
        self._started = False
        self._first_seq = 0
        self._first_t = 0.0

    def _open_span(self, span: tuple[Block, Block | None]) -> None:
        first_blk, last_blk = span
        self.partial = True
        self._span = span
        self._source = BlockSource(self.path, start=first_blk.off,
                                   end=None if last_blk is None else last_blk.end,
                                   first_block=first_blk.b)
        self._gen = _batches(self._source)
        self._it = self._gen
        self._first_seq, self._first_t = first_blk.seq, first_blk.t0

    def part(self, span: tuple[Block, Block | None], *,
             select: Container[str] | None = None) -> TraceReader:
        """A lazy reader of the blocks ``span`` (as the ``span`` argument) of this reader's
        trace that shares its header, config and nodes instead of reading them again."""
        return TraceReader(self.path, lazy=True, span=span, select=select, of=self)

    @property
    def started(self) -> bool:
        """Whether iterating has begun (a reader is iterated once)."""
        return self._started

    def __iter__(self) -> Iterator[Record]:
        if self._started:
            raise RuntimeError("a TraceReader can be iterated once")
        self._started = True
        return self._records_lazy() if self.lazy else self._records()

    # -- strict ------------------------------------------------------------------------------
    def _records(self) -> Iterator[Record]:
        lineno = last_ok = self._first_seq + 1
        last_t = self._first_t
        try:
            for raw, ended in _unbatch(self._it):
                lineno += 1
                if self.outcome is not None:
                    if not ended and not raw.strip():
                        break
                    raise TraceError(f"{self.name}:{lineno}", "line after the Outcome record")
                rec = self._strict(raw, ended, lineno, last_t)
                if rec is None:
                    break
                if self.first_t is None:
                    self.first_t = rec.t
                last_t = self.last_t = rec.t
                last_ok = lineno
                self.counts[(rec.node, rec.dir, rec.type)] += 1
                yield rec
        except TraceError as exc:
            raise self._damaged(exc, last_ok) from None
        self._finish(last_ok)

    def _strict(self, raw: bytes, ended: bool, lineno: int, last_t: float) -> Record | None:
        """Check and decode one line completely; None when it is a truncated last line."""
        where = f"{self.name}:{lineno}"
        expect_seq = lineno - 2
        try:
            d = _fast_loads(raw)
        except ValueError:
            d = None
        if d is None:  # the fast parser failed (or a JSON null, which is no object either)
            try:
                d = json.loads(raw)
            except ValueError:
                if not ended:
                    self._truncate(f"line {lineno} truncated: trace ends at line {lineno - 1}")
                    return None
                raise TraceError(where, "not valid JSON") from None
        if type(d) is not dict:
            raise TraceError(where, "expected a JSON object")
        seq = d.pop("seq", None)
        t = d.pop("t", None)
        node = d.pop("node", None)
        direction = d.pop("dir", None)
        if seq != expect_seq or type(seq) is not int:
            raise TraceError(where, f"expected {expect_seq}, got {seq!r} (seq must count "
                             f"0, 1, 2, ... without gaps)", "seq")
        if type(t) not in (float, int) or not math.isfinite(t):
            raise TraceError(where, f"expected a finite number, got {t!r}", "t")
        if t < last_t:
            raise TraceError(where, f"time goes backwards ({t!r} < {last_t!r})", "t")
        if direction not in DIRS:
            raise TraceError(where, f"expected one of {DIRS}, got {direction!r}", "dir")
        if node not in self.nodes and not (node == DRIVER and direction == "sys"):
            detail = (f"unknown node {node!r}" if node != DRIVER
                      else '"driver" only writes sys records')
            raise TraceError(where, detail, "node")
        rtype = d.get("type")
        if direction == "sys":
            rtype, room = self._sys(d, where, node)
            event = None
        else:
            allowed = INPUT_NAMES if direction == "in" else EFFECT_NAMES
            if rtype not in allowed:
                kind = "input" if direction == "in" else "effect"
                raise TraceError(where, f"unknown {kind} type {rtype!r}", "type")
            event = event_from_json(d, where=where)
            room = room_of(event)
        if room is not None and room not in self.rooms and not self.partial:
            raise TraceError(where, f"room {room} was never introduced by a RequestArrived "
                             "record", "room")
        return Record(seq, float(t), node, direction, rtype, d, event, lineno)

    def _sys(self, d: dict[str, Any], where: str, node: str) -> tuple[str, int | None]:
        rtype = check_record(d, where, self.nodes)
        room = d.get("room") if rtype in ("ForwardStart", "ForwardEnd") else None
        if rtype == "RequestArrived":
            if d["room"] in self.rooms and not self.partial:
                raise TraceError(where, f"room {d['room']} introduced twice", "room")
            self.rooms.add(d["room"])
        elif rtype == "Outcome":
            if node != DRIVER:
                raise TraceError(where, 'an Outcome belongs to node "driver"', "node")
            self.outcome = d
        return rtype, room

    def _finish(self, last_ok: int) -> None:
        if self._source.corrupt is not None:
            raise self._corrupt(last_ok)
        if self._source.cut:
            self._truncate(f"gzip stream ends early: trace ends at line {last_ok}"
                           if self._source.codec == "gzip" else
                           f"{self._source.codec} stream ends early: trace ends at line "
                           f"{last_ok}")
        if self.outcome is None and not self.partial:
            self.warnings.append(f"{self.name}: no Outcome record: trace is incomplete")

    def _corrupt(self, last_ok: int) -> TraceError:
        """The error for a compressed stream that could not be decoded (``BlockSource``)."""
        return TraceError(self.name, f"{self._corrupt_text()}; the trace is damaged after "
                          f"line {last_ok} (the lines up to there read)")

    def _corrupt_text(self) -> str:
        """Where the compressed stream could not be decoded: the block (a gzip trace's from
        its index) and the byte offset."""
        bad = self._source.corrupt
        assert bad is not None
        if bad.block is None:
            from twin.trace.index import TraceIndex

            with contextlib.suppress(OSError):
                index = TraceIndex.load(self.path, self.header_line, os.path.getsize(self.path))
                for blk in index.blocks if index is not None else ():
                    if blk.off <= bad.offset < blk.end:
                        bad = bad._replace(block=blk.b)
                        break
        return str(bad)

    def _damaged(self, exc: TraceError, last_ok: int) -> TraceError:
        """``exc``, met on a line of a compressed trace, or, when the rest of the stream turns
        out not to decode (a gzip trace's one checksum is at its end; damaged data decodes to
        wrong text before it), the corruption, which caused it."""
        if self._source.codec == "none" or self._source.corrupt is not None:
            return exc
        for _ in self._it:  # decode the rest: does the stream hold together?
            pass
        if _corruption(self._source) is None:  # (read again: decoding may have set it)
            return exc
        return TraceError(self.name, f"{self._corrupt_text()}; the damage shows first at "
                          f"{exc.where}: {exc.detail}")

    def _whole(self, raw: bytes, lineno: int) -> None:
        """Line ``raw`` (``lineno``), an input or effect whose envelope matched, must be whole
        JSON. A line as the writer writes it ends in ``}``, and one of a type with an object
        inside (``_NESTED``) in ``}}`` or ``]}`` (the message or the targets come last); cut
        short, it cannot: a line of a flat type has no other ``}``, and a nested one cut
        right after an inner object ends in that object's last value and ``}``. A line that
        does not end so is parsed here (fields in another order are fine) and, when it does
        not parse, reported as a line cut short."""
        try:
            d = _fast_loads(raw)
        except ValueError:
            try:
                d = json.loads(raw)
            except ValueError:
                raise TraceError(f"{self.name}:{lineno}", "not valid JSON") from None
        if type(d) is not dict:
            raise TraceError(f"{self.name}:{lineno}", "expected a JSON object")

    # -- lazy --------------------------------------------------------------------------------
    def _records_lazy(self) -> Generator[Any, Sequence[Any] | None, None]:
        """The lazy records. Sent core effects right after yielding an input record (see
        ``RecordStream``), the generator first yields whether it passed over those effects'
        lines, then goes on with the next record."""
        name = self.name
        match = _ENV_RE.match
        keys: dict[bytes, tuple[str, str, str, int, bool, bool]] = {}
        by_key: dict[bytes, int] = {}  # envelope-matched lines by their node/dir/type text
        counts: dict[tuple[str, str, str], int] = {}  # strict-path lines
        select = self.select
        passed = self.passed_effects
        last_t, last_tb = self._first_t, b""
        lineno = last_ok = self._first_seq + 1
        strict = self._strict
        done = False  # the Outcome was read
        try:
            for lines, ended in self._it:
                base = lineno  # lines[i] is line base + 1 + i
                n_lines = len(lines)
                i = 0
                ahead = None  # the envelope match of the line after effect lines passed over
                while i < n_lines:
                    raw = lines[i]
                    i += 1
                    lineno += 1
                    if ahead is None:
                        m = match(raw)
                    else:
                        m, ahead = ahead, None
                    if m is None or not ended or done:
                        if done:
                            if not ended and not raw.strip():
                                break
                            raise TraceError(f"{name}:{lineno}",
                                             "line after the Outcome record")
                        rec = strict(raw, ended, lineno, last_t)
                        if rec is None:
                            break
                        if self.first_t is None:
                            self.first_t = rec.t
                        last_t, last_tb, last_ok = rec.t, b"", lineno
                        k = (rec.node, rec.dir, rec.type)
                        counts[k] = counts.get(k, 0) + 1
                        done = self.outcome is not None
                        if select is None or rec.dir == "sys" or rec.type in select:
                            if (yield rec) is not None:  # skip_effects: not after a
                                yield False  # strict line
                        elif passed is not None and rec.dir == "out":
                            passed(rec.body)
                        continue
                    seq_b, t_b, key = m.groups()
                    if int(seq_b) != lineno - 2:
                        raise TraceError(f"{name}:{lineno}", f"expected {lineno - 2}, got "
                                         f"{seq_b.decode()} (seq must count 0, 1, 2, ... "
                                         "without gaps)", "seq")
                    if t_b != last_tb:
                        t = float(t_b) if _NUMBER_RE.match(t_b) else math.nan
                        if not t >= last_t or not math.isfinite(t):
                            raise TraceError(
                                f"{name}:{lineno}", f"time goes backwards ({t!r} < "
                                f"{last_t!r})" if t < last_t else
                                f"expected a finite number, got {t_b.decode()}", "t")
                        if self.first_t is None:
                            self.first_t = t
                        last_t, last_tb = t, t_b
                    try:
                        by_key[key] += 1
                        node, direction, rtype, body_from_key, wanted, nested = keys[key]
                    except KeyError:
                        keys[key] = self._envelope_key(key, lineno)
                        by_key[key] = 1
                        node, direction, rtype, body_from_key, wanted, nested = keys[key]
                    last_ok = lineno
                    if direction == "sys":
                        by_key[key] -= 1  # counted by the strict path
                        rec = strict(raw, ended, lineno, last_t)
                        assert rec is not None
                        counts[(node, direction, rec.type)] = counts.get(
                            (node, direction, rec.type), 0) + 1
                        done = self.outcome is not None
                        if (yield rec) is not None:  # skip_effects: not after a sys record
                            yield False
                        continue
                    if raw[-1] != 125 or (nested and raw[-2] != 125  # '}'
                                          and raw[-2] != 93):  # ']'
                        self._whole(raw, lineno)
                    if not wanted:
                        if passed is not None and direction == "out":
                            passed(raw[m.start(3) + body_from_key:-1])
                        continue
                    body_at = m.start(3) + body_from_key
                    effects = yield Record(lineno - 2, last_t, node, direction, rtype, None, None,
                                           lineno, raw, body_at, self)
                    if effects is not None:  # RecordStream.skip_effects
                        ahead = _written_next(
                            lines, lineno - base, effects, lineno - 1,
                            b'"t":' + t_b + b',"node":"' + node.encode() + b'","dir":"out",'
                        ) if direction == "in" else None
                        skip = ahead is not None
                        if skip:
                            n = len(effects)
                            i += n
                            lineno = last_ok = lineno + n
                            for e in effects:
                                k = (node, "out", type(e).__name__)
                                counts[k] = counts.get(k, 0) + 1
                        yield skip
        except TraceError as exc:
            raise self._damaged(exc, last_ok) from None
        finally:
            for key, n in by_key.items():
                if n:
                    k = keys[key][:3]
                    counts[k] = counts.get(k, 0) + n
            self.counts.update(counts)
            self.last_t = last_t if self.first_t is not None else None
        self._finish(last_ok)

    def _envelope_key(self, key: bytes, lineno: int
                      ) -> tuple[str, str, str, int, bool, bool]:
        """Node, dir, type, the payload's offset in ``key`` of a fast-path envelope, whether
        the reader hands such lines on and whether their payload holds objects
        (``_NESTED``)."""
        where = f"{self.name}:{lineno}"
        m = _KEY_RE.fullmatch(key)
        assert m is not None
        node, direction, rtype = (x.decode() for x in m.groups())
        if direction not in DIRS:  # pragma: no cover - the pattern allows only these
            raise TraceError(where, f"expected one of {DIRS}, got {direction!r}", "dir")
        if direction != "sys":
            if node not in self.nodes:
                detail = (f"unknown node {node!r}" if node != DRIVER
                          else '"driver" only writes sys records')
                raise TraceError(where, detail, "node")
            if rtype not in (INPUT_NAMES if direction == "in" else EFFECT_NAMES):
                kind = "input" if direction == "in" else "effect"
                raise TraceError(where, f"unknown {kind} type {rtype!r}", "type")
        wanted = self.select is None or rtype in self.select
        return node, direction, rtype, m.start(3) - 8, wanted, rtype in _NESTED

    def _truncate(self, message: str) -> None:
        if not self.truncated:
            self.truncated = True
            self.warnings.append(f"{self.name}: {message}")

    def close(self) -> None:
        """Release the file (iteration does this at its end)."""
        self._gen.close()

    def __enter__(self) -> TraceReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def read(self) -> Trace:
        """Consume everything into a ``Trace``."""
        events = list(self)
        return Trace(self.name, self.header, self.config, self.nodes, events, self.outcome,
                     self.truncated, self.warnings)


def _written_next(lines: list[bytes], start: int, effects: Sequence[Any], seq: int,
                  head: bytes) -> re.Match[bytes] | None:
    """Whether ``lines[start:]`` are, byte for byte, the lines a ``TraceWriter`` writes for
    ``effects`` (one or more core effects; seq from ``seq``, ``head`` the envelope after seq:
    ``b'"t":0.5,"node":"p0g0r0","dir":"out",'``) followed by a line, in ``lines``, whose
    envelope says it is no effect line: that line's ``_ENV_RE`` match when so, else None.
    Such lines need no further check: the writer's text of an effect is valid, and seq, time
    and node are those of the input they follow."""
    end = start + len(effects)
    if end == start or end >= len(lines):
        return None
    for k, e in enumerate(effects):
        if type(e) not in _EFFECT_CLASSES or lines[start + k] != (
                b'{"seq":%d,%s%s' % (seq + k, head, encode(e)[1:])):
            return None
    after = _ENV_RE.match(lines[end])
    if after is None or b'"dir":"out"' in after[3]:
        return None
    return after


class RecordStream:
    """A trace's records, read once in order (as iterating the trace yields them), and a way
    to pass over the effect lines of an input without reading them as records.

    After the iteration yielded an input record, ``skip_effects(effects)`` says whether the
    lines that follow it are exactly the lines a writer writes for ``effects`` (same time and
    node as the input, no further effect line after them). If so they are counted and passed
    over: iteration goes on after them. If not (or the source cannot tell: an in-memory trace,
    a strict reader, lines beyond the decompressed chunk at hand), nothing is skipped and the
    lines are yielded as records, checked as usual.
    """

    __slots__ = ("_records", "skip_effects")

    def __init__(self, source: Trace | TraceReader) -> None:
        self._records: Iterator[Record] = iter(source)
        self.skip_effects: Callable[[Sequence[Any]], bool] = _skips_nothing
        """After an input record: pass over its effect lines if they are ``effects`` as
        written (see the class docstring); True when they were passed over."""
        if isinstance(source, TraceReader) and source.lazy:
            self.skip_effects = cast(Generator[Any, Any, None], self._records).send

    def __iter__(self) -> Iterator[Record]:
        return self._records


def _skips_nothing(effects: Sequence[Any]) -> bool:
    return False


def iter_trace(path: str | os.PathLike[str], *, lazy: bool = False) -> TraceReader:
    """Open a trace for streaming: the header is checked now, records as you iterate
    (``lazy``: payloads decoded when used, see ``TraceReader``)."""
    return TraceReader(path, lazy=lazy)


TraceSource = Trace | TraceReader | str | os.PathLike[str]
"""A trace to read: an in-memory ``Trace``, an open reader, or a path (streamed)."""


def open_trace(source: TraceSource) -> Trace | TraceReader:
    """``source`` ready to iterate once: a path opens a lazy streaming reader."""
    if isinstance(source, (Trace, TraceReader)):
        return source
    return TraceReader(source, lazy=True)


def read_trace(path: str | os.PathLike[str]) -> Trace:
    """Read and validate a whole trace (plain or gzip, detected by magic bytes).

    Raises ``TraceError`` naming ``file:line`` and the field for anything malformed, except a
    truncated last line (or a gzip stream cut short), which ends the trace with a warning and
    ``truncated=True``. A trace without an ``Outcome`` record is returned with ``outcome=None``
    and an "incomplete" warning.
    """
    return TraceReader(path).read()


# ---------------------------------------------------------------------------------------------
# JSON Schema and documentation tables, derived from the classes
# ---------------------------------------------------------------------------------------------
_JSON_OF_SYS: dict[str, dict[str, Any]] = {
    "int": {"type": "integer"}, "str": {"type": "string"}, "number": {"type": "number"},
    "list[str]": {"type": "array", "items": {"type": "string"}}}


def _schema_of(spec: tuple[Any, ...]) -> dict[str, Any]:
    kind = spec[0]
    if kind == "int":
        return {"type": "integer"}
    if kind == "str":
        return {"type": "string"}
    if kind == "bool":
        return {"type": "boolean"}
    if kind == "float":
        return {"type": "number"}
    if kind == "opt":
        inner = _schema_of(spec[1])
        return {**inner, "type": [inner["type"], "null"]}
    if kind == "list":
        return {"type": "array", "items": _schema_of(spec[1])}
    if kind == "enum":
        return {"enum": [m.value for m in spec[1]]}
    if kind == "msg":
        return {"oneOf": [{"$ref": f"#/$defs/msg.{k}"} for k in MESSAGE_KINDS]}
    if kind == "event":
        return {"$ref": f"#/$defs/{spec[1].__name__}"}
    raise AssertionError(spec)


def _object_schema(tag_key: str, tag: str, cls: type, extra: dict[str, Any] | None = None,
                   required_extra: Sequence[str] = ()) -> dict[str, Any]:
    props: dict[str, Any] = dict(extra or {})
    props[tag_key] = {"const": tag}
    required = [*required_extra, tag_key]
    for f in field_specs(cls):
        props[f.name] = _schema_of(f.spec)
        if f.required:
            required.append(f.name)
    out: dict[str, Any] = {"type": "object", "properties": props, "required": required,
                           "additionalProperties": False}
    doc = (cls.__doc__ or "").strip().split("\n")[0]
    if doc and not doc.startswith(f"{cls.__name__}("):
        out = {"description": doc, **out}
    return out


def _envelope(direction: str) -> dict[str, Any]:
    node: dict[str, Any] = {"type": "string", "pattern": _NODE_RE.pattern}
    if direction == "sys":
        node = {"anyOf": [node, {"const": DRIVER}]}
    return {"seq": {"type": "integer", "minimum": 0}, "t": {"type": "number", "minimum": 0},
            "node": node, "dir": {"const": direction}}


def build_schema() -> dict[str, Any]:
    """JSON Schema (draft 2020-12) of one trace line: the header or any event line."""
    defs: dict[str, Any] = {}
    defs["node"] = {
        "type": "object",
        "properties": {"id": {"type": "string", "pattern": _NODE_RE.pattern},
                       "role": {"enum": list(ROLES)},
                       "instance": {"type": "integer", "minimum": 0},
                       "dp": {"type": "integer", "minimum": 0},
                       "rank": {"type": "integer", "minimum": 0}},
        "required": ["id", "role", "instance", "dp", "rank"],
    }
    defs["header"] = {
        "description": "Line 1 of a trace.",
        "type": "object",
        "properties": {
            "format": {"const": FORMAT_NAME},
            "version": {"const": FORMAT_VERSION},
            "mode": {"enum": list(MODES)},
            "config": {"type": "object", "description": "TwinConfig.to_dict()"},
            "defects": {"type": "array", "items": {"type": "string"}},
            "faults": {"type": "array", "items": {"type": "string"}},
            "seed": {"type": ["integer", "null"]},
            "workload": {"type": "object"},
            "nodes": {"type": "array", "items": {"$ref": "#/$defs/node"}},
            "software": {"type": "object", "additionalProperties": {"type": "string"}},
            "created": {"type": "string"},
        },
        "required": ["format", "version", "mode", "config", "defects", "faults", "seed",
                     "workload", "nodes", "software"],
    }
    for kind, cls in MESSAGE_KINDS.items():
        defs[f"msg.{kind}"] = _object_schema("kind", kind, cls)
    defs["Target"] = _object_schema("type", "Target", ev.Target)
    lines: list[dict[str, str]] = [{"$ref": "#/$defs/header"}]
    envelope_keys = list(_ENVELOPE)
    for direction, classes in (("in", ev.INPUT_TYPES), ("out", ev.EFFECT_TYPES)):
        for cls in classes:
            defs[f"{direction}.{cls.__name__}"] = _object_schema(
                "type", cls.__name__, cls, _envelope(direction), envelope_keys)
            lines.append({"$ref": f"#/$defs/{direction}.{cls.__name__}"})
    for rtype, fields in SYS_TYPES.items():
        props = {**_envelope("sys"), "type": {"const": rtype}}
        props.update({name: dict(_JSON_OF_SYS[kind]) for name, kind in fields.items()})
        if rtype == "Outcome":
            props["status"] = {"enum": list(OUTCOME_STATUSES)}
        defs[f"sys.{rtype}"] = {"description": SYS_DOCS[rtype].replace("``", "`"),
                                "type": "object", "properties": props,
                                "required": [*envelope_keys, "type", *fields]}
        lines.append({"$ref": f"#/$defs/sys.{rtype}"})
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": f"https://staging-twin.invalid/trace/v{FORMAT_VERSION}/line.schema.json",
        "title": f"staging-twin trace line (format version {FORMAT_VERSION})",
        "description": "Generated by twin.trace.format.build_schema(); do not edit by hand.",
        "oneOf": lines,
        "$defs": defs,
    }


def schema_text() -> str:
    """``build_schema()`` as written to ``schema.json``."""
    return json.dumps(build_schema(), indent=2) + "\n"


_MD_TYPE = {"int": "int", "str": "string", "bool": "bool", "float": "number",
            "number": "number", "list[str]": "list of string"}


def _md_type(spec: tuple[Any, ...]) -> str:
    kind = spec[0]
    if kind in _MD_TYPE:
        return _MD_TYPE[kind]
    if kind == "opt":
        return f"{_md_type(spec[1])} or null"
    if kind == "list":
        return f"list of {_md_type(spec[1])}"
    if kind == "enum":
        return " \\| ".join(f'"{m.value}"' for m in spec[1])
    if kind == "msg":
        return "message"
    if kind == "event":
        return str(spec[1].__name__)
    raise AssertionError(spec)


def _md_doc(cls: type) -> str:
    doc = (cls.__doc__ or "").strip()
    if not doc or doc.startswith(f"{cls.__name__}("):
        return ""
    return " ".join(doc.split("\n\n")[0].split()).replace("``", "`")


def _md_class(title: str, cls: type) -> list[str]:
    out = [f"#### {title}", ""]
    doc = _md_doc(cls)
    if doc:
        out += [doc, ""]
    specs = field_specs(cls)
    if not specs:
        return [*out, "No fields.", ""]
    out += ["| field | type | default |", "|---|---|---|"]
    for f in specs:
        default = "required" if f.required else json.dumps(f.default)
        out.append(f"| `{f.name}` | {_md_type(f.spec)} | {default} |")
    return [*out, ""]


def markdown_event_tables() -> str:
    """Markdown field tables of every input, effect, message and sys record type."""
    out = ["### Inputs (`\"dir\": \"in\"`)", ""]
    for in_cls in ev.INPUT_TYPES:
        out += _md_class(f"`{in_cls.__name__}`", in_cls)
    out += ["### Effects (`\"dir\": \"out\"`)", ""]
    for out_cls in ev.EFFECT_TYPES:
        out += _md_class(f"`{out_cls.__name__}`", out_cls)
    out += ["### Nested objects", ""]
    out += _md_class("`Target` (`\"type\": \"Target\"`)", ev.Target)
    for kind, msg_cls in MESSAGE_KINDS.items():
        out += _md_class(f"`{kind}` (`{msg_cls.__name__}`, `\"kind\": \"{kind}\"`)", msg_cls)
    out += ["### Driver records (`\"dir\": \"sys\"`)", ""]
    for rtype, fields in SYS_TYPES.items():
        out += [f"#### `{rtype}`", "", " ".join(SYS_DOCS[rtype].replace("``", "`").split()), "",
                "| field | type |", "|---|---|"]
        for name, kind in fields.items():
            out.append(f"| `{name}` | {_MD_TYPE[kind]} |")
        out.append("")
    return "\n".join(out).rstrip() + "\n"


TABLES_BEGIN = "<!-- BEGIN GENERATED: python -m twin.trace.format docs -->"
TABLES_END = "<!-- END GENERATED -->"


def update_doc_tables(text: str) -> str:
    """``text`` (the format document) with its generated section replaced by fresh tables."""
    start, end = text.index(TABLES_BEGIN) + len(TABLES_BEGIN), text.index(TABLES_END)
    return f"{text[:start]}\n\n{markdown_event_tables()}\n{text[end:]}"


def _main(argv: Sequence[str]) -> int:
    args = list(argv)
    if args == ["schema"]:
        SCHEMA_PATH.write_text(schema_text(), encoding="utf-8")
        print(f"wrote {SCHEMA_PATH}")
        return 0
    if args == ["tables"]:
        sys.stdout.write(markdown_event_tables())
        return 0
    if args[:1] == ["docs"] and len(args) <= 2:
        SCHEMA_PATH.write_text(schema_text(), encoding="utf-8")
        doc = Path(args[1] if len(args) == 2 else "docs/trace-format.md")
        doc.write_text(update_doc_tables(doc.read_text(encoding="utf-8")), encoding="utf-8")
        print(f"wrote {SCHEMA_PATH} and updated {doc}")
        return 0
    print("usage: python -m twin.trace.format schema | tables | docs [PATH]", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(_main(sys.argv[1:]))

