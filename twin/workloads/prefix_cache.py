"""A deterministic LRU model of SGLang's radix (prefix) cache."""

from __future__ import annotations

from collections import OrderedDict

from twin.workloads.model import MOONCAKE_BLOCK_TOKENS, Request, _is_int


class PrefixCache:
    """Deterministic LRU model of SGLang's radix (prefix) cache, sized in blocks.

    Entries are prompt blocks keyed by their prefix hash, plus one entry per ``prefix_group``
    holding the longest shared prefix inserted for that group (it costs one block if that prefix
    ends inside a block, else nothing: its full blocks are already hash entries).

    * :meth:`match` returns the cached prompt tokens of a request: ``k * block_tokens`` for the
      ``k`` leading ``prefix_hashes`` present, raised to ``min(group prefix, shared_prefix_len)``
      when the request's group has an entry and the full blocks of that prefix matched; capped at
      ``input_len - 1`` (at least one token is always prefilled). It does not change the cache.
    * :meth:`insert` records a request's blocks (and group prefix) as most recently used, then
      evicts least-recently-used entries until at most ``capacity_blocks`` blocks are held. Blocks
      are touched last-block-first, so a prompt's leading blocks are the last to be evicted, like
      the leaf-first eviction of a radix tree.
    """

    def __init__(self, capacity_blocks: int) -> None:
        if not _is_int(capacity_blocks) or capacity_blocks < 0:
            raise ValueError(f"capacity_blocks must be an int >= 0, got {capacity_blocks!r}")
        self.capacity_blocks = int(capacity_blocks)
        self._lru: OrderedDict[object, int] = OrderedDict()  # key -> size in blocks
        self._groups: dict[int, int] = {}  # group -> cached shared prefix tokens
        self._used = 0

    @classmethod
    def from_tokens(
        cls, capacity_tokens: int, block_tokens: int = MOONCAKE_BLOCK_TOKENS
    ) -> PrefixCache:
        """A cache holding ``capacity_tokens // block_tokens`` blocks."""
        return cls(capacity_tokens // block_tokens)

    @property
    def used_blocks(self) -> int:
        """Blocks currently held (<= ``capacity_blocks``)."""
        return self._used

    def __len__(self) -> int:
        return len(self._lru)

    def clear(self) -> None:
        """Drop every entry."""
        self._lru.clear()
        self._groups.clear()
        self._used = 0

    def match(self, request: Request) -> int:
        """Cached prompt tokens of ``request`` (see the class docstring); never mutates."""
        lru = self._lru
        k = 0
        for h in request.prefix_hashes:
            if h not in lru:
                break
            k += 1
        bt = request.block_tokens
        tokens = k * bt
        g = request.prefix_group
        if g is not None and request.shared_prefix_len > 0 and g in self._groups:
            shared = min(self._groups[g], request.shared_prefix_len)
            if k >= shared // bt:
                tokens = max(tokens, shared)
        return max(0, min(tokens, request.input_len - 1))

    def insert(self, request: Request) -> None:
        """Record ``request``'s prompt blocks as cached and most recently used; evict LRU."""
        g = request.prefix_group
        if g is not None and request.shared_prefix_len > 0:
            length = max(self._groups.get(g, 0), request.shared_prefix_len)
            self._groups[g] = length
            self._touch(("group", g), 1 if length % request.block_tokens else 0)
        for h in reversed(request.prefix_hashes):
            self._touch(h, 1)
        self.evict_to(self.capacity_blocks)

    def evict_to(self, blocks: int) -> None:
        """Evict least-recently-used entries until at most ``blocks`` blocks are held (a cache
        in a KV pool gives up pages that running requests need)."""
        lru = self._lru
        while self._used > blocks and lru:
            key, size = lru.popitem(last=False)
            self._used -= size
            if type(key) is tuple:
                del self._groups[key[1]]

    def _touch(self, key: object, size: int) -> None:
        old = self._lru.pop(key, None)
        if old is not None:
            self._used -= old
        self._lru[key] = size
        self._used += size
