"""SGLang's staging control frames: message classes (tagged msgspec Structs) and a byte-exact
frame codec.

Frames are ZMQ multipart messages with ASCII decimal fields (sglang 0.5.23)::

    [b"STAGING_REQ", room, chunk_idx, chunk_pages, session_id(, pp_rank)]
    [b"STAGING_RSP", room, chunk_idx, offset, round, end, session_id]
    [b"WATERMARK", round, tail, session_id]
    [b"CHUNK_READY", room, chunk_idx, page_start, num_pages, writer_id, prefill_rank]
    [b"KV_STATUS", room, status, prefill_rank, failure_reason]
    [b"ABORT", room(, decode_ip, decode_port(, generation))]
    [b"ABORT_ACK", room, prefill_rank(, generation)]

``decode`` raises ``ValueError`` naming the message kind and field on malformed input.

Sockets. Each frame travels on one ZMQ PUSH socket, and only frames on the same socket keep
their order (``socket_of``): prefill sends STAGING_REQ on its own prefetch socket and context
(``prefetch_staging_reqs``), CHUNK_READY, KV_STATUS and ABORT_ACK on the manager's cached socket
(``_send_multipart_locked``); decode sends STAGING_RSP, WATERMARK, ABORT and its bootstrap
metadata on one cached socket per prefill endpoint (``_connect_to_bootstrap_server``).
"""

from __future__ import annotations

from enum import Enum
from typing import Any

import msgspec


class KVPoll(Enum):
    """Per-room transfer status (sglang ``KVPoll``): named in traces, ``code`` in frames."""

    Failed = "Failed"
    Bootstrapping = "Bootstrapping"
    WaitingForInput = "WaitingForInput"
    Transferring = "Transferring"
    Success = "Success"

    @property
    def code(self) -> int:
        """SGLang's integer value (``KVPoll.Failed == 0`` ... ``KVPoll.Success == 4``)."""
        return _POLL_CODES.index(self.value)

    def __int__(self) -> int:
        return self.code

    @classmethod
    def of_code(cls, code: int) -> KVPoll:
        """The status of SGLang's integer ``code``; ValueError for an unknown one."""
        if not 0 <= code < len(_POLL_CODES):
            raise ValueError(code)
        return cls(_POLL_CODES[code])


_POLL_CODES = ("Failed", "Bootstrapping", "WaitingForInput", "Transferring", "Success")


class Frame(msgspec.Struct, frozen=True, kw_only=True, gc=False, forbid_unknown_fields=True,
            tag_field="kind"):
    """Base of the control frames: a frozen, keyword-only msgspec Struct tagged (``"kind"``)
    with the frame's first part (``STAGING_REQ``, ...)."""


class StagingReq(Frame, frozen=True, tag="STAGING_REQ"):
    room: int
    chunk_idx: int
    chunk_pages: int
    session_id: str
    pp_rank: int | None = None


class StagingRsp(Frame, frozen=True, tag="STAGING_RSP"):
    room: int
    chunk_idx: int
    offset: int
    round: int
    end: int
    session_id: str


class Watermark(Frame, frozen=True, tag="WATERMARK"):
    round: int
    tail: int
    session_id: str


class ChunkReady(Frame, frozen=True, tag="CHUNK_READY"):
    room: int
    chunk_idx: int
    page_start: int
    num_pages: int
    writer_id: str
    prefill_rank: int


class TransferStatus(Frame, frozen=True, tag="KV_STATUS"):
    """A prefill rank's per-room transfer result (nixl ``KV_STATUS``)."""

    room: int
    status: KVPoll
    prefill_rank: int
    failure_reason: str = ""


class Abort(Frame, frozen=True, tag="ABORT"):
    """Decode's abort notification (``AbortNotification``): ``decode_ip``/``decode_port`` name
    where the acknowledgement goes, ``generation`` the armed deferred-release generation (None
    when deferred release is off: no acknowledgement is awaited). A legacy ``[ABORT, room]``
    frame carries no return address: ``decode_ip`` is then ``NO_RETURN_ADDRESS`` (SGLang's
    ``None``) and no acknowledgement can be sent."""

    room: int
    decode_ip: str
    decode_port: int
    generation: int | None = None


class AbortAck(Frame, frozen=True, tag="ABORT_ACK"):
    """Prefill's acknowledgement that its transfer of an aborted room drained (``AbortAck``)."""

    room: int
    prefill_rank: int
    generation: int | None = None


Message = StagingReq | StagingRsp | Watermark | ChunkReady | TransferStatus | Abort | AbortAck
MESSAGE_TYPES: dict[bytes, type[Frame]] = {
    b"STAGING_REQ": StagingReq,
    b"STAGING_RSP": StagingRsp,
    b"WATERMARK": Watermark,
    b"CHUNK_READY": ChunkReady,
    b"KV_STATUS": TransferStatus,
    b"ABORT": Abort,
    b"ABORT_ACK": AbortAck,
}
"""Each message's first frame (its kind) -> its class."""
TAGS: dict[type[Frame], bytes] = {cls: tag for tag, cls in MESSAGE_TYPES.items()}
"""Message class -> its first frame (its msgspec tag, ``kind`` in a trace)."""


