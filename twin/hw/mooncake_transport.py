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
``TWIN_MOONCAKE_PROTOCOL`` picks another protocol (``rdma``).

GPU memory: ``register_memory`` takes a CUDA pointer as it takes a host one, but only an engine
built with CUDA (``mooncake.engine.SUPPORT_CUDA``; the ``mooncake-transfer-engine`` wheel) moves
it: its ``rdma`` transport reads and writes VRAM in place (GPUDirect RDMA, which needs the
``nvidia-peermem`` module or dma-buf for the registration to succeed), and its ``tcp``
transport copies VRAM through host memory 64 KiB at a time (``cudaMemcpy`` on its socket
threads). A build without CUDA accepts the registration and then hands the device pointer to
its sockets, so :func:`gpu_memory_support` decides before anything is registered, and
:meth:`MooncakeEndpoint.register` refuses a CUDA tensor with that reason (use NIXL instead)
rather than copying it to host memory behind the protocol's back.

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
#: The protocols whose transport moves CUDA memory in a CUDA build of the engine, and how.
GPU_PROTOCOLS: dict[str, str] = {
    "rdma": "GPUDirect RDMA, the NIC reading and writing VRAM in place",
    "tcp": "the engine's TCP transport, which copies VRAM through host memory",
}
NIXL_FOR_VRAM = ("move VRAM with NIXL instead (--disaggregation-transfer-backend nixl, or "
                 "TWIN_HW_TRANSPORT=nixl)")


def engine_available() -> str | None:
    """None when the Mooncake transfer engine imports here, else why not."""
    try:
        from mooncake.engine import TransferEngine  # noqa: F401
    except ImportError as exc:
        return f"the Mooncake transfer engine does not import: {exc}"
    return None


def mooncake_protocol() -> str:
    """The protocol endpoints initialise with: ``TWIN_MOONCAKE_PROTOCOL``, else ``tcp``."""
    return os.environ.get("TWIN_MOONCAKE_PROTOCOL") or DEFAULT_PROTOCOL


def gpu_memory_support(protocol: str, cuda_build: bool) -> str | None:
    """None when an engine built with CUDA (``cuda_build``) or not registers and moves CUDA
    memory over ``protocol``; else why not, saying what to use instead."""
    if not cuda_build:
        return ("this Mooncake transfer engine is built without CUDA (mooncake.engine."
                "SUPPORT_CUDA is false, as in mooncake-transfer-engine-non-cuda) and moves host "
                "memory only: install the CUDA build (mooncake-transfer-engine), or "
                + NIXL_FOR_VRAM)
    if protocol not in GPU_PROTOCOLS:
        return (f"the Mooncake {protocol!r} protocol is not one that moves VRAM here (set "
                f"TWIN_MOONCAKE_PROTOCOL to {' or '.join(GPU_PROTOCOLS)}), or " + NIXL_FOR_VRAM)
    return None


def engine_gpu_support(protocol: str | None = None) -> str | None:
    """:func:`gpu_memory_support` of the engine installed here (``protocol`` defaults to
    :func:`mooncake_protocol`); why not also when the engine does not import."""
    why = engine_available()
    if why is not None:
        return why
    import mooncake.engine as engine

    return gpu_memory_support(protocol or mooncake_protocol(),
                              bool(getattr(engine, "SUPPORT_CUDA", False)))


