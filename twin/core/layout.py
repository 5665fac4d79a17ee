"""Head slicing and staging-region byte layout for heterogeneous attention TP.

Same signatures and results as sglang 0.5.23 ``common/staging_buffer.py``. A staging region
holds ``num_writers`` writer blocks back to back; each block is all K layers then all V layers,
each layer ``[num_tokens, num_heads, head_dim]``.
"""

from __future__ import annotations

from functools import lru_cache


def compute_head_slice_params(
    src_attn_tp_size: int,
    dst_attn_tp_size: int,
    src_tp_rank: int,
    dst_tp_rank: int,
    total_kv_heads: int,
) -> tuple[int, int, int, int]:
    """Return ``(src_head_start, num_heads, dst_head_start, num_heads)`` for one writer.

    Prefill TP larger than decode: every prefill rank sends all its heads into a head range of
    the decode rank. Otherwise the prefill rank sends the decode rank's heads (GQA replicated
    decode ranks share a KV head by integer division) into head 0.
    """
    src_heads_per_rank = max(1, total_kv_heads // src_attn_tp_size)
    dst_heads_per_rank = max(1, total_kv_heads // dst_attn_tp_size)
    local_tp_rank = src_tp_rank % src_attn_tp_size
    dst_rank_in_group = dst_tp_rank % dst_attn_tp_size
    if src_attn_tp_size > dst_attn_tp_size:
        src_replication = max(1, src_attn_tp_size // total_kv_heads)
        unique_head_idx = local_tp_rank // src_replication
        dst_head_start = (unique_head_idx * src_heads_per_rank) % dst_heads_per_rank
        return 0, src_heads_per_rank, dst_head_start, src_heads_per_rank
    dst_replication = max(1, dst_attn_tp_size // total_kv_heads)
    unique_dst_head_idx = dst_rank_in_group // dst_replication
    src_head_start = (unique_dst_head_idx * dst_heads_per_rank) % src_heads_per_rank
    return src_head_start, dst_heads_per_rank, 0, dst_heads_per_rank


def num_tp_writers(src_attn_tp_size: int, dst_attn_tp_size: int) -> int:
    """Prefill TP ranks writing into one decode rank's region for a chunk."""
    if src_attn_tp_size > dst_attn_tp_size:
        return src_attn_tp_size // max(1, dst_attn_tp_size)
    return 1


@lru_cache(maxsize=4096)
def _layout_cached(src_attn_tp_size: int, dst_attn_tp_size: int, dst_tp_rank: int,
                   total_kv_heads: int, num_tokens: int, bytes_per_head_token: int,
                   num_layers: int) -> tuple[int, tuple[int, ...], int]:
    n, writer_bytes, total = compute_staging_layout(
        src_attn_tp_size, dst_attn_tp_size, dst_tp_rank, total_kv_heads, num_tokens,
        bytes_per_head_token, num_layers)
    return n, tuple(writer_bytes), total


def staging_layout(src_attn_tp_size: int, dst_attn_tp_size: int, dst_tp_rank: int,
                   total_kv_heads: int, num_tokens: int, bytes_per_head_token: int,
                   num_layers: int) -> tuple[int, tuple[int, ...], int]:
    """``compute_staging_layout`` memoised, with the writer sizes as a tuple (hot paths)."""
    return _layout_cached(src_attn_tp_size, dst_attn_tp_size, dst_tp_rank, total_kv_heads,
                          num_tokens, bytes_per_head_token, num_layers)


def compute_staging_layout(
    src_attn_tp_size: int,
    dst_attn_tp_size: int,
    dst_tp_rank: int,
    total_kv_heads: int,
    num_tokens: int,
    bytes_per_head_token: int,
    num_layers: int,
) -> tuple[int, list[int], int]:
    """Return ``(num_writers, writer_bytes, total_bytes)`` of one staging region.

    ``writer_bytes[i]`` covers writer ``i``'s K and V for every layer.
    """
    num_writers = num_tp_writers(src_attn_tp_size, dst_attn_tp_size)
    writer_bytes = []
    for wr in range(num_writers):
        _, nh, _, _ = compute_head_slice_params(
            src_attn_tp_size, dst_attn_tp_size, wr, dst_tp_rank, total_kv_heads
        )
        writer_bytes.append(num_tokens * nh * bytes_per_head_token * num_layers * 2)
    return num_writers, writer_bytes, sum(writer_bytes)


def writer_index(src_attn_tp_size: int, dst_attn_tp_size: int, src_tp_rank: int) -> int:
    """Block index of prefill rank ``src_tp_rank`` inside a decode rank's staging region.

    The decode scatter reads writer ``w`` at ``w * per_writer_bytes``; prefill rank ``r`` is
    writer ``r % num_writers`` of the decode rank it targets.
    """
    return (src_tp_rank % src_attn_tp_size) % num_tp_writers(src_attn_tp_size, dst_attn_tp_size)


def target_decode_ranks(src_attn_tp_size: int, dst_attn_tp_size: int, src_tp_rank: int) -> list[int]:
    """Decode attention-TP ranks a prefill rank writes to.

    Prefill TP >= decode TP: exactly one decode rank (``src_rank // writers``). Prefill TP
    smaller: the ``dst_tp // src_tp`` consecutive decode ranks holding this rank's heads.
    """
    r = src_tp_rank % src_attn_tp_size
    if src_attn_tp_size >= dst_attn_tp_size:
        return [r // num_tp_writers(src_attn_tp_size, dst_attn_tp_size)]
    fan = dst_attn_tp_size // src_attn_tp_size
    return [r * fan + i for i in range(fan)]


def pp_slot_blocks(slot_bytes: int, num_layers: int, first: int,
                   stop: int) -> tuple[tuple[int, int, int], ...]:
    """The writes of the PP stage holding layers ``[first, stop)`` into its TP writer's block,
    one per layer slot, as SGLang's Mooncake staging builds them (``build_transfer_entry_pairs``
    of the stage's slot layer ids, its K layers then its V layers, against decode's, every K
    layer then every V layer; ``mooncake/conn.py`` ~733-803).

    Each is ``(offset in the stage's staging buffer, offset in the writer block, bytes)``;
    ``slot_bytes`` is one layer's K (or V) of the chunk for this writer. The stage's buffer
    holds its K layers then its V layers (a gather over its own layers); its K slot ``i`` lands
    at the block's K slot ``first + i``, its V slot at ``num_layers + first + i``. The core's
    ``StartTransfer`` carries the stage's bytes as one span at ``2 * first * slot_bytes`` of the
    block (the same bytes and region, the simulator's simplification)."""
    n = stop - first
    return tuple((i * slot_bytes, (first + i) * slot_bytes, slot_bytes) for i in range(n)) \
        + tuple(((n + i) * slot_bytes, (num_layers + first + i) * slot_bytes, slot_bytes)
                for i in range(n))


def pp_stage_write(dst_offset: int, nbytes: int, num_layers: int, first: int,
                   stop: int) -> tuple[int, tuple[tuple[int, int, int], ...]]:
    """A PP stage's ``StartTransfer`` (``dst_offset``, ``nbytes``: the core's span) as SGLang
    writes it: ``(offset of the TP writer's block, pp_slot_blocks relative to it)``."""
    slot = nbytes // (2 * (stop - first))
    return dst_offset - 2 * first * slot, pp_slot_blocks(slot, num_layers, first, stop)


def pp_stage_of(node: str) -> int:
    """The PP stage a prefill node id names (``p0g0s1r0`` -> 1; 0 when it names none)."""
    at = node.find("s")
    if at < 0:
        return 0
    return int(node[at + 1:node.index("r", at)])
