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
