"""One NIXL agent with a UCX backend, wrapped for one-sided WRITEs into sub-ranges.

``NixlEndpoint`` owns a single ``nixl_agent``. A rank registers its buffers with
:meth:`NixlEndpoint.register` (getting a serialisable :class:`RegionDesc`), ships
:meth:`NixlEndpoint.metadata` plus its descriptors to the peer out of band (see
``twin.hw.control``), and the peer loads them with :meth:`NixlEndpoint.add_peer`. The
initiator then posts :meth:`NixlEndpoint.write` calls that copy ``nbytes`` from a local
registered range into ``remote.addr + remote_offset``; completion is observed with
:meth:`poll` / :meth:`wait` on the initiator and with :meth:`get_notifs` /
:meth:`wait_notif` on the target, if a notification was attached.

Memory kinds: CPU tensors are registered as ``"DRAM"`` with dev id 0; CUDA tensors as
``"VRAM"`` with dev id equal to the CUDA device index. Local and remote kinds may differ.

Behaviour of NIXL 1.5.1 (UCX backend) observed on a CPU-only host, relied on here:

* ``shm=True`` creates the UCX backend with ``ucx_error_handling_mode=none`` (agent built
  with no default backends, then ``create_backend``); ``shm=False`` keeps UCX's default
  ``peer`` mode. ``peer`` mode disables the shared-memory *active-message* transports
  (sysv/posix), so wire-up and notifications go over TCP loopback, but same-host bulk
  WRITEs still use the CMA zero-copy transport (``process_vm_writev``) in both modes, so
  bulk throughput is about the same. To really push data through TCP set ``UCX_TLS=tcp``
  in the environment before the agent is created (UCX then stripes over all TCP
  interfaces, loopback included). On a host with NVIDIA GPUs NIXL's UCX plugin refuses a
  ``UCX_TLS`` without CUDA support (``all``, ``cuda`` or ``cuda_copy``): use
  ``UCX_TLS=tcp,cuda_copy`` there, or ``tcp,cuda_copy,cuda_ipc`` to keep CUDA IPC.
* With ``shm=False`` the first WRITE to a peer needs the peer's progress thread (TCP
  wire-up): while the peer is stopped it stays ``PROC``. With ``shm=True`` writes complete
  without any help from the target process.
* Once a peer process has died, the next post fails in both modes (``transfer`` raises
  ``NIXL_ERR_REMOTE_DISCONNECT`` rather than returning ``"ERR"``; mapped to
  :class:`TransferError`). A write in flight when the peer dies ends in ``ERR`` in ``peer``
  mode; UCX gives no such guarantee in ``none`` mode, so always ``wait`` with a timeout.
* ``add_peer`` with refreshed metadata for an already-known agent is accepted and returns
  the same name.
* ``get_backend_params("UCX")`` after creation echoes only the parameters that were
  passed in, not the effective configuration.
* The full agent metadata snapshot includes the memory registered *so far*; regions
  registered later are unknown to peers that loaded an older snapshot, and NIXL then
  refuses transfers into them (``nixlNotFoundError``). Register everything before calling
  :meth:`metadata`, or send a fresh snapshot and ``add_peer`` it again.
* A remote range that is not inside a region known from the peer's metadata (for example
  past the registered length) is rejected by ``initialize_xfer`` with
  ``nixlNotFoundError`` ("no specified or potential backend had the required
  registrations"); NIXL does not write out of bounds. The same happens for a local range
  that is not registered. This wrapper checks both bounds itself first so the error names
  the offending range, and maps any NIXL exception to :class:`TransferError`.
* An empty notification message means "no notification": NIXL only sends one when the
  message is non-empty, so ``notif=b""`` is rejected here to avoid a silent no-op.
* Deregistering a region twice raises ``nixlNotFoundError``; :meth:`close` is idempotent
  because it tracks what it registered.
* Writes often complete inside the posting call (``transfer`` returns ``DONE``); with the
  CMA transport this holds even for 64 MiB, so the post itself can take milliseconds.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    import torch

MemKind = Literal["DRAM", "VRAM"]
XferState = Literal["PROC", "DONE", "ERR"]

_MEM_KINDS: tuple[str, ...] = ("DRAM", "VRAM")


class TransferError(RuntimeError):
    """A NIXL transfer could not be created, posted, or finished successfully."""


class TransferBoundsError(TransferError, ValueError):
    """A requested byte range falls outside the local or remote registered region."""


class TransferTimeout(TransferError, TimeoutError):
    """A transfer was still in progress when :meth:`NixlEndpoint.wait` gave up."""


@dataclass(frozen=True)
class RegionDesc:
    """A registered, contiguous memory region of one agent.

    ``addr`` is the base address in the owning process; it is only meaningful to NIXL
    (as a remote target) and to the owner. ``dev_id`` is 0 for DRAM, the CUDA index for VRAM.
    """

    agent: str
    addr: int
    length: int
    mem: MemKind
    dev_id: int

    def __post_init__(self) -> None:
        if self.mem not in _MEM_KINDS:
            raise ValueError(f"mem must be one of {_MEM_KINDS}, got {self.mem!r}")
        if self.length <= 0 or self.addr <= 0 or self.dev_id < 0:
            raise ValueError(f"invalid region: {self!r}")

    def contains(self, addr: int, nbytes: int) -> bool:
        """Whether ``[addr, addr + nbytes)`` lies inside this region (``nbytes > 0``)."""
        return nbytes > 0 and self.addr <= addr and addr + nbytes <= self.addr + self.length

    def to_dict(self) -> dict[str, Any]:
        """Plain-JSON representation."""
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> RegionDesc:
        """Inverse of :meth:`to_dict`; raises ``ValueError`` on missing or bad fields."""
        try:
            return cls(
                agent=str(d["agent"]),
                addr=int(d["addr"]),
                length=int(d["length"]),
                mem=str(d["mem"]),  # type: ignore[arg-type]
                dev_id=int(d["dev_id"]),
            )
        except (KeyError, TypeError) as e:
            raise ValueError(f"malformed RegionDesc: {d!r}") from e

    def to_json(self) -> str:
        """Compact JSON string."""
        return json.dumps(self.to_dict(), separators=(",", ":"))

    @classmethod
    def from_json(cls, s: str | bytes) -> RegionDesc:
        """Inverse of :meth:`to_json`; raises ``ValueError`` on malformed input."""
        try:
            d = json.loads(s)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"RegionDesc JSON does not parse: {e}") from e
        if not isinstance(d, dict):
            raise ValueError(f"RegionDesc JSON is not an object: {d!r}")
        return cls.from_dict(d)


def write_blocks(nbytes: int, remote: RegionDesc, remote_offset: int,
                 blocks: list[tuple[int, int, int]] | None,
                 local_span: int | None = None) -> list[tuple[int, int, int]]:
    """The ``(local offset, remote offset, length)`` pieces of one WRITE of ``nbytes`` to
    ``remote + remote_offset``: ``blocks`` (relative to the start of the local buffer and to
    ``remote_offset``; a PP stage's layer slots, a direct write's pages), or one block of
    ``nbytes``. ``local_span``: the local bytes the blocks may read (default the first
    ``nbytes``; a direct write's pages lie anywhere in its KV pool). Raises
    :class:`TransferBoundsError` for a piece outside those local bytes or the remote region,
    or pieces that do not add up to ``nbytes``."""
    if nbytes <= 0:
        raise TransferBoundsError(f"nbytes must be positive, got {nbytes}")
    span = nbytes if local_span is None else local_span
    parts = blocks if blocks else [(0, 0, nbytes)]
    for lo, ro, n in parts:
        if n <= 0 or lo < 0 or lo + n > span:
            what = "being written" if local_span is None else "of the local span"
            raise TransferBoundsError(f"block (local {lo}, remote {ro}, {n} B) is outside the "
                                      f"{span} B {what}")
        start = remote_offset + ro
        if start < 0 or start + n > remote.length:
            raise TransferBoundsError(
                f"remote range [{start}, {start + n}) is outside the {remote.length} B region "
                f"of {remote.agent!r}")
    if sum(n for _, _, n in parts) != nbytes:
        raise TransferBoundsError(f"blocks of {sum(n for _, _, n in parts)} B for a WRITE of "
                                  f"{nbytes} B")
    return parts


@dataclass(eq=False)
class TransferHandle:
    """One posted WRITE. ``state`` is the last state observed; owned by its endpoint."""

    xfer_id: int
    peer: str
    nbytes: int
    notif: bytes | None
    posted_at: float
    state: XferState = "PROC"
    released: bool = False
    done_at: float | None = None
    _xfer: Any = field(default=None, repr=False)

    @property
    def elapsed_s(self) -> float | None:
        """Seconds from posting to the first observed ``DONE`` (``None`` until then)."""
        return None if self.done_at is None else self.done_at - self.posted_at


def _tensor_region(t: torch.Tensor) -> tuple[int, int, MemKind, int]:
    """``(addr, nbytes, mem, dev_id)`` of a contiguous tensor."""
    if not t.is_contiguous():
        raise ValueError("tensor must be contiguous")
    nbytes = t.numel() * t.element_size()
    if t.device.type == "cpu":
        return t.data_ptr(), nbytes, "DRAM", 0
    if t.device.type == "cuda":
        return t.data_ptr(), nbytes, "VRAM", int(t.device.index or 0)
    raise ValueError(f"unsupported tensor device {t.device}")


class NixlEndpoint:
    """One NIXL agent with a UCX backend (see the module docstring for NIXL quirks).

    Not thread-safe: use one endpoint from one thread. ``close`` is idempotent, releases
    outstanding handles (best effort), deregisters memory and forgets peers; the endpoint
    is also a context manager.
    """

    _ids = itertools.count(1)

    def __init__(self, name: str, *, shm: bool = True, progress_thread: bool = True) -> None:
        from twin.hw.netutil import choose_ucx_modules

        #: What was chosen for UCX's InfiniBand modules (``netutil.choose_ucx_modules``).
        self.ucx_modules = choose_ucx_modules()
        from nixl._api import nixl_agent, nixl_agent_config

        if not name:
            raise ValueError("agent name must be non-empty")
        self.name = name
        self.shm = shm
        # NIXL's progress thread spins without pause (its delay is fixed at 0). Between
        # processes of one host with ``shm`` a WRITE completes without it (the initiator's
        # polls progress it), so a rank whose peers are all local turns it off and takes one
        # core instead of two; over TCP the target's thread must run (wire-up).
        self._agent: Any = nixl_agent(name, nixl_agent_config(
            enable_prog_thread=progress_thread or not shm, backends=[]))
        params = {"ucx_error_handling_mode": "none"} if shm else {}
        try:
            self._agent.create_backend("UCX", params)
        except Exception as e:
            self._agent = None
            raise TransferError(f"cannot create UCX backend for {name!r}: {e}") from e
        # (RegionDesc, nixl reg dlist, owner kept alive while registered)
        self._regions: list[tuple[RegionDesc, Any, Any]] = []
        self._peers: set[str] = set()
        self._handles: dict[int, TransferHandle] = {}
        self._notif_backlog: list[tuple[str, bytes]] = []
        self._closed = False

    # ------------------------------------------------------------------ lifecycle
    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> NixlEndpoint:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        """Release handles, deregister memory, drop peers and the agent. Idempotent."""
        if self._closed:
            return
        self._closed = True
        agent = self._agent
        for h in list(self._handles.values()):
            # NIXL keeps handles it cannot cancel on its own leak list.
            with contextlib.suppress(Exception):
                h._xfer.release()
            h.released, h._xfer = True, None
        self._handles.clear()
        for _desc, dlist, _owner in self._regions:
            with contextlib.suppress(Exception):
                agent.deregister_memory(dlist)
        self._regions.clear()
        for peer in list(self._peers):
            with contextlib.suppress(Exception):
                agent.remove_remote_agent(peer)
        self._peers.clear()
        self._notif_backlog.clear()
        self._agent = None

    def _live_agent(self) -> Any:
        if self._closed or self._agent is None:
            raise TransferError(f"endpoint {self.name!r} is closed")
        return self._agent

    # ------------------------------------------------------------------ memory
    def register(self, tensor: torch.Tensor) -> RegionDesc:
        """Register a contiguous, non-empty tensor; it is kept alive until deregistered."""
        agent = self._live_agent()
        addr, nbytes, mem, dev = _tensor_region(tensor)
        if nbytes == 0:
            raise ValueError("cannot register an empty tensor")
        try:
            dlist = agent.register_memory([(addr, nbytes, dev, "")], mem)
        except Exception as e:
            raise TransferError(f"register_memory failed for {mem}:{dev} {nbytes} B: {e}") from e
        desc = RegionDesc(agent=self.name, addr=addr, length=nbytes, mem=mem, dev_id=dev)
        self._regions.append((desc, dlist, tensor))
        return desc

    def deregister(self, region: RegionDesc) -> None:
        """Deregister a region returned by :meth:`register`; unknown regions raise ``KeyError``."""
        agent = self._live_agent()
        for i, (desc, dlist, _owner) in enumerate(self._regions):
            if desc == region:
                del self._regions[i]
                agent.deregister_memory(dlist)
                return
        raise KeyError(f"region not registered here: {region!r}")

    @property
    def regions(self) -> list[RegionDesc]:
        """Regions currently registered by this endpoint."""
        return [d for d, _, _ in self._regions]

    # ------------------------------------------------------------------ peers
    def metadata(self) -> bytes:
        """Full agent metadata (connection info plus current registrations)."""
        return bytes(self._live_agent().get_agent_metadata())

    def add_peer(self, metadata: bytes) -> str:
        """Load a peer's metadata (new or refreshed) and return its agent name."""
        agent = self._live_agent()
        try:
            name = agent.add_remote_agent(metadata)
        except Exception as e:
            raise TransferError(f"add_remote_agent failed: {e}") from e
        name = name.decode() if isinstance(name, bytes) else str(name)
        self._peers.add(name)
        return name

    def connect(self, peer: str) -> None:
        """Optionally pre-establish the connection so the first write is not slowed."""
        agent = self._live_agent()
        self._require_peer(peer)
        try:
            agent.make_connection(peer)
        except Exception as e:
            raise TransferError(f"make_connection to {peer!r} failed: {e}") from e

    def remove_peer(self, peer: str) -> None:
        """Forget a peer (and disconnect from it). Unknown peers are ignored."""
        agent = self._live_agent()
        if peer in self._peers:
            self._peers.discard(peer)
            try:
                agent.remove_remote_agent(peer)
            except Exception as e:
                raise TransferError(f"remove_remote_agent({peer!r}) failed: {e}") from e

    @property
    def peers(self) -> frozenset[str]:
        return frozenset(self._peers)

    def _require_peer(self, peer: str) -> None:
        if peer not in self._peers:
            raise TransferError(f"unknown peer {peer!r}; call add_peer with its metadata first")

    # ------------------------------------------------------------------ transfers
    def _resolve_local(
        self, local: torch.Tensor | tuple[int, int], nbytes: int
    ) -> tuple[int, MemKind, int]:
        if isinstance(local, tuple):
            addr, length = int(local[0]), int(local[1])
            mem: MemKind | None = None
            dev = 0
        else:
            addr, length, mem, dev = _tensor_region(local)
        if nbytes > length:
            raise TransferBoundsError(f"nbytes={nbytes} exceeds the local source ({length} B)")
        for desc, _, _ in self._regions:
            if (mem is None or (desc.mem == mem and desc.dev_id == dev)) and desc.contains(
                addr, nbytes
            ):
                return addr, desc.mem, desc.dev_id
        raise TransferBoundsError(
            f"local range [0x{addr:x}, +{nbytes}) is not inside a region registered by "
            f"{self.name!r}"
        )

    def write(
        self,
        local: torch.Tensor | tuple[int, int],
        peer_name: str,
        remote: RegionDesc,
        remote_offset: int,
        nbytes: int,
        notif: bytes | None = None,
        blocks: list[tuple[int, int, int]] | None = None,
        local_span: int | None = None,
    ) -> TransferHandle:
        """Post a WRITE of ``nbytes`` from the start of ``local`` to ``remote + remote_offset``.

        ``local`` is a contiguous tensor (or view) or an ``(addr, length)`` pair; either must
        lie inside a region registered here. ``notif`` (non-empty) is delivered to the peer
        once the data has landed. ``blocks`` (``(local offset, remote offset, length)``)
        splits the WRITE into one descriptor per block (a PP stage's layer slots, a direct
        write's pages); default one block. ``local_span``: the bytes of ``local`` the blocks
        may read (default the first ``nbytes``). Raises :class:`TransferBoundsError` for
        out-of-range requests and :class:`TransferError` if NIXL refuses or fails to post.
        The returned handle must be released (:meth:`release`) or left for :meth:`close`.
        """
        agent = self._live_agent()
        self._require_peer(peer_name)
        if remote.agent != peer_name:
            raise TransferError(f"region belongs to {remote.agent!r}, not peer {peer_name!r}")
        if notif is not None and len(notif) == 0:
            raise ValueError("empty notification; pass None for no notification")
        parts = write_blocks(nbytes, remote, remote_offset, blocks, local_span)
        laddr, lmem, ldev = self._resolve_local(local, nbytes if local_span is None
                                                else local_span)
        try:
            ldescs = agent.get_xfer_descs([(laddr + lo, n, ldev) for lo, _, n in parts], lmem)
            rdescs = agent.get_xfer_descs(
                [(remote.addr + remote_offset + ro, n, remote.dev_id) for _, ro, n in parts],
                remote.mem,
            )
            xfer = agent.initialize_xfer("WRITE", ldescs, rdescs, peer_name, notif or b"")
        except Exception as e:
            raise TransferError(
                f"NIXL refused WRITE of {nbytes} B to {peer_name!r}+{remote_offset}: "
                f"{type(e).__name__}: {e}"
            ) from e
        posted_at = time.perf_counter()
        try:
            state = agent.transfer(xfer)
        except Exception as e:
            xfer.release()
            raise TransferError(f"posting WRITE to {peer_name!r} failed: {e}") from e
        if state == "ERR":
            with contextlib.suppress(Exception):
                xfer.release()
            raise TransferError(f"posting WRITE to {peer_name!r} returned ERR")
        h = TransferHandle(
            xfer_id=next(self._ids),
            peer=peer_name,
            nbytes=nbytes,
            notif=notif,
            posted_at=posted_at,
            state=state,
            _xfer=xfer,
        )
        if state == "DONE":
            h.done_at = time.perf_counter()
        self._handles[h.xfer_id] = h
        return h

    def poll(self, handle: TransferHandle) -> XferState:
        """Non-blocking state check; never raises for a failed transfer (returns ``"ERR"``).

        Final states are sticky; a released handle reports its last observed state.
        """
        if handle.state != "PROC" or handle.released or handle._xfer is None:
            return handle.state
        agent = self._live_agent()
        try:
            state: XferState = agent.check_xfer_state(handle._xfer)
        except Exception:
            state = "ERR"
        if state != "PROC":
            handle.state = state
            if state == "DONE":
                handle.done_at = time.perf_counter()
        return state

    def wait(self, handle: TransferHandle, timeout_s: float = 30.0) -> None:
        """Block until ``DONE``; raise :class:`TransferError` on ``ERR``, :class:`TransferTimeout`.

        Busy-polls for the first millisecond (so short transfers are timed accurately), then
        backs off to sleeps of at most 1 ms.
        """
        start = time.perf_counter()
        deadline = start + timeout_s
        nap = 0.0
        while True:
            state = self.poll(handle)
            if state == "DONE":
                return
            if state == "ERR":
                raise TransferError(
                    f"WRITE #{handle.xfer_id} of {handle.nbytes} B to {handle.peer!r} failed"
                )
            now = time.perf_counter()
            if now >= deadline:
                raise TransferTimeout(
                    f"WRITE #{handle.xfer_id} of {handle.nbytes} B to {handle.peer!r} still in "
                    f"progress after {timeout_s:.3g} s"
                )
            if now - start > 1e-3:
                nap = min(nap + 5e-5, 1e-3, deadline - now)
                time.sleep(nap)

    def release(self, handle: TransferHandle) -> None:
        """Free the NIXL request. Idempotent. Releasing an in-flight transfer asks NIXL to
        cancel it; if that fails a :class:`TransferError` is raised and the handle stays owned.
        """
        if handle.released:
            return
        if handle._xfer is not None:
            try:
                handle._xfer.release()
            except Exception as e:
                raise TransferError(
                    f"cannot release WRITE #{handle.xfer_id} (state {handle.state}): {e}"
                ) from e
        handle.released, handle._xfer = True, None
        self._handles.pop(handle.xfer_id, None)

    @property
    def outstanding(self) -> int:
        """Number of handles not yet released."""
        return len(self._handles)

    # ------------------------------------------------------------------ notifications
    def get_notifs(self) -> list[tuple[str, bytes]]:
        """Drain all notifications received so far as ``(peer_name, message)`` pairs."""
        agent = self._live_agent()
        out, self._notif_backlog = self._notif_backlog, []
        for peer, msgs in agent.get_new_notifs().items():
            name = peer.decode() if isinstance(peer, bytes) else str(peer)
            out.extend((name, bytes(m)) for m in msgs)
        return out

    def wait_notif(
        self, prefix: bytes, timeout_s: float = 30.0, *, peer: str | None = None
    ) -> tuple[str, bytes]:
        """Wait for the first notification starting with ``prefix`` (optionally from ``peer``).

        Non-matching notifications are kept for later :meth:`get_notifs` / ``wait_notif``
        calls. Raises ``TimeoutError`` if none arrives within ``timeout_s``.
        """
        deadline = time.perf_counter() + timeout_s
        keep: list[tuple[str, bytes]] = []
        try:
            while True:
                for i, (src, msg) in enumerate(pending := self.get_notifs()):
                    if msg.startswith(prefix) and (peer is None or src == peer):
                        keep.extend(pending[:i] + pending[i + 1 :])
                        return src, msg
                keep.extend(pending)
                if time.perf_counter() >= deadline:
                    raise TimeoutError(f"no notification {prefix!r} within {timeout_s:.3g} s")
                time.sleep(2e-4)
        finally:
            self._notif_backlog = keep + self._notif_backlog
