"""Reading traces of older format versions: what each version added, and how to compare.

A replay compares the effects a fresh core returns with the recorded ones. A trace written by
an older version lacks the effect types and fields added since; ``comparable`` drops them from
both sides, so an old trace still replays exactly where its content allows.
"""

from __future__ import annotations

from typing import Any

from twin.core import events as ev
from twin.core.config import TwinConfig

ADDED_IN: dict[int, dict[type, tuple[str, ...] | None]] = {
    # Version 2: effects carry what a driver needs (the one runtime); None: a new effect type.
    2: {
        ev.TargetsKnown: None,
        ev.StartTransfer: ("decode_rank",),
        ev.StartScatter: ("prefill_attn_tp", "writer_bytes"),
        ev.Deferred: ("retry_at",),
        ev.WakeWorkers: ("at",),
        ev.SendMetadata: ("register_at",),
        ev.WatermarkMoved: ("lag_bytes",),
    },
    # Version 3: failure paths and sockets as SGLang runs them: the decode group's poll
    # reduction, deferred decode KV release (ABORT / ABORT_ACK frames ride in Send), the
    # metadata's control port; inputs gained DecodeRoomInit.group, Target.dst_port,
    # TransferDone.settled and PeerPolled.
    3: {
        ev.GroupPoll: None,
        ev.RoomHeld: None,
        ev.RoomReleased: None,
        ev.SendMetadata: ("dst_port",),
    },
}


def _missing_in(version: int) -> tuple[set[type], dict[type, set[str]]]:
    types: set[type] = set()
    fields: dict[type, set[str]] = {}
    for v, added in ADDED_IN.items():
        if v <= version:
            continue
        for t, names in added.items():
            if names is None:
                types.add(t)
            else:
                fields.setdefault(t, set()).update(names)
    return types, fields


def comparable(effects: list[Any], version: int,
               encode: Any) -> list[dict[str, Any]]:
    """``encode(e)`` of each effect, without what a trace of ``version`` cannot hold."""
    types, fields = _missing_in(version)
    out = []
    for e in effects:
        t = type(e)
        if t in types:
            continue
        d = encode(e)
        for name in fields.get(t, ()):
            d.pop(name, None)
        out.append(d)
    return out


def recorded_config(version: int, cfg: TwinConfig,
                    data: dict[str, object] | None = None) -> TwinConfig:
    """The config a trace of ``version`` was recorded with, in today's terms: before format 3
    the twin woke a deferred transfer worker on any allocation or queued chunk
    (``worker_wake = "eager"``); a config without ``stage_equal_tp`` (``data``: the header's
    config as read) staged every room, equal TP too."""
    if version < 3 and cfg.worker_wake == "sglang":
        cfg = cfg.replace(worker_wake="eager")
    if data is not None and "stage_equal_tp" not in data and not cfg.stage_equal_tp:
        cfg = cfg.replace(stage_equal_tp=True)
    return cfg

