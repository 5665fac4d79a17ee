"""Packed batches, the trace writer's hand-over to its encoder (``twin.trace.packio``, the
generated ``twin.trace.packers``, ``twin.trace.packing``): current with the classes, every event
reads back as its row, an item that fails leaves nothing behind, the string table's reset, and
the fast float text. Run against the compiled build too (``tests/test_compiled.py``)."""

from __future__ import annotations

import math
import random
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_format import ANY_EVENT, NODES, D, P, small_config

from twin.core import events as ev
from twin.core import factories
from twin.trace import codec, emitters
from twin.trace.format import TraceWriter, make_header, read_trace
from twin.trace.packers import EFFECT_TAGS, INPUT_TAGS, pack_effect, pack_input, unpack_event
from twin.trace.packgen import PACKERS_PATH, packers_source
from twin.trace.packing import BAD_EFFECT, BAD_INPUT, BAD_NODE, OK, pack_item
from twin.trace.packio import K_END, K_INOUT, K_TIME, Packer, Reader
from twin.trace.rows import BUILD, LINE_OF_ROW, REDUCE

HEAD = '"t":0.25,"node":"p0g0r0","dir":"out",'
TAGS = {**INPUT_TAGS, **EFFECT_TAGS}


def _plain(v: Any) -> Any:
    """A row with its lists as tuples (a field may hold either; the text is the same)."""
    if isinstance(v, (list, tuple)):
        return tuple(_plain(x) for x in v)
    return v


def _packer() -> Packer:
    return Packer([P, D], {D}, "driver")


def test_the_generated_packers_are_current() -> None:
    assert PACKERS_PATH.read_text() == packers_source(), (
        "twin/trace/packers.py is stale: run python scripts/generate_factories.py")


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(ANY_EVENT.filter(lambda e: type(e) in TAGS), min_size=1, max_size=4))
def test_events_pack_to_their_rows(events: list[Any]) -> None:
    """Every field reads back as the row holds it: the same line, the same object; strings a
    second time come as codes."""
    p = _packer()
    for e in events:
        assert (pack_input if type(e) in INPUT_TAGS else pack_effect)(p, e)
        assert not (pack_effect if type(e) in INPUT_TAGS else pack_input)(p, e)  # nothing
    data, records = p.take()
    assert records == []
    r = Reader(data, [])
    for e in events:
        row = unpack_event(r)
        assert _plain(row) == _plain(REDUCE[type(e)](e))
        assert LINE_OF_ROW[row[0]](row, 5, HEAD) == codec.LINE_TEXT[type(e)](e, 5, HEAD)
        assert BUILD[row[0]](row) == e
    assert r.get_tag() == K_END
    assert sorted(r.strs) == sorted(p.strs)  # each string defined once, in the same order


def _send(dst: str) -> Any:
    return factories.new_send(dst=dst, msg=factories.new_staging_rsp(
        room=3, chunk_idx=1, offset=4096, round=2, end=8192, session_id="d0g0r0"))


def test_an_item_that_fails_half_way_leaves_nothing() -> None:
    p = _packer()
    assert pack_item(p, 1.0, P, ev.Tick(), [_send("fresh")]) == OK
    before = (p.lines, p.items, dict(p.strs), p.t)
    # a new string, a new time, then a float that is not finite: all of it undone
    newer = "".join(["new", "er"])  # one object, used twice in the item that fails
    with pytest.raises(ValueError, match="finite"):
        pack_item(p, 2.0, P, ev.Tick(), [_send(newer), _send(newer), ev.SetTimer(at=math.inf)])
    assert (p.lines, p.items, dict(p.strs), p.t) == before
    # refused before anything is written: an unknown node, the driver, not a core event
    assert pack_item(p, 2.0, "p9g9r9", ev.Tick(), []) == BAD_NODE
    assert pack_item(p, 2.0, "driver", ev.Tick(), []) == BAD_NODE
    assert pack_item(p, 2.0, P, ev.WorkerIdle(worker=0), []) == BAD_INPUT
    assert pack_item(p, 2.0, P, ev.Tick(), [_send("newest"), ev.Tick()]) == BAD_EFFECT
    assert (p.lines, p.items, dict(p.strs), p.t) == before
    assert pack_item(p, 3.0, P, ev.Tick(), [_send(newer)]) == OK
    data, _ = p.take()
    r = Reader(data, [])
    for t, dst in ((1.0, "fresh"), (3.0, "newer")):
        assert (r.get_tag(), r.get_float()) == (K_TIME, t)
        assert (r.get_tag(), r.get_int()) == (K_INOUT, 0)
        assert unpack_event(r) == REDUCE[ev.Tick](ev.Tick())
        assert r.get_int() == 1
        assert unpack_event(r)[1] == dst
    assert r.get_tag() == K_END
    assert r.strs == ["fresh", "d0g0r0", "newer"]


def test_a_decode_nodes_conclusions_are_counted() -> None:
    p = _packer()
    done = [ev.RoomConcluded(room=1, status="Success", reason=""),
            ev.RoomConcluded(room=2, status="Failed", reason="timeout")]
    assert pack_item(p, 1.0, P, ev.Tick(), done) == OK  # a prefill node's: not the room's end
    assert (p.succeeded, p.failed) == (set(), set())
    assert pack_item(p, 1.0, D, ev.Tick(), done) == OK
    assert (p.succeeded, p.failed) == ({1}, {2})


@pytest.mark.parametrize("encoder", ["inline", "process"])
def test_the_string_table_resets_between_batches(tmp_path: Path, encoder: str) -> None:
    """A run naming ever new strings: past ``keep_strings`` the table starts again, on both
    sides, and every line still names its own."""
    path = tmp_path / "s.jsonl"
    w = TraceWriter(path, make_header("sim", small_config(), NODES), flush_every=3,
                    encoder=encoder)
    w._p.keep_strings = 5
    names = [f"n{i % 17}-{i // 40}" for i in range(200)]
    for i, name in enumerate(names):  # a message naming no room: none to introduce
        w.write_effects(i * 0.5, P, [factories.new_send(dst=name, msg=factories.new_watermark(
            round=i, tail=4096, session_id=name[::-1]))])
    w.close()
    got = [(r.data["dst"], r.data["msg"]["session_id"]) for r in read_trace(path).events]
    assert got == [(n, n[::-1]) for n in names]


FAST = st.floats(min_value=1e-4, max_value=1e16, exclude_max=True)


@settings(max_examples=2000, deadline=None)
@given(st.one_of(FAST, st.floats(allow_nan=False, allow_infinity=False)))
def test_float_text_is_repr(v: float) -> None:
    assert codec._float_text(v) == repr(v)
    assert emitters.float_text(v) == repr(v)


def test_float_text_is_repr_at_the_edges_and_for_clock_sums() -> None:
    edges = [1e-4, math.nextafter(1e-4, 0), math.nextafter(1e-4, 1), 1e16,
             math.nextafter(1e16, 0), 0.0, -0.0, 5e-5, 123456789012345.6, 0.1 + 0.2]
    rng = random.Random(7)
    t, times = 0.0, []
    for _ in range(20_000):  # a clock: sums of small random delays, as the simulator's
        t += rng.expovariate(rng.choice([1.0, 30.0, 1000.0]))
        times.append(t)
    times += [rng.uniform(0, 10.0 ** rng.randint(-4, 16)) for _ in range(20_000)]
    for v in edges + times:
        assert emitters.float_text(v) == repr(v), v
    with pytest.raises(ValueError, match="finite"):
        emitters.float_text(math.nan)
