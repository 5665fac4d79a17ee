"""Sweep throughput (points per minute) of each executor on the same sweep.

    python benchmarks/bench_sweep.py                      # 1 and 2 local workers, local Ray
    python benchmarks/bench_sweep.py --ray-cluster        # ... and a 2-node Ray cluster on
                                                          #     this host (two `ray start`)
    python benchmarks/bench_sweep.py --points 8 --quick   # a smoke run
    python benchmarks/bench_sweep.py --workload ../shared/traces/mooncake/synthetic_trace.jsonl \
        --first-n 300                                     # heavier points (a trace cut)

The sweep is ring size x chunked_prefill_size x seeds on the ring-sizing notebook's deployment
(prefill TP4 -> decode TP2, small GQA model, shared-prefix traffic), or any workload given with
``--workload``. Every mode starts from an empty result file and includes its start-up (process
spawn, Ray start, shipping the job) in the wall time. The one-worker run is the baseline: the
ratio column is each mode's throughput over it; "after start" is the throughput once the
executor is up. The load average is printed because the machine may be shared.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from twin.advise import Base, Job, ResultsFile, grid, parse_axis  # noqa: E402
from twin.advise.executors import RayExecutor, make_executor  # noqa: E402
from twin.advise.sweep import run_sweep  # noqa: E402
from twin.core.config import ServerSide, TwinConfig  # noqa: E402
from twin.sim.scenarios import SMALL  # noqa: E402
from twin.workloads import Workload, parse_workload_spec, shared_prefix  # noqa: E402

RAY_PORT = 6391


def _job(spec: str | None, first_n: int | None) -> Job:
    cfg = TwinConfig(model=SMALL, prefill=ServerSide(tp_size=4), decode=ServerSide(tp_size=2),
                     chunked_prefill_size=2048, page_size=16, staging_pool_size_mb=64)
    wl = parse_workload_spec(spec) if spec else shared_prefix(4, 8, 4096, 512, 64,
                                                              rate_per_s=20.0, seed=7)
    if first_n:
        wl = Workload(wl.name, wl.requests[:first_n], wl.source)
    return Job(Base(cfg=cfg, horizon_s=30.0), wl)


def _measure(name: str, job: Job, points, make) -> dict[str, object]:  # type: ignore[no-untyped-def]
    tmp = Path(tempfile.mkdtemp())
    load0 = os.getloadavg()[0]
    startup = [0.0]

    def timed_make():  # type: ignore[no-untyped-def]
        t0 = time.perf_counter()
        ex = make()
        startup[0] = time.perf_counter() - t0
        return ex

    with ResultsFile(tmp / "r.csv", ["staging_pool_size_mb", "chunked_prefill_size"]) as res:
        report = run_sweep(job, points, res, timed_make, progress=False)
    shutil.rmtree(tmp, ignore_errors=True)
    steady = report.wall_s - startup[0]
    return {"mode": name, "points": report.ran, "wall_s": report.wall_s,
            "ppm": report.points_per_min, "startup": startup[0],
            "steady": 60 * report.ran / steady if steady > 0 else 0.0,
            "load": (load0 + os.getloadavg()[0]) / 2}


def _ray_node(*args: str) -> subprocess.Popen[bytes]:
    """``ray start --block ARGS`` in the foreground: terminating it stops that node's
    processes (and only those)."""
    exe = shutil.which("ray") or str(Path(sys.executable).parent / "ray")
    return subprocess.Popen([exe, "start", "--block", *args], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)


def _wait_for_cpus(address: str, want: int, timeout_s: float = 120) -> None:
    import ray

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            ray.init(address=address, include_dashboard=False, log_to_driver=False)
            cpus = ray.cluster_resources().get("CPU", 0)
            ray.shutdown()
            if cpus >= want:
                return
        except Exception:
            pass
        time.sleep(2)
    raise RuntimeError(f"the Ray cluster at {address} did not reach {want} CPUs")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", default=None, help="workload spec or trace (default: the "
                                                     "notebook's shared-prefix traffic)")
    ap.add_argument("--first-n", type=int, default=None, help="keep the first N requests")
    ap.add_argument("--points", type=int, default=24, help="points per mode (default 24)")
    ap.add_argument("--quick", action="store_true", help="1 and 2 local workers only")
    ap.add_argument("--ray-cluster", action="store_true",
                    help="also start a 2-node Ray cluster on this host (1 CPU per node)")
    args = ap.parse_args()
    job = _job(args.workload, args.first_n)
    rings = parse_axis("ring_mb=4,6,8,12,16,24,32,64")
    cps = parse_axis("cps=512,1024,2048")
    points = grid([rings, cps], tuple(range(8)))[: args.points]
    print(f"{len(points)} points per mode; {os.cpu_count()} CPUs; workload "
          f"{job.workload.name} ({len(job.workload.requests)} requests)")
    results = [_measure("local, 1 worker", job, points, lambda: make_executor(job, "local", 1)),
               _measure("local, 2 workers", job, points, lambda: make_executor(job, "local", 2))]
    try:
        import ray  # noqa: F401
        have_ray = True
    except ImportError:
        have_ray = False
        print("ray is not installed: pip install 'staging-twin[ray]' to measure it")
    if have_ray and not args.quick:
        results.append(_measure("ray, local instance, 2 CPUs", job, points,
                                lambda: RayExecutor(job, num_cpus=2)))
    if have_ray and args.ray_cluster:
        address = f"127.0.0.1:{RAY_PORT}"
        nodes = [_ray_node("--head", f"--port={RAY_PORT}", "--num-cpus=1",
                           "--include-dashboard=false")]
        try:
            time.sleep(5)
            nodes.append(_ray_node(f"--address={address}", "--num-cpus=1"))
            _wait_for_cpus(address, 2)
            results.append(_measure("ray, 2-node cluster (ray start x2)", job, points,
                                    lambda: RayExecutor(job, address=address)))
        finally:
            for node in reversed(nodes):
                node.terminate()
                try:
                    node.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    node.kill()
    one = results[0]["ppm"] or 1.0
    print(f"\n{'mode':38s} {'points':>6s} {'wall s':>7s} {'start s':>7s} {'points/min':>10s} "
          f"{'vs 1':>5s} {'after start':>11s} {'load avg':>8s}")
    for r in results:
        print(f"{r['mode']:38s} {r['points']:>6d} {r['wall_s']:>7.1f} {r['startup']:>7.1f} "
              f"{r['ppm']:>10.1f} {r['ppm'] / one:>5.2f} {r['steady']:>11.1f} {r['load']:>8.1f}")


if __name__ == "__main__":
    main()
