"""Wedge diagnosis from the cores' state: who waits, on what, and what pins it.

Works on any mapping of node id to core rank, so the simulator, a replay and the hardware mode
explain a wedge the same way. Every line names a room, a chunk and the blocking resource.
"""

from __future__ import annotations

from collections.abc import Mapping

from twin.core.allocator import ALLOC_OVERSIZED, is_watermark_ready
from twin.core.decode import DecodeRank
from twin.core.grid import chunk_index
from twin.core.prefill import PrefillRank


def _pinning(decode: DecodeRank) -> str:
    """Describe the allocation at the decode watermark (the oldest live one)."""
    live = decode.allocator.live()
    wm = decode.allocator.get_watermark()
    if not live:
        return (f"{decode.session} ring is empty at watermark {wm} (head {decode.allocator.head},"
                f" round {decode.allocator.round})")
    alloc_id, off, size, rnd = live[0]
    if (rnd, off) != wm:
        return (f"{decode.session} watermark {wm} is stale: the oldest live allocation is alloc "
                f"{alloc_id} at ({rnd}, {off}); the ring emptied and its watermark stayed at the "
                f"old head instead of moving to (round + 1, 0)")
    owner = "an unregistered room (leaked)"
    for room in decode.rooms.values():
        for chunk_idx, info in room.chunks.items():
            if info.alloc_id == alloc_id:
                arrived = len(room.arrivals.get(chunk_idx, []))
                owner = (f"room {room.room} chunk {chunk_idx}, unscattered: {arrived} of "
                         f"{len(room.prefill_ranks)} CHUNK_READY arrived")
        if alloc_id in room.scattering:
            owner = f"room {room.room} chunk {room.scattering[alloc_id]}, scatter in flight"
    return (f"{decode.session} watermark {wm} is pinned by alloc {alloc_id} "
            f"[{off}, {off + size}) round {rnd}: {owner}")


def diagnose(ranks: Mapping[str, PrefillRank | DecodeRank], crashed: Mapping[str, str],
             unfinished: set[int], dropped: Mapping[int, list[str]] | None = None) -> list[str]:
    """Lines explaining why ``unfinished`` rooms cannot progress."""
    lines: list[str] = [f"{node} crashed: {why}" for node, why in sorted(crashed.items())]
    decodes = {n: r for n, r in ranks.items() if isinstance(r, DecodeRank)}
    for node, rank in sorted(ranks.items()):
        if not isinstance(rank, PrefillRank):
            continue
        for wi, worker in enumerate(rank.workers):
            seen = set()
            for chunk in ([worker.busy] if worker.busy else []) + list(worker.queue):
                if chunk.room not in unfinished or (chunk.room, chunk.page_start) in seen:
                    continue
                seen.add((chunk.room, chunk.page_start))
                room = rank.rooms.get(chunk.room)
                if room is None:
                    continue
                ci = chunk_index(chunk.page_start, rank.cfg.full_chunk_pages)
                for target in room.targets:
                    info = target.staging.get(ci)
                    head = f"{node} worker {wi}: room {chunk.room} chunk {ci} -> {target.session}"
                    if chunk is worker.busy:
                        lines.append(f"{head}: WRITE in flight")
                        break
                    if info is None:
                        why = "waits for its allocation (no STAGING_RSP)"
                        for note in (dropped or {}).get(chunk.room, []):
                            if "STAGING_REQ" in note:
                                why += f"; {note}"
                                break
                        lines.append(f"{head}: {why}")
                        break
                    if info[0] == ALLOC_OVERSIZED:
                        lines.append(f"{head}: allocation oversized")
                        break
                    wm = rank.watermarks.get(target.session, (0, 0))
                    if not is_watermark_ready(wm, info[1], info[2]):
                        line = (f"{head}: waits for watermark: needs round {info[1]} end "
                                f"{info[2]}, prefill knows {wm}")
                        dec = decodes.get(target.session)
                        if dec is not None:
                            cur = dec.allocator.get_watermark()
                            if is_watermark_ready(cur, info[1], info[2]):
                                line += (f"; decode's watermark {cur} would admit it but was "
                                         f"never sent to this session")
                            else:
                                line += f"; {_pinning(dec)}"
                        lines.append(line)
                        break
    for node, dec in sorted(decodes.items()):
        for room in sorted(dec.rooms.values(), key=lambda r: r.room):
            if room.room not in unfinished:
                continue
            if not room.registered:
                lines.append(f"{node}: room {room.room} is not registered yet")
            elif not room.all_success:
                missing = sorted(set(room.prefill_ranks) - room.success_ranks)
                lines.append(f"{node}: room {room.room} waits for transfer status from "
                             f"{', '.join(missing)}")
            elif room.chunks:
                chunks = ", ".join(str(c) for c in sorted(room.chunks))
                lines.append(f"{node}: room {room.room} has all-ranks Success but chunks "
                             f"{chunks} were never scattered (no CHUNK_READY)")
    return lines
