"""Device memory of one rank: a paged KV pool, its page allocator, staging buffers and ring.

Every layer's K and V is a ``[num_pages * page_size, heads, head_dim]`` tensor (token-major, as
SGLang's MHA pool). Pages are handed out from a free list; a request's pages need not be
contiguous, so gather and scatter really are scatter-gathers. The tensors are views of one
allocation (``KVPool.storage``: every layer's K, then every layer's V), so a rank registers its
whole pool as one region, and a direct page write (equal attention TP, no staging) addresses a
page of a layer's K or V by its offset there (``PoolLayout``, ``direct_blocks``).

On CUDA, zeroing is a kernel queued on the current stream, while a peer's NIXL WRITE lands
through UCX on its own stream (CUDA IPC) or its own engine: nothing orders the two. Both
constructors therefore wait for the device before returning, so memory whose metadata is sent
afterwards is already zero.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

DTYPES = {2: torch.bfloat16, 4: torch.float32, 1: torch.uint8}


class OutOfPages(RuntimeError):
    """The KV pool has no room for a request."""


@dataclass(frozen=True)
class PoolLayout:
    """Where a KV pool's pages lie in its ``storage``: ``layers`` K tensors then ``layers`` V
    tensors, each ``num_pages`` pages of ``page_bytes`` (one page of one layer's K or V)."""

    layers: int
    num_pages: int
    page_bytes: int

    def offset(self, layer: int, kv: int, page: int) -> int:
        """Byte offset of page ``page`` of layer ``layer``'s K (``kv`` 0) or V (``kv`` 1)."""
        if not (0 <= layer < self.layers and kv in (0, 1) and 0 <= page < self.num_pages):
            raise IndexError(f"page {page} of layer {layer} {'KV'[kv]} is outside a pool of "
                             f"{self.layers} layers and {self.num_pages} pages")
        return ((kv * self.layers + layer) * self.num_pages + page) * self.page_bytes

    def to_dict(self) -> dict[str, int]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> PoolLayout:
        """Inverse of :meth:`to_dict`; ``ValueError`` on missing or bad fields."""
        try:
            layout = cls(int(d["layers"]), int(d["num_pages"]), int(d["page_bytes"]))
        except (KeyError, TypeError) as exc:
            raise ValueError(f"malformed pool layout: {d!r}") from exc
        if min(layout.layers, layout.num_pages, layout.page_bytes) <= 0:
            raise ValueError(f"malformed pool layout: {d!r}")
        return layout


def direct_blocks(src: PoolLayout, src_pages: Sequence[int], dst: PoolLayout,
                  dst_pages: Sequence[int]) -> list[tuple[int, int, int]]:
    """The ``(local offset, remote offset, length)`` blocks of a direct page write (SGLang's
    ``send_kvcache``): page ``src_pages[i]`` of every layer's K, then of every layer's V, to
    page ``dst_pages[i]`` of the same layer's K or V, one block per (page, layer, K/V).

    Both pools hold the same heads (equal attention TP), so a page's bytes map 1:1: the
    layouts must agree on layers and page bytes (``ValueError`` otherwise, or when the page
    lists differ in length); a page outside either pool raises ``IndexError``."""
    if (src.layers, src.page_bytes) != (dst.layers, dst.page_bytes):
        raise ValueError(f"a direct write needs pools of the same layers and page bytes: "
                         f"{src} -> {dst}")
    if len(src_pages) != len(dst_pages):
        raise ValueError(f"{len(src_pages)} source pages for {len(dst_pages)} destination pages")
    n = src.page_bytes
    return [(src.offset(layer, kv, s), dst.offset(layer, kv, d), n)
            for kv in (0, 1) for layer in range(src.layers)
            for s, d in zip(src_pages, dst_pages, strict=True)]


class KVPool:
    """K and V tensors of every layer (views of one ``storage``) plus a free list of pages."""

    def __init__(self, num_layers: int, num_pages: int, page_size: int, heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device) -> None:
        shape = (num_pages * page_size, heads, head_dim)
        numel = math.prod(shape)
        self.page_size = page_size
        self.heads = heads
        self.storage = torch.zeros(2 * num_layers * numel, dtype=dtype, device=device)
        views = [self.storage[i * numel:(i + 1) * numel].view(shape)
                 for i in range(2 * num_layers)]
        self.k, self.v = views[:num_layers], views[num_layers:]
        elem = self.storage.element_size()
        self.layout = PoolLayout(num_layers, num_pages, page_size * heads * head_dim * elem)
        settle(device)
        self.free_pages: deque[int] = deque(range(num_pages))
        self.owned: dict[int, list[int]] = {}

    def alloc(self, owner: int, num_pages: int) -> list[int]:
        """Pages for ``owner`` (a room); raises ``OutOfPages``."""
        if num_pages > len(self.free_pages):
            raise OutOfPages(f"need {num_pages} pages, {len(self.free_pages)} free")
        pages = [self.free_pages.popleft() for _ in range(num_pages)]
        self.owned.setdefault(owner, []).extend(pages)
        return pages

    def release(self, owner: int) -> None:
        self.free_pages.extend(self.owned.pop(owner, []))

    def pages_of(self, owner: int) -> list[int]:
        return self.owned.get(owner, [])

    def token_indices(self, pages: list[int], first_token: int, num_tokens: int) -> torch.Tensor:
        """Pool token index of request tokens ``[first_token, +num_tokens)`` (0 = first page)."""
        t = torch.arange(first_token, first_token + num_tokens)
        p = torch.tensor(pages, dtype=torch.int64)[t // self.page_size]
        return p * self.page_size + t % self.page_size


def settle(device: torch.device | str) -> None:
    """Wait until every kernel queued on ``device`` has finished (no-op off CUDA)."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def byte_buffer(nbytes: int, device: torch.device) -> torch.Tensor:
    """A zeroed, 64-byte-aligned ``uint8`` buffer (staging buffer or ring), zero on return."""
    buf = torch.zeros(max(1, nbytes), dtype=torch.uint8, device=device)
    settle(device)
    return buf
