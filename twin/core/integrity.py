"""Symbolic data-integrity model: content tags for every staging byte range and KV page.

Fed the effects of the ranks, it detects the ways staged KV goes wrong, naming request, chunk
and pages: a write over data not yet scattered, a write past its own allocation (ring overrun),
a scatter that reads the wrong bytes (or writes them to the wrong pages), and a room completing
before all of its pages landed. Pure
bookkeeping; no I/O. Byte ranges are kept as sorted, disjoint intervals per ring.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from twin.core import events as ev

Tag = tuple[int, int, int, int]  # (room, page_start, num_pages, writer)


class Span:
    """Bytes ``[start, end)`` of a ring holding ``tag``'s data; ``live`` until scattered.
    (A plain class: compiled, its constructor is native, where a dataclass's is not.)"""

    __slots__ = ("start", "end", "tag", "live")

    def __init__(self, start: int, end: int, tag: Tag, live: bool) -> None:
        self.start = start
        self.end = end
        self.tag = tag
        self.live = live

    def __repr__(self) -> str:
        return f"Span({self.start}, {self.end}, {self.tag}, {self.live})"


@dataclass(slots=True)
class Ring:
    """Tagged byte intervals of one decode staging ring: ``spans`` sorted by start, disjoint
    (so sorted by end too), and the spans meeting any interval a contiguous run of them."""

    spans: list[Span] = field(default_factory=list)

    def meeting(self, a: int, b: int) -> tuple[int, int]:
        """``(lo, hi)``: ``spans[lo:hi]`` are the spans that overlap ``[a, b)``, in order."""
        spans = self.spans
        lo, hi = 0, len(spans)
        while lo < hi:  # the first span ending after ``a``
            mid = (lo + hi) >> 1
            if spans[mid].end <= a:
                lo = mid + 1
            else:
                hi = mid
        n = len(spans)
        hi = lo
        while hi < n and spans[hi].start < b:
            hi += 1
        return lo, hi

    def overlapping(self, a: int, b: int) -> list[Span]:
        """The spans that overlap ``[a, b)``, in order."""
        lo, hi = self.meeting(a, b)
        return self.spans[lo:hi]

    def put(self, a: int, b: int, tag: Tag, live: bool = True) -> None:
        """``[a, b)`` now holds ``tag``'s data; what it overlapped keeps only its bytes outside."""
        spans = self.spans
        lo, hi = self.meeting(a, b)
        new = Span(a, b, tag, live)
        if lo == hi:
            spans.insert(lo, new)
            return
        first, last = spans[lo], spans[hi - 1]
        pieces = [new]
        if first.start < a:
            pieces.insert(0, Span(first.start, a, first.tag, first.live))
        if last.end > b:
            pieces.append(Span(b, last.end, last.tag, last.live))
        spans[lo:hi] = pieces

    def consume(self, a: int, b: int) -> None:
        """Mark ``[a, b)`` scattered: its bytes may be overwritten from now on."""
        spans = self.spans
        lo, hi = self.meeting(a, b)
        for i in range(lo, hi):
            spans[i].live = False

    def retire(self, room: int) -> None:
        """Mark every byte of ``room`` dead: the room ended and nothing will scatter it."""
        for span in self.spans:
            if span.live and span.tag[0] == room:
                span.live = False


@dataclass(slots=True)
class RoomSet:
    """A set of room ids kept small for ids that end roughly in order: every id below
    ``floor`` is a member, ``above`` holds the members from ``floor`` up."""

    floor: int = 0
    above: set[int] = field(default_factory=set)

    def add(self, room: int) -> None:
        if 0 <= room < self.floor:
            return
        above = self.above
        above.add(room)
        while self.floor in above:
            above.remove(self.floor)
            self.floor += 1

    def __contains__(self, room: object) -> bool:
        return isinstance(room, int) and (0 <= room < self.floor or room in self.above)


@dataclass(frozen=True, slots=True)
class Violation:
    kind: str  # "overwrite" | "overrun" | "misplaced" | "incomplete"
    node: str
    room: int
    detail: str

    def __str__(self) -> str:
        return f"{self.kind}: {self.node} room {self.room}: {self.detail}"


class DecodeNode:
    """What the model knows of one decode node: its ring, the page ranges landed per room
    (start, end, correct), the chunks scattered per room (page starts, kept until the room
    ends there) and the rooms ended (bounded by the rooms in flight, not the run's length)."""

    __slots__ = ("ring", "pages", "scattered", "ended")

    def __init__(self, ended: RoomSet | None = None) -> None:
        self.ring = Ring()
        self.pages: dict[int, list[tuple[int, int, bool]]] = {}
        self.scattered: dict[int, set[int]] = {}
        self.ended = ended if ended is not None else RoomSet()


class IntegrityModel:
    """Feed it ``on_transfer`` (prefill writes), ``on_effects`` (decode effects) and it collects
    ``violations``. ``writer_bytes(node, room, num_pages)`` must give per-writer block bytes."""

    def __init__(self, ring_bytes: int, pp_stages: int = 1) -> None:
        self.ring_bytes = ring_bytes
        # Each PP stage writes its own share of every writer block (Mooncake, PP > 1): a
        # block then holds exactly this many spans of the writer's tag.
        self.pp_stages = pp_stages
        self.nodes: dict[str, DecodeNode] = {}
        self.violations: list[Violation] = []
        self._seen: set[tuple[str, int, str]] = set()

    @property
    def rings(self) -> dict[str, Ring]:
        """Each decode node's ring."""
        return {node: d.ring for node, d in self.nodes.items()}

    def restarted(self, node: str) -> None:
        """``node`` came back as a new process: a new ring, no landed pages of its old rooms
        (what the old process held is gone, not overwritten); its ended rooms stay ended."""
        old = self.nodes.get(node)
        if old is not None:
            self.nodes[node] = DecodeNode(old.ended)

    def _node(self, node: str) -> DecodeNode:
        """``node``'s record, made on first use (a ``setdefault`` would build and drop one on
        every call)."""
        d = self.nodes.get(node)
        if d is None:
            d = self.nodes[node] = DecodeNode()
        return d

    def _flag(self, kind: str, node: str, room: int, detail: str) -> None:
        key = (kind, room, node)
        if key in self._seen:
            return
        self._seen.add(key)
        self.violations.append(Violation(kind, node, room, detail))

    def on_transfer(self, node: str, t: ev.StartTransfer) -> None:
        """A prefill writer's bytes land in ``node``'s ring (called when the WRITE completes)."""
        room, page_start, num_pages = t.room, t.page_start, t.num_pages  # read once each
        d = self._node(node)
        if not t.staged:
            _landed(d, room, page_start, page_start + num_pages, True)
            return
        ring = d.ring
        a = t.dst_offset
        b = a + t.nbytes
        if b > t.region_end:
            self._flag("overrun", node, room,
                       f"chunk {t.chunk_idx} (pages [{page_start}, "
                       f"{page_start + num_pages})) writes [{a}, {b}) past its allocation "
                       f"[{t.region_offset}, {t.region_end})")
        if b > self.ring_bytes:
            self._flag("overwrite", node, room,
                       f"chunk {t.chunk_idx} write [{a}, {b}) runs past the ring end "
                       f"{self.ring_bytes}")
            b = self.ring_bytes
        spans = ring.spans
        lo, hi = ring.meeting(a, b)
        for i in range(lo, hi):
            span = spans[i]
            tag = span.tag
            if span.live and (tag[0] != room or tag[1] != page_start):
                self._flag("overwrite", node, tag[0],
                           f"write of room {room} pages [{page_start}, "
                           f"{page_start + num_pages}) landed on unscattered data of room "
                           f"{tag[0]} pages [{tag[1]}, {tag[1] + tag[2]}) at bytes "
                           f"[{max(span.start, a)}, {min(span.end, b)})")
        # A write for a room that already ended on ``node``, or a repeat write of a chunk that
        # was already scattered there, is garbage nobody scatters: it may clobber live data
        # (flagged above) but is itself free to be overwritten.
        scattered = d.scattered.get(room)
        dead = room in d.ended or (scattered is not None and page_start in scattered)
        ring.put(a, b, (room, page_start, num_pages, t.writer), live=not dead)

    def on_scatter(self, node: str, s: ev.StartScatter, writer_bytes: list[int]) -> None:
        """A scatter reads the region and writes pages of ``s.room``."""
        d = self._node(node)
        ring = d.ring
        room, page_start, num_pages = s.room, s.page_start, s.num_pages  # read once each
        scattered = d.scattered.get(room)
        if scattered is None:
            scattered = d.scattered[room] = set()
        scattered.add(page_start)
        pos = s.offset
        ok = True
        for w, nb in enumerate(writer_bytes):
            a, b = pos, pos + nb
            pos = b
            hits = ring.overlapping(a, b)
            want = (room, page_start, num_pages, w)
            good = _covers(hits, a, b, want, self.pp_stages)
            if not good:
                ok = False
                found = sorted({(h.tag[0], h.tag[1]) for h in hits})
                what = ", ".join(f"room {r} page {p}" for r, p in found) or "never-written bytes"
                self._flag("misplaced", node, s.room,
                           f"scatter of chunk {s.chunk_idx} (pages [{s.page_start}, "
                           f"{s.page_start + s.num_pages}), writer {w}) read bytes [{a}, {b}) "
                           f"holding {what}" + (" (blind tail scatter)" if s.blind else ""))
            for h in hits:  # scattered: may be overwritten from now on
                h.live = False
        _landed(d, room, page_start, page_start + num_pages, ok)

    def on_freed(self, node: str, offset: int, size: int) -> None:
        self._node(node).ring.consume(offset, offset + size)

    def on_concluded(self, node: str, room: int, status: str, total_pages: int) -> None:
        """A decode room ended; on Success every page must hold the right data."""
        d = self._node(node)
        ranges = d.pages.pop(room, [])
        d.scattered.pop(room, None)
        d.ended.add(room)
        d.ring.retire(room)
        if status != "Success":
            return
        missing, first = _uncovered(ranges, total_pages)
        if missing:
            self._flag("incomplete", node, room,
                       f"completed with {missing} of {total_pages} pages not landed "
                       f"(first: page {first})")


def _landed(d: DecodeNode, room: int, start: int, end: int, ok: bool) -> None:
    """Pages ``[start, end)`` of ``room`` landed on ``d`` (correctly when ``ok``)."""
    ranges = d.pages.get(room)
    if ranges is None:
        ranges = d.pages[room] = []
    ranges.append((start, end, ok))


def _covers(hits: list[Span], a: int, b: int, want: Tag, stages: int) -> bool:
    """Whether ``hits`` (the spans meeting ``[a, b)``, in order) cover it without a gap, all
    tagged ``want``: one span per writer block, or one per PP stage when ``stages > 1``."""
    if not hits:
        return False
    first = hits[0]
    if len(hits) == 1:
        return first.tag == want and first.start <= a and first.end >= b
    if len(hits) != stages or first.start > a:
        return False
    pos = first.start
    for h in hits:
        if h.tag != want or h.start != pos:
            return False
        pos = h.end
    return pos >= b


def _uncovered(ranges: list[tuple[int, int, bool]], total: int) -> tuple[int, int]:
    """Pages of ``[0, total)`` not covered by a correct range, or hit by a wrong scatter:
    ``(count, first)``."""
    bad: list[tuple[int, int]] = [(a, b) for a, b, ok in ranges if not ok]
    pos = 0
    for a, b in sorted((a, b) for a, b, ok in ranges if ok):
        if a > pos:
            bad.append((pos, a))
        pos = max(pos, b)
    if pos < total:
        bad.append((pos, total))
    missing, first, end = 0, -1, 0
    for a, b in sorted(bad):
        a, b = max(a, end, 0), min(b, total)
        if b > a:
            missing += b - a
            first = a if first < 0 else first
            end = b
    return missing, first
