"""The staging chunk grid: slot width, send segmentation and positional chunk indices.

Same results as sglang 0.5.23 (``staging_grid_tokens``, ``compute_grid_segments``). Decode
identifies a chunk positionally, ``chunk_idx = page_start // full_chunk_pages``, so every send
must start and end on the grid anchored at the decode-side cached prefix (``base``).
"""

from __future__ import annotations

DEFAULT_CHUNKED_PREFILL_SIZE = 8192


def staging_grid_tokens(chunked_prefill_size: int | None, page_size: int) -> int:
    """Token width of one staging grid slot (``chunked_prefill_size`` floored to pages)."""
    cps = chunked_prefill_size or DEFAULT_CHUNKED_PREFILL_SIZE
    return max(1, cps // page_size) * page_size


def compute_grid_segments(
    start_idx: int, end_idx: int, base: int, grid_tokens: int
) -> list[tuple[int, int]]:
    """Split ``[start_idx, end_idx)`` at ``base + k * grid_tokens``.

    An empty range yields one empty segment: a metadata-only last send still needs a chunk.
    """
    segments: list[tuple[int, int]] = []
    seg_start = start_idx
    while seg_start < end_idx:
        next_boundary = base + ((seg_start - base) // grid_tokens + 1) * grid_tokens
        seg_end = min(next_boundary, end_idx)
        segments.append((seg_start, seg_end))
        seg_start = seg_end
    if not segments:
        segments = [(start_idx, end_idx)]
    return segments


def floor_to_grid(end_idx: int, base: int, grid_tokens: int) -> int:
    """Floor a non-last send's end to the grid; the remainder rides with the next send."""
    return base + ((end_idx - base) // grid_tokens) * grid_tokens


def chunk_index(page_start: int, full_chunk_pages: int) -> int:
    """Positional chunk index decode and prefill agree on."""
    return page_start // full_chunk_pages if full_chunk_pages > 0 else 0


def prefetch_chunks(total_pages: int, full_chunk_pages: int) -> list[tuple[int, int]]:
    """``(chunk_idx, chunk_pages)`` of every grid chunk the prefill prefetches for a session."""
    if total_pages <= 0:
        return []
    n = (total_pages + full_chunk_pages - 1) // full_chunk_pages
    return [(i, min(full_chunk_pages, total_pages - i * full_chunk_pages)) for i in range(n)]


def pages_for_tokens(num_tokens: int, page_size: int) -> int:
    """Pages needed to hold ``num_tokens`` (ceil)."""
    return (num_tokens + page_size - 1) // page_size
