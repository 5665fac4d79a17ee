"""A field is added in one place: the event's class. On a scratch copy of the package, one new
field on ``Allocated`` (with a default, so older traces still read) reaches the trace lines, is
read back, replays and exports to Perfetto, with no other file touched and nothing regenerated.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import json, sys
from twin.cli import main
from twin.core import events as ev
from twin.trace.format import read_trace
from twin.replay import replay_sim
from twin.trace.perfetto import write_perfetto

assert "colour" in ev.Allocated.__struct_fields__
trace_path, pf = sys.argv[1], sys.argv[2]
trace = read_trace(trace_path)
got = [r.event for r in trace.events if r.type == "Allocated"]
result = replay_sim(trace_path)
write_perfetto(trace_path, pf)
print(json.dumps({"allocated": len(got), "colours": sorted({e.colour for e in got}),
                  "status": result.status, "same": result.same_outcome,
                  "divergence": str(result.divergence) if result.divergence else None}))
"""


def test_a_new_event_field_needs_only_its_class(tmp_path: Path) -> None:
    scratch = tmp_path / "pkg"
    shutil.copytree(ROOT / "twin", scratch / "twin",
                    ignore=shutil.ignore_patterns("__pycache__", "*.so", "_compiled.json"))
    events = scratch / "twin" / "core" / "events.py"
    text = events.read_text()
    anchor = "class Allocated("
    start = text.index(anchor)
    end = text.index("\n\n\n", start)
    events.write_text(text[:end] + '\n    colour: str = "blue"' + text[end:])
    env = {**os.environ, "PYTHONPATH": str(scratch), "TWIN_PURE_PYTHON": "1"}
    trace = tmp_path / "run.jsonl.zst"
    sim = subprocess.run([sys.executable, "-m", "twin", "sim", "--workload",
                          "poisson:n=20,rate=10,input=2048,output=4,seed=1", "--trace-out",
                          str(trace)], env=env, cwd=tmp_path, capture_output=True, text=True,
                         timeout=300)
    assert sim.returncode == 0, sim.stderr
    check = subprocess.run([sys.executable, "-c", SCRIPT, str(trace), str(tmp_path / "r.pf")],
                           env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert check.returncode == 0, check.stderr
    out = json.loads(check.stdout.strip().splitlines()[-1])
    assert out["allocated"] > 20 and out["colours"] == ["blue"]
    assert out["status"] == "completed" and out["same"], out
    assert (tmp_path / "r.pf").stat().st_size > 1000
    import zstandard

    raw = zstandard.ZstdDecompressor().stream_reader(trace.open("rb")).read()
    assert b'"type":"Allocated",' in raw and b'"colour":"blue"' in raw
