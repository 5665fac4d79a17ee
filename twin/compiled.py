"""The optional compiled core: the protocol logic, the runtime and the simulated serving loops
built with mypyc.

``twin compile`` builds the modules in ``MODULES`` into C extensions placed beside their
sources (Python imports an extension before a source file of the same name) and records each
source's hash in ``twin/_compiled.json``. The pure-Python modules stay the reference: they are
what the tests exercise by default, and a compiled run must produce the same trace byte for
byte (``tests/test_compiled.py``).

``activate()`` runs when ``twin`` is imported, before any of these modules is: it routes them to
their sources (the pure-Python path) when ``TWIN_PURE_PYTHON=1`` is set or when any source no
longer matches the hash it was compiled from, so an edit never runs against stale machine code.
``state()`` says which path this process runs and why.
"""

from __future__ import annotations

import hashlib
import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

# Compiled together (calls between them stay native). The events and frames are msgspec Structs
# (C types already) and the config a Python class: neither is compiled.
MODULES: tuple[str, ...] = (
    "twin.core.states",
    "twin.core.allocator",
    "twin.core.grid",
    "twin.core.layout",
    "twin.core.sendplan",
    "twin.core.integrity",
    "twin.core.decode",
    "twin.core.prefill",
    "twin.runtime.runtime",
    "twin.runtime.requests",
    "twin.runtime.placement",
    "twin.trace.rooms",
    "twin.trace.lines",
    "twin.trace.format",
    "twin.replay.feeding",
    "twin.workloads.prefix_cache",
    "twin.sim.metrics",
    "twin.sim.decode_loop",
    "twin.sim.scheduler",
    "twin.sim.engine",
)
GROUP = "twin._native"  # the shared library: twin/_native__mypyc.<abi>.so
PURE_ENV = "TWIN_PURE_PYTHON"
_PACKAGE = Path(__file__).resolve().parent  # .../twin
_ROOT = _PACKAGE.parent
MANIFEST = _PACKAGE / "_compiled.json"


@dataclass(frozen=True)
class CompiledState:
    """Which path this process runs: ``mode`` is ``"compiled"`` or ``"pure"``; ``reason``
    says why pure (not built, forced, stale) or what was compiled (mypyc version)."""

    mode: str
    reason: str

    def line(self) -> str:
        return f"{self.mode} ({self.reason})"


_state = CompiledState("pure", "not compiled; twin compile builds it")


def source_path(module: str) -> Path:
    """The Python source of ``module`` (a compiled module's ``__file__`` names its extension)."""
    return _ROOT / (module.replace(".", "/") + ".py")


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _extensions() -> list[Path]:
    """Every extension file in the package: the built modules, the shared library, and any
    stray one (an older or newer build's module that ``MODULES`` no longer or not yet names)."""
    return sorted(p for p in _PACKAGE.rglob("*") if p.suffix in (".so", ".pyd"))


def _module_of(extension: Path) -> str:
    """``twin/sim/engine.cpython-311-x86_64-linux-gnu.so`` -> ``twin.sim.engine``."""
    rel = extension.relative_to(_ROOT)
    return ".".join((*rel.parent.parts, rel.name.split(".")[0]))


def _stale(manifest: dict[str, Any] | None, extensions: list[Path]) -> str | None:
    """Why the built extensions must not run (no manifest, a source changed, a module missing
    from the manifest, another Python), or None when they match their sources."""
    if manifest is None:
        return "no readable build manifest"
    if manifest.get("python") != sys.implementation.cache_tag:
        return f"built for {manifest.get('python')}, running {sys.implementation.cache_tag}"
    sources = manifest.get("sources", {})
    known = {*MODULES, GROUP + "__mypyc"}
    for ext in extensions:
        if _module_of(ext) not in known:
            return f"{ext.relative_to(_ROOT)} is not part of this build"
    for module in MODULES:
        want = sources.get(module)
        if want is None:
            return f"{module} was not compiled"
        if want != _digest(source_path(module)):
            return f"{source_path(module).relative_to(_ROOT)} changed since it was compiled"
    return None


