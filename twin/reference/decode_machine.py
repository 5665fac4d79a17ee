"""SGLang 0.5.23's decode-side staging state machine, run from the wheel with recording stubs.

``sglang_wheel`` loads SGLang's pure helpers; this module loads the code that *decides*: the
whole ``DecodeStagingHandler`` class and ``handle_staging_req`` (``common/staging_handler.py``),
``StagingManagerMixin._handle_staging_req`` (the listener's STAGING_REQ entry),
``CommonKVManager.handle_chunk_ready`` and ``apply_prefill_status``, the receiver's
``CommonKVReceiver.poll``, ``_poll`` and ``_check_waiting_timeout`` (``common/conn.py``) and
``poll_and_all_reduce_with_staging`` (``utils.py``). NIXL, ZMQ, CUDA streams, events and
threads are replaced by recording stubs; the clock is a settable fake. Loading refuses when
the code's shape changed (a method or a function-local import that is not where it was).

``SglangDecodeRank`` wraps one decode rank around that code. What is *not* SGLang's own code
here is the thin glue a decode scheduler supplies, written after ``decode.py``
(``pop_transferred`` with deferred release off: conclude on the reduced poll, then
``unregister_decode_req``), the end of ``send_metadata`` (``init_time``, the start of the
waiting clock the loaded ``_check_waiting_timeout`` reads), the receiver's ``abort`` and the
decode TP group's MIN all-reduce of polls (the peers' polls are inputs, ``on_peer_poll``, as
the twin's decode ranks share them); it is marked ``# glue`` below.

Contract: every ``on_*`` call is one input; the rank polls its transfer queue after it and
records what SGLang decided (frames sent, scatters submitted, allocations freed, rooms
concluded), which ``drain`` hands over. The loaded code reads one fake clock shared by every
``SglangDecodeRank`` of the process: call ``at(now)`` before each input (or ``on_time``) when
several ranks are driven in turn. ``ReferenceUnavailable`` when the wheel cannot be had.
"""

from __future__ import annotations

import ast
import functools
import logging
import threading
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from twin.reference.sglang_wheel import (
    CONN,
    STAGING_HANDLER,
    UTILS,
    ReferenceUnavailable,
    exec_definitions,
    load_wheel,
    method_of,
    read_sources,
    say_on_stderr,
    strip_local_imports,
    top_level,
    wheel_path,
)

HANDLER_METHODS = {
    "register_wm_subscriber", "num_writers_for", "register_decode_req",
    "unregister_decode_req", "release_room", "submit_chunk_scatter", "is_staging_room",
    "handle_chunk_arrived", "submit_last_scatter_async", "is_done", "is_failed",
    "advance_scatter", "_scatter_region", "_free_and_send_watermark", "_send_watermark",
}
_LOCAL_IMPORTS = {
    "handle_staging_req": {"StagingAllocator", "compute_staging_layout",
                           "resolve_total_kv_heads"},
}


class KVPoll:
    """SGLang's ``KVPoll`` values (``disaggregation/base/conn.py``)."""

    Failed = 0
    Bootstrapping = 1
    WaitingForInput = 2
    Transferring = 3
    Success = 4


class FakeClock:
    """``time.monotonic()`` and ``time.time()`` for the loaded code: ``now``, set by hand."""

    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now

    def time(self) -> float:
        return self.now


class Event:
    """A scatter's device event: ``query()`` is True once the harness says it finished."""

    def __init__(self) -> None:
        self.done = False

    def record(self, _stream: Any = None) -> None:
        pass

    def query(self) -> bool:
        return self.done


class Stream:
    def synchronize(self) -> None:
        pass


def load_machines(note: Callable[[str], None] = say_on_stderr) -> types.SimpleNamespace:
    """SGLang's decode-side decision code, executed from the wheel's source (memoised per
    wheel file; ``note`` hears of a download before it starts)."""
    return load_machines_from(wheel_path(note))


