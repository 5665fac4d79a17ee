"""Traces at production scale: recording, replay, inspection and Perfetto export.

Run: ``python benchmarks/bench_trace.py [--quick] [--json out.json] [--keep DIR]``.

(a) An hour of Poisson traffic at a production rate (3.3 requests/s, Mooncake-like prompts of
    12,000 +- 8,000 tokens, 256 output tokens) on SGLang's default deployment (prefill TP4 ->
    decode TP2), cut at 1/16, 1/4 and the whole hour (the 1x / 4x / 16x lengths). For each length
    every step runs as its own ``twin`` process: the untraced simulation (the baseline), the
    simulation recording ``.jsonl.zst`` (and ``.jsonl.gz``), ``twin replay``,
    ``twin trace summary``, ``twin trace room`` (a room in the middle), ``twin trace diff`` of
    the trace with itself, ``twin perfetto`` (protobuf, and Chrome JSON for the size
    comparison), and a one-minute window from the middle (``--from/--to``).
(b) The Azure LLM code trace (``shared/traces/azure2023/AzureLLMInferenceTrace_code.csv``
    beside the repository), when present: the same steps, once.

``--core both`` runs everything twice, compiled core (``twin compile``) then pure Python
(``TWIN_PURE_PYTHON=1``), each against its own untraced simulation; the JSON keeps both under
``compiled`` and ``pure``. Each step reports wall and CPU seconds, each with its ratio to the untraced simulation of the
same length, and the process's peak resident memory (``os.wait4``'s ``ru_maxrss``). On a
shared, busy machine the CPU ratios are the steadier measure; ``--repeat N`` keeps the least of
N rounds (each round runs every step once, so that noise falls on all steps alike), and the
``median`` column is the median over the rounds of each round's wall ratio (a step against the
untraced simulation of the same round, which cancels a slow spell that lasts a round). Steps run
with the modules' bytecode cached, as installed (``PYTHONDONTWRITEBYTECODE`` is dropped).
Goals
(issue 15): recording <= 1.3x, replay <= 1.5x, summary <= 0.5x the untraced simulation; peak
memory of replay and inspection < 500 MB and flat across lengths; the Perfetto file at most a
third of the JSON; a one-minute window in under 5 s.

``--quick`` uses 1/8 of the hour (1x = 28 s of traffic) and the first 1,000 Azure requests.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if __package__ in (None, ""):
    sys.path.insert(0, str(ROOT))
AZURE = ROOT.parent / "shared" / "traces" / "azure2023" / "AzureLLMInferenceTrace_code.csv"
RATE = 3.3
POISSON = "poisson:n={n},rate={rate},input=12000~8000,output=256,seed=1"
TWIN = [sys.executable, "-c", "from twin.cli import main; main()"]


REPEAT = 1
CORE_ENV: dict[str, str] = {}
"""Set on every ``twin`` process: ``TWIN_PURE_PYTHON=1`` for the pure-Python core."""


PLAN: list[tuple[dict[str, Any], list[str], Path | None]] = []
"""Every step run so far for the current workload: its result, ``twin`` arguments and output."""


def run(args: list[str], out: Path | None = None) -> dict[str, Any]:
    """Run ``twin ARGS`` in a fresh process: wall and CPU seconds, peak RSS, exit code. The
    step joins ``PLAN``; ``rerun_plan`` runs every step again, in the same order."""
    res = _run_once(args, out)
    res["walls"] = [res["wall_s"]]
    PLAN.append((res, args, out))
    return res


def rerun_plan() -> None:
    """Run the steps of ``PLAN`` ``REPEAT - 1`` more times, round after round (each round every
    step once, so that a busy spell on a shared machine falls on all of them alike), keeping
    each step's least wall and CPU seconds and peak RSS."""
    for _ in range(REPEAT - 1):
        for res, args, out in PLAN:
            again = _run_once(args, out)
            res["walls"].append(again["wall_s"])
            for key in ("wall_s", "cpu_s", "rss_mb"):
                res[key] = min(res[key], again[key])
    PLAN.clear()


