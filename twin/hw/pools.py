"""Device memory of one rank: a paged KV pool, its page allocator, staging buffers and ring.

Every layer's K and V is a ``[num_pages * page_size, heads, head_dim]`` tensor (token-major, as
SGLang's MHA pool). Pages are handed out from a free list; a request's pages need not be
contiguous, so gather and scatter really are scatter-gathers.

On CUDA, zeroing is a kernel queued on the current stream, while a peer's NIXL WRITE lands
through UCX on its own stream (CUDA IPC) or its own engine: nothing orders the two. Both
constructors therefore wait for the device before returning, so memory whose metadata is sent
afterwards is already zero.
"""

from __future__ import annotations

from collections import deque

import torch

DTYPES = {2: torch.bfloat16, 4: torch.float32, 1: torch.uint8}


class OutOfPages(RuntimeError):
    """The KV pool has no room for a request."""


class KVPool:
    """K and V tensors of every layer plus a free list of pages."""

    def __init__(self, num_layers: int, num_pages: int, page_size: int, heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device) -> None:
        shape = (num_pages * page_size, heads, head_dim)
        self.page_size = page_size
        self.heads = heads
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
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
