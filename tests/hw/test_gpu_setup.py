"""The one-GPU check's set-up path, proved without a GPU.

The GPU host has CPython 3.12 with torch 2.11 (CUDA 13), Triton 3.6, numpy, pytest, hypothesis,
click, tqdm and matplotlib, and nothing else: no registry, no project virtualenv. The slow test
builds a virtualenv of CPython 3.12 holding just that (the registry's torch 2.11 wheel is the
CUDA 13 build, as on the GPU host; no CPU-only torch 2.11 wheel for 3.12 is reachable here, and
the CUDA build runs on a CPU host), downloads the wheels with ``scripts/gpu_wheels.sh``, and runs
``scripts/gpu_check.sh --device cpu`` in it: the check installs the wheels with ``pip --target``
exactly as on the GPU host and runs every step without CUDA. A missing wheel, a dependency the
image lacks or a broken entry point fails here. The virtualenv (about 5 GB, a minute or two to
build) is cached under ``~/.cache/staging-twin/`` keyed by the interpreter and the requirement
list; without a CPython 3.12 the test is skipped.

The fast tests check that the check's judgement cannot pass on a failure.
"""

from __future__ import annotations

import glob
import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
# What the GPU image holds that the project uses (versions where they matter to the check).
IMAGE_REQUIREMENTS = ("torch==2.11.0", "triton==3.6.0", "numpy", "pytest", "hypothesis", "click",
                      "tqdm", "matplotlib")
VENV_FORMAT = 1
STEPS = ["install", "environment", "kernels", "nixl-transfer", "twin-hw", "replay",
         "bench-kernels", "bench-transfer", "bench-staged", "mooncake", "mooncake-vram",
         "twin-hw-b", "calibrate", "calibrated-replay"]
#: Steps that run only where an optional module imports (the image has no Mooncake engine)
#: and, for the VRAM one, where its probe passes (a CUDA build of the engine on a GPU).
OPTIONAL = {"mooncake", "mooncake-vram"}


def _load_check() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_check", REPO / "scripts" / "gpu_check.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _python312() -> str | None:
    candidates = sorted(glob.glob(os.path.expanduser("~/.pyenv/versions/3.12*/bin/python3.12")))
    which = shutil.which("python3.12")
    for exe in [*reversed(candidates), *([which] if which else [])]:
        try:
            out = subprocess.run([exe, "-c", "import sys, venv; print(sys.version_info[:2])"],
                                 capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            continue
        if out.returncode == 0 and out.stdout.strip() == "(3, 12)":
            return exe
    return None


def _image_venv(python: str) -> Path:
    """A cached virtualenv holding only what the GPU image holds."""
    version = subprocess.run([python, "-c", "import sys; print(sys.version)"],
                             capture_output=True, text=True, check=True).stdout.strip()
    key = hashlib.sha256(json.dumps([VENV_FORMAT, version, IMAGE_REQUIREMENTS]).encode())
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "staging-twin"
    venv = cache / f"gpu-image-py312-{key.hexdigest()[:16]}"
    if (venv / ".ready").exists():
        return venv
    build = cache / f"{venv.name}.build-{os.getpid()}"
    shutil.rmtree(build, ignore_errors=True)
    build.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run([python, "-m", "venv", str(build)], check=True, timeout=300)
    subprocess.run([str(build / "bin" / "python"), "-m", "pip", "install", "--quiet",
                    "--disable-pip-version-check", *IMAGE_REQUIREMENTS], check=True, timeout=1500)
    (build / ".ready").write_text("\n".join(IMAGE_REQUIREMENTS) + "\n")
    try:
        build.rename(venv)
    except OSError:  # built by a concurrent run meanwhile
        shutil.rmtree(build, ignore_errors=True)
    return venv


@pytest.mark.slow
@pytest.mark.hw
def test_gpu_check_set_up_path_on_cpu(tmp_path: Path) -> None:
    python = _python312()
    if python is None:
        pytest.skip("no CPython 3.12 on this machine (the GPU host's Python)")
    venv_python = _image_venv(python) / "bin" / "python"
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "VIRTUAL_ENV", "TWIN_KERNELS", "OUT", "PYTHONHOME")}

    wheels = tmp_path / "whl"
    got = subprocess.run(["scripts/gpu_wheels.sh"], cwd=REPO, capture_output=True, text=True,
                         timeout=600, env={**env, "PYTHON": sys.executable,
                                           "WHEEL_DIR": str(wheels)})
    assert got.returncode == 0, got.stdout[-3000:] + got.stderr[-3000:]
    wanted = [line.split("#")[0].strip() for line in
              (REPO / "scripts" / "gpu-wheels.txt").read_text().splitlines()]
    assert f"ready: {sum(bool(w) for w in wanted)} wheels" in got.stdout, got.stdout
    assert any(w.name.startswith("nixl_cu13-") and "cp312" in w.name for w in wheels.iterdir())

    # The image has none of these: the check must bring them itself.
    bare = subprocess.run([str(venv_python), "-c", "import zmq"], capture_output=True, env=env)
    assert bare.returncode != 0

    out, site = tmp_path / "out", tmp_path / "site"
    run = subprocess.run(["scripts/gpu_check.sh", "--device", "cpu", "--out", str(out),
                          "--wheels", str(wheels), "--site", str(site), "--budget", "420"],
                         cwd=REPO, capture_output=True, text=True, timeout=480,
                         env={**env, "PYTHON": str(venv_python)})
    summary_path = out / "summary.json"
    assert summary_path.exists(), run.stdout[-3000:] + run.stderr[-3000:]
    summary: dict[str, Any] = json.loads(summary_path.read_text())
    log = (out / "steps.log").read_text()
    assert run.returncode == 0 and summary["passed"], (run.stdout, log[-8000:])

    assert summary["device"] == "cpu" and summary["failed_steps"] == []
    steps = {s["name"]: s for s in summary["steps"]}
    assert [s["name"] for s in summary["steps"]] == STEPS
    assert all(s["status"] == "pass" and s["rc"] == 0 for s in summary["steps"]
               if s["name"] not in OPTIONAL), steps
    mc = steps["mooncake"]
    assert mc["status"] == "pass" or (mc["status"] == "skipped" and mc["optional"]), mc
    envr = summary["environment"]
    assert envr["python"].startswith("3.12.") and envr["torch"].startswith("2.11.0")
    assert envr["torch_cuda"].startswith("13.") and envr["cuda_available"] is False
    assert envr["nixl_flavour"] == "nixl_cu13._api"
    assert envr["nixl_module"].startswith(str(site)), envr  # from the carried wheel
    assert envr["twin_path"].startswith(str(REPO)) and envr["problems"] == []
    for name in ("kernels", "nixl-transfer"):
        counts = steps[name]["result"]
        assert counts["passed"] > 0 and counts["failures"] == counts["errors"] == 0, counts
    hw = summary["hw_run"]
    assert hw["status"] == "completed" and hw["requests"] > 0
    assert hw["completed"] == hw["verified"] == hw["requests"]
    assert steps["replay"]["result"]["same_outcome"] is True
    ratios = summary["ratios"]
    assert ratios["bench-kernels"]["backend"] == "torch"
    assert set(ratios["bench-staged"]["staged_over_raw"]) == {"4MiB"}
    assert ratios["bench-transfer"]["nixl_gbps"]["4MiB"] > 0

    for name in STEPS:
        assert f"===== {name}: pass" in log or name in OPTIONAL
    with tarfile.open(out / "steps.tar.gz") as tar:
        names = tar.getnames()
    assert len([n for n in names if n.endswith(".log")]) == len(STEPS)
    assert {"steps/kernels.xml", "steps/env.json", "steps/bench_staged.json"} <= set(names)
    assert (out / "hw-run.jsonl.gz").stat().st_size > 0
    assert len(list(out.iterdir())) <= 8  # few files: summary, logs, archive, trace


