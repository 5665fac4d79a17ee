"""Fault spec parsing: every accepted form, and errors that name the spec and the key."""

from __future__ import annotations

import random
import re

import pytest

from twin.core import wire
from twin.runtime.faults import (
    ACTIONS,
    KINDS,
    FaultInjector,
    FaultSpec,
    FaultSpecError,
    parse_fault,
)


@pytest.mark.parametrize(("text", "want"), [
    ("drop:WATERMARK:p=0.1", dict(action="drop", target="WATERMARK", p=0.1)),
    ("drop:WATERMARK:nth=3", dict(action="drop", target="WATERMARK", nth=3)),
    ("delay:CHUNK_READY:ms=20:p=0.5", dict(action="delay", target="CHUNK_READY", ms=20.0,
                                          p=0.5)),
    ("dup:STAGING_RSP", dict(action="dup", target="STAGING_RSP")),
    ("reorder:*:ms=2", dict(action="reorder", target="*", ms=2.0)),
    ("fail-send:CHUNK_READY:nth=1", dict(action="fail-send", target="CHUNK_READY", nth=1)),
    ("fail-transfer:p=0.01", dict(action="fail-transfer", target="*", p=0.01)),
    ("fail-transfer:node=p0g0r1:nth=2", dict(action="fail-transfer", node="p0g0r1", nth=2)),
    ("crash:d0g0r0:at=2.5", dict(action="crash", target="d0g0r0", at=2.5)),
    ("restart:d0g0r0:at=2.5:down=1", dict(action="restart", target="d0g0r0", at=2.5,
                                          down=1.0)),
    ("abort:room=3:at=1.5", dict(action="abort", room=3, at=1.5)),
    ("delay:STAGING_RSP:room=0:chunk=0:ms=50", dict(room=0, chunk=0, ms=50.0)),
    ("drop:KV_STATUS:src=p0g0r0:dst=d0g0r0", dict(src="p0g0r0", dst="d0g0r0")),
])
def test_parse_valid(text: str, want: dict[str, object]) -> None:
    spec = parse_fault(text)
    assert isinstance(spec, FaultSpec)
    for key, value in want.items():
        assert getattr(spec, key) == value, key
    assert spec.text == text and str(spec) == text


def test_defaults() -> None:
    spec = parse_fault("drop:WATERMARK")
    assert (spec.p, spec.nth, spec.ms, spec.room, spec.chunk) == (None, None, 1.0, None, None)


def test_every_message_kind_is_accepted() -> None:
    for kind in KINDS:
        assert parse_fault(f"drop:{kind}").target == kind
    assert set(KINDS) >= {"STAGING_REQ", "STAGING_RSP", "WATERMARK", "CHUNK_READY", "*"}


@pytest.mark.parametrize(("text", "needles"), [
    ("explode:WATERMARK", ["'explode'", "unknown action"] + list(ACTIONS[:2])),
    ("drop", ["needs a target", "message kind"]),
    ("drop:p=0.1", ["needs a target"]),
    ("crash:at=1", ["needs a target", "node"]),
    ("drop:HEARTBEAT", ["unknown message kind", "'HEARTBEAT'"]),
    ("drop:WATERMARK:nth", ["expected key=value", "'nth'"]),
    ("drop:WATERMARK:bogus=1", ["unknown key", "'bogus'"]),
    ("drop:WATERMARK:p=lots", ["key 'p'", "bad value", "'lots'"]),
    ("drop:WATERMARK:nth=1.5", ["key 'nth'", "'1.5'"]),
    ("drop:WATERMARK:p=1.5", ["key 'p'", "[0, 1]"]),
    ("crash:d0g0r0", ["crash needs at=SECONDS"]),
    ("restart:d0g0r0:at=1", ["restart needs down=SECONDS"]),
    ("abort:at=1", ["abort needs room=N"]),
    ("abort:room=1", ["abort needs at=SECONDS"]),
])
def test_errors_name_the_spec_and_the_key(text: str, needles: list[str]) -> None:
    with pytest.raises(FaultSpecError) as info:
        parse_fault(text)
    msg = str(info.value)
    assert msg.startswith(f"fault {text!r}: "), msg
    for needle in needles:
        assert needle in msg, (needle, msg)


def test_fault_spec_error_is_a_value_error() -> None:
    assert issubclass(FaultSpecError, ValueError)


# -- the injector's decisions -----------------------------------------------------------------
WM = wire.Watermark(round=1, tail=0, session_id="d0g0r0")
RSP = wire.StagingRsp(room=4, chunk_idx=1, offset=0, round=0, end=10, session_id="d0g0r0")


