"""Calibration against the host's own spread: does a fit on one run here predict another run
here as well as a repeat of that run does?

Records three hardware-mode runs back to back (``twin hw``, prefill TP2 -> decode TP1 of
``examples/tp2-tp1-small.toml`` with ``--fix drop-late-staging-req``, the workloads of
``bench_calibrate.py``): A (workload ``--fit``, default a-long = 72 requests of 600 tokens at
20/s), B (workload ``--check``, default b-long = 72 of 1,000 at 10/s) and B2 (B again). Fits A
(``twin calibrate A -o costs.toml``), predicts B (fresh simulations of B's workload on the
fitted costs, ``--seeds`` of them from B's seed on, as ``twin replay`` makes them) and
prints, for TTFT, ``kv_done_s`` and ``transfer_s``:

* the prediction's **error**: p50 over B's requests of ``|predicted / measured - 1|``, a
  request's prediction being its median over the simulations (21 by default: with 5, enough
  of the simulated jitter is left in each request's median to add about 0.02 to the error);
* the **spread** between B and B2: p50 over B's requests of ``|B2 / B - 1|``, matched by
  request id;
* error / spread, against the goal: each at most 1.1x the repeat spread.

Both read how far another estimate of each request's time (the model's, or a repeat's) is
from B's measured one, so they compare like with like (``twin/calibrate/check.py`` says why a
per-request median rather than the ratio of two runs' p50s, which is printed beside them as
``twin replay`` reports it: p50 of the per-request ratios, the simulations pooled). TTFT is
arrival to all KV landed on the hardware (no token streams there, as ``twin hw`` reports it)
and the simulator's TTFT (first token) in the prediction.

A recording is only as good as the host was quiet while it ran. Each waits for the 1-minute
load average to fall to ``--max-load``; while it runs, the CPU time that processes other than
its own take on the host is summed (``/proc``), and a recording during which they took more
than ``--max-foreign`` of a core on average (other engineers' work on a shared machine, which
the load average sees late) is recorded again, up to ``--tries`` times, and the table says how
much each kept recording had.

Run: ``python benchmarks/bench_calibration.py [--work DIR] [--reuse] [--json out.json]
[--fit a-long] [--check b-long] [--seeds N] [--max-load L] [--max-foreign F] [--tries N]``.
``--reuse`` keeps recordings and costs already in ``--work`` (a fresh fit when A is
recorded again). About 70 s here (2 cores) on a quiet host; ``--fit a --check b`` (24
requests each, the default before) about 60 s, with error / spread moving between 0.7 and 1.6
from one run to the next for the same code (docs/simulator.md, "Seventy-two requests").
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_calibrate import (  # noqa: E402
    WORKLOADS,
    record,
    scatter_us_per_kib,
    settle,
    twin,
)

LABELS = {"ttft_s": "TTFT", "kv_done_s": "kv_done_s", "transfer_s": "transfer_s"}


class ForeignCpu:
    """CPU seconds that processes other than this one and its descendants take on the host
    while the block runs, read from ``/proc`` every ``every`` seconds: a process's CPU time
    from when the block began (or from its start, for one started meanwhile) to when it was
    last seen. A process that starts and ends between two reads is missed."""

    def __init__(self, every: float = 0.25) -> None:
        self.every = every
        self.seconds = 0.0
        self.wall = 0.0
        self._seen: dict[tuple[int, str], tuple[float, float, bool]] = {}  # first, last, ours
        self._stop = threading.Event()
        self._tick = os.sysconf("SC_CLK_TCK")

    @property
    def cores(self) -> float:
        """Foreign CPU seconds per wall second (0 on a host nobody else uses)."""
        return self.seconds / self.wall if self.wall > 0 else 0.0

    def _poll(self, first: bool = False) -> None:
        procs: dict[int, tuple[int, str, float]] = {}  # pid -> parent, start, cpu seconds
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                with open(f"/proc/{entry.name}/stat") as f:
                    rest = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue  # exited meanwhile
            procs[int(entry.name)] = (int(rest[1]), rest[19],
                                      (int(rest[11]) + int(rest[12])) / self._tick)
        me = os.getpid()
        for pid, (_, start, cpu) in procs.items():
            p, hops = pid, 0
            while p not in (me, 0, 1) and p in procs and hops < 64:
                p, hops = procs[p][0], hops + 1
            key = (pid, start)
            begin, _, ours = self._seen.get(key, (cpu if first else 0.0, 0.0, False))
            # once ours, always: a rank server outliving its parent is reparented to init
            self._seen[key] = (begin, cpu, ours or p == me)

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            self._poll()

    def __enter__(self) -> ForeignCpu:
        self._t0 = time.monotonic()
        self._poll(first=True)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._poll()
        self.wall = time.monotonic() - self._t0
        self.seconds = sum(last - begin for begin, last, ours in self._seen.values()
                           if not ours)


def record_quiet(work: Path, name: str, repeat: int, reuse: bool, max_load: float,
                 max_foreign: float, tries: int) -> tuple[Path, dict[str, Any]]:
    """Record workload ``name`` (its ``repeat``-th recording) with ``bench_calibrate.record``
    on a settled host; again (at most ``tries`` recordings) while other processes took more
    than ``max_foreign`` cores on average. The path and how it was recorded."""
    out = work / f"hw-{name}{repeat if repeat > 1 else ''}.jsonl.gz"
    if reuse and out.exists():
        return out, {"reused": True}
    info: dict[str, Any] = {}
    for attempt in range(1, tries + 1):
        load = settle(max_load)
        with ForeignCpu() as foreign:
            record(work, name, repeat, False, float("inf"))
        info = {"load_avg": round(load, 2), "foreign_cores": round(foreign.cores, 3),
                "wall_s": round(foreign.wall, 2), "tries": attempt}
        quiet = foreign.cores <= max_foreign
        print(f"  other processes took {foreign.cores:.2f} cores on average; {speed_of(out)}"
              + ("" if quiet or attempt == tries else "; recording again"), flush=True)
        if quiet:
            break
    return out, info


def fit(work: Path, trace: Path, reuse: bool) -> Path:
    """``twin calibrate trace -o costs.toml`` (kept with ``reuse`` when newer than the trace)."""
    costs = work / "costs.toml"
    if reuse and costs.exists() and costs.stat().st_mtime >= trace.stat().st_mtime:
        return costs
    t0 = time.perf_counter()
    r = twin("calibrate", str(trace), "-o", str(costs))
    if r.returncode != 0:
        raise SystemExit(f"twin calibrate exited {r.returncode}:\n{r.stderr[-2000:]}")
    print(f"calibrated on {trace.name} in {time.perf_counter() - t0:.1f} s", flush=True)
    return costs


def check(costs: Path, b: Path, b2: Path, seeds: int) -> dict[str, Any]:
    """The prediction of ``b`` on ``costs`` against the spread between ``b`` and ``b2``, and
    where the costs were fitted against where ``b`` ran (``host``)."""
    from twin.calibrate import costs_from
    from twin.calibrate.check import compare, request_phases, simulated_phases
    from twin.calibrate.host import costs_host, host_check, trace_host
    from twin.trace.format import read_trace

    params = costs_from(str(costs))
    assert params is not None
    trace_b = read_trace(b)
    first = trace_b.header.get("seed") or 0
    predicted = simulated_phases(trace_b, params, range(first, first + seeds))
    result = compare(predicted, request_phases(trace_b), request_phases(read_trace(b2)))
    return {**result, "host": host_check(trace_host(trace_b), costs_host(costs))}


def speed_of(trace: Path) -> str:
    """The recording's probe and its decode ranks' scatter rate, in a few words."""
    from twin.calibrate.host import trace_host
    from twin.trace.format import read_trace

    host = trace_host(read_trace(trace)) or {}
    rates = host.get("probe", {})
    probe = (f"probe {rates['py_ops_per_s'] / 1e6:.1f} M Python ops/s, scatter "
             f"{rates['scatter_Bps'] / 1e9:.1f} GB/s" if "scatter_Bps" in rates else "no probe")
    return f"{probe}; the run's scatters {scatter_us_per_kib(trace):.2f} us per KiB"


def show(result: dict[str, Any]) -> None:
    print(f"{'phase':<11} {'error':>6} {'spread':>6} {'error/spread':>12}   "
          f"{'p50 ratio pred/B':>16} {'B2/B':>6}  requests")
    for phase, v in result["phases"].items():
        err, spr = v["error"] or {}, v["spread"] or {}

        def num(d: dict[str, Any], key: str) -> str:
            return f"{d[key]:.3f}" if key in d else "-"
        ratio = f"{v['ratio']:.2f}" if v["ratio"] is not None else "-"
        print(f"{LABELS[phase]:<11} {num(err, 'median_abs'):>6} {num(spr, 'median_abs'):>6} "
              f"{ratio:>12}   {num(err, 'ratio_p50'):>16} {num(spr, 'ratio_p50'):>6}  "
              f"{err.get('requests', '-')}")
    if result["host"].get("note"):
        print(f"note: {result['host']['note']}")
    missed = [LABELS[p] for p, v in result["phases"].items() if not v["met"]]
    print(f"goal: each at most {result['goal']:g}x the repeat spread: "
          + ("met" if not missed else f"missed on {', '.join(missed)}"), flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--work", default="bench-calibration", help="folder for traces and costs")
    ap.add_argument("--reuse", action="store_true",
                    help="keep recordings and costs already in --work")
    ap.add_argument("--fit", default="a-long", help="workload A, fitted on")
    ap.add_argument("--check", default="b-long", help="workload B, predicted and repeated")
    ap.add_argument("--seeds", type=int, default=21,
                    help="simulations of B's workload (a request's prediction is its median)")
    ap.add_argument("--max-load", type=float, default=0.5,
                    help="before each recording, wait (up to 3 min) for the 1-minute load "
                         "average to fall to this")
    ap.add_argument("--max-foreign", type=float, default=0.1,
                    help="record again when other processes took more than this many cores "
                         "on average during a recording")
    ap.add_argument("--tries", type=int, default=4, help="recordings of each run at most")
    ap.add_argument("--json", dest="json_out", help="write the results here")
    args = ap.parse_args(argv)
    for opt, name in (("--fit", args.fit), ("--check", args.check)):
        if name not in WORKLOADS:
            ap.error(f"{opt}: unknown workload {name!r}; known: {', '.join(WORKLOADS)}")
    if args.fit == args.check:
        ap.error("--fit and --check: two different workloads")
    if args.seeds < 1 or args.tries < 1:
        ap.error("--seeds and --tries: at least 1")
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    runs: dict[str, Any] = {}
    paths = {}
    for label, name, repeat in (("A", args.fit, 1), ("B", args.check, 1),
                                ("B2", args.check, 2)):
        print(f"{label}: workload {name} ({WORKLOADS[name]})", flush=True)
        paths[label], runs[label] = record_quiet(work, name, repeat, args.reuse, args.max_load,
                                                 args.max_foreign, args.tries)
    costs = fit(work, paths["A"], args.reuse)
    result = check(costs, paths["B"], paths["B2"], args.seeds)
    show(result)
    print(f"in {time.perf_counter() - t0:.0f} s", flush=True)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(
            {"fit": args.fit, "check": args.check, "seeds": args.seeds, "recordings": runs,
             "costs": str(costs), **result}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