# --------------------------------------------------------------------------- the judgement


def _step(check: ModuleType, kind: str, artifact: str | None = None) -> Any:
    return check.Step("s", ["true"], 10, kind=kind, artifact=artifact)


HW_OK = {"status": "completed", "requests": 4, "completed": 4, "verified": 4, "failed": 0,
         "unfinished": 0, "wedged": False, "corrupted": False, "errors": []}


def test_hw_verdict_requires_every_request_completed_and_verified(tmp_path: Path) -> None:
    check = _load_check()
    step = _step(check, "hw")
    text = "NIXL INFO something\n" + json.dumps(HW_OK, indent=2)
    assert check._judge(step, 0, False, text, tmp_path, "cuda")[0] == "pass"
    # Every WRITE failed: the protocol fails the rooms by design, the run still exits 0.
    writes_failed = dict(HW_OK, completed=0, verified=0, failed=4)
    status, reason, _ = check._judge(step, 0, False, json.dumps(writes_failed), tmp_path, "cuda")
    assert status == "fail" and "completed 0 of 4" in reason and "failed 4" in reason
    unverified = dict(HW_OK, verified=3)
    assert check._judge(step, 0, False, json.dumps(unverified), tmp_path, "cuda")[0] == "fail"
    assert check._judge(step, 0, False, "Traceback ...", tmp_path, "cuda")[0] == "fail"
    assert check._judge(step, 0, True, json.dumps(HW_OK), tmp_path, "cuda")[0] == "timeout"
    assert check._judge(step, 3, False, json.dumps(HW_OK), tmp_path, "cuda")[0] == "fail"


def test_pytest_steps_need_tests_that_ran_and_no_skip_on_cuda(tmp_path: Path) -> None:
    check = _load_check()
    step = _step(check, "pytest", "r.xml")

    def junit(tests: int, failures: int = 0, skipped: int = 0) -> None:
        (tmp_path / "r.xml").write_text(
            f'<testsuites><testsuite name="pytest" tests="{tests}" failures="{failures}" '
            f'errors="0" skipped="{skipped}"/></testsuites>')

    junit(5)
    assert check._judge(step, 0, False, "", tmp_path, "cuda")[0] == "pass"
    junit(5, skipped=2)
    assert check._judge(step, 0, False, "", tmp_path, "cpu")[0] == "pass"
    assert check._judge(step, 0, False, "", tmp_path, "cuda")[0] == "fail"
    junit(5, skipped=5)
    assert check._judge(step, 0, False, "", tmp_path, "cpu")[1] == "no test ran"
    junit(5, failures=1)
    assert check._judge(step, 1, False, "", tmp_path, "cpu")[0] == "fail"
    (tmp_path / "r.xml").unlink()
    assert check._judge(step, 0, False, "", tmp_path, "cpu")[0] == "fail"