@functools.lru_cache(maxsize=4)
def load_machines_from(wheel: Path) -> types.SimpleNamespace:
    """``load_machines()`` from this wheel file."""
    ref = load_wheel(wheel)
    src = read_sources(wheel, (STAGING_HANDLER, CONN, UTILS))
    clock = FakeClock()
    events: list[Event] = []

    def create_device_event(_device: Any) -> Event:
        ev = Event()
        events.append(ev)
        return ev

    # staging_handler.py: the handler class, handle_staging_req, the mixin's entry point.
    tree = ast.parse(src[STAGING_HANDLER])
    handler = top_level(tree, "DecodeStagingHandler", STAGING_HANDLER)
    assert isinstance(handler, ast.ClassDef)
    have = {n.name for n in handler.body if isinstance(n, ast.FunctionDef)}
    missing = HANDLER_METHODS - have
    if missing:
        raise ReferenceUnavailable(f"DecodeStagingHandler changed shape: no {sorted(missing)}")
    hsr = top_level(tree, "handle_staging_req", STAGING_HANDLER)
    assert isinstance(hsr, ast.FunctionDef)
    strip_local_imports(hsr, _LOCAL_IMPORTS["handle_staging_req"])
    mixin = top_level(tree, "StagingManagerMixin", STAGING_HANDLER)
    assert isinstance(mixin, ast.ClassDef)
    entry = method_of(mixin, "_handle_staging_req")
    ns = exec_definitions("sglang_sm_staging_handler", STAGING_HANDLER, src[STAGING_HANDLER],
                          [handler, hsr, entry], {
        "time": clock, "torch": types.SimpleNamespace(), "create_device_event":
        create_device_event, "create_device_stream": lambda _d: Stream(),
        "device_stream_context": None, "get_schedule": None,
        "StagingAllocator": ref.StagingAllocator,
        "compute_staging_layout": ref.compute_staging_layout,
        "resolve_total_kv_heads": _resolve_total_kv_heads,
    }, wheel)

    # conn.py: the listener's CHUNK_READY path and the status bookkeeping.
    ctree = ast.parse(src[CONN])
    manager = top_level(ctree, "CommonKVManager", CONN)
    assert isinstance(manager, ast.ClassDef)
    conn_fns = [method_of(manager, m) for m in ("handle_chunk_ready", "apply_prefill_status")]
    receiver = top_level(ctree, "CommonKVReceiver", CONN)
    assert isinstance(receiver, ast.ClassDef)
    recv_fns = [method_of(receiver, m) for m in ("poll", "_poll", "_check_waiting_timeout")]
    logger = logging.getLogger("sglang_sm_conn")
    cns = exec_definitions("sglang_sm_conn", CONN, src[CONN], [*conn_fns, *recv_fns], {
        "KVPoll": KVPoll, "time": clock,
        "logger": types.SimpleNamespace(debug=logger.debug, warning=logger.warning,
                                        error=logger.error, warning_once=logger.warning),
    }, wheel)

    # utils.py: the staging-aware poll. The gloo group's MIN all-reduce is glue: the group
    # argument is None for a rank alone, or a function over the polls (SglangDecodeRank's).
    poll_fn = top_level(ast.parse(src[UTILS]), "poll_and_all_reduce_with_staging", UTILS)
    uns = exec_definitions("sglang_sm_utils", UTILS, src[UTILS], [poll_fn], {
        "KVPoll": KVPoll,
        "_poll_with_failure_injection": lambda pollers: [int(p.poll()) for p in pollers],
        "_apply_metadata_gate": lambda *a: None,
        "_all_reduce_polls": lambda polls, group: polls if group is None else group(polls),
        "dist": None,
    }, wheel)
    return types.SimpleNamespace(
        DecodeStagingHandler=ns["DecodeStagingHandler"],
        handle_staging_req_entry=ns["_handle_staging_req"],
        handle_chunk_ready=cns["handle_chunk_ready"],
        apply_prefill_status=cns["apply_prefill_status"],
        receiver_poll=cns["poll"], receiver_poll_inner=cns["_poll"],
        check_waiting_timeout=cns["_check_waiting_timeout"],
        poll_and_all_reduce_with_staging=uns["poll_and_all_reduce_with_staging"],
        StagingAllocator=ref.StagingAllocator, clock=clock, events=events, wheel=wheel,
    )


def _resolve_total_kv_heads(kv_args: Any, attn_tp_size: int) -> int:
    return int(kv_args.total_kv_head_num)


# ---------------------------------------------------------------------------------------------
# One decode rank around SGLang's code
# ---------------------------------------------------------------------------------------------
class _Sock:
    def __init__(self, dst: str, sent: list[tuple[str, list[bytes]]]) -> None:
        self.dst, self.sent = dst, sent

    def send_multipart(self, parts: list[bytes]) -> None:
        self.sent.append((self.dst, [bytes(p) for p in parts]))


