"""When the prefill scheduler calls ``send_kv_chunk`` for one request.

A request of ``input_len`` tokens with a prefill-side radix hit of ``prefill_prefix_len`` tokens
is prefilled in forwards of at most ``chunked_prefill_size`` tokens. With the cached-prefix early
send on (``SGLANG_DISAGG_PREFILL_EARLY_SEND_CACHED_PREFIX``), the at-rest prefix snapshotted on
the first batch is sent before the first forward. After every forward but the last, the new KV
is sent (non-last, floored by the core); after the last, the rest goes with ``last=True``.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class PlannedSend:
    """One ``send_kv_chunk`` call: after forward ``forward`` (-1: the early send)."""

    forward: int
    forward_tokens: int
    end_idx: int
    last: bool


def early_send_end(prefill_prefix_len: int, decode_prefix_len: int, page_size: int) -> int | None:
    """End of the cached-prefix early send on a request's first batch, or None when there is
    none: the at-rest prefill prefix, if it goes past the decode prefix and is page-aligned."""
    if prefill_prefix_len > decode_prefix_len and prefill_prefix_len % page_size == 0:
        return prefill_prefix_len
    return None


def plan_sends(input_len: int, prefill_prefix_len: int, decode_prefix_len: int,
               chunked_prefill_size: int, page_size: int,
               early_send_cached_prefix: bool = True) -> list[PlannedSend]:
    """Every send of one request in order; the last one has ``last=True``."""
    assert input_len > 0 and chunked_prefill_size > 0
    prefix = min(prefill_prefix_len, input_len - 1)
    sends: list[PlannedSend] = []
    early = early_send_end(prefix, decode_prefix_len, page_size)
    if early_send_cached_prefix and early is not None:
        sends.append(PlannedSend(forward=-1, forward_tokens=0, end_idx=early, last=False))
    pos = prefix
    k = 0
    while True:
        step = min(chunked_prefill_size, input_len - pos)
        pos += step
        last = pos >= input_len
        sends.append(PlannedSend(forward=k, forward_tokens=step, end_idx=pos, last=last))
        if last:
            return sends
        k += 1
