"""The architecture's boundaries, checked on the source: what may import and read what."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "twin"


def _modules(under: str = "") -> list[Path]:
    return sorted((ROOT / under).rglob("*.py"))


def _private_attrs_of_core() -> set[str]:
    """Attribute names the core's ranks keep to themselves (assigned as ``self._name``)."""
    names: set[str] = set()
    for path in (ROOT / "core" / "prefill.py", ROOT / "core" / "decode.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.value.id == "self" and node.attr.startswith("_")
                    and not node.attr.startswith("__") and isinstance(node.ctx, ast.Store)):
                names.add(node.attr)
    return names


def test_core_ranks_have_private_state() -> None:
    names = _private_attrs_of_core()
    # The state a driver was tempted to read: rooms, workers, watermarks, ring, crash flag.
    assert {"_rooms", "_workers", "_watermarks", "_allocator", "_crashed"} <= names, names


def test_no_module_outside_the_core_reads_a_ranks_private_state() -> None:
    private = _private_attrs_of_core()
    offenders = []
    for path in _modules():
        if path.is_relative_to(ROOT / "core"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in private and not (
                    isinstance(node.value, ast.Name) and node.value.id == "self"):
                offenders.append(f"{path.relative_to(ROOT.parent)}:{node.lineno} .{node.attr}")
    assert not offenders, offenders


def _imports(path: Path) -> set[str]:
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return out


def test_hardware_mode_imports_nothing_from_the_simulator() -> None:
    bad = [f"{p.name}: {m}" for p in _modules("hw") for m in _imports(p)
           if m == "twin.sim" or m.startswith("twin.sim.")]
    assert not bad, bad


def test_core_imports_only_the_core_and_the_standard_library() -> None:
    """The core is sans-I/O: the standard library's data modules, and msgspec, whose Structs
    are the events' and frames' classes (no clocks, threads, sockets, SimPy or torch)."""
    allowed_roots = {"__future__", "dataclasses", "enum", "typing", "collections", "heapq",
                     "functools", "itertools", "math", "sys", "pathlib", "tomllib", "tomli",
                     "bisect", "difflib", "msgspec"}
    bad = []
    for p in _modules("core"):
        for m in _imports(p):
            if m.startswith("twin.core") or m.split(".")[0] in allowed_roots:
                continue
            bad.append(f"{p.name}: {m}")
    assert not bad, bad


def test_no_import_cycles_between_twin_modules() -> None:
    """Module-level imports (including ones under ``TYPE_CHECKING``) form no cycle."""
    graph: dict[str, set[str]] = {}
    for p in _modules():
        rel = p.relative_to(ROOT.parent).with_suffix("")
        name = ".".join(rel.parts).removesuffix(".__init__")
        deps = set()
        for node in ast.parse(p.read_text()).body:
            mods: list[str] = []
            if isinstance(node, ast.ImportFrom) and node.module:
                mods = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            elif isinstance(node, ast.If):  # if TYPE_CHECKING: imports
                for sub in node.body:
                    if isinstance(sub, ast.ImportFrom) and sub.module:
                        mods += [sub.module] + [f"{sub.module}.{a.name}" for a in sub.names]
            deps.update(m for m in mods if m.startswith("twin"))
        graph[name] = deps
    known = set(graph)
    edges = {n: {d for d in ds if d in known and d != n} for n, ds in graph.items()}
    # a package's __init__ re-exporting its own submodules is not a cycle
    for n in edges:
        edges[n] = {d for d in edges[n] if not d.startswith(n + ".")}
    seen: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> None:
        seen[n] = 1
        stack.append(n)
        for d in sorted(edges[n]):
            if seen.get(d) == 1:
                raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(d):] + [d]))
            if d not in seen:
                visit(d)
        stack.pop()
        seen[n] = 2

    for n in sorted(edges):
        if n not in seen:
            visit(n)