@dataclass
class _Receiver:
    """The parts of ``CommonKVReceiver`` the staging code and its loaded poll read."""

    room: int
    bootstrap_infos: list[dict[str, Any]]
    prefill_info: Any
    mgr: Any
    sent: list[tuple[str, list[bytes]]]
    init_time: float | None  # glue: set where send_metadata ends (cc ~2886)
    require_staging: bool = True
    chunk_staging_infos: list[tuple[int, int, int, int, int]] = field(default_factory=list)
    conclude_state: int | None = None
    _prefill_wait_start: float | None = None  # the "early" allocation policy never sets it
    abort_notified: bool = False
    _lifecycle_lock: Any = field(default_factory=threading.Lock)

    @property
    def bootstrap_room(self) -> int:
        return self.room

    @property
    def kv_mgr(self) -> Any:
        return self.mgr

    def _connect_to_bootstrap_server(self, info: dict[str, Any]) -> tuple[_Sock, Any]:
        return _Sock(info["rank_ip"], self.sent), threading.Lock()

    def poll(self) -> int:  # CommonKVReceiver.poll, _poll, _check_waiting_timeout: loaded
        return int(self.mgr.m.receiver_poll(self))

    def _poll(self) -> int:
        return int(self.mgr.m.receiver_poll_inner(self))

    def _check_waiting_timeout(self) -> int | None:
        return self.mgr.m.check_waiting_timeout(self)  # type: ignore[no-any-return]

    def invalidate_cached_bootstrap_infos(self) -> None:
        pass

    def _send_abort_notification(self) -> None:
        pass  # the ABORT frames are not compared (the twin's are checked by its own tests)


class _Manager:
    """A stand-in ``CommonKVManager``/``StagingManagerMixin`` for the lifted methods."""

    DEFAULT_PREFILL_FAILURE_REASON = "prefill failed"

    def __init__(self, m: types.SimpleNamespace, attn_tp_size: int, kv_args: Any) -> None:
        self.m = m
        self.clock = m.clock
        self.waiting_timeout = 0.0
        self.attn_tp_size = attn_tp_size
        self.kv_args = kv_args
        self.kv_buffer_tensors = None
        self.pp_size = 1
        self.enable_staging = True
        self.defer_decode_allocation = False
        self.request_status: dict[int, int] = {}
        self.prefill_response_tracker: dict[int, set[int]] = {}
        self.required_prefill_response_num_table: dict[int, int] = {}
        self.failure_records: dict[int, str] = {}
        self._staging_ctx = types.SimpleNamespace(allocator=None, room_bootstrap={},
                                                  room_receivers={})
        self._staging_handler: Any = None

    def record_failure(self, room: int, reason: str) -> None:
        self.failure_records.setdefault(room, reason)

    def check_status(self, room: int) -> int:  # NixlKVManager.check_status (nx ~1084)
        return self.request_status.get(room, KVPoll.WaitingForInput)

    def update_status(self, room: int, status: int) -> None:  # glue: update_status's rules
        current = self.request_status.get(room)
        if current is None:
            return
        if status == KVPoll.Failed or current == KVPoll.Failed:
            self.request_status[room] = KVPoll.Failed
            return
        self.request_status[room] = max(current, status)


