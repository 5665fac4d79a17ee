"""The staging control frames: byte-exact against SGLang 0.5.23, round trips, malformed input.

Expected frames come from SGLang's own builders and parsers (``twin.reference.sglang_wheel``) wherever they run
without a server; STAGING_REQ's parser is inline in the decode allocation path, so its decoding
side is spelled out from the source.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from twin.core.wire import (
    TAGS,
    ChunkReady,
    KVPoll,
    StagingReq,
    StagingRsp,
    TransferStatus,
    Watermark,
    decode,
    encode,
)
from twin.reference import sglang_wheel

SETTINGS = settings(derandomize=True, database=None, deadline=None, max_examples=300)


@pytest.fixture(scope="module")
def ref(sglang_reference):
    return sglang_reference


# --- exact frames -----------------------------------------------------------------------------


def test_watermark_frames(ref):
    msg = Watermark(round=3, tail=0, session_id="session-new")
    frames = [b"WATERMARK", b"3", b"0", b"session-new"]
    assert encode(msg) == frames
    assert sglang_wheel.watermark_frames(3, 0, "session-new") == frames
    assert decode(frames) == msg
    assert sglang_wheel.parse_watermark(frames) == {"session-new": (3, 0)}


def test_staging_req_frames_without_pp_rank(ref):
    msg = StagingReq(room=12345, chunk_idx=0, chunk_pages=3, session_id="10.0.0.1:7000_3")
    frames = [b"STAGING_REQ", b"12345", b"0", b"3", b"10.0.0.1:7000_3"]
    assert encode(msg) == frames
    assert sglang_wheel.prefetch_frames(12345, {"10.0.0.1:7000_3": 3}, 8192, 16) == [frames]
    assert decode(frames) == msg
    assert decode(frames).pp_rank is None


def test_staging_req_frames_with_pp_rank(ref):
    msg = StagingReq(room=7, chunk_idx=1, chunk_pages=2, session_id="s", pp_rank=1)
    frames = [b"STAGING_REQ", b"7", b"1", b"2", b"s", b"1"]
    assert encode(msg) == frames
    # 8192-token grid of 16-token pages: 514 pages are a full chunk and a 2-page one
    assert sglang_wheel.prefetch_frames(7, {"s": 514}, 8192, 16, pp_rank=1)[1] == frames
    assert decode(frames) == msg


def test_staging_rsp_frames(ref):
    msg = StagingRsp(room=9, chunk_idx=1, offset=4096, round=2, end=8192, session_id="s")
    frames = [b"STAGING_RSP", b"9", b"1", b"4096", b"2", b"8192", b"s"]
    assert encode(msg) == frames
    assert decode(frames) == msg
    assert sglang_wheel.parse_staging_rsp(frames, 9, "s") == ([-1, 4096], [0, 2], [-1, 8192])


def test_staging_rsp_oversized(ref):
    """ALLOC_OVERSIZED goes out as offset -2, round 0, end -1."""
    msg = StagingRsp(room=9, chunk_idx=0, offset=-2, round=0, end=-1, session_id="s")
    frames = [b"STAGING_RSP", b"9", b"0", b"-2", b"0", b"-1", b"s"]
    assert encode(msg) == frames
    assert decode(frames) == msg
    assert sglang_wheel.parse_staging_rsp(frames, 9, "s") == ([-2], [0], [-1])


def test_chunk_ready_frames(ref):
    msg = ChunkReady(room=5, chunk_idx=3, page_start=1536, num_pages=512, writer_id="w1",
                     prefill_rank=6)
    frames = [b"CHUNK_READY", b"5", b"3", b"1536", b"512", b"w1", b"6"]
    assert encode(msg) == frames
    assert sglang_wheel.chunk_ready_frames(5, 3, 1536, 512, "w1", 6) == frames
    assert decode(frames) == msg
    assert sglang_wheel.parse_chunk_ready(frames, 5) == [(5, 3, 1536, 512, "w1")]


@pytest.mark.parametrize("reason", ["", "staging chunk 3 does not fit: need 9 MiB", "é ✓"])
def test_kv_status_frames(ref, reason):
    msg = TransferStatus(room=11, status=KVPoll.Failed, prefill_rank=2, failure_reason=reason)
    frames = [b"KV_STATUS", b"11", b"0", b"2", reason.encode("utf-8")]
    assert encode(msg) == frames
    assert sglang_wheel.kv_status_frames(11, KVPoll.Failed, 2, reason or None) == frames
    assert decode(frames) == msg
    assert sglang_wheel.parse_kv_status(frames) == (11, 0, 2, reason or None)


def test_kv_status_success_and_status_is_kvpoll(ref):
    frames = encode(TransferStatus(room=1, status=KVPoll.Success, prefill_rank=0))
    assert frames == [b"KV_STATUS", b"1", b"4", b"0", b""]
    assert sglang_wheel.kv_status_frames(1, KVPoll.Success, 0, None) == frames
    assert decode(frames).status is KVPoll.Success
    assert [p.code for p in KVPoll] == [0, 1, 2, 3, 4]


def test_kv_status_without_reason_frame():
    """SGLang's parser accepts a status without the reason frame; so does the twin."""
    msg = decode([b"KV_STATUS", b"1", b"3", b"0"])
    assert msg == TransferStatus(room=1, status=KVPoll.Transferring, prefill_rank=0)


