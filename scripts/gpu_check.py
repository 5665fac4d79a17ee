"""The one-GPU hardware check (run it through ``scripts/gpu_check.sh``).

Runs a fixed list of steps, each a subprocess with its own time limit, inside one overall budget
(8 minutes by default), and writes into the output folder (``--out``, else ``$OUT``, else a new
temporary folder):

- ``summary.json``: the verdict (``passed``), the environment, and per step its status, exit
  code, seconds, limit, the reason it failed and what was read from its output (test counts,
  benchmark ratios, the ``twin hw`` verdict);
- ``steps.log``: every step's full output, one after the other;
- ``steps.tar.gz``: the same logs one file per step, with the JUnit XML and benchmark JSON files;
- ``hw-run.jsonl.gz``: the trace of the ``twin hw`` run; ``hw-run-b.jsonl.gz``, a second run
  on another workload; ``costs.toml``, the simulator's cost model calibrated on the first run
  (``twin calibrate``), which the last step checks against the second run's timings.

A step passes only on positive evidence: pytest steps need tests that ran and none failed (and,
on CUDA, none skipped), the ``twin hw`` step needs its JSON verdict to show every request
completed and byte-verified, benchmarks need their JSON rows. Standard library only, so it runs
before the wheels are installed; ``--device cpu`` runs the same steps without CUDA.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
SUMMARY_VERSION = 1
HW_CONFIG = "examples/tp2-tp1-small.toml"
JSON_KINDS = ("hw", "replay", "calibrate")

# The Mooncake VRAM step's probe: an engine built with CUDA whose protocol moves VRAM, and a
# one-page CUDA tensor that it registers (twin.hw.mooncake_transport.probe_vram).
MOONCAKE_VRAM_PROBE = r"""
import sys
why = None
if sys.argv[1] != "cuda":
    why = "runs with --device cuda only (this check is --device " + sys.argv[1] + ")"
else:
    from twin.hw.mooncake_transport import probe_vram
    why = probe_vram("cuda:0")
if why is not None:
    print("Mooncake VRAM: " + " ".join(why.split()), flush=True)
    sys.exit(1)
"""

ENV_SCRIPT = r"""
import importlib, json, os, platform, shutil, subprocess, sys
device, path = sys.argv[1], sys.argv[2]
info = {"python": sys.version.split()[0], "executable": sys.executable,
        "platform": platform.platform(), "cpus": os.cpu_count(),
        "env": {k: v for k, v in os.environ.items()
                if k.startswith(("UCX_", "NIXL_", "CUDA_", "TRITON_", "TWIN_"))
                or k == "PYTHONPATH"}}
problems = []
def version(name):
    try:
        mod = importlib.import_module(name)
    except Exception as exc:
        problems.append(f"import {name}: {type(exc).__name__}: {exc}")
        return None
    return getattr(mod, "__version__", "?")
for name in ("numpy", "torch", "triton", "zmq", "simpy", "tomli_w", "click", "pytest",
             "hypothesis"):
    info[name] = version(name)
try:
    import nixl._api as api
    info["nixl_module"] = api.__file__
    info["nixl_flavour"] = api.__name__ if api.__name__ != "nixl._api" else api.__file__
except Exception as exc:
    problems.append(f"import nixl: {type(exc).__name__}: {exc}")
# Optional: the Mooncake transfer engine (the CUDA build, mooncake-transfer-engine, on a GPU
# host; its step is skipped where it does not import, without failing the check).
from importlib import metadata
for dist in ("mooncake-transfer-engine", "mooncake-transfer-engine-non-cuda"):
    try:
        info["mooncake"] = f"{dist} {metadata.version(dist)}"
        break
    except metadata.PackageNotFoundError:
        info["mooncake"] = None
try:
    import twin
    info["twin"] = twin.__version__
    info["twin_path"] = twin.__file__
except Exception as exc:
    problems.append(f"import twin: {exc}")
try:
    import torch
    info["torch_cuda"] = torch.version.cuda
    info["cuda_available"] = torch.cuda.is_available()
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info["gpu"] = {"name": p.name, "memory_gib": round(p.total_memory / 2**30, 1),
                       "capability": list(torch.cuda.get_device_capability(0)),
                       "count": torch.cuda.device_count(),
                       "multiprocessors": p.multi_processor_count}
    elif device == "cuda":
        problems.append("no CUDA device visible to torch")
except Exception as exc:
    problems.append(f"torch: {exc}")
