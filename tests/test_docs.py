"""The commands the README and the docs show run, and end with the exit status they claim.

Each ``twin ...`` line of a ``bash`` block (continuations joined, ``;`` splitting commands) runs
in a scratch folder through click's CliRunner; ``# exit N`` in its comment is the expected exit
status, 0 otherwise. ``mooncake_trace.jsonl`` is a small generated Mooncake trace. Hardware-mode
commands run in ``test_readme_hw_commands`` (marked ``hw``).
"""

from __future__ import annotations

import json
import os
import random
import re
import shlex
from pathlib import Path

import pytest
from click.testing import CliRunner

from twin.cli import cli

ROOT = Path(__file__).resolve().parents[1]


def commands(path: Path, section: str | None = None) -> list[tuple[list[str], int, str]]:
    """``(argv after 'twin', expected exit, source line)`` of every twin command in the bash
    blocks of ``path`` (only under the heading ``section`` when given)."""
    text = path.read_text()
    if section is not None:
        text = text.split(f"## {section}", 1)[1].split("\n## ", 1)[0]
    out = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            code, _, comment = line.partition("#")
            m = re.search(r"exit (\d)", comment)
            want = int(m.group(1)) if m else 0
            for part in code.split(";"):
                words = shlex.split(part)
                if words[:1] == ["twin"]:
                    out.append((words[1:], want, line.strip()))
    return out


def is_hw(argv: list[str]) -> bool:
    return argv[:1] == ["hw"] or "--mode" in argv and argv[argv.index("--mode") + 1] == "hw"


def mooncake(path: Path, n: int = 30) -> None:
    rng = random.Random(5)
    with path.open("w") as f:
        for i in range(n):
            tokens = rng.randint(600, 6000)
            blocks = list(range(i % 3 * 1000, i % 3 * 1000 + (tokens + 511) // 512))
            f.write(json.dumps({"timestamp": i * 150, "input_length": tokens,
                                "output_length": 16, "hash_ids": blocks}) + "\n")


def run(argv: list[str], cwd: Path) -> tuple[int, str]:
    """Run ``twin ARGV`` in ``cwd`` (paths under examples/ point into the repository)."""
    argv = [str(ROOT / a) if a.startswith("examples/") else a for a in argv]
    old = os.getcwd()
    os.chdir(cwd)
    try:
        r = CliRunner().invoke(cli, argv, catch_exceptions=False)
    finally:
        os.chdir(old)
    return r.exit_code, r.output


README = commands(ROOT / "README.md", "What you can do")


def test_readme_lists_the_commands() -> None:
    assert len(README) >= 12
    assert any(is_hw(a) for a, _, _ in README)


def test_readme_commands(tmp_path: Path) -> None:
    mooncake(tmp_path / "mooncake_trace.jsonl")
    for argv, want, line in README:
        if is_hw(argv):
            continue
        code, output = run(argv, tmp_path)
        assert code == want, (line, code, output[-2000:])
        assert "Traceback" not in output, line
    written = [a[a.index("-o") + 1] for a, _, _ in README if a[:1] == ["perfetto"]]
    assert written and all((tmp_path / w).stat().st_size > 0 for w in written)
    assert {p.name for p in (tmp_path / "plots").iterdir()} >= {"latency.png", "ring.png"}


@pytest.mark.hw
def test_readme_hw_commands(tmp_path: Path) -> None:
    hw = [c for c in README if is_hw(c[0])]
    assert hw
    for argv, _, _ in README:
        if argv[:1] == ["sim"] and "--trace-out" in argv:
            run(argv, tmp_path)  # the trace the replay reads
    for argv, want, line in hw:
        code, output = run(argv, tmp_path)
        assert code == want, (line, code, output[-2000:])


def test_simulator_doc_commands(tmp_path: Path) -> None:
    cmds = commands(ROOT / "docs" / "simulator.md")
    assert len(cmds) >= 4
    for argv, want, line in cmds:
        code, output = run(argv, tmp_path)
        assert code == want, (line, code, output[-2000:])


def test_trace_format_header_example_runs(tmp_path: Path) -> None:
    """The header example's defects, faults and seed are accepted and recorded as written."""
    doc = (ROOT / "docs" / "trace-format.md").read_text()
    header = doc.split("## Header", 1)[1]
    defects = json.loads(re.search(r'"defects": (\[.*?\])', header).group(1))
    faults = json.loads(re.search(r'"faults": (\[.*?\])', header).group(1))
    seed = re.search(r'"seed": (\d+)', header).group(1)
    trace = tmp_path / "t.jsonl"
    argv = ["sim", "--workload", "poisson:n=40,rate=20,input=1024,output=8", "--seed", seed,
            "--trace-out", str(trace)]
    for d in defects:
        argv += ["--defect", d]
    for f in faults:
        argv += ["--fault", f]
    code, output = run(argv, tmp_path)
    assert code in (0, 3, 4, 5), output
    from twin.trace.format import read_trace

    t = read_trace(trace)
    assert t.header["faults"] == faults and t.header["defects"] == defects


def test_hw_help_suggests_only_faults_hw_accepts() -> None:
    from twin.core.defects import Defects
    from twin.hw.run import check_supported
    from twin.runtime.faults import parse_fault

    text = " ".join(CliRunner().invoke(cli, ["hw", "--help"]).output.split())
    examples = text.split("Inject a fault (repeatable), e.g. ", 1)[1].split(" (", 1)[0]
    specs = [s.strip() for s in examples.split(",")]
    assert len(specs) >= 3
    for spec in specs:
        parse_fault(spec)
        check_supported(Defects(), [spec])


def test_every_option_has_help() -> None:
    import click

    def walk(group: click.Group, prefix: str = "") -> None:
        for name, cmd in group.commands.items():
            if isinstance(cmd, click.Group):
                walk(cmd, f"{prefix}{name} ")
                continue
            for param in cmd.params:
                if isinstance(param, click.Option) and param.name not in ("help",):
                    assert param.help, f"twin {prefix}{name} {param.opts[0]} has no help"

    walk(cli)


def test_the_readme_counts_scenarios_and_defects_as_they_are() -> None:
    from twin.core.defects import ALL_DEFECTS
    from twin.sim.scenarios import SCENARIOS

    text = (ROOT / "README.md").read_text()
    scenarios = re.findall(r"the (\d+) built-in scenarios", text)
    assert scenarios and all(int(n) == len(SCENARIOS) for n in scenarios)
    words = {w: i for i, w in enumerate(("zero", "one", "two", "three", "four", "five", "six",
                                         "seven", "eight", "nine", "ten", "eleven", "twelve"))}
    defects = re.findall(r"the (\w+) upstream defects", text)
    assert defects and all(words[w] == len(ALL_DEFECTS) for w in defects)


def test_the_license_file_is_the_license_pyproject_declares() -> None:
    from twin.core.config import tomllib  # tomli before Python 3.11

    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["license"]
    assert declared == {"text": "Apache-2.0"}
    words = (ROOT / "LICENSE").read_text().split()
    assert words[:4] == ["Apache", "License", "Version", "2.0,"]
    assert "END OF TERMS AND CONDITIONS" in " ".join(words)