def tag_of(msg: Message) -> bytes:
    """The first frame of ``msg`` (``b"STAGING_REQ"``, ...)."""
    return TAGS[type(msg)]
_STR_FIELDS = {"session_id", "writer_id", "decode_ip"}
NO_RETURN_ADDRESS = ""
"""``Abort.decode_ip`` of a frame without a return address (SGLang: ``decode_ip=None``)."""

PREFETCH_SOCKET = "prefetch"
CONTROL_SOCKET = "control"


def socket_of(msg: Message) -> str:
    """The sender's socket for ``msg``: ``"prefetch"`` for STAGING_REQ, else ``"control"``.

    Frames keep their order only within one (source, destination, socket)."""
    return PREFETCH_SOCKET if isinstance(msg, StagingReq) else CONTROL_SOCKET


def _enc(value: object) -> bytes:
    if isinstance(value, KVPoll):
        return str(value.code).encode("ascii")
    return str(value).encode("ascii")


def encode(msg: Message) -> list[bytes]:
    """Frames of ``msg`` exactly as SGLang sends them."""
    if isinstance(msg, TransferStatus):
        return [TAGS[TransferStatus], _enc(msg.room), _enc(msg.status), _enc(msg.prefill_rank),
                msg.failure_reason.encode("utf-8")]
    if isinstance(msg, Abort) and msg.decode_ip == NO_RETURN_ADDRESS:
        return [TAGS[Abort], _enc(msg.room)]  # AbortNotification.to_zmq: no address, no more
    parts = [tag_of(msg)]
    for name in msg.__struct_fields__:
        value = getattr(msg, name)
        if name in _OPTIONAL and value is None:
            continue
        parts.append(_enc(value))
    return parts


_OPTIONAL = {"pp_rank", "failure_reason", "generation"}


def _field_names(cls: type[Frame]) -> list[str]:
    return list(cls.__struct_fields__)


def decode(frames: list[bytes]) -> Message:
    """Parse one multipart message; ``ValueError`` names the kind and field on bad input."""
    if not frames:
        raise ValueError("empty message: no frames")
    tag = bytes(frames[0])
    cls = MESSAGE_TYPES.get(tag)
    if cls is None:
        raise ValueError(f"unknown message kind {tag[:32]!r}")
    kind = tag.decode("ascii")
    if cls is Abort:
        return _decode_abort(frames)
    names = _field_names(cls)
    required = [n for n in names if n not in _OPTIONAL]
    body = frames[1:]
    if len(body) < len(required):
        missing = required[len(body)]
        raise ValueError(f"{kind}: missing field {missing!r} ({len(body)} of {len(required)} fields)")
    if len(body) > len(names):
        raise ValueError(f"{kind}: {len(body)} fields, at most {len(names)} expected")
    values: dict[str, Any] = {}
    for name, raw in zip(names, body, strict=False):
        values[name] = _decode_field(kind, name, bytes(raw))
    if cls is TransferStatus:
        try:
            values["status"] = KVPoll.of_code(values["status"])
        except ValueError:
            raise ValueError(f"{kind}: field 'status': unknown status {values['status']}") from None
    msg: Message = cls(**values)  # type: ignore[assignment]  # one of the Message classes
    return msg


def _decode_abort(frames: list[bytes]) -> Abort:
    """``AbortNotification.from_zmq`` (sglang 0.5.23 common/conn.py ~187-220): the room is
    required; with fewer than four frames, or a return address that does not parse, the
    notification has no return address (a legacy ``[ABORT, room]``); a generation that does
    not parse is None; frames past the fifth are ignored."""
    if len(frames) < 2:
        raise ValueError("ABORT: missing field 'room' (0 of 1 fields)")
    room = _decode_field("ABORT", "room", bytes(frames[1]))
    assert isinstance(room, int)
    legacy = Abort(room=room, decode_ip=NO_RETURN_ADDRESS, decode_port=0)
    if len(frames) < 4:
        return legacy
    try:
        ip = bytes(frames[2]).decode("ascii")
        port = int(bytes(frames[3]).decode("ascii"))
    except (UnicodeDecodeError, ValueError):
        return legacy
    generation: int | None = None
    if len(frames) >= 5:
        try:
            generation = int(bytes(frames[4]).decode("ascii"))
        except (UnicodeDecodeError, ValueError):
            generation = None
    return Abort(room=room, decode_ip=ip, decode_port=port, generation=generation)


def _decode_field(kind: str, name: str, raw: bytes) -> object:
    if name == "failure_reason":
        return raw.decode("utf-8", errors="replace")
    try:
        text = raw.decode("ascii")
    except UnicodeDecodeError:
        raise ValueError(f"{kind}: field {name!r}: not ASCII: {raw[:32]!r}") from None
    if name in _STR_FIELDS:
        return text
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{kind}: field {name!r}: expected a decimal integer, got {text[:32]!r}") from None
