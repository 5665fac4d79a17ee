"""Equal attention TP needs no staging (sglang 0.5.23 ``nixl/conn.py`` ~1058 ``needs_staging``,
``mooncake/conn.py`` ~664, ``common/conn.py`` ~2557 ``require_staging``): prefill writes the
KV pages straight into decode's pool, with no STAGING_REQ, ring allocation or WATERMARK."""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner

from twin.cli import cli
from twin.core import wire
from twin.core.config import ServerSide, TwinConfig
from twin.replay import replay_sim
from twin.sim.runner import SimResult, run_sim
from twin.trace.compat import recorded_config
from twin.trace.format import read_trace
from twin.workloads import poisson

WL = poisson(40, 20.0, 3000, 8, seed=5)  # 3000 tokens: several chunks at cps 1024


def _cfg(prefill_tp: int, decode_tp: int, **kw: object) -> TwinConfig:
    return TwinConfig(prefill=ServerSide(tp_size=prefill_tp), decode=ServerSide(tp_size=decode_tp),
                      chunked_prefill_size=1024, **kw)  # type: ignore[arg-type]


def _frames(path: Path) -> dict[str, int]:
    """SGLang frames delivered in a trace, by tag."""
    out: dict[str, int] = {}
    for r in read_trace(path).events:
        if r.dir == "in" and r.type == "MessageArrived":
            tag = wire.tag_of(r.event.msg).decode()
            out[tag] = out.get(tag, 0) + 1
    return out


def _run(cfg: TwinConfig, path: Path, **kw: object) -> SimResult:
    return run_sim(cfg, WL, trace_out=path, **kw)  # type: ignore[arg-type]


def test_equal_tp_sends_no_staging_frames_and_holds_no_ring(tmp_path: Path) -> None:
    r = _run(_cfg(2, 2), tmp_path / "direct.jsonl")
    s = r.summary()
    assert s["status"] == "completed" and s["completed"] == len(WL.requests)
    assert s["peak_ring_bytes"] == {} and s["deferrals"] == {}
    frames = _frames(tmp_path / "direct.jsonl")
    for tag in ("STAGING_REQ", "STAGING_RSP", "WATERMARK", "CHUNK_READY"):
        assert tag not in frames, frames
    assert frames.get("KV_STATUS", 0) > 0  # each room still concludes through its status
    assert r.sim.integrity.violations == []  # every page landed before its room completed
    # the same trace replays in the simulator without a difference
    replay = replay_sim(read_trace(tmp_path / "direct.jsonl"))
    assert replay.divergence is None and replay.status == "completed"


def test_staging_only_where_tp_differs_or_when_forced(tmp_path: Path) -> None:
    hetero = _run(_cfg(4, 2), tmp_path / "hetero.jsonl")
    assert hetero.summary()["peak_ring_bytes"]
    assert _frames(tmp_path / "hetero.jsonl")["STAGING_REQ"] > 0
    forced = _run(_cfg(2, 2, stage_equal_tp=True), tmp_path / "forced.jsonl")
    assert forced.summary()["status"] == "completed" and forced.summary()["peak_ring_bytes"]
    assert _frames(tmp_path / "forced.jsonl")["CHUNK_READY"] > 0


def test_unaligned_decode_prefix_fails_only_a_staged_room(tmp_path: Path) -> None:
    overrides = {0: {"decode_prefix_len": 8}}  # page size 16: not page-aligned
    direct = run_sim(_cfg(2, 2), WL, request_overrides=overrides)
    assert direct.summary()["failed"] == 0
    staged = run_sim(_cfg(4, 2), WL, request_overrides=overrides)
    assert staged.summary()["failed"] == 1


def test_traces_recorded_before_the_field_staged_every_room() -> None:
    cfg = _cfg(2, 2)
    data = cfg.to_dict()
    assert data["stage_equal_tp"] is False
    assert recorded_config(3, cfg, data).stages is False
    del data["stage_equal_tp"]
    assert recorded_config(3, cfg, data).stage_equal_tp is True


def test_advise_says_no_ring_is_needed() -> None:
    runner = CliRunner()
    args = ["advise", "--prefill-args", "--tp-size 2", "--decode-args", "--tp-size 2",
            "--workload", "poisson:n=10,rate=5"]
    r = runner.invoke(cli, args, catch_exceptions=False)
    assert r.exit_code == 0 and "no staging ring is needed" in r.output
    r = runner.invoke(cli, [*args, "--json"], catch_exceptions=False)
    assert json.loads(r.stdout)["staging"] is False
