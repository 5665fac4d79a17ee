"""One Mooncake transfer engine, wrapped with the interface of :class:`NixlEndpoint`.

SGLang's default staging backend (``--disaggregation-transfer-backend mooncake``) moves each
staged chunk with ``TransferEngine.batch_transfer_sync(session, srcs, dsts, lengths)``
(``mooncake/conn.py`` ``_transfer_data``): a *blocking* call on the transfer worker thread,
which serves no other room until it returns. ``MooncakeEndpoint`` keeps that: :meth:`write`
hands the blocking ``batch_transfer_sync_write`` to the calling worker's own thread and
returns a handle that :meth:`poll` reports ``PROC`` until the call returned; a rank's event
loop therefore stays responsive while each worker thread is blocked, as SGLang's scheduler
does.

Set-up as SGLang does it (``distributed/device_communicators/mooncake_transfer_engine.py``):
``initialize(hostname, "P2PHANDSHAKE", protocol, device)`` (no metadata server: peers
handshake directly), the session id is ``host:rpc_port``, and memory is registered with
``register_memory(addr, length)``. On a CPU host the engine is
``mooncake-transfer-engine-non-cuda`` with the ``tcp`` protocol; it links the system's
``libibverbs.so.1`` even then (``scripts/setup.sh`` installs rdma-core's libraries as root).

Behaviour of the engine (0.3.13, TCP) relied on here:

* A write whose remote range lies outside the peer's registered memory is refused by the
  peer (``remote-supplied address ... is not within any registered buffer``) and the call
  returns -1; this wrapper checks bounds first so the error names the range.
* ``batch_transfer_sync_*`` returns -1 also when its wall-clock timeout passes with the batch
  still running (SGLang's ``_poison_unsettled_send``): nothing proves the bytes stopped, so a
  failed write is reported as ``ERR`` with ``settled = False`` (the room is poisoned).
* The first write to a peer opens its connection (tens of milliseconds on a loaded host).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from twin.hw.nixl_transport import (
    MemKind,
    RegionDesc,
    TransferBoundsError,
    TransferError,
    TransferTimeout,
    XferState,
    write_blocks,
)

if TYPE_CHECKING:
    import torch

DEFAULT_PROTOCOL = "tcp"


def engine_available() -> str | None:
    """None when the Mooncake transfer engine imports here, else why not."""
    try:
        from mooncake.engine import TransferEngine  # noqa: F401
    except ImportError as exc:
        return f"the Mooncake transfer engine does not import: {exc}"
    return None


@dataclass(eq=False)
class MooncakeHandle:
    """One blocking WRITE running on a worker thread."""

    xfer_id: int
    peer: str
    nbytes: int
    posted_at: float
    state: XferState = "PROC"
    released: bool = False
    done_at: float | None = None
    error: str = ""
    settled: bool = True
    _future: Future[int] | None = field(default=None, repr=False)

    @property
    def elapsed_s(self) -> float | None:
        return None if self.done_at is None else self.done_at - self.posted_at


class MooncakeEndpoint:
    """A Mooncake ``TransferEngine`` (P2P handshake) with ``NixlEndpoint``'s methods.

    ``workers``: threads that run blocking writes, one per transfer worker of the rank (a
    write names its worker; each worker's writes run one after another on its thread).
    """

    _ids = itertools.count(1)

    def __init__(self, name: str, *, host: str = "127.0.0.1", protocol: str | None = None,
                 workers: int = 4, device_name: str = "") -> None:
        os.environ.setdefault("GLOG_minloglevel", "1")  # the engine's INFO lines: warnings up
        from mooncake.engine import TransferEngine

        if not name:
            raise ValueError("endpoint name must be non-empty")
        self.name = name
        self.protocol = protocol or os.environ.get("TWIN_MOONCAKE_PROTOCOL", DEFAULT_PROTOCOL)
        self._engine: Any = TransferEngine()
        rc = self._engine.initialize(host, "P2PHANDSHAKE", self.protocol, device_name)
        if rc != 0:
            self._engine = None
            raise TransferError(f"cannot initialise the Mooncake transfer engine for {name!r} "
                                f"({self.protocol} on {host}): {rc}")
        #: SGLang's ``mooncake_session_id``: where peers write to.
        self.session = f"{host}:{self._engine.get_rpc_port()}"
        self._regions: list[tuple[RegionDesc, Any]] = []
        self._peers: set[str] = set()
        self._handles: dict[int, MooncakeHandle] = {}
        self._pools = [ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"mc-{name}-{i}")
                       for i in range(max(1, workers))]
        self._lock = threading.Lock()
        self._closed = False

    # ------------------------------------------------------------------ lifecycle
    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> MooncakeEndpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Wait for running writes, unregister memory, stop the threads. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for pool in self._pools:
            pool.shutdown(wait=True)
        if self._engine is not None:
            for region, _owner in self._regions:
                with contextlib.suppress(Exception):
                    self._engine.unregister_memory(region.addr)
        self._regions.clear()
        self._handles.clear()
        self._peers.clear()

    def _live(self) -> Any:
        if self._closed or self._engine is None:
            raise TransferError(f"endpoint {self.name!r} is closed")
        return self._engine

    # ------------------------------------------------------------------ memory and peers
    def register(self, tensor: torch.Tensor) -> RegionDesc:
        """Register a contiguous CPU tensor's bytes (``register_memory``)."""
        engine = self._live()
        if not tensor.is_contiguous():
            raise ValueError("tensor must be contiguous")
        if tensor.device.type != "cpu":
            raise TransferError("the non-CUDA Mooncake engine registers DRAM only")
        addr, length = tensor.data_ptr(), tensor.numel() * tensor.element_size()
        rc = engine.register_memory(addr, length)
        if rc != 0:
            raise TransferError(f"register_memory({length} B) failed: {rc}")
        mem: MemKind = "DRAM"
        region = RegionDesc(agent=self.session, addr=addr, length=length, mem=mem, dev_id=0)
        self._regions.append((region, tensor))
        return region

    def deregister(self, region: RegionDesc) -> None:
        for i, (r, _) in enumerate(self._regions):
            if r == region:
                self._live().unregister_memory(r.addr)
                del self._regions[i]
                return
        raise TransferError(f"region {region!r} is not registered here")

    def regions(self) -> list[RegionDesc]:
        return [r for r, _ in self._regions]

    def metadata(self) -> bytes:
        """What a peer needs to write here: the session id (P2P handshake, no server)."""
        return json.dumps({"backend": "mooncake", "session": self.session}).encode()

    def add_peer(self, metadata: bytes) -> str:
        """Load a peer's :meth:`metadata`; returns its session id (the peer's name)."""
        try:
            data = json.loads(metadata)
            session = str(data["session"])
        except (ValueError, KeyError, TypeError) as exc:
            raise TransferError(f"not Mooncake endpoint metadata: {metadata[:64]!r}") from exc
        self._peers.add(session)
        return session

    @property
    def peers(self) -> frozenset[str]:
        return frozenset(self._peers)

    def _local(self, local: torch.Tensor | tuple[int, int], nbytes: int) -> int:
        if isinstance(local, tuple):
            addr, length = local
        else:
            addr, length = local.data_ptr(), local.numel() * local.element_size()
        if nbytes > length:
            raise TransferBoundsError(f"{nbytes} B from a {length} B local buffer")
        for r, _ in self._regions:
            if r.contains(addr, nbytes):
                return addr
        raise TransferBoundsError(f"local range [0x{addr:x}, +{nbytes}) is not inside a "
                                  f"region registered by {self.name!r}")

    # ------------------------------------------------------------------ writes
    def write(self, local: torch.Tensor | tuple[int, int], peer_name: str, remote: RegionDesc,
              remote_offset: int, nbytes: int, *, worker: int = 0,
              blocks: list[tuple[int, int, int]] | None = None) -> MooncakeHandle:
        """Start a blocking ``batch_transfer_sync_write`` of ``nbytes`` from ``local`` to
        ``remote + remote_offset`` on worker ``worker``'s thread. ``blocks`` (``(local offset,
        remote offset, length)``) splits it as SGLang does for PP stages (one block per layer
        slot); default one block."""
        engine = self._live()
        if peer_name not in self._peers:
            raise TransferError(f"unknown peer {peer_name!r}")
        if remote.agent != peer_name:
            raise TransferError(f"region belongs to {remote.agent!r}, not peer {peer_name!r}")
        parts = write_blocks(nbytes, remote, remote_offset, blocks)
        laddr = self._local(local, nbytes)
        srcs = [laddr + lo for lo, _, _ in parts]
        dsts = [remote.addr + remote_offset + ro for _, ro, _ in parts]
        lens = [n for _, _, n in parts]
        h = MooncakeHandle(xfer_id=next(self._ids), peer=peer_name, nbytes=nbytes,
                           posted_at=time.perf_counter())
        call: Callable[[], int] = lambda: int(  # noqa: E731
            engine.batch_transfer_sync_write(peer_name, srcs, dsts, lens))
        h._future = self._pools[worker % len(self._pools)].submit(call)
        self._handles[h.xfer_id] = h
        return h

    def poll(self, handle: MooncakeHandle) -> XferState:
        """``PROC`` while the blocking call runs, then ``DONE`` (0) or ``ERR``."""
        if handle.state != "PROC" or handle._future is None or not handle._future.done():
            return handle.state
        try:
            rc = handle._future.result()
        except Exception as exc:  # the engine raised instead of returning
            rc, handle.error = -1, f"{type(exc).__name__}: {exc}"
        if rc == 0:
            handle.state, handle.done_at = "DONE", time.perf_counter()
        else:
            # batch_transfer_sync returns -1 on its timeout with the batch maybe still
            # running: SGLang poisons the room (mooncake/conn.py _poison_unsettled_send).
            handle.state, handle.settled = "ERR", False
            handle.error = handle.error or f"batch_transfer_sync_write returned {rc}"
        return handle.state

    def wait(self, handle: MooncakeHandle, timeout_s: float = 30.0) -> None:
        """Block until the write returned; raise :class:`TransferError` on failure."""
        if handle._future is None:
            raise TransferError("handle was never posted")
        try:
            handle._future.result(timeout=timeout_s)
        except TimeoutError as exc:
            raise TransferTimeout(f"WRITE #{handle.xfer_id} of {handle.nbytes} B to "
                                  f"{handle.peer!r} still running after {timeout_s:.3g} s"
                                  ) from exc
        except Exception:
            pass
        if self.poll(handle) != "DONE":
            raise TransferError(f"WRITE #{handle.xfer_id} of {handle.nbytes} B to "
                                f"{handle.peer!r} failed: {handle.error}")

    def release(self, handle: MooncakeHandle) -> None:
        """Forget a finished handle (a running write cannot be cancelled). Idempotent."""
        if handle.released:
            return
        if handle.state == "PROC":
            raise TransferError(f"WRITE #{handle.xfer_id} is still running; Mooncake's "
                                f"synchronous writes cannot be cancelled")
        handle.released = True
        self._handles.pop(handle.xfer_id, None)

    def outstanding(self) -> int:
        return sum(1 for h in self._handles.values() if h.state == "PROC")


def choose_transport(backend: str) -> tuple[str, str]:
    """``(transport, note)``: which engine moves a hardware run's bytes for the config's
    ``disaggregation_transfer_backend``. ``TWIN_HW_TRANSPORT`` (``mooncake`` or ``nixl``)
    forces one; otherwise Mooncake runs on the Mooncake engine when it loads here, and on
    NIXL, said in the note, when it does not (the protocol, PP writers included, is the
    core's either way; what changes is the data mover)."""
    forced = os.environ.get("TWIN_HW_TRANSPORT")
    if forced is not None:
        if forced not in ("mooncake", "nixl"):
            raise ValueError(f"TWIN_HW_TRANSPORT: expected mooncake or nixl, got {forced!r}")
        return forced, f"{forced} transfers (TWIN_HW_TRANSPORT)"
    if backend != "mooncake":
        return "nixl", "NIXL transfers (UCX)"
    why = engine_available()
    if why is None:
        return "mooncake", "Mooncake transfer engine (P2P handshake, batch_transfer_sync_write)"
    return "nixl", (f"NIXL transfers in place of Mooncake's: {why} (install the mooncake "
                    f"extra and libibverbs1, or set TWIN_HW_TRANSPORT)")
