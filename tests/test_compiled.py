"""The compiled core (``twin compile``) against the pure-Python reference.

Builds a copy of the package with mypyc once (about two minutes on two cores; where
``scripts/setup.sh`` or ``twin compile`` built this checkout and no source changed since, the
copy takes that build instead of compiling again), then requires:
the compiled modules are the ones imported; every trace of a set of runs covering clean runs,
wedges, corruption, faults and a crash is byte-identical to the pure-Python run's; the core's
and the serving loops' unit tests pass against the compiled modules (the property tests stay
with the pure-Python suite: the byte-identical traces hold the compiled path to them);
``TWIN_PURE_PYTHON=1`` and an edited source both fall back to the sources; ``twin compile
--clean`` removes the build.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from twin import compiled

REPO = Path(__file__).resolve().parents[1]
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                       reason="needs a C compiler"),
]

RUNS = [
    ["--scenario", "default"],
    ["--scenario", "warmup-stall", "--scenario-defects"],
    ["--scenario", "radix-grid", "--fault", "delay:STAGING_REQ:src=p0g0r1:room=0:chunk=0:ms=10"],
    ["--scenario", "completion-race", "--scenario-defects"],
    ["--workload", "poisson:n=200,rate=20,input=3000,output=16,seed=3",
     "--fault", "reorder:WATERMARK:p=0.3", "--fault", "delay:CHUNK_READY:ms=5:p=0.2",
     "--seed", "7"],
    ["--workload", "poisson:n=150,rate=50,input=6000,output=64,seed=1",
     "--fault", "fail-transfer:p=0.05", "--fault", "crash:d0g0r0:at=2"],
    ["--workload", "poisson:n=120,rate=30,input=5000,output=32,seed=2",
     "--prefill-args", "--tp-size 4", "--decode-args", "--tp-size 2",
     "--fix", "multi-target-retry-resume", "--until", "3"],
    ["--workload", "poisson:n=100,rate=40,input=3000,output=8,seed=5", "--config", "@stalls"],
]
STALLS = "[sim]\nprocess_stall_s = 0.004\nprocess_run_s = 0.006\n"  # per-process stalls


def _run(tree: Path, *args: str, pure: bool = False) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "TWIN_PURE_PYTHON"}
    env["PYTHONPATH"] = str(tree)
    if pure:
        env["TWIN_PURE_PYTHON"] = "1"
    return subprocess.run([sys.executable, *args], cwd=tree, env=env, capture_output=True,
                          text=True, timeout=600)


def _status(tree: Path, pure: bool = False) -> str:
    code = ("import twin.compiled as c, twin.core.prefill as p, twin.runtime.runtime as r;"
            "print(c.state().line(), p.__file__.endswith('.py'), r.__file__.endswith('.py'))")
    proc = _run(tree, "-c", code, pure=pure)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tree = tmp_path_factory.mktemp("compiled")
    shutil.copy(REPO / "pyproject.toml", tree)
    if compiled.current():
        # scripts/setup.sh (or twin compile) built this checkout's core and no source changed
        # since: check that build, the one this installation runs, instead of building again.
        shutil.copytree(REPO / "twin", tree / "twin",
                        ignore=shutil.ignore_patterns("__pycache__"))
        return tree
    shutil.copytree(REPO / "twin", tree / "twin",
                    ignore=shutil.ignore_patterns("__pycache__", "*.so", "_compiled.json"))
    # --quick (no C optimisation) halves the build; mypyc's semantics are the same at -O3.
    proc = _run(tree, "-m", "twin", "compile", "--quick")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"built {len(compiled.MODULES) + 1} extension(s)" in proc.stdout
    return tree


def test_the_compiled_modules_are_the_ones_imported(built: Path) -> None:
    assert _status(built).startswith("compiled (mypyc ")
    assert ", -O0)" in _status(built) or ", -O3)" in _status(built)  # --quick, or the set-up's
    assert _status(built).endswith("False False")  # extensions, not sources
    proc = _run(built, "-m", "twin", "--version")
    assert "core: compiled" in proc.stdout
    proc = _run(built, "-m", "twin", "sim", "--until", "0.01")
    assert "\ncore        compiled (mypyc " in proc.stdout, proc.stdout + proc.stderr


@pytest.mark.parametrize("args", RUNS, ids=lambda a: " ".join(a)[:50])
def test_traces_are_byte_identical_to_pure_python(built: Path, tmp_path: Path,
                                                   args: list[str]) -> None:
    stalls = tmp_path / "stalls.toml"
    stalls.write_text(STALLS)
    args = [str(stalls) if a == "@stalls" else a for a in args]
    outs = []
    for pure in (False, True):
        trace = tmp_path / f"{'pure' if pure else 'compiled'}.jsonl"
        proc = _run(built, "-m", "twin", "sim", *args, "--trace-out", str(trace), "--json",
                    pure=pure)
        assert proc.returncode in (0, 3, 4, 5), proc.stderr
        outs.append((proc.returncode, trace.read_bytes(),
                     Path(f"{trace}.idx").read_bytes()))  # its live state included
    assert outs[0][0] == outs[1][0]
    assert outs[0][1] == outs[1][1]
    assert outs[0][2] == outs[1][2]
    assert len(outs[0][1]) > 1000


def test_explore_sees_the_same_transitions_compiled_and_pure(built: Path) -> None:
    """Explore's coverage counts room transitions taken inside compiled ranks too: the same
    trials reach the same keys, every family included, compiled and pure."""
    code = ("import json, random;"
            "from twin.explore.strategies import generate, Strategies;"
            "from twin.explore.oracles import run_trial;"
            "from twin.explore.trial import Base;"
            "from twin.sim.scenarios import SCENARIOS;"
            "sc = SCENARIOS['default'];"
            "base = Base(sc.config, sc.params.replace(wedge_window_s=5.0));"
            "rng = random.Random(3); keys = set();"
            "[keys.update(run_trial(base, generate(rng, base, Strategies())).coverage)"
            " for _ in range(12)];"
            "print(json.dumps(sorted(keys)))")
    seen = []
    for pure in (False, True):
        proc = _run(built, "-c", code, pure=pure)
        assert proc.returncode == 0, proc.stderr[-3000:]
        seen.append(json.loads(proc.stdout))
    assert seen[0] == seen[1]
    assert sum(k.startswith("tr:prefill:") for k in seen[0]) >= 2
    assert sum(k.startswith("tr:decode:") for k in seen[0]) >= 2


def test_unit_tests_pass_against_the_compiled_modules(built: Path) -> None:
    for sub in ("core", "sim", "trace"):
        shutil.copytree(REPO / "tests" / sub, built / "tests" / sub,
                        ignore=shutil.ignore_patterns("__pycache__"))
    # The suite's conftest forces the pure path; this copy must not.
    conftest = (REPO / "tests" / "conftest.py").read_text()
    forced = 'os.environ["TWIN_PURE_PYTHON"] = "1"'
    assert forced in conftest
    (built / "tests" / "conftest.py").write_text(
        conftest.replace(forced, 'os.environ.pop("TWIN_PURE_PYTHON", None)'))
    (built / "tests" / "test_path.py").write_text(
        "import importlib\n"
        "from twin import compiled\n"
        "def test_the_compiled_modules_run():\n"
        "    assert compiled.state().mode == 'compiled', compiled.state().line()\n"
        "    for m in compiled.MODULES:\n"
        "        assert not importlib.import_module(m).__file__.endswith('.py'), m\n")
    shutil.copytree(REPO / "docs", built / "docs")  # a test checks the simulator's doc
    files = [f"tests/core/{name}" for name in (
        "test_prefill.py", "test_decode.py", "test_integrity.py", "test_failpaths.py",
        "test_defects.py", "test_states.py", "test_pickle.py")] + [
        f"tests/sim/{name}" for name in ("test_decode_loop.py", "test_engine.py",
                                          "test_calendar.py")] + [
        "tests/trace/test_parallel.py", "tests/trace/test_encoder.py",
        "tests/trace/test_format.py", "tests/trace/test_damaged.py"] + [
        "tests/test_path.py"]
    proc = _run(built, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=",
                "-k", "not test_sigkill_leaves_readable_trace",  # a minute of killed writers
                *files)
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert " passed" in proc.stdout
    assert _status(built).endswith("False False")


def test_the_set_up_keeps_a_current_build(built: Path) -> None:
    shutil.copytree(REPO / "scripts", built / "scripts", dirs_exist_ok=True)
    before = {p: p.stat().st_mtime_ns for p in (built / "twin").rglob("*.so")}
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    proc = subprocess.run([str(built / "scripts" / "build_core.sh")], cwd=built, text=True,
                          capture_output=True, timeout=600, env={**os.environ, "PATH": path})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("core: compiled (already built for these sources;")
    assert before and before == {p: p.stat().st_mtime_ns for p in (built / "twin").rglob("*.so")}


def test_pure_python_forced_by_the_environment(built: Path) -> None:
    assert _status(built, pure=True) == "pure (TWIN_PURE_PYTHON is set) True True"


def test_an_edited_source_falls_back_to_pure_python_until_cleaned(
        built: Path, tmp_path: Path) -> None:
    tree = tmp_path / "edited"
    shutil.copytree(built, tree, ignore=shutil.ignore_patterns("tests"))
    grid = tree / "twin" / "core" / "grid.py"
    grid.write_text(grid.read_text() + "\n# edited\n")
    line = _status(tree)
    assert line.startswith("pure (compiled build ignored: twin/core/grid.py changed since")
    assert line.endswith("True True")
    proc = _run(tree, "-m", "twin", "compile", "--clean")
    removed = f"removed {len(compiled.MODULES) + 2} compiled file(s)"
    assert proc.returncode == 0 and removed in proc.stdout
    assert not list((tree / "twin").rglob("*.so"))
    assert _status(tree).startswith("pure (not compiled")


def test_an_extension_this_checkout_does_not_compile_is_not_imported(
        built: Path, tmp_path: Path) -> None:
    """An older checkout beside a newer build (the engine was compiled, this checkout's
    ``MODULES`` does not name it): everything runs from source, the stray extension too."""
    tree = tmp_path / "older"
    shutil.copytree(built, tree, ignore=shutil.ignore_patterns("tests"))
    module = tree / "twin" / "compiled.py"
    text = module.read_text()
    assert '    "twin.sim.engine",\n' in text
    module.write_text(text.replace('    "twin.sim.engine",\n', ""))
    line = _status(tree)
    assert line.startswith("pure (compiled build ignored: twin/sim/engine.") and \
        "is not part of this build" in line, line
    assert line.endswith("True True")
    proc = _run(tree, "-c", "import twin.sim.engine as e; print(e.__file__)")
    assert proc.returncode == 0 and proc.stdout.strip().endswith("engine.py"), proc.stderr
    proc = _run(tree, "-m", "twin", "sim", "--workload", "poisson:n=20,rate=20,input=2000,"
                "output=4,seed=1", "--json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert '"status": "completed"' in proc.stdout


def test_the_suite_itself_runs_the_pure_python_modules() -> None:
    """Even after a local `twin compile` (tests/conftest.py sets TWIN_PURE_PYTHON=1)."""
    import twin.core.prefill
    import twin.runtime.runtime

    assert twin.core.prefill.__file__.endswith("prefill.py")
    assert twin.runtime.runtime.__file__.endswith("runtime.py")
    assert compiled.state().mode == "pure"
