"""Per-request bookkeeping of the simulator: placement, progress and timestamps."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class SimRequest:
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

    @property
    def finished(self) -> bool:
        return self.status != "pending"

    @property
    def ttft_s(self) -> float:
        return self.kv_done_s - self.arrival_s if self.status == "Success" else -1.0
