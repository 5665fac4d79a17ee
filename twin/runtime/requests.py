"""Per-request bookkeeping every driver keeps: placement, progress, conclusions, timestamps."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class RequestState:
    """One request (room) in flight; times are simulated seconds, -1 until reached."""

    room: int
    rid: int
    arrival_s: float
    input_len: int
    output_len: int
    prefill_group: int
    decode_group: int
    decode_prefix_len: int
    prefill_prefix_len: int
    extend_end: int = 0
    first_batch: bool = True
    bootstrapped: set[str] = field(default_factory=set)
    decode_status: dict[str, str] = field(default_factory=dict)
    status: str = "pending"  # pending | Success | Failed
    reason: str = ""
    bootstrap_done_s: float = -1.0
    first_forward_s: float = -1.0
    prefill_done_s: float = -1.0
    first_transfer_s: float = -1.0
    last_transfer_s: float = -1.0
    kv_done_s: float = -1.0
    deferrals: int = 0

    def note_targets(self, node: str, known: int, want: int, group_size: int) -> bool:
        """Prefill ``node`` knows ``known`` of its ``want`` decode targets. True exactly once:
        when every one of the ``group_size`` prefill ranks of the group knows all of them."""
        if known == want:
            self.bootstrapped.add(node)
        return len(self.bootstrapped) == group_size and self.bootstrap_done_s < 0

    def note_concluded(self, node: str, status: str, reason: str, group_size: int) -> str | None:
        """Decode ``node`` concluded the room. Once all ``group_size`` decode ranks of the group
        have, the request's status (``Success`` only if every rank succeeded), else None."""
        self.decode_status[node] = status
        if status == "Failed" and not self.reason:
            self.reason = reason
        if len(self.decode_status) < group_size or self.finished:
            return None
        return "Success" if all(s == "Success" for s in self.decode_status.values()) else "Failed"

    @property
    def finished(self) -> bool:
        return self.status != "pending"

    @property
    def ttft_s(self) -> float:
        return self.kv_done_s - self.arrival_s if self.status == "Success" else -1.0
