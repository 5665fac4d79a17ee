"""Host memory as the hardware mode checks it before launching ranks (single node or agents)."""

from __future__ import annotations

from collections.abc import Iterable

#: Host memory a rank process takes beyond its pools, buffers and ring (Python, torch, NIXL,
#: UCX; about 0.2-0.4 GiB resident on a CPU host).
RANK_OVERHEAD_BYTES = 384 << 20
#: The ranks may take at most this share of the memory available when they start.
HOST_SHARE = 0.9


def available_host_bytes() -> int | None:
    """``MemAvailable`` from ``/proc/meminfo``; ``None`` where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def host_need(rank_bytes: Iterable[int]) -> int:
    """Host bytes of ranks whose pools, buffers and rings take ``rank_bytes`` each."""
    sizes = list(rank_bytes)
    return sum(sizes) + RANK_OVERHEAD_BYTES * len(sizes)


def fits(need: int, available: int | None) -> bool:
    return available is None or need <= HOST_SHARE * available
