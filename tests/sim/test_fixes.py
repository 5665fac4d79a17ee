"""``--fix NAME``: proposed changes SGLang has not merged, switched on from the command line.

A run's fixes travel in its config, so the trace header carries them and a replay rebuilds the
same cores.
"""

from __future__ import annotations

from pathlib import Path

from click.testing import CliRunner, Result

from twin.cli import cli
from twin.core.config import ConfigError, TwinConfig
from twin.core.fixes import ALL_FIXES, LOST_CONTROL_RECOVERY
from twin.replay import replay_sim
from twin.runtime.outcome import EXIT_BAD_INPUT, EXIT_OK, EXIT_WEDGE
from twin.trace.format import read_trace


def invoke(*args: str) -> Result:
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


def test_fix_names_are_validated_in_config_and_cli() -> None:
    assert TwinConfig(fixes=ALL_FIXES).fixes == ALL_FIXES
    try:
        TwinConfig(fixes=("no-such-fix",))
    except ConfigError as exc:
        assert "no-such-fix" in str(exc)
    else:
        raise AssertionError("an unknown fix was accepted")
    r = invoke("sim", "--fix", "no-such-fix")
    assert r.exit_code == EXIT_BAD_INPUT and "unknown fix" in r.output


def test_fix_removes_the_lost_watermark_wedge_and_replays(tmp_path: Path) -> None:
    r = invoke("sim", "--scenario", "lost-watermark", "--json")
    assert r.exit_code == EXIT_WEDGE, r.output
    out = tmp_path / "fixed.jsonl"
    r = invoke("sim", "--scenario", "lost-watermark", "--fix", LOST_CONTROL_RECOVERY,
               "--json", "--trace-out", str(out))
    assert r.exit_code == EXIT_OK, r.output
    trace = read_trace(out)
    assert trace.config.fixes == (LOST_CONTROL_RECOVERY,)
    result = replay_sim(trace)
    assert result.divergence is None and result.status == "completed"