def test_environment_and_benchmark_results_are_read(tmp_path: Path) -> None:
    check = _load_check()
    (tmp_path / "env.json").write_text(json.dumps({"problems": ["import nixl: no module"]}))
    status, reason, _ = check._judge(_step(check, "env", "env.json"), 1, False, "", tmp_path,
                                     "cuda")
    assert status == "fail" and "nixl" in reason
    rows = [{"bytes": 4 << 20, "staged_ratio": 0.9, "scatter_ratio": 0.7}]
    (tmp_path / "b.json").write_text(json.dumps(rows))
    step = check.Step("bench-staged", ["true"], 10, kind="bench", artifact="b.json")
    status, _, result = check._judge(step, 0, False, "", tmp_path, "cuda")
    assert status == "pass" and result["staged_over_raw"] == {"4MiB": 0.9}
    (tmp_path / "b.json").write_text("[]")
    assert check._judge(step, 0, False, "", tmp_path, "cuda")[0] == "fail"


def test_an_optional_step_is_skipped_only_for_want_of_its_module(tmp_path: Path) -> None:
    """The Mooncake step runs where its engine imports; where it does not, the step is
    skipped without failing the check. Once it runs, its verdict counts like any other."""
    check = _load_check()
    env = dict(os.environ)
    absent = check.Step("mooncake", ["true"], 10, kind="hw", optional="no_such_module_here")
    reason = check._absent(absent, env)
    assert reason is not None and "no_such_module_here does not import" in reason
    assert check._absent(check.Step("m", ["true"], 10, kind="hw", optional="json"), env) is None
    assert check._absent(check.Step("m", ["true"], 10, kind="hw"), env) is None
    assert check.Outcome("mooncake", "skipped", None, 0, 10, "l", reason, optional=True).ok
    assert not check.Outcome("twin-hw", "skipped", None, 0, 10, "l", "needs environment").ok
    assert not check.Outcome("mooncake", "fail", 1, 1, 10, "l", "status 'wedged'").ok
    args = type("A", (), {"device": "cuda", "out": tmp_path, "steps": None})()
    steps = {s.name: s for s in check._steps(args, tmp_path, tmp_path, [])}
    mc = steps["mooncake"]
    assert mc.optional == "mooncake.engine" and mc.env == {"TWIN_HW_TRANSPORT": "mooncake"}
    assert "--pp-size 2" in " ".join(mc.argv) and mc.kind == "hw"


def test_the_mooncake_vram_step_runs_only_where_the_engine_registers_vram(
        tmp_path: Path) -> None:
    """Skipped with the reason on ``--device cpu`` and where the engine is built without
    CUDA (the probe is real: it asks the engine installed here); when it runs, its verdict is
    the benchmark's rows (bytes checked by the target) and the bandwidth is reported."""
    check = _load_check()
    env = dict(os.environ, PYTHONPATH=str(REPO))
    for device in ("cpu", "cuda"):
        args = type("A", (), {"device": device, "out": tmp_path, "steps": None})()
        step = {s.name: s for s in check._steps(args, tmp_path, tmp_path, [])}["mooncake-vram"]
        assert step.optional == "mooncake.engine" and step.probe and step.kind == "bench"
        assert "--modes" in step.argv and "mooncake" in step.argv
        assert step.argv[step.argv.index("--device") + 1] == device
    reason = check._absent(step, env, "cpu")
    assert reason is not None and reason.startswith("optional: "), reason
    assert "--device cuda" in reason or "does not import" in reason
    from twin.hw.mooncake_transport import engine_gpu_support

    why = engine_gpu_support()
    if why is not None:  # the engine here cannot register VRAM: skipped saying why
        reason = check._absent(step, env, "cuda")
        assert reason is not None and " ".join(why.split())[:60] in reason, reason
    rows = {str(4 << 20): {"gbps_median": 2.0}}
    (tmp_path / "bench_mooncake_vram.json").write_text(json.dumps(
        {"memcpy": {str(4 << 20): {"gbps_median": 200.0}}, "mooncake": rows,
         "mooncake_protocol": "tcp"}))
    status, _, result = check._judge(step, 0, False, "", tmp_path, "cuda")
    assert status == "pass" and result == {"protocol": "tcp", "gbps": {"4MiB": 2.0},
                                           "over_memcpy": {"4MiB": 0.01}}
    (tmp_path / "bench_mooncake_vram.json").unlink()  # the benchmark failed: no rows
    assert check._judge(step, 1, False, "", tmp_path, "cuda")[0] == "fail"