class SglangDecodeRank:
    """One decode attention-TP rank: SGLang's handler, allocator, entry points and poll.

    Every ``on_*`` call is one input; it runs the decode poll afterwards (the twin's core
    advances its rooms after every input), and records what SGLang decided: frames sent,
    scatters submitted, allocations freed, rooms concluded (``drain``).
    """

    def __init__(self, *, ring_bytes: int, page_size: int, decode_tp: int, tp_rank: int,
                 total_kv_heads: int, head_bytes: int, num_layers: int,
                 timeout_s: float, note: Callable[[str], None] = say_on_stderr) -> None:
        m = load_machines(note)
        self.m = m
        m.events.clear()
        m.clock.now = 0.0
        heads = max(1, total_kv_heads // decode_tp)
        kv_args = types.SimpleNamespace(
            page_size=page_size, engine_rank=tp_rank, total_kv_head_num=total_kv_heads,
            kv_item_lens=[page_size * heads * head_bytes] * (2 * num_layers))
        self.mgr = _Manager(m, decode_tp, kv_args)
        self.mgr.waiting_timeout = float(timeout_s)
        self.alloc = m.StagingAllocator(ring_bytes, "cpu", 0)
        self.alloc._scatter_stream = Stream()
        self.freed: list[int] = []
        real_free = self.alloc.free

        def free(alloc_id: int) -> None:
            if alloc_id in self.alloc.allocations:
                self.freed.append(alloc_id)
            real_free(alloc_id)

        self.alloc.free = free
        self.mgr._staging_ctx.allocator = self.alloc
        h = m.DecodeStagingHandler.__new__(m.DecodeStagingHandler)
        h.kv_manager, h.staging_allocator = self.mgr, self.alloc
        h.kv_buffer_info = {"page_size": page_size}
        h.decode_tp, h.total_kv_heads, h.tp_rank = decode_tp, total_kv_heads, tp_rank
        h.scheduler, h.completion_timeout = None, float(timeout_s)
        h._room_to_decode_req, h._room_to_receiver = {}, {}
        h._wm_subscribers, h._writer_counts = {}, {}
        h.device, h.gpu_id = types.SimpleNamespace(type="cpu", index=0), 0
        self.scatters: list[tuple[int, int, int, int, int]] = []
        self._pending_event: tuple[int, int] | None = None
        self._scattering: tuple[int, int] = (-1, -1)
        h._scatter_region = self._scatter_region  # the kernel launch: recorded
        submit = h.submit_chunk_scatter

        def submit_chunk_scatter(room: int, chunk_idx: int, page_start: int,
                                 num_pages: int) -> bool:
            self._scattering = (room, chunk_idx)
            return bool(submit(room, chunk_idx, page_start, num_pages))

        h.submit_chunk_scatter = submit_chunk_scatter
        self.handler = h
        self.mgr._staging_handler = h
        self.timeout_s = timeout_s
        self.sent: list[tuple[str, list[bytes]]] = []
        self.queue: list[Any] = []  # decode requests in the transfer queue, in arrival order
        self.events: dict[int, tuple[int, Event]] = {}  # alloc_id -> (room, event)
        self.concluded: list[tuple[int, str]] = []
        self.peers: dict[int, tuple[str, ...]] = {}  # room -> the other ranks of its TP group
        self.peer_polls: dict[int, dict[str, int]] = {}  # room -> peer -> its last poll

    def _scatter_region(self, staging_offset: int, page_start: int, num_pages: int,
                        decode_req: Any, receiver: Any) -> bool:
        room, chunk = self._scattering
        self.scatters.append((room, chunk, staging_offset, page_start, num_pages))
        self._pending_event = (room, receiver.chunk_staging_infos[chunk][0])
        return True

    # -- inputs -------------------------------------------------------------------------------
    def at(self, now: float) -> None:
        """Set the clock the loaded code reads, without polling (before an input at ``now``)."""
        self.m.clock.now = now

    def on_room(self, room: int, prefill_ranks: list[str], prefill_ranks_ids: list[int],
                prefill_tp: int, prefix: int, pp_ranks: list[int] | None = None,
                pp_size: int = 1, peers: tuple[str, ...] = (), staged: bool = True) -> None:
        """A room whose metadata went to ``prefill_ranks``. ``pp_ranks``: each prefill rank's
        PP stage (its bootstrap info's ``pp_rank``); ``peers``: the other decode ranks of its
        TP group, whose polls the all-reduce takes (``on_peer_poll``); ``staged``: the
        receiver ``require_staging`` (else ``register_decode_req`` is not called)."""
        mgr, m = self.mgr, self.m
        info = types.SimpleNamespace(attn_tp_size=prefill_tp, pp_size=pp_size)
        stages = pp_ranks or [0] * len(prefill_ranks)
        receiver = _Receiver(room, [{"rank_ip": p, "rank_port": i, "pp_rank": s}
                                    for p, i, s in zip(prefill_ranks, prefill_ranks_ids,
                                                       stages, strict=True)],
                             info, mgr, self.sent, m.clock.now,  # glue: send_metadata ends
                             require_staging=staged)
        req = types.SimpleNamespace(bootstrap_room=room, kv=types.SimpleNamespace(
            cache_protected_len=prefix, req_pool_idx=0))
        decode_req = types.SimpleNamespace(req=req, kv_receiver=receiver)
        mgr.request_status[room] = KVPoll.WaitingForInput  # glue: bootstrapped, metadata sent
        mgr.prefill_response_tracker[room] = set()
        mgr.required_prefill_response_num_table[room] = len(prefill_ranks)
        if staged:
            self.handler.register_decode_req(room, decode_req)
            mgr._staging_ctx.room_bootstrap[room] = receiver.bootstrap_infos  # send_metadata
            mgr._staging_ctx.room_receivers[room] = receiver
        if peers:
            self.peers[room] = tuple(peers)
        self.queue.append(decode_req)
        self._poll()

    def on_staging_req(self, frames: list[bytes]) -> None:
        self.m.handle_staging_req_entry(self.mgr, frames)
        self._poll()

    def on_chunk_ready(self, frames: list[bytes]) -> None:
        self._pending_event = None
        self.m.handle_chunk_ready(self.mgr, frames)
        if self._pending_event is not None:
            room, alloc_id = self._pending_event
            self.events[alloc_id] = (room, self.m.events[-1])
        self._poll()

    def on_status(self, room: int, status: int, prefill_rank: int) -> None:
        self.m.apply_prefill_status(self.mgr, bootstrap_room=room, status=status,
                                    prefill_rank=prefill_rank, failure_reason="failed")
        self._poll()

    def on_scatter_done(self, alloc_id: int) -> None:
        """The scatter of ``alloc_id`` finished (one whose room was released already: its
        event is no longer polled, release_room drained and freed it)."""
        got = self.events.pop(alloc_id, None)
        if got is not None:
            got[1].done = True
        self._poll()

    def on_abort(self, room: int) -> None:  # glue: CommonKVReceiver.abort
        for decode_req in self.queue:
            receiver = decode_req.kv_receiver
            if decode_req.req.bootstrap_room == room and receiver.conclude_state != KVPoll.Failed:
                self.mgr.record_failure(room, "Aborted by AbortReq.")
                self.mgr.update_status(room, KVPoll.Failed)
                receiver.conclude_state = KVPoll.Failed
        self._poll()

    def on_peer_poll(self, room: int, peer: str, poll: int) -> None:  # glue: the all-reduce
        """Decode rank ``peer`` of ``room``'s TP group now polls ``poll`` (a ``KVPoll``)."""
        self.peer_polls.setdefault(room, {})[peer] = poll
        self._poll()

    def on_time(self, now: float) -> None:
        self.m.clock.now = now
        self._poll()

    # -- the decode loop's transfer-queue poll (glue after pop_transferred) -------------------
    def _reduce(self, polls: list[int]) -> list[int]:
        """glue: the TP group's MIN all-reduce, each room's poll against its peers' last ones
        (a peer not heard from yet is still transferring)."""
        out = []
        for decode_req, poll in zip(self.queue, polls, strict=True):
            room = decode_req.req.bootstrap_room
            heard = self.peer_polls.get(room, {})
            out.append(min([poll, *(heard.get(p, KVPoll.Transferring)
                                    for p in self.peers.get(room, ()))]))
        return out

    def _poll(self) -> None:
        if not self.queue:
            return
        polls = self.m.poll_and_all_reduce_with_staging(self.queue, self.handler,
                                                        self._reduce if self.peers else None)
        done = []
        for decode_req, poll in zip(self.queue, polls, strict=True):
            room = decode_req.req.bootstrap_room
            if poll == KVPoll.Success:
                self.concluded.append((room, "Success"))
                done.append(decode_req)
            elif poll == KVPoll.Failed:
                self.concluded.append((room, "Failed"))
                done.append(decode_req)
        for decode_req in done:
            room = decode_req.req.bootstrap_room
            self.queue.remove(decode_req)
            for alloc_id in [a for a, (r, _) in self.events.items() if r == room]:
                del self.events[alloc_id]  # release_room drains the stream and frees them
            self.handler.unregister_decode_req(room)
            self.mgr.request_status.pop(room, None)
            self.peers.pop(room, None)
            self.peer_polls.pop(room, None)

    def drain(self) -> tuple[list[tuple[str, list[bytes]]], list[tuple[int, int, int, int, int]],
                             list[int], list[tuple[int, str]]]:
        """What happened since the last drain: frames, scatters, frees, conclusions."""
        out = (self.sent[:], self.scatters[:], self.freed[:], self.concluded[:])
        self.sent.clear()
        self.scatters.clear()
        self.freed.clear()
        self.concluded.clear()
        return out

    def ring(self) -> tuple[int, int, tuple[int, int], list[tuple[int, int, int, int]]]:
        """``(head, round, watermark, live allocations (id, offset, size, round))``."""
        a = self.alloc
        live = [(i, *a.allocations[i]) for i in a.alloc_order if i in a.allocations]
        return a.head, a.round, a.get_watermark(), [(i, o, n, r) for i, o, n, r in live]