def test_nth_fires_once_and_counts_matching_frames_only() -> None:
    inj = FaultInjector([parse_fault("drop:WATERMARK:nth=2")], random.Random(0))
    fates = [inj.message("d0g0r0", "p0g0r0", m).copies for m in (RSP, WM, RSP, WM, WM)]
    assert fates == [1, 1, 1, 0, 1]


def test_room_and_chunk_filters() -> None:
    inj = FaultInjector([parse_fault("delay:STAGING_RSP:room=4:chunk=1:ms=50")],
                        random.Random(0))
    other = wire.StagingRsp(room=4, chunk_idx=0, offset=0, round=0, end=10, session_id="s")
    assert inj.message("d", "p", RSP).extra_s == pytest.approx(0.05)
    assert inj.message("d", "p", other).extra_s == 0.0


def test_probability_is_seeded() -> None:
    spec = [parse_fault("drop:*:p=0.5")]
    runs = []
    for _ in range(2):
        inj = FaultInjector(spec, random.Random("7:faults"))
        runs.append([inj.message("a", "b", WM).copies for _ in range(64)])
    assert runs[0] == runs[1] and 10 < runs[0].count(0) < 54


def test_dup_fail_send_and_transfer() -> None:
    inj = FaultInjector([parse_fault("dup:WATERMARK"), parse_fault("fail-send:STAGING_RSP"),
                         parse_fault("fail-transfer:node=p0g0r1")], random.Random(0))
    assert inj.message("a", "b", WM).copies == 2
    fate = inj.message("a", "b", RSP)
    assert fate.send_failed and fate.copies == 0 and fate.applied == ("fail-send:STAGING_RSP",)
    assert inj.transfer_fails("p0g0r0") is None
    assert inj.transfer_fails("p0g0r1") == "fail-transfer:node=p0g0r1"


def test_timed_faults() -> None:
    specs = [parse_fault(t) for t in ("drop:WATERMARK", "crash:d0g0r0:at=1",
                                      "abort:room=2:at=3")]
    inj = FaultInjector(specs, random.Random(0))
    assert [s.action for s in inj.timed()] == ["crash", "abort"]


@pytest.mark.parametrize(("spec", "message"), [
    ("corrupt:*:field=room:value=1", "not '*'"),
    ("corrupt:STAGING_REQ:value=1", "needs field=NAME and value=INTEGER"),
    ("corrupt:STAGING_REQ:field=chunk_idx", "needs field=NAME and value=INTEGER"),
    ("corrupt:STAGING_REQ:field=session_id:value=1", "no integer field 'session_id'"),
    ("corrupt:WATERMARK:field=chunk_idx:value=1", "(its fields: round, tail)"),
    ("corrupt:STAGING_REQ:field=chunk_idx:value=x", "bad value 'x'"),
])
def test_bad_corrupt_specs_are_rejected(spec: str, message: str) -> None:
    with pytest.raises(FaultSpecError, match=re.escape(message)):
        parse_fault(spec)


def test_corrupt_rewrites_only_the_matching_frame() -> None:
    inj = FaultInjector([parse_fault("corrupt:STAGING_REQ:nth=2:field=chunk_idx:value=-7")],
                        random.Random(0))
    msg = wire.StagingReq(room=3, chunk_idx=1, chunk_pages=4, session_id="d0")
    first, second = inj.message("p0", "d0", msg), inj.message("p0", "d0", msg)
    assert first.frame(msg) == msg and not first.applied
    assert second.frame(msg) == wire.StagingReq(room=3, chunk_idx=-7, chunk_pages=4,
                                                session_id="d0")


@pytest.mark.parametrize("text", ["fail-send:STAGING_RSP:nth=1", "fail-send:WATERMARK:nth=1",
                                  "fail-send:*:nth=1", "fail-send:*:src=d0g0r0:nth=1"])
def test_a_failed_send_of_a_decode_frame_is_refused(text: str) -> None:
    """Only a prefill rank's core handles a send that raises; fed to a decode rank it raised
    TypeError mid-run. Now refused before the run, naming what to give instead."""
    from twin.core.config import ServerSide, TwinConfig
    from twin.runtime.faults import check_faults

    cfg = TwinConfig(prefill=ServerSide(tp_size=2), decode=ServerSide(tp_size=1))
    with pytest.raises(FaultSpecError, match="fail-send models a prefill rank's send"):
        check_faults([parse_fault(text)], cfg, [1000])
    check_faults([parse_fault("fail-send:CHUNK_READY:nth=1")], cfg, [1000])
    check_faults([parse_fault("fail-send:*:src=p0g0r0:nth=1")], cfg, [1000])
