"""The faster ``__init__`` of the core's frozen dataclasses, and the generated factories,
build the same objects."""

from __future__ import annotations

import dataclasses
import inspect

import pytest

from twin.core import events as ev
from twin.core import factories, wire
from twin.core.fastinit import (
    FACTORIES_PATH,
    FACTORY_CLASSES,
    factories_source,
    factory_name,
    fast_frozen_init,
)

CLASSES = [*ev.INPUT_TYPES, *ev.EFFECT_TYPES, ev.Target, *wire.MESSAGE_TYPES.values()]


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Plain:
    a: int
    b: str = "x"
    c: tuple[int, ...] = ()


Fast = fast_frozen_init(dataclasses.dataclass(frozen=True, slots=True, kw_only=True)(
    type("Fast", (), {"__annotations__": {"a": "int", "b": "str", "c": "tuple[int, ...]"},
                      "b": "x", "c": ()})))


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_every_event_and_frame_has_the_fast_init(cls: type) -> None:
    assert cls.__init__.__code__.co_filename == "<string>"
    # the slot setters, bound in a closure (none for a class without fields)
    assert len(cls.__init__.__code__.co_freevars) >= len(dataclasses.fields(cls))
    params = inspect.signature(cls).parameters.values()
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in params)
    assert [p.name for p in params] == [f.name for f in dataclasses.fields(cls)]
    assert [p.default for p in params] == [
        inspect.Parameter.empty if f.default is dataclasses.MISSING else f.default
        for f in dataclasses.fields(cls)]


def test_fast_init_builds_the_same_frozen_object() -> None:
    x = Fast(a=1)
    assert (x.a, x.b, x.c) == (1, "x", ())
    assert repr(x).removeprefix("Fast") == repr(Plain(a=1)).removeprefix("Plain")
    assert x == Fast(a=1, b="x") and hash(x) == hash(Fast(a=1))
    assert x != Fast(a=1, b="y")
    with pytest.raises(dataclasses.FrozenInstanceError):
        x.a = 2  # type: ignore[misc]
    with pytest.raises(TypeError, match="required keyword-only argument: 'a'"):
        Fast()
    with pytest.raises(TypeError, match="positional"):
        Fast(1)  # type: ignore[misc]
    with pytest.raises(TypeError, match="unexpected keyword"):
        Fast(a=1, d=2)  # type: ignore[call-arg]


def test_events_compare_and_hash_by_value() -> None:
    msg = wire.StagingReq(room=1, chunk_idx=0, chunk_pages=4, session_id="d0")
    a = ev.MessageArrived(src="p0", msg=msg)
    assert a == ev.MessageArrived(src="p0", msg=wire.StagingReq(
        room=1, chunk_idx=0, chunk_pages=4, session_id="d0"))
    assert len({a, ev.MessageArrived(src="p0", msg=msg)}) == 1
    assert dataclasses.asdict(ev.Tick()) == {}


def test_classes_it_cannot_mirror_are_left_alone() -> None:
    @dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
    class WithFactory:
        a: list[int] = dataclasses.field(default_factory=list)

    @dataclasses.dataclass(frozen=True, slots=True)
    class Positional:
        a: int

    for cls in (WithFactory, Positional):
        init = cls.__init__
        assert fast_frozen_init(cls).__init__ is init


FACTORIES = [(name, value) for name, value in vars(factories).items()
             if name.startswith("new_")]


def test_the_factories_module_is_current() -> None:
    assert FACTORIES_PATH.read_text() == factories_source([wire, ev]), (
        "twin/core/factories.py is out of date: run python scripts/generate_factories.py")


def test_the_hot_classes_have_factories() -> None:
    names = {name for name, _ in FACTORIES}
    assert {"new_send", "new_message_arrived", "new_start_transfer", "new_staging_rsp"} <= names
    assert len(FACTORIES) == len(FACTORY_CLASSES)


@pytest.mark.parametrize(("name", "new"), FACTORIES, ids=[n for n, _ in FACTORIES])
def test_factory_has_the_class_signature(name: str, new: object) -> None:
    cls = next(c for c in CLASSES if factory_name(c) == name)
    assert new is not cls and callable(new)

    def shape(f: object) -> list[tuple[str, object, object]]:
        return [(p.name, p.kind, p.default) for p in inspect.signature(f).parameters.values()]

    assert shape(new) == shape(cls)


def test_factories_build_the_same_object() -> None:
    msg = factories.new_staging_req(room=1, chunk_idx=0, chunk_pages=4, session_id="d0")
    assert type(msg) is wire.StagingReq
    assert msg == wire.StagingReq(room=1, chunk_idx=0, chunk_pages=4, session_id="d0")
    assert hash(msg) == hash(wire.StagingReq(room=1, chunk_idx=0, chunk_pages=4, session_id="d0"))
    arrived = factories.new_message_arrived(src="p0", msg=msg)
    assert arrived == ev.MessageArrived(src="p0", msg=msg)
    done = factories.new_transfer_done(worker=3)  # defaults filled in
    assert done == ev.TransferDone(worker=3) and (done.ok, done.error, done.settled) == (
        True, "", True)
    with pytest.raises(dataclasses.FrozenInstanceError):
        done.worker = 4  # type: ignore[misc]
    with pytest.raises(TypeError):
        factories.new_transfer_done()  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        factories.new_transfer_done(3)  # type: ignore[misc]