try:
    info["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                    text=True, timeout=10).stdout.strip() or None
except (OSError, subprocess.TimeoutExpired):
    info["commit"] = None
if shutil.which("nvidia-smi"):
    run = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                          "--format=csv,noheader"], capture_output=True, text=True, timeout=30)
    info["nvidia_smi"] = (run.stdout or run.stderr).strip()
info["problems"] = problems
print(json.dumps(info, indent=2))
open(path, "w").write(json.dumps(info, indent=2))
sys.exit(1 if problems else 0)
"""


@dataclass
class Step:
    """One subprocess of the check and how to judge it."""

    name: str
    argv: list[str]
    timeout_s: float
    kind: str = "plain"  # plain | pytest | bench | hw | replay | calibrate | env | install
    env: dict[str, str] = field(default_factory=dict)
    artifact: str | None = None  # a file the step writes (JSON, JUnit XML)
    needs: tuple[str, ...] = ()  # earlier steps that must have passed
    # A module that must import for the step to run; where it does not, the step is skipped
    # and does not fail the check (an optional part of the host, such as the Mooncake engine).
    optional: str | None = None
    # Python code run (``python -c CODE DEVICE``) once ``optional`` imports: a non-zero exit
    # skips the step the same way, the last line it printed (else of stderr) the reason.
    probe: str | None = None


@dataclass
class Outcome:
    name: str
    status: str  # pass | fail | timeout | skipped
    rc: int | None
    seconds: float
    timeout_s: float
    log: str
    reason: str = ""
    result: dict[str, Any] = field(default_factory=dict)
    optional: bool = False  # skipped for want of an optional module: not a failure

    @property
    def ok(self) -> bool:
        return self.status == "pass" or (self.optional and self.status == "skipped")


def _steps(args: argparse.Namespace, work: Path, site: Path, wheels: list[Path]) -> list[Step]:
    py = sys.executable
    cuda = args.device == "cuda"
    pytest = [py, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider"]
    steps: list[Step] = []
    if wheels:
        steps.append(Step("install", [py, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                                      "--no-compile", "--no-cache-dir", "--upgrade",
                                      "--disable-pip-version-check", "--target", str(site),
                                      *map(str, wheels)], 120, kind="install"))
    steps.append(Step("environment", [py, "-c", ENV_SCRIPT, args.device, str(work / "env.json")],
                      90, kind="env", artifact="env.json"))
    kernel_tests = ["tests/hw/test_kernels.py", "tests/hw/test_triton_kernels.py",
                    "tests/hw/test_kvpattern.py"]
    steps.append(Step("kernels", [*pytest, *kernel_tests, "--junitxml",
                                  str(work / "kernels.xml")],
                      180 if cuda else 150, kind="pytest", artifact="kernels.xml",
                      needs=("environment",)))
    # Two processes, one device: VRAM to VRAM goes through UCX's CUDA IPC transport on a GPU.
    steps.append(Step("nixl-transfer", [*pytest, "-s", "tests/hw/test_nixl_transport.py",
                                        "-k", "cuda" if cuda else "shm-cpu and not noshm",
                                        "--junitxml", str(work / "nixl.xml")],
                      120, kind="pytest", artifact="nixl.xml", needs=("environment",),
                      env={"UCX_PROTO_INFO": "y"} if cuda else {}))
    workload = ("poisson:n=24,rate=40,input=1500,output=4,seed=5" if cuda
                else "poisson:n=8,rate=40,input=600,output=4,seed=5")
    gpus = ["--prefill-gpus", "0,0", "--decode-gpus", "0"] if cuda else []
    # The check is about the data path. A writer's STAGING_REQ that trails its chunk (its own
    # socket, overtaken on a loaded host) wedges the ring as it would in SGLang; the fix keeps
    # that protocol race out of the verdict (docs/defects.md).
    hw_args = [*gpus, "--fix", "drop-late-staging-req"]
    trace = args.out / "hw-run.jsonl.gz"
    steps.append(Step("twin-hw", [py, "-m", "twin", "hw", "--config", HW_CONFIG, "--device",
                                  args.device, *hw_args, "--workload", workload, "--timeout", "90",
                                  "--json", "--trace-out", str(trace)],
                      150, kind="hw", needs=("environment",)))
    steps.append(Step("replay", [py, "-m", "twin", "replay", str(trace), "--json"], 60,
                      kind="replay", needs=("twin-hw",)))
    if cuda:
        kern = ["--device", "cuda", "--repeat", "20"]
        xfer = ["--sizes-mib", "4", "16", "64", "--repeat", "10"]
        staged = ["--sizes-mib", "4", "16", "64", "--repeat", "10"]
    else:
        kern = ["--device", "cpu", "--repeat", "3", "--layers", "4", "--tokens", "64"]
        xfer = ["--sizes-mib", "1", "4", "--repeat", "3"]
        staged = ["--sizes-mib", "4", "--repeat", "3"]
    steps.append(Step("bench-kernels", [py, "benchmarks/bench_kernels.py", *kern, "--json",
                                        str(work / "bench_kernels.json")],
                      90, kind="bench", artifact="bench_kernels.json", needs=("environment",)))
    steps.append(Step("bench-transfer", [py, "benchmarks/bench_transfer.py", "--device",
                                         args.device, "--modes", "shm", *xfer, "--json",
                                         str(work / "bench_transfer.json")],
                      90, kind="bench", artifact="bench_transfer.json", needs=("environment",)))
    steps.append(Step("bench-staged", [py, "benchmarks/bench_staged.py", "--device", args.device,
                                       *staged, "--json", str(work / "bench_staged.json")],
                      120, kind="bench", artifact="bench_staged.json", needs=("environment",)))
    # Mooncake (SGLang's default backend) where its engine imports: the CUDA build on a GPU
    # host. A PP2 prefill on it (each stage's rank writes its layer slots; Mooncake is the only
    # backend SGLang stages PP on), DRAM staging (the twin registers DRAM with the engine),
    # Mooncake forced as the data mover so that a broken engine fails instead of falling back.
    mc = "--disaggregation-transfer-backend mooncake"
    steps.append(Step("mooncake", [py, "-m", "twin", "hw", "--config", HW_CONFIG, "--device",
                                   "cpu", "--prefill-args", f"--tp-size 2 --pp-size 2 {mc}",
                                   "--decode-args", f"--tp-size 1 {mc}", "--fix",
                                   "drop-late-staging-req", "--workload",
                                   "poisson:n=8,rate=40,input=600,output=4,seed=5", "--timeout",
                                   "90", "--json"],
                      150, kind="hw", needs=("environment",),
                      env={"TWIN_HW_TRANSPORT": "mooncake"}, optional="mooncake.engine"))
    # VRAM to VRAM between two processes on the GPU through the Mooncake engine (its protocol:
    # TWIN_MOONCAKE_PROTOCOL, default tcp), the target checking every byte: only where the
    # engine is built with CUDA and registers a CUDA page, else skipped with the reason.
    steps.append(Step("mooncake-vram", [py, "benchmarks/bench_transfer.py", "--device",
                                        args.device, "--modes", "mooncake", "--sizes-mib", "4",
                                        "16", "64", "--repeat", "5", "--json",
                                        str(work / "bench_mooncake_vram.json")],
                      90, kind="bench", artifact="bench_mooncake_vram.json",
                      needs=("environment",), optional="mooncake.engine",
                      probe=MOONCAKE_VRAM_PROBE))
    # Calibration last, so a slow fit cannot starve the checks above: a second run on another
    # workload, the cost model fitted to the first run, and its timings against the second.
    workload_b = ("poisson:n=24,rate=20,input=800,output=4,seed=7" if cuda
                  else "poisson:n=8,rate=20,input=400,output=4,seed=7")
    trace_b = args.out / "hw-run-b.jsonl.gz"
    costs = args.out / "costs.toml"
    steps.append(Step("twin-hw-b", [py, "-m", "twin", "hw", "--config", HW_CONFIG, "--device",
                                    args.device, *hw_args, "--workload", workload_b, "--timeout",
                                    "90", "--json", "--trace-out", str(trace_b)],
                      150, kind="hw", needs=("environment",)))
    steps.append(Step("calibrate", [py, "-m", "twin", "calibrate", str(trace), "-o", str(costs),
                                    "--json"],
                      120, kind="calibrate", needs=("twin-hw",)))
    steps.append(Step("calibrated-replay", [py, "-m", "twin", "replay", str(trace_b), "--config",
                                            str(costs), "--json"],
                      60, kind="replay", needs=("twin-hw-b", "calibrate")))
    if args.steps:
        unknown = set(args.steps) - {s.name for s in steps}
        if unknown:
            raise SystemExit(f"unknown step(s) {sorted(unknown)}; "
                             f"steps: {', '.join(s.name for s in steps)}")
        steps = [s for s in steps if s.name in args.steps or s.kind in ("install", "env")]
    return steps


def _run(step: Step, env: dict[str, str], timeout_s: float, log: Path) -> tuple[int | None, bool,
                                                                                 float, str]:
    """Run one step in its own session; kill the whole group at its limit."""
    t0 = time.monotonic()
    with open(log, "w") as out, open(log.with_suffix(".stdout"), "w") as stdout:
        out.write(f"$ {' '.join(step.argv)}\n")
        out.flush()
        # The JSON printed by twin hw / twin replay is read from stdout alone; the other
        # steps keep the order of their output by sending both streams to one file.
        proc = subprocess.Popen(step.argv, cwd=REPO, env=env, stdout=stdout,
                                stderr=out if step.kind in JSON_KINDS else subprocess.STDOUT,
                                start_new_session=True)
        timed_out = False
        try:
            rc: int | None = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            for sig in (signal.SIGTERM, signal.SIGKILL):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, sig)
                try:
                    proc.wait(timeout=10)
                    break
                except subprocess.TimeoutExpired:
                    continue
            rc = proc.returncode
    seconds = time.monotonic() - t0
    text = log.with_suffix(".stdout").read_text(errors="replace")
    with open(log, "a") as out:
        out.write(("\n--- stdout ---\n" if step.kind in JSON_KINDS else "") + text)
        out.write(f"\n--- exit {rc}{' (time limit)' if timed_out else ''} after "
                  f"{seconds:.1f} s ---\n")
    return rc, timed_out, seconds, text


def _junit(path: Path) -> dict[str, int]:
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    for s in suites:
        for key in counts:
            counts[key] += int(s.get(key, 0))
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    return counts


def _json_from(text: str) -> dict[str, Any]:
    """The last JSON object a command printed at the start of a line (log lines around it, from
    the command or the processes it started, are skipped)."""
    decoder = json.JSONDecoder()
    starts = [0] if text.startswith("{") else []
    starts += [m.start() + 1 for m in re.finditer(r"\n\{", text)]
    found = None
    for pos in starts:
        try:
            obj, _ = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            continue
        if isinstance(obj, dict):
            found = obj
    if found is None:
        raise ValueError("no JSON object in the output")
    return found


def _ratios(name: str, data: Any) -> dict[str, Any]:
    if name == "bench-kernels":
        return {"backend": data["backend"],
                "kernel_over_copy": {r["op"]: round(r["ratio"], 3) for r in data["rows"]}}
    if name == "bench-transfer":
        return {"nixl_over_memcpy": {
            f"{int(n) >> 20}MiB": round(data["shm"][n]["gbps_median"]
                                        / data["memcpy"][n]["gbps_median"], 3)
            for n in data["shm"]},
            "nixl_gbps": {f"{int(n) >> 20}MiB": round(v["gbps_median"], 2)
                          for n, v in data["shm"].items()}}
    if name == "mooncake-vram":
        rows = data["mooncake"]
        return {"protocol": data.get("mooncake_protocol"),
                "gbps": {f"{int(n) >> 20}MiB": round(v["gbps_median"], 2)
                         for n, v in rows.items()},
                "over_memcpy": {f"{int(n) >> 20}MiB": round(v["gbps_median"]
                                                            / data["memcpy"][n]["gbps_median"], 3)
                                for n, v in rows.items()}}
    if name == "bench-staged":
        return {"staged_over_raw": {f"{r['bytes'] >> 20}MiB": round(r["staged_ratio"], 3)
                                    for r in data},
                "scatter_over_copy": {f"{r['bytes'] >> 20}MiB": round(r["scatter_ratio"], 3)
                                      for r in data}}
    return {}


def _judge(step: Step, rc: int | None, timed_out: bool, stdout: str, work: Path,
           device: str) -> tuple[str, str, dict[str, Any]]:
    """``(status, reason, result)`` from what the step left behind."""
    if timed_out:
        return "timeout", f"killed at its {step.timeout_s:g} s limit", {}
    result: dict[str, Any] = {}
    try:
        if step.kind == "pytest":
            result = _junit(work / str(step.artifact))
            if result["failures"] or result["errors"]:
                return "fail", f"{result['failures']} failed, {result['errors']} errors", result
            if result["passed"] == 0:
                return "fail", "no test ran", result
            if device == "cuda" and result["skipped"]:
                return "fail", f"{result['skipped']} skipped on CUDA (see the log's -rs lines)", \
                    result
        elif step.kind == "env":
            result = json.loads((work / "env.json").read_text())
            if result.get("problems"):
                return "fail", "; ".join(result["problems"]), result
        elif step.kind == "bench":
            data = json.loads((work / str(step.artifact)).read_text())
            if not data:
                return "fail", "the benchmark wrote no rows", result
            result = _ratios(step.name, data)
        elif step.kind == "hw":
            s = _json_from(stdout)
            keys = ("status", "requests", "completed", "verified", "failed", "unfinished",
                    "wedged", "corrupted", "errors", "notes", "diagnosis", "corruption",
                    "sim_seconds", "wall_seconds", "latency")
            result = {k: s.get(k) for k in keys}
            wrong = []
            if s.get("status") != "completed":
                wrong.append(f"status {s.get('status')!r}")
            n = s.get("requests") or 0
            if n <= 0:
                wrong.append("no requests")
            for key in ("completed", "verified"):
                if s.get(key) != n:
                    wrong.append(f"{key} {s.get(key)} of {n}")
            for key in ("failed", "unfinished"):
                if s.get(key):
                    wrong.append(f"{key} {s[key]}")
            for key in ("wedged", "corrupted"):
                if s.get(key):
                    wrong.append(key)
            if s.get("errors"):
                wrong.append(f"errors: {s['errors'][:3]}")
            if wrong:
                return "fail", "; ".join(wrong), result
        elif step.kind == "calibrate":
            s = _json_from(stdout)
            result = {k: s.get(k) for k in ("params", "scales", "traces", "out")}
            if not s.get("params"):
                return "fail", "calibration wrote no parameters", result
        elif step.kind == "replay":
            s = _json_from(stdout)
            result = {k: s.get(k) for k in ("status", "same_outcome", "divergence", "timing")}
            if not s.get("same_outcome") or s.get("status") != "completed":
                return "fail", f"replay: status {s.get('status')!r}, same outcome " \
                    f"{s.get('same_outcome')}, divergence {s.get('divergence')}", result
    except (OSError, ValueError, KeyError, TypeError, ET.ParseError) as exc:
        return "fail", f"cannot read the step's result: {type(exc).__name__}: {exc}", result
    if rc != 0:
        return "fail", f"exit code {rc}", result
    return "pass", "", result


def _absent(step: Step, env: dict[str, str], device: str = "cuda") -> str | None:
    """Why an optional step cannot run here (its module does not import, or its probe,
    given ``device``, exits non-zero), or None."""
    if step.optional is None:
        return None
    try:
        probe = subprocess.run([sys.executable, "-c", f"import {step.optional}"], cwd=REPO,
                               env=env, capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        return f"optional: importing {step.optional} took over 60 s"
    if probe.returncode != 0:
        last = (probe.stderr.strip().splitlines() or ["?"])[-1]
        return f"optional: {step.optional} does not import here ({last})"
    if step.probe is None:
        return None
    try:
        probe = subprocess.run([sys.executable, "-c", step.probe, device], cwd=REPO, env=env,
                               capture_output=True, text=True, timeout=90)
    except subprocess.TimeoutExpired:
        return "optional: its probe took over 90 s"
    if probe.returncode == 0:
        return None
    out = (probe.stdout.strip() or probe.stderr.strip()).splitlines() or ["?"]
    return f"optional: {out[-1]}"


def _pack(out: Path, work: Path, outcomes: list[Outcome]) -> None:
    with open(out / "steps.log", "w") as combined:
        for o in outcomes:
            combined.write(f"\n===== {o.name}: {o.status} ({o.seconds:.1f} s) {o.reason}\n")
            path = work / o.log
            if path.exists():
                combined.write(path.read_text(errors="replace"))
    with tarfile.open(out / "steps.tar.gz", "w:gz") as tar:
        for path in sorted(work.iterdir()):
            if path.suffix != ".stdout":
                tar.add(path, arcname=f"steps/{path.name}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--out", type=Path, default=None, help="output folder (default: $OUT, "
                    "else a new temporary folder)")
    ap.add_argument("--budget", type=float, default=480.0,
                    help="seconds for the whole check; steps share it (default: 480)")
    ap.add_argument("--wheels", type=Path, default=REPO / ".whl",
                    help="folder of wheels to install first (default: .whl, if present)")
    ap.add_argument("--site", type=Path, default=Path(os.environ.get("GPU_CHECK_SITE",
                                                                    "/tmp/site")),
                    help="where the wheels are installed (default: $GPU_CHECK_SITE or /tmp/site)")
    ap.add_argument("--steps", nargs="+", default=None,
                    help="run only these steps (install and environment always run)")
    args = ap.parse_args(argv)
    t0 = time.monotonic()
    deadline = t0 + args.budget
    if args.out is None:
        args.out = Path(os.environ["OUT"]) if os.environ.get("OUT") else \
            Path(tempfile.mkdtemp(prefix="gpu-check-"))
    args.out = args.out.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="gpu-check-steps-"))
    wheels = sorted(args.wheels.glob("*.whl")) if args.wheels.is_dir() else []
    if wheels and sys.version_info[:2] != (3, 12):
        print(f"gpu check: the wheels in {args.wheels} are for CPython 3.12, this is "
              f"{sys.version.split()[0]}: using the packages already installed", flush=True)
        wheels = []
    env = dict(os.environ, NIXL_LOG_LEVEL=os.environ.get("NIXL_LOG_LEVEL", "WARN"),
               PYTHONUNBUFFERED="1")
    env.pop("TWIN_KERNELS", None)  # the check picks backends itself (auto: Triton on CUDA)
    path = [str(REPO)] + ([str(args.site)] if wheels else [])
    env["PYTHONPATH"] = os.pathsep.join(path + [p for p in [os.environ.get("PYTHONPATH")] if p])

    print(f"gpu check: device {args.device}, budget {args.budget:g} s, output {args.out}",
          flush=True)
    outcomes: list[Outcome] = []
    passed: set[str] = set()
    for i, step in enumerate(_steps(args, work, args.site, wheels)):
        log = f"{i:02d}-{step.name}.log"
        left = deadline - time.monotonic()
        missing = [n for n in step.needs if n not in passed]
        absent = None if missing or left < 15 else _absent(step, {**env, **step.env},
                                                           args.device)
        if absent is not None:
            (work / log).write_text(f"not run: {absent}\n")
            outcomes.append(Outcome(step.name, "skipped", None, 0.0, step.timeout_s, log,
                                    absent, optional=True))
        elif missing or left < 15:
            reason = (f"needs {', '.join(missing)}" if missing else
                      f"only {max(left, 0):.0f} s of the budget left")
            (work / log).write_text(f"not run: {reason}\n")
            outcomes.append(Outcome(step.name, "skipped", None, 0.0, step.timeout_s, log, reason))
        else:
            limit = min(step.timeout_s, left - 5)
            rc, timed_out, seconds, stdout = _run(step, {**env, **step.env}, limit, work / log)
            step.timeout_s = limit
            status, reason, result = _judge(step, rc, timed_out, stdout, work, args.device)
            outcomes.append(Outcome(step.name, status, rc, round(seconds, 2), round(limit, 1),
                                    log, reason, result))
            if status == "pass":
                passed.add(step.name)
        o = outcomes[-1]
        print(f"  {o.name:<17} {o.status:<8} {o.seconds:7.1f} s  {o.reason}", flush=True)

    ok = all(o.ok for o in outcomes)
    summary = {
        "version": SUMMARY_VERSION,
        "passed": ok,
        "device": args.device,
        "wall_s": round(time.monotonic() - t0, 1),
        "budget_s": args.budget,
        "wheels": [w.name for w in wheels],
        "environment": next((o.result for o in outcomes if o.name == "environment"), {}),
        "failed_steps": [o.name for o in outcomes if not o.ok],
        "steps": [{k: v for k, v in vars(o).items()} for o in outcomes],
        "hw_run": next((o.result for o in outcomes if o.name == "twin-hw"), {}),
        "mooncake_run": next((o.result for o in outcomes if o.name == "mooncake"), {}),
        "mooncake_vram": next((o.result for o in outcomes if o.name == "mooncake-vram"), {}),
        "ratios": {o.name: o.result for o in outcomes if o.name.startswith("bench-")},
    }
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2))
    _pack(args.out, work, outcomes)
    print(f"GPU CHECK ({args.device}): {'PASS' if ok else 'FAIL'} in {summary['wall_s']} s; "
          f"summary {args.out / 'summary.json'}, logs {args.out / 'steps.log'}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
