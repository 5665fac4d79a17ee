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
    kv_done_s: float = -1.0  # every decode rank concluded the room (all KV landed)
    first_token_s: float = -1.0  # the request joined a decode batch and streamed its first token
    end_s: float = -1.0  # last token streamed (or the request failed)
    deferrals: int = 0
    retractions: int = 0
    prefill_concluded: set[str] = field(default_factory=set)

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

    def note_prefill_concluded(self, node: str, group_size: int) -> bool:
        """Prefill ``node`` concluded the room; True exactly once, when all ``group_size``
        prefill ranks of the group have (the prefill server then releases the request's KV)."""
        if node in self.prefill_concluded:
            return False
        self.prefill_concluded.add(node)
        return len(self.prefill_concluded) == group_size

    @property
    def ttft_s(self) -> float:
        """Arrival to first token; where no token was streamed (a driver without a decode
        loop), arrival to all KV landed; -1 unless the transfer succeeded."""
        if self.status != "Success":
            return -1.0
        end = self.first_token_s if self.first_token_s >= 0 else self.kv_done_s
        return end - self.arrival_s

    @property
    def e2e_s(self) -> float:
        """Arrival to last token (-1 unless the request completed)."""
        if self.status != "Success" or self.end_s < 0 or self.first_token_s < 0:
            return -1.0
        return self.end_s - self.arrival_s

    @property
    def tpot_s(self) -> float:
        """Mean time per output token after the first (-1 for fewer than two tokens)."""
        if self.e2e_s < 0 or self.output_len < 2:
            return -1.0
        return (self.end_s - self.first_token_s) / (self.output_len - 1)
