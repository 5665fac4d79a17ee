"""Blind rediscovery: how fast does `twin explore` find each upstream defect, told nothing else?

For each defect switched on alone, a campaign starts from the default deployment (as `twin
explore --defect NAME` does) and runs until its first finding that needs that defect (the
shrunk repro, rerun with the defect off, no longer shows the signature), or a cap. Reported per
defect: runs and seconds to that finding, its signature and the size of its shrunk repro.
A campaign with no defect on gives the baseline: findings in today's protocol, runs per second
on one core (trials only; shrinking counted separately) and the coverage reached of the total.

    python benchmarks/bench_explore.py                   # every defect, 400 runs / 60 s cap each
    python benchmarks/bench_explore.py --cap-runs 200 --cap-seconds 20 --defects no-grid-alignment
    python benchmarks/bench_explore.py --json out.json

Not a timed test: the numbers depend on the host and on the seed; docs/explore.md records the
ones measured.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from twin.advise.executors import InlineExecutor  # noqa: E402
from twin.core.defects import ALL_DEFECTS  # noqa: E402
from twin.explore.campaign import Campaign  # noqa: E402
from twin.explore.runner import explore  # noqa: E402
from twin.explore.strategies import Strategies  # noqa: E402
from twin.explore.trial import Base, Req  # noqa: E402
from twin.sim.scenarios import SCENARIOS  # noqa: E402


def default_base(defects: tuple[str, ...]) -> tuple[Base, tuple[Req, ...]]:
    """What `twin explore --defect ...` starts from with no other flag."""
    sc = SCENARIOS["default"]
    params = sc.params.replace(prefill_radix_tokens=0, decode_radix_tokens=0,
                               wedge_window_s=min(sc.params.wedge_window_s, 5.0))
    wl = sc.workload()
    user = tuple(Req(round(r.arrival_s - wl.requests[0].arrival_s, 6), r.input_len)
                 for r in wl.requests[:8])
    return Base(sc.config, params, defects), user


def inline(job: Any) -> InlineExecutor:
    return InlineExecutor(job)


def hunt(defect: str | None, seed: int, cap_runs: int, cap_s: float,
         out: Path, with_: tuple[str, ...] = (), fault_model: str = "sglang") -> dict[str, Any]:
    base, user = default_base((*with_, defect) if defect else ())
    c = Campaign(base, out, seed=seed, user_requests=user, shrink_runs=100,
                 strategies=Strategies(fault_model=fault_model))
    t0 = time.perf_counter()
    trial_s = 0.0
    trial_runs = 0
    hit = None
    while c.runs < cap_runs and time.perf_counter() - t0 < cap_s:
        before = time.perf_counter()
        n0, r0 = len(c.findings), c.runs
        explore(c, inline, runs=c.runs + 8)
        spent = time.perf_counter() - before
        if len(c.findings) == n0:  # rounds with no shrink in them: trials only
            trial_s += spent
            trial_runs += c.runs - r0
        if defect is not None:
            hit = next((f for f in c.findings.values() if defect in f.needs_defects), None)
            if hit is not None:
                break
    wall = time.perf_counter() - t0
    cov = c.coverage_report()
    row: dict[str, Any] = {
        "defect": (defect or "(none)") + (f" (with {', '.join(with_)})" if with_ else ""),
        "runs": c.runs, "wall_s": round(wall, 2),
        "coverage": {k: f"{r}/{t}" for k, (r, t) in cov.items()},
        "coverage_total": f"{sum(r for r, _ in cov.values())}/{sum(t for _, t in cov.values())}",
        "findings": [f"{f.kind}: {f.root[:90]}" for f in c.findings.values()]}
    if defect is None:
        row["runs_per_s_one_core"] = round(trial_runs / trial_s, 1) if trial_s else None
    elif hit is not None:
        s = hit.shrunk
        row.update(found=True, first_run=hit.first_run, first_s=round(hit.first_seconds, 2),
                   signature=f"{hit.kind}: {hit.root[:100]}",
                   shrunk={"requests": len(s.requests), "faults": len(s.faults),
                           "tokens": sum(r.input_len for r in s.requests),
                           "deploy_changes": s.deploy.fields(),
                           "loopback": bool(s.schedule)})
    else:
        row["found"] = False
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--defects", default=",".join(ALL_DEFECTS))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cap-runs", type=int, default=400)
    ap.add_argument("--cap-seconds", type=float, default=60.0)
    ap.add_argument("--no-baseline", action="store_true")
    ap.add_argument("--fault-model", choices=("sglang", "all"), default="sglang",
                    help="The fault kinds trials draw (twin explore --fault-model); 'all' is "
                         "the draw of campaigns before the fault model.")
    ap.add_argument("--json", default=None, help="Also write the rows here.")
    args = ap.parse_args()
    import tempfile

    rows = []
    names: list[tuple[str | None, tuple[str, ...]]] = [] if args.no_baseline else [(None, ())]
    for d in filter(None, args.defects.split(",")):
        if d not in ALL_DEFECTS:
            ap.error(f"--defects: unknown defect {d!r}; known: {', '.join(ALL_DEFECTS)} "
                     f"(--defects '' runs the baseline alone)")
        names.append((d, ()))
    with tempfile.TemporaryDirectory() as tmp:
        for i, (d, with_) in enumerate(names):
            row = hunt(d, args.seed, args.cap_runs, args.cap_seconds, Path(tmp) / str(i),
                       with_, args.fault_model)
            label = row["defect"]
            rows.append(row)
            if d is None:
                print(f"baseline (no defect, fault model {args.fault_model}): "
                      f"{row['runs']} runs in {row['wall_s']} s, "
                      f"{row['runs_per_s_one_core']} runs/s on one core, coverage "
                      f"{row['coverage_total']} {row['coverage']}")
                for f in row["findings"]:
                    print(f"    finding: {f}")
            elif row["found"]:
                s = row["shrunk"]
                print(f"{label:32s} run {row['first_run']:4d}  {row['first_s']:6.1f} s  "
                      f"repro {s['requests']} req, {s['faults']} fault, {s['tokens']} tok"
                      f"{' (loopback)' if s['loopback'] else ''}  {row['signature'][:70]}")
            else:
                print(f"{label:32s} not found in {row['runs']} runs / {row['wall_s']} s")
            sys.stdout.flush()
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