def test_kv_status_invalid_utf8_reason_is_replaced_like_sglang(ref):
    frames = [b"KV_STATUS", b"1", b"0", b"0", b"bad \xff byte"]
    assert decode(frames).failure_reason == sglang_wheel.parse_kv_status(frames)[3]


@pytest.mark.parametrize("raw", [b"+3", b" 3", b"3 ", b"3_0", b"-0", b"007"])
def test_integer_fields_accept_what_sglang_accepts(ref, raw):
    """Both sides parse with ``int(frame.decode("ascii"))``; the twin must not be stricter."""
    frames = [b"WATERMARK", raw, b"0", b"s"]
    assert decode(frames).round == sglang_wheel.parse_watermark(frames).get("s", (0, 0))[0]


def test_frames_may_be_bytearray_or_memoryview():
    frames = [bytearray(b"WATERMARK"), memoryview(b"1"), b"2", bytearray(b"s")]
    assert decode(frames) == Watermark(round=1, tail=2, session_id="s")


# --- round trips ------------------------------------------------------------------------------

ascii_ids = st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=40)
rooms = st.integers(0, 2**63 - 1)
counts = st.integers(0, 2**31)
chunk_ids = st.integers(0, 1000)  # SGLang pads per-chunk lists up to chunk_idx
signed = st.integers(-2, 2**40)
reasons = st.text(st.characters(blacklist_categories=("Cs",)), max_size=60)

messages = st.one_of(
    st.builds(StagingReq, room=rooms, chunk_idx=chunk_ids, chunk_pages=counts, session_id=ascii_ids,
              pp_rank=st.one_of(st.none(), st.integers(0, 64))),
    st.builds(StagingRsp, room=rooms, chunk_idx=chunk_ids, offset=signed, round=counts, end=signed,
              session_id=ascii_ids),
    st.builds(Watermark, round=counts, tail=counts, session_id=ascii_ids),
    st.builds(ChunkReady, room=rooms, chunk_idx=chunk_ids, page_start=counts, num_pages=counts,
              writer_id=ascii_ids, prefill_rank=st.integers(0, 1024)),
    st.builds(TransferStatus, room=rooms, status=st.sampled_from(list(KVPoll)),
              prefill_rank=st.integers(0, 1024), failure_reason=reasons),
)


@SETTINGS
@given(msg=messages)
def test_round_trip(msg):
    frames = encode(msg)
    assert all(type(f) is bytes for f in frames)
    assert frames[0] == TAGS[type(msg)]
    back = decode(frames)
    assert back == msg
    assert type(back) is type(msg)
    assert encode(back) == frames


