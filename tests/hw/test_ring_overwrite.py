"""A simulated overwrite of ring data that is written and never scattered replays on real ranks
as ``corrupted``, the overwritten region named (``twin.hw.ringcheck``); before that check the
decode ranks' byte check saw only scattered pages, and the replay read ``wedged``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from twin.cli import cli
from twin.core.config import ServerSide
from twin.explore.oracles import run_trial
from twin.explore.trial import Base, Req, Trial
from twin.runtime.params import SimParams
from twin.sim.scenarios import SCENARIOS

pytestmark = pytest.mark.hw

# A finding of `twin explore --defect no-release-room --fault-model all` on the deployment
# below, with one more fault: the CHUNK_READY of room 0's first chunk to d0g0r0 is dropped, so
# that chunk is written and never scattered there. Prefill TP1 writes every chunk to both decode
# ranks; the STAGING_REQ reorder and the late CHUNK_READY make p0g0r0 write chunk 1 to d0g0r0
# a second time at the offset of an allocation d0g0r0 had scattered and freed, which is now the
# start of chunk 0's region (the multi-target retry; the explorer finds the defect not needed).
# The same rank writes both, chunk 0 first, so on real ranks the overwrite lands after the
# bytes it overwrites as in the simulation; the room then waits for the lost CHUNK_READY.
FAULTS = ("delay:CHUNK_READY:nth=3:ms=50", "reorder:STAGING_REQ:nth=1:ms=20",
          "drop:CHUNK_READY:dst=d0g0r0:chunk=0:nth=1")


def _repro(path: Path) -> None:
    cfg = SCENARIOS["multi-target-retry"].config.replace(
        prefill=ServerSide(tp_size=1), staging_pool_size_bytes=1 << 20)
    base = Base(cfg, SimParams(prefill_radix_tokens=0, wedge_window_s=5.0),
                defects=("no-release-room",))
    res = run_trial(base, Trial(requests=(Req(0.0, 264),), faults=FAULTS),
                    trace_out=str(path))
    assert res.status == "corrupted", res
    assert res.corruption == [
        "overwrite: d0g0r0 room 0: write of room 0 pages [16, 17) landed on unscattered data "
        "of room 0 pages [0, 16) at bytes [0, 65536)"], res.corruption
    assert any("never got their CHUNK_READY" in line for line in res.diagnosis), res.diagnosis


def test_an_overwrite_of_unscattered_ring_data_replays_corrupted_on_real_ranks(
        tmp_path: Path) -> None:
    trace = tmp_path / "repro.jsonl.gz"
    _repro(trace)
    r = CliRunner().invoke(cli, ["replay", str(trace), "--mode", "hw", "--json"],
                           catch_exceptions=False)
    assert r.exit_code == 4, r.output
    out = json.loads(r.output)
    assert out["status"] == "corrupted" and out["same_outcome"], out
    (line,) = out["corruption"]  # d0g0r1 scattered its copy of chunk 0: nothing there
    # The region the simulator names, who should be there and whose bytes are.
    assert line.startswith("d0g0r0 room 0 (unfinished): ring bytes [0, 65536) of room 0 "
                           "chunk 0 (pages [0, 16), writer p0g0r0), written and not scattered, "
                           "were overwritten: request 0 layer 0 K token 0 head 0 dim 0 at ring "
                           "offset 0"), line
    assert line.endswith("they hold the bytes of room 0 chunk 1 (pages [16, 17), writer "
                         "p0g0r0) written at ring offset 0"), line