def _run_once(args: list[str], out: Path | None = None) -> dict[str, Any]:
    """Run ``twin ARGS`` in a fresh process: wall and CPU seconds, peak RSS (MB), exit code."""
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("TWIN_PURE_PYTHON", None)
    env.pop("PYTHONDONTWRITEBYTECODE", None)  # as installed: modules' bytecode cached
    env.update(CORE_ENV)
    sink = open(out, "wb") if out is not None else subprocess.DEVNULL  # noqa: SIM115
    t0 = time.perf_counter()
    proc = subprocess.Popen([*TWIN, *args], stdout=sink, stderr=subprocess.PIPE, env=env)
    assert proc.stderr is not None
    err = proc.stderr.read()
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    if out is not None:
        sink.close()  # type: ignore[union-attr]
    if proc.returncode not in (0, 3, 4):
        raise RuntimeError(f"twin {' '.join(args)} exited {proc.returncode}: {err.decode()[-2000:]}")
    return {"wall_s": round(wall, 3), "cpu_s": round(usage.ru_utime + usage.ru_stime, 3),
            "rss_mb": round(usage.ru_maxrss / 1024, 1), "code": proc.returncode}


def size_mb(path: Path) -> float:
    return round(path.stat().st_size / 1e6, 2)


def middle_room(trace: Path) -> int:
    """The room that arrived in the middle of the run."""
    from twin.trace.format import TraceReader

    rooms = [rec.data["room"] for rec in TraceReader(trace, select=())
             if rec.type == "RequestArrived"]
    return rooms[len(rooms) // 2]


def steps(label: str, workload: list[str], work: Path) -> dict[str, Any]:
    """Every step for one workload; ratios against its untraced simulation."""
    zst, gz = work / f"{label}.jsonl.zst", work / f"{label}.jsonl.gz"
    pf, js, win = work / f"{label}.pftrace", work / f"{label}.json", work / f"{label}-win.pftrace"
    res: dict[str, Any] = {}
    print(f"[{label}] untraced simulation ...", flush=True)
    res["sim"] = run(["sim", *workload, "--json"], work / f"{label}.sim.json")
    sim = json.loads((work / f"{label}.sim.json").read_text())
    res["requests"], res["core_inputs"] = sim["requests"], sim["events"]
    res["sim_seconds"] = sim["sim_seconds"]
    print(f"[{label}] recording ...", flush=True)
    res["record_zst"] = run(["sim", *workload, "--json", "--trace-out", str(zst)])
    res["record_gz"] = run(["sim", *workload, "--json", "--trace-out", str(gz)])
    res["trace_mb"] = {"zst": size_mb(zst), "gz": size_mb(gz),
                       "index": size_mb(Path(f"{zst}.idx"))}
    print(f"[{label}] replay, summary, room, diff ...", flush=True)
    res["replay"] = run(["replay", str(zst)])
    res["summary"] = run(["trace", "summary", str(zst)])
    room = middle_room(zst)
    res["room"] = run(["trace", "room", str(zst), str(room)])
    res["room"]["which"] = room
    res["diff"] = run(["trace", "diff", str(zst), str(gz)])
    print(f"[{label}] perfetto ...", flush=True)
    res["perfetto"] = run(["perfetto", str(zst), "-o", str(pf)])
    res["perfetto_json"] = run(["perfetto", str(zst), "-o", str(js)])
    mid = round(sim["sim_seconds"] / 2, 3)
    res["window"] = run(["perfetto", str(zst), "-o", str(win), "--from", str(mid), "--to",
                         str(mid + 60)])
    res["perfetto_mb"] = {"proto": size_mb(pf), "json": size_mb(js), "window": size_mb(win)}
    if REPEAT > 1:
        print(f"[{label}] {REPEAT - 1} more rounds of every step ...", flush=True)
    rerun_plan()
    base, base_cpu = res["sim"]["wall_s"], res["sim"]["cpu_s"]
    for key in ("record_zst", "record_gz", "replay", "summary", "room", "diff", "perfetto",
                "perfetto_json", "window"):
        res[key]["ratio"] = round(res[key]["wall_s"] / base, 3)
        res[key]["cpu_ratio"] = round(res[key]["cpu_s"] / base_cpu, 3)
        res[key]["round_ratios"] = [
            round(w / b, 3) for w, b in zip(res[key]["walls"], res["sim"]["walls"], strict=True)]
        res[key]["median_ratio"] = round(statistics.median(res[key]["round_ratios"]), 3)
    for p in (js, pf, win, gz, Path(f"{gz}.idx")):
        p.unlink(missing_ok=True)
    return res


def show(label: str, r: dict[str, Any]) -> None:
    print(f"\n{label}: {r['requests']} requests, {r['core_inputs']} core inputs, "
          f"{r['sim_seconds']:.0f} s simulated; trace {r['trace_mb']['zst']} MB zst "
          f"({r['trace_mb']['gz']} MB gz, index {r['trace_mb']['index']} MB); Perfetto "
          f"{r['perfetto_mb']['proto']} MB proto vs {r['perfetto_mb']['json']} MB JSON "
          f"({r['perfetto_mb']['proto'] / max(r['perfetto_mb']['json'], 1e-9):.2f}x)")
    print(f"  {'step':<24}{'wall s':>8}{'x sim':>7}{'median':>8}{'cpu s':>8}{'x sim':>7}"
          f"{'peak MB':>9}")
    rows = [("sim (untraced)", "sim"), ("sim --trace-out .zst", "record_zst"),
            ("sim --trace-out .gz", "record_gz"), ("replay", "replay"),
            ("trace summary", "summary"), (f"trace room {r['room']['which']}", "room"),
            ("trace diff (zst vs gz)", "diff"), ("perfetto (proto)", "perfetto"),
            ("perfetto (json)", "perfetto_json"), ("perfetto 60 s window", "window")]
    for name, key in rows:
        s = r[key]
        ratio = f"{s['ratio']:.2f}" if "ratio" in s else "1.00"
        cpu_ratio = f"{s['cpu_ratio']:.2f}" if "cpu_ratio" in s else "1.00"
        median = f"{s['median_ratio']:.2f}" if "median_ratio" in s else "1.00"
        print(f"  {name:<24}{s['wall_s']:>8.2f}{ratio:>7}{median:>8}{s['cpu_s']:>8.2f}"
              f"{cpu_ratio:>7}{s['rss_mb']:>9.0f}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="1/8 of the hour; 1,000 Azure requests")
    ap.add_argument("--json", dest="json_out", help="write the results here")
    ap.add_argument("--keep", help="keep the traces in this folder")
    ap.add_argument("--no-azure", action="store_true")
    ap.add_argument("--repeat", type=int, default=1,
                    help="run every step N times, in rounds, and keep each step's least "
                         "time (a busy machine)")
    ap.add_argument("--sizes", default="1,4,16", help="lengths in 16ths of the hour")
    ap.add_argument("--core", choices=["installed", "pure", "both"], default="installed",
                    help="the core every step runs: as installed (compiled after twin "
                         "compile), pure Python, or both, one after the other")
    args = ap.parse_args(argv)
    global REPEAT
    REPEAT = max(1, args.repeat)
    from twin import compiled

    built = compiled.state().mode == "compiled"
    if args.core == "both" and not built:
        ap.error(f"--core both needs the compiled core: {compiled.state().line()}")
    paths = {"installed": ["compiled" if built else "pure"], "pure": ["pure"],
             "both": ["compiled", "pure"]}[args.core]
    results: dict[str, Any] = {"quick": args.quick}
    for path in paths:
        CORE_ENV.clear()
        if path == "pure":
            CORE_ENV["TWIN_PURE_PYTHON"] = "1"
        print(f"== core: {path}", flush=True)
        results[path] = _bench(args)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(results, indent=2) + "\n")
    return 0


def _bench(args: argparse.Namespace) -> dict[str, Any]:
    """Every step on every length (and the Azure trace), on the core ``CORE_ENV`` selects."""
    hour = 3600.0 / (8 if args.quick else 1)
    work = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="bench-trace-"))
    work.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {"quick": args.quick, "poisson": {}}
    try:
        mults = [int(x) for x in args.sizes.split(",")]
        for mult in mults:
            n = max(1, round(RATE * hour * mult / 16))
            spec = POISSON.format(n=n, rate=RATE)
            r = steps(f"poisson-{mult}x", ["--workload", spec], work)
            r["workload"] = spec
            results["poisson"][f"{mult}x"] = r
            show(f"Poisson {mult}x ({hour * mult / 16:.0f} s of traffic)", r)
        if AZURE.exists() and not args.no_azure:
            cut = ["--first-n", "1000"] if args.quick else []
            r = steps("azure-code", ["--workload", str(AZURE), *cut], work)
            results["azure"] = r
            show("Azure code trace", r)
        flat = {step: [results["poisson"][f"{m}x"][step]["rss_mb"] for m in mults]
                for step in ("replay", "summary", "room", "diff", "perfetto", "window")}
        results["peak_rss_mb_by_length"] = flat
        print(f"\npeak RSS (MB) at {' / '.join(f'{m}x' for m in mults)}:")
        for step, v in flat.items():
            print(f"  {step:<10} {' / '.join(f'{x:.0f}' for x in v)}")
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    return results


if __name__ == "__main__":
    raise SystemExit(main())
