"""``scripts/build_core.sh``, the set-up's last step: the compiled core where a C compiler is,
else one line saying why the pure-Python core runs (the compiling case: tests/test_compiled.py).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def build_core(cwd: Path, **env: str) -> subprocess.CompletedProcess[str]:
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    return subprocess.run([str(cwd / "scripts" / "build_core.sh")], cwd=cwd, text=True,
                          capture_output=True, timeout=600,
                          env={**os.environ, "PATH": path, **env})


def test_without_a_c_compiler_the_set_up_says_why_it_runs_pure_python() -> None:
    proc = build_core(REPO, CC="no-such-compiler")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == ("core: pure Python: no C compiler found (install gcc or clang, then "
                           "run twin compile)\n")


def test_forced_pure_python_says_so_without_a_build_too(tmp_path: Path) -> None:
    import shutil

    shutil.copytree(REPO / "twin", tmp_path / "twin",
                    ignore=shutil.ignore_patterns("__pycache__", "*.so", "_compiled.json"))
    code = "import twin.compiled as c; print(c.state().line())"
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    for pure, line in (("1", "pure (TWIN_PURE_PYTHON is set)"),
                       ("", "pure (not compiled; twin compile builds it)")):
        proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, text=True,
                              capture_output=True, env={**env, "TWIN_PURE_PYTHON": pure})
        assert proc.returncode == 0 and proc.stdout.strip() == line, proc.stderr
