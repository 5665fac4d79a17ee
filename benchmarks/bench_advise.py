"""Where ``twin advise``'s time goes: wall and CPU of one advise run, and its probes' run time
by role and outcome.

    python benchmarks/bench_advise.py --workload ../shared/traces/mooncake/synthetic_trace.jsonl
    python benchmarks/bench_advise.py --workload ... -- --ttft 6 --cps 2048,4096   # more flags

Runs ``twin advise ARGS -o TMP.csv --json`` as a child process (the command a user types, so
worker start-up and trace loading count) and reports its wall time, the CPU time of it and its
workers, and the load average before and after (the machine may be shared); the baseline,
measured in the same run, is ``twin sim`` of the same workload on the default deployment, and
the ratios say how many such simulations the answer costs. Then each probe row
is put in one role: ``answer`` (the rows the printed answer quotes or needs the verdict of: every
seed at each candidate's smallest passing ring, the failing seed just below it, and the pick's
largest sustained and first failing rate scale), ``extra seed`` (another seed of a probe whose
quoted failure is on one seed: run beside it while a slot was free), ``search`` (every other
probe: the verdicts that steer a bisection). A probe's
``wall_s`` is its own process's time, inflated when the workers share a loaded machine.
Last, the floor: the answer's own probes spread over the cores, which no search order can
beat at this simulator speed.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import re
import resource
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

Key = tuple[int, float, int]


def _roles(answer: dict[str, Any]) -> dict[Key, int | None]:
    """(cps, rate scale, ring) of the probes the answer rests on: None where every seed
    counts (a passing probe), else the seed whose failure the answer quotes."""
    out: dict[Key, int | None] = {}

    def failing_seed(p: dict[str, Any]) -> int | None:
        m = re.search(r"\(seed (\d+)\)$", str(p.get("why") or ""))
        return int(m.group(1)) if m else None

    for c in answer["candidates"]:
        cps = c["chunked_prefill_size"]
        ring = c.get("recommended_ring_mb")
        if c.get("at_smallest_ring"):
            out[(cps, 1.0, int(c["at_smallest_ring"]["value"]))] = None
        if c.get("below_smallest_ring"):
            p = c["below_smallest_ring"]
            out[(cps, 1.0, int(p["value"]))] = failing_seed(p)
        if c.get("max_rate_scale") is not None and ring:
            out[(cps, round(float(c["max_rate_scale"]), 3), int(ring))] = None
        if c.get("first_failing_scale") and ring:
            p = c["first_failing_scale"]
            out[(cps, round(float(p["value"]), 3), int(ring))] = failing_seed(p)
    return out


def _role(roles: dict[Key, int | None], key: Key, seed: int) -> str:
    if key not in roles:
        return "search"
    quoted = roles[key]
    return "answer" if quoted is None or quoted == seed else "extra seed"


def _timed(cmd: list[str], env: dict[str, str], cwd: Path) -> tuple[float, float]:
    """Wall and CPU seconds of ``cmd`` run to its end (its exit status must be 0)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=cwd)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        sys.exit(f"{' '.join(cmd[2:])} exited {proc.returncode}: {proc.stderr[-2000:]}")
    return wall, (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", required=True)
    ap.add_argument("rest", nargs="*", help="more twin advise flags (after --)")
    args = ap.parse_args()
    root = Path(__file__).resolve().parents[1]
    out = Path(tempfile.mkdtemp()) / "probes.csv"
    cmd = [sys.executable, "-m", "twin", "advise", "--workload", args.workload, "-o", str(out),
           "--json", *args.rest]
    env = {**os.environ, "PYTHONPATH": str(root)}
    base = _timed([sys.executable, "-m", "twin", "sim", "--workload", args.workload], env, root)
    load0 = os.getloadavg()
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=root)
    wall = time.perf_counter() - t0
    load1 = os.getloadavg()
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode not in (0, 1):
        sys.exit(f"twin advise exited {proc.returncode}: {proc.stderr[-2000:]}")
    answer = json.loads(proc.stdout)
    roles = _roles(answer)
    with out.open(newline="") as f:
        rows = list(csv.DictReader(f))
    table: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0, 0.0])
    for r in rows:
        key = (int(r["x.chunked_prefill_size"]), round(float(r["x.rate_scale"]), 3),
               int(r["x.staging_pool_size_mb"]))
        w = float(r["wall_s"] or 0.0)
        role = _role(roles, key, int(r["seed"]))
        cell = table[(role, r["outcome"])]
        cell[0] += 1
        cell[1] += w
    rec = answer.get("recommendation") or {}
    cpu = usage.ru_utime + usage.ru_stime - base[1]
    print(f"command  twin advise --workload {args.workload} {' '.join(args.rest)}")
    print(f"answer   cps {rec.get('chunked_prefill_size')}, ring {rec.get('staging_pool_size_mb')}"
          f" MiB, margin {rec.get('max_rate_scale')}x; runs {answer['runs']}")
    print(f"baseline twin sim of the workload: {base[0]:.1f} s wall, {base[1]:.1f} s CPU")
    print(f"wall     {wall:.1f} s ({wall / base[0]:.1f}x the baseline); CPU {cpu:.1f} s "
          f"({cpu / base[1]:.1f}x; command and workers); load average {load0[0]:.2f} before, "
          f"{load1[0]:.2f} after")
    total = sum(c[1] for c in table.values()) or 1.0
    print("\n| role | outcome | probes | probe wall (s) | share |\n|---|---|---|---|---|")
    for (role, outcome), (n, w) in sorted(table.items(), key=lambda kv: -kv[1][1]):
        print(f"| {role} | {outcome} | {n:.0f} | {w:.1f} | {w / total:.0%} |")
    # The answer's own probes bound any search from below: even one that knew in advance
    # which probes to run must run these (at this simulator speed, on these cores).
    quoted = sum(w for (role, _), (_, w) in table.items() if role == "answer")
    cores = len(os.sched_getaffinity(0))
    print(f"\nfloor    the answer's own probes: {quoted:.1f} s of probe time, {quoted / cores:.1f} s "
          f"wall on {cores} core(s) even for a search that ran nothing else")


if __name__ == "__main__":
    main()