@SETTINGS
@given(msg=messages)
def test_sglang_reads_and_writes_the_same_frames(ref, msg):
    frames = encode(msg)
    if isinstance(msg, Watermark):
        assert sglang_wheel.watermark_frames(msg.round, msg.tail, msg.session_id) == frames
        want = {msg.session_id: (msg.round, msg.tail)} if (msg.round, msg.tail) > (0, 0) else {}
        assert sglang_wheel.parse_watermark(frames) == want
    elif isinstance(msg, StagingRsp):
        offsets, rounds, ends = sglang_wheel.parse_staging_rsp(frames, msg.room, msg.session_id)
        i = msg.chunk_idx
        assert (offsets[i], rounds[i], ends[i]) == (msg.offset, msg.round, msg.end)
    elif isinstance(msg, ChunkReady):
        assert sglang_wheel.chunk_ready_frames(msg.room, msg.chunk_idx, msg.page_start,
                                             msg.num_pages, msg.writer_id,
                                             msg.prefill_rank) == frames
        assert sglang_wheel.parse_chunk_ready(frames, msg.room) == [
            (msg.room, msg.chunk_idx, msg.page_start, msg.num_pages, msg.writer_id)
        ]
    elif isinstance(msg, TransferStatus):
        assert sglang_wheel.kv_status_frames(msg.room, msg.status, msg.prefill_rank,
                                           msg.failure_reason or None) == frames
        assert sglang_wheel.parse_kv_status(frames) == (
            msg.room, int(msg.status), msg.prefill_rank, msg.failure_reason or None
        )
    else:  # STAGING_REQ: built like prefetch_staging_reqs, parsed like handle_staging_req
        want = [b"STAGING_REQ", *(str(v).encode() for v in
                                  (msg.room, msg.chunk_idx, msg.chunk_pages)),
                msg.session_id.encode("ascii")]
        if msg.pp_rank is not None:
            want.append(str(msg.pp_rank).encode())
        assert frames == want
        parsed = (int(frames[1].decode("ascii")), int(frames[2].decode("ascii")),
                  int(frames[3].decode("ascii")), frames[4].decode("ascii"),
                  int(frames[5].decode("ascii")) if len(frames) > 5 else None)
        assert parsed == (msg.room, msg.chunk_idx, msg.chunk_pages, msg.session_id, msg.pp_rank)


# --- malformed frames -------------------------------------------------------------------------

MALFORMED = [
    pytest.param([], ["empty"], id="empty"),
    pytest.param([b"NOPE", b"1"], ["unknown", "NOPE"], id="unknown-tag"),
    pytest.param([b""], ["unknown"], id="empty-tag"),
    pytest.param([b"STAGING_REQ", b"1", b"0", b"4"], ["STAGING_REQ", "session_id"],
                 id="missing-session"),
    pytest.param([b"WATERMARK"], ["WATERMARK", "round"], id="missing-all"),
    pytest.param([b"CHUNK_READY", b"1", b"0", b"0", b"4", b"w"], ["CHUNK_READY", "prefill_rank"],
                 id="missing-last"),
    pytest.param([b"KV_STATUS", b"1", b"4"], ["KV_STATUS", "prefill_rank"],
                 id="kv-status-missing"),
    pytest.param([b"WATERMARK", b"1", b"2", b"s", b"extra"], ["WATERMARK", "4 fields"],
                 id="too-many"),
    pytest.param([b"STAGING_REQ", b"1", b"0", b"4", b"s", b"0", b"x"], ["STAGING_REQ", "6"],
                 id="too-many-after-optional"),
    pytest.param([b"WATERMARK", b"1", b"2", "sé".encode()], ["WATERMARK", "session_id",
                                                             "ASCII"], id="non-ascii-str"),
    pytest.param([b"CHUNK_READY", b"1", b"\xff", b"0", b"4", b"w", b"0"],
                 ["CHUNK_READY", "chunk_idx", "ASCII"], id="non-ascii-int"),
    pytest.param([b"STAGING_RSP", b"1", b"0", b"x", b"0", b"1", b"s"],
                 ["STAGING_RSP", "offset", "integer"], id="non-integer"),
    pytest.param([b"WATERMARK", b"", b"0", b"s"], ["WATERMARK", "round", "integer"],
                 id="empty-integer"),
    pytest.param([b"STAGING_REQ", b"1", b"0", b"4", b"s", b"1.5"],
                 ["STAGING_REQ", "pp_rank", "integer"], id="non-integer-optional"),
    pytest.param([b"KV_STATUS", b"1", b"9", b"0", b""], ["KV_STATUS", "status", "9"],
                 id="unknown-status"),
    pytest.param([b"KV_STATUS", b"1", b"-1", b"0", b""], ["KV_STATUS", "status"],
                 id="negative-status"),
]


@pytest.mark.parametrize(("frames", "words"), MALFORMED)
def test_malformed_frames_raise_value_error_naming_kind_and_field(frames, words):
    with pytest.raises(ValueError) as info:
        decode(frames)
    text = str(info.value)
    for word in words:
        assert word in text, (word, text)