def _manifest() -> dict[str, Any] | None:
    try:
        data = json.loads(MANIFEST.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


class _PureFinder(importlib.abc.MetaPathFinder):
    """Finds the Python sources of ``modules``, ahead of their extensions."""

    def __init__(self, modules: set[str]) -> None:
        self.modules = modules

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        del path, target
        if fullname not in self.modules or not source_path(fullname).exists():
            return None
        return importlib.util.spec_from_file_location(fullname, source_path(fullname))


def activate() -> CompiledState:
    """Choose the path for this process (once, before the modules are imported)."""
    global _state
    extensions = _extensions()
    forced = os.environ.get(PURE_ENV, "") not in ("", "0")
    if not extensions and not forced:
        return _state
    # Forced, the sources win even over extensions that appear later (a build in progress).
    manifest = None if forced else _manifest()
    why = f"{PURE_ENV} is set" if forced else _stale(manifest, extensions)
    if why is None:
        assert manifest is not None  # _stale says None only of a manifest that matches
        _state = CompiledState("compiled", f"mypyc {manifest.get('mypyc', '?')}, "
                                            f"-O{manifest.get('opt', '3')}")
        return _state
    if not any(isinstance(f, _PureFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _PureFinder({*MODULES, *map(_module_of, extensions)}))
    _state = CompiledState("pure", why if forced else f"compiled build ignored: {why}; "
                           "run twin compile to rebuild")
    return _state


def current() -> bool:
    """Whether a build lies beside these sources and matches them, whatever ``TWIN_PURE_PYTHON``
    says: what ``twin compile`` (or ``scripts/setup.sh``) left, not yet outdated by an edit."""
    extensions = _extensions()
    return bool(extensions) and _stale(_manifest(), extensions) is None


def state() -> CompiledState:
    """The path this process runs (after ``activate``)."""
    return _state


def remove() -> list[Path]:
    """Delete the built extensions and the manifest; returns what was deleted."""
    gone = _extensions() + ([MANIFEST] if MANIFEST.exists() else [])
    for p in gone:
        p.unlink()
    return gone


def build(*, verbose: bool = False, quick: bool = False) -> list[Path]:
    """Compile ``MODULES`` in place with mypyc and write the manifest; returns the files built.
    ``quick`` builds without C optimisation (about half the build time, slower code).

    Raises ``RuntimeError`` with the compiler's output when mypyc or the C compiler is missing
    or fails. Builds in a temporary folder; the tree is only touched once the build succeeded.
    """
    import subprocess
    import tempfile

    try:
        import mypy.version
        import mypyc  # noqa: F401
        import setuptools  # noqa: F401
    except ImportError as e:
        raise RuntimeError(f"building the compiled core needs mypy and setuptools "
                           f"(pip install 'staging-twin[fast]'): {e}") from None
    remove()
    sources = {m: _digest(source_path(m)) for m in MODULES}
    paths = [str(source_path(m).relative_to(_ROOT)) for m in MODULES]
    opt = "0" if quick else "3"
    script = (
        "import sys\n"
        "from setuptools import setup\n"
        "from mypyc.build import mypycify\n"
        f"ext = mypycify({paths!r}, group_name={GROUP!r}, opt_level={opt!r},\n"
        "                target_dir=sys.argv[1] + '/c')\n"
        "setup(name='twin-native', ext_modules=ext,\n"
        "      script_args=['build_ext', '--inplace', '--build-temp', sys.argv[1] + '/o'])\n"
    )
    with tempfile.TemporaryDirectory(prefix="twin-compile-") as tmp:
        env = {**os.environ, PURE_ENV: "1"}
        proc = subprocess.run([sys.executable, "-c", script, tmp], cwd=_ROOT, env=env,
                              capture_output=not verbose, text=True)
    if proc.returncode != 0:
        out = (proc.stdout or "") + (proc.stderr or "")
        remove()
        raise RuntimeError("mypyc failed:\n" + "\n".join(out.strip().splitlines()[-25:]))
    MANIFEST.write_text(json.dumps({
        "python": sys.implementation.cache_tag, "mypyc": mypy.version.__version__, "opt": opt,
        "sources": sources}, indent=1) + "\n")
    return _extensions()