def probe_vram(device: str = "cuda", protocol: str | None = None) -> str | None:
    """None when a real endpoint here registers a one-page CUDA tensor on ``device``; else why
    not. :func:`engine_gpu_support` is checked first, so no device pointer reaches an engine
    without CUDA; with ``rdma`` the registration itself shows GPUDirect works on this host."""
    why = engine_gpu_support(protocol)
    if why is not None:
        return why
    import torch

    if not torch.cuda.is_available():
        return "no CUDA device is visible to torch"
    try:
        page = torch.zeros(4096, dtype=torch.uint8, device=device)
        torch.cuda.synchronize(page.device)
        with MooncakeEndpoint(f"vram-probe-{os.getpid()}", protocol=protocol,
                              workers=1) as ep:
            ep.register(page)
    except (TransferError, RuntimeError) as exc:
        return str(exc)
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
        self.protocol = protocol or mooncake_protocol()
        import mooncake.engine as engine_module

        #: Why this endpoint refuses CUDA memory (:func:`gpu_memory_support`), or None.
        self.vram_refusal = gpu_memory_support(
            self.protocol, bool(getattr(engine_module, "SUPPORT_CUDA", False)))
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
        """Register a contiguous tensor's bytes in place (``register_memory``): host memory,
        or CUDA memory where :attr:`vram_refusal` is None. Anything else raises
        :class:`TransferError` with the reason before the engine sees the pointer."""
        engine = self._live()
        if not tensor.is_contiguous():
            raise ValueError("tensor must be contiguous")
        kind = tensor.device.type
        mem: MemKind
        if kind == "cpu":
            mem, dev = "DRAM", 0
        elif kind == "cuda":
            if self.vram_refusal is not None:
                raise TransferError(f"cannot register {tensor.device} memory with Mooncake "
                                    f"for {self.name!r}: {self.vram_refusal}")
            mem, dev = "VRAM", int(tensor.device.index or 0)
        else:
            raise TransferError(f"Mooncake registers host or CUDA memory, not {kind}")
        addr, length = tensor.data_ptr(), tensor.numel() * tensor.element_size()
        rc = engine.register_memory(addr, length)
        if rc != 0:
            why = ""
            if mem == "VRAM":
                why = (f" ({self.protocol} could not register {tensor.device} memory"
                       + (": GPUDirect RDMA needs the nvidia-peermem module or dma-buf "
                          "support" if self.protocol == "rdma" else "")
                       + f"; {NIXL_FOR_VRAM})")
            raise TransferError(f"register_memory({length} B) failed: {rc}{why}")
        region = RegionDesc(agent=self.session, addr=addr, length=length, mem=mem, dev_id=dev)
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
              blocks: list[tuple[int, int, int]] | None = None,
              local_span: int | None = None) -> MooncakeHandle:
        """Start a blocking ``batch_transfer_sync_write`` of ``nbytes`` from ``local`` to
        ``remote + remote_offset`` on worker ``worker``'s thread. ``blocks`` (``(local offset,
        remote offset, length)``) splits it as SGLang does for PP stages (one block per layer
        slot) and direct page writes (one per page, layer and K/V); default one block.
        ``local_span``: the bytes of ``local`` the blocks may read (default the first
        ``nbytes``)."""
        engine = self._live()
        if peer_name not in self._peers:
            raise TransferError(f"unknown peer {peer_name!r}")
        if remote.agent != peer_name:
            raise TransferError(f"region belongs to {remote.agent!r}, not peer {peer_name!r}")
        parts = write_blocks(nbytes, remote, remote_offset, blocks, local_span)
        laddr = self._local(local, nbytes if local_span is None else local_span)
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


def choose_transport(backend: str, device: str = "cpu") -> tuple[str, str]:
    """``(transport, note)``: which engine moves a hardware run's bytes for the config's
    ``disaggregation_transfer_backend`` with ranks on ``device`` (``cpu``, ``cuda[:N]``).
    ``TWIN_HW_TRANSPORT`` (``mooncake`` or ``nixl``) forces one; otherwise Mooncake runs on
    the Mooncake engine when it loads here and, on CUDA, moves VRAM
    (:func:`engine_gpu_support`), and on NIXL, said in the note, when it does not (the
    protocol, PP writers included, is the core's either way; what changes is the data mover).
    Raises ``ValueError`` for a bad ``TWIN_HW_TRANSPORT`` and for Mooncake forced on CUDA
    where the engine cannot register VRAM (with the reason)."""
    cuda = device.split(":")[0] == "cuda"
    protocol = mooncake_protocol()
    forced = os.environ.get("TWIN_HW_TRANSPORT")
    if forced is not None:
        if forced not in ("mooncake", "nixl"):
            raise ValueError(f"TWIN_HW_TRANSPORT: expected mooncake or nixl, got {forced!r}")
        why = engine_gpu_support(protocol) if forced == "mooncake" and cuda else None
        if why is not None:
            raise ValueError(f"TWIN_HW_TRANSPORT=mooncake with ranks on {device}: {why}")
        return forced, f"{forced} transfers (TWIN_HW_TRANSPORT)" + (
            f"; VRAM over Mooncake {protocol}: {GPU_PROTOCOLS[protocol]}"
            if forced == "mooncake" and cuda else "")
    if backend != "mooncake":
        return "nixl", "NIXL transfers (UCX)"
    why = engine_available()
    if why is not None:
        return "nixl", (f"NIXL transfers in place of Mooncake's: {why} (install the mooncake "
                        f"extra and libibverbs1, or set TWIN_HW_TRANSPORT)")
    note = "Mooncake transfer engine (P2P handshake, batch_transfer_sync_write)"
    if not cuda:
        return "mooncake", note
    why = engine_gpu_support(protocol)
    if why is not None:
        return "nixl", f"NIXL transfers in place of Mooncake's for VRAM: {why}"
    return "mooncake", f"{note}; VRAM over {protocol}: {GPU_PROTOCOLS[protocol]}"
