"""The ``twin`` command line, in process (click's CliRunner) and once as a real subprocess."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import click
import pytest
from click.testing import CliRunner, Result

from twin.cli import cli
from twin.core.config import TwinConfig
from twin.core.fixes import ALL_FIXES
from twin.trace.format import read_trace

TWIN = Path(sys.executable).parent / "twin"


def invoke(*args: str) -> Result:
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


def _commands(group: click.Group, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    out = []
    ctx = click.Context(group)
    for name in group.list_commands(ctx):
        cmd = group.get_command(ctx, name)
        assert cmd is not None, name
        out.append((*prefix, name))
        if isinstance(cmd, click.Group):
            out += _commands(cmd, (*prefix, name))
    return out


ALL_COMMANDS = _commands(cli)
EXPECTED_OPTIONS = {
    ("sim",): ["--config", "--scenario", "--scenario-defects", "--workload", "--defect",
               "--fault", "--seed", "--until", "--max-concurrency", "--trace-out",
               "--metrics-out", "--plot", "--json", "--prefill-args", "--decode-args", "--env"],
    ("scenarios",): ["--check", "--json"],
    ("config",): ["show"],
    ("config", "show"): ["--config", "--scenario", "--workload", "--prefill-args",
                         "--decode-args", "--env"],
    ("hw",): ["--config", "--scenario", "--scenario-defects", "--workload", "--first-n",
              "--slowdown", "--defect", "--fault", "--seed", "--until", "--max-concurrency",
              "--trace-out", "--json", "--prefill-args", "--decode-args", "--env",
              "--kv-pool-pages", "--log-dir", "--device"],
    ("defects",): ["--json"],
    ("walkthrough",): ["--help"],
    ("trace",): ["summary", "room", "diff"],
    ("trace", "summary"): ["TRACE_PATH"],
    ("trace", "room"): ["TRACE_PATH", "ROOM"],
    ("trace", "diff"): ["A", "B"],
    ("perfetto",): ["--out"],
    ("replay",): ["--mode", "--json"],
}


def test_every_expected_command_exists() -> None:
    assert set(EXPECTED_OPTIONS) <= set(ALL_COMMANDS)


@pytest.mark.parametrize("path", ALL_COMMANDS, ids=" ".join)
def test_help(path: tuple[str, ...]) -> None:
    r = invoke(*path, "--help")
    assert r.exit_code == 0, r.output
    assert r.output.startswith("Usage: ")
    for needle in EXPECTED_OPTIONS.get(path, []):
        assert needle in r.output, (path, needle)


def test_subcommands_load_from_their_modules_on_first_use(traces: dict[str, Path]) -> None:
    """``COMMAND_MODULES`` names every module's ``COMMANDS`` (and nothing else), and a trace
    inspection does not import the simulator or the hardware mode."""
    import importlib

    from twin.cli import COMMAND_MODULES

    found = {}
    for module in set(COMMAND_MODULES.values()):
        for command in importlib.import_module(f"twin.cli.{module}").COMMANDS:
            found[command.name] = module
    assert found == COMMAND_MODULES
    trace = str(next(iter(traces.values())))
    code = (f"import sys; from twin.cli import cli; cli(['trace', 'summary', {trace!r}], "
            "standalone_mode=False); print(sorted(m for m in sys.modules if m.startswith("
            "('twin.sim', 'twin.hw', 'twin.runtime.runtime', 'twin.cli.'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip().splitlines()[-1] == "['twin.cli.options', 'twin.cli.trace_cmd']"


def test_top_level_help_lists_commands() -> None:
    r = invoke("--help")
    assert r.exit_code == 0
    for (name,) in [p for p in EXPECTED_OPTIONS if len(p) == 1]:
        assert name in r.output


# -- twin sim ---------------------------------------------------------------------------------
def _json(r: Result) -> dict:
    return json.loads(r.stdout)


def test_sim_json_keys_and_exit_0() -> None:
    r = invoke("sim", "--json")
    assert r.exit_code == 0, r.output
    s = _json(r)
    for key in ("requests", "completed", "failed", "wedged", "corrupted", "diagnosis",
                "sim_seconds", "wall_seconds", "events", "latency"):
        assert key in s, key
    assert s["requests"] == s["completed"] == 128 and s["failed"] == 0
    assert s["wedged"] is False and s["corrupted"] is False and s["diagnosis"] == []
    assert s["sim_seconds"] > 0 and s["events"] > 1000
    ttft = s["latency"]["ttft_s"]
    assert set(ttft) >= {"p50", "p90", "p99", "mean"}
    assert 0 < ttft["p50"] <= ttft["p90"] <= ttft["p99"]


def test_sim_human_output() -> None:
    r = invoke("sim", "--workload", "poisson:n=20,rate=10,input=1024,output=8,seed=1")
    assert r.exit_code == 0
    assert "status      completed" in r.output and "requests    20: 20 completed" in r.output
    assert "TTFT        p50" in r.output


def test_bad_config_file_exits_2_naming_file_and_field(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text('page_size = "big"\n')
    r = invoke("sim", "--config", str(bad))
    assert r.exit_code == 2
    assert str(bad) in r.stderr and "field 'page_size'" in r.stderr
    bad.write_text("[sim]\nzmq_latency_s = -1\n")
    r = invoke("sim", "--config", str(bad))
    assert r.exit_code == 2 and "field 'sim.zmq_latency_s'" in r.stderr
    bad.write_text("page_size = \n")
    r = invoke("sim", "--config", str(bad))
    assert r.exit_code == 2 and str(bad) in r.stderr and "not valid TOML" in r.stderr


@pytest.mark.parametrize(("args", "needle"), [
    (("--defect", "nope"), "unknown defect 'nope'"),
    (("--fault", "drop:NOPE"), "fault 'drop:NOPE'"),
    (("--scenario", "nope"), "unknown scenario 'nope'"),
    (("--workload", "poisson:n=0,rate=1"), "key 'n'"),
    (("--env", "FOO"), "--env 'FOO'"),
])
def test_bad_input_exits_2(args: tuple[str, ...], needle: str) -> None:
    r = invoke("sim", *args)
    assert r.exit_code == 2
    assert r.stderr.startswith("error: ") and needle in r.stderr, r.stderr


def test_wedge_scenario_exits_3() -> None:
    r = invoke("sim", "--scenario", "warmup-stall", "--scenario-defects", "--json")
    assert r.exit_code == 3
    s = _json(r)
    assert s["wedged"] is True and 0 < s["completed"] < 11 and s["diagnosis"]


def test_corruption_scenario_exits_4() -> None:
    r = invoke("sim", "--scenario", "completion-race", "--scenario-defects", "--json")
    assert r.exit_code == 4
    s = _json(r)
    assert s["corrupted"] is True and s["corruption"]


def test_scenario_without_its_defects_exits_0() -> None:
    assert invoke("sim", "--scenario", "warmup-stall").exit_code == 0


def test_sim_launch_args_and_env(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    r = invoke("sim", "--json", "--workload", "poisson:n=8,rate=20,input=2048,output=8",
               "--prefill-args", "--tp-size 4 --chunked-prefill-size 512",
               "--decode-args", "--tp-size 2", "--env", "SGLANG_DISAGG_STAGING_POOL_SIZE_MB=64",
               "--trace-out", str(trace))
    assert r.exit_code == 0, r.output
    s = _json(r)
    assert s["completed"] == 8
    assert sorted(s["peak_ring_bytes"]) == ["d0g0r0", "d0g0r1"]  # decode TP2
    cfg = read_trace(trace).config
    assert (cfg.prefill.tp_size, cfg.decode.tp_size, cfg.chunked_prefill_size) == (4, 2, 512)
    assert cfg.ring_bytes == 64 * 1024 * 1024
    r = invoke("sim", "--prefill-args", "--chunked-prefill-size 100", "--decode-args", "")
    assert r.exit_code == 2 and "chunked_prefill_size" in r.stderr


def test_sim_writes_metrics_and_plots(tmp_path: Path) -> None:
    r = invoke("sim", "--workload", "poisson:n=10,rate=10,input=1024,output=8",
               "--metrics-out", str(tmp_path / "m"), "--plot", str(tmp_path / "p"))
    assert r.exit_code == 0
    assert (tmp_path / "m" / "requests.csv").read_text().count("\n") == 11
    assert all((tmp_path / "p" / n).stat().st_size > 0
               for n in ("latency.png", "ring.png", "deferrals.png"))


def test_config_round_trip(tmp_path: Path) -> None:
    r = invoke("config", "show", "--prefill-args", "--tp-size 4 --dp-size 4 --enable-dp-attention "
               "--chunked-prefill-size 256 --page-size 16", "--decode-args", "--tp-size 8",
               "--env", "SGLANG_DISAGG_STAGING_POOL_SIZE_MB=64",
               "--env", "SGLANG_DISAGGREGATION_WAITING_TIMEOUT=120")
    assert r.exit_code == 0, r.output
    path = tmp_path / "c.toml"
    path.write_text(r.stdout)
    cfg = TwinConfig.from_toml(path)
    assert (cfg.prefill.tp_size, cfg.prefill.dp_size, cfg.prefill.enable_dp_attention) == \
        (4, 4, True)
    assert cfg.decode.tp_size == 8 and cfg.chunked_prefill_size == 256
    assert cfg.staging_pool_size_mb == 64 and cfg.waiting_timeout_s == 120.0
    # The printed config drives a run.
    r = invoke("sim", "--config", str(path), "--json", "--workload",
               "poisson:n=4,rate=10,input=1024,output=8")
    assert r.exit_code == 0 and _json(r)["completed"] == 4


def test_scenarios_list_and_defects() -> None:
    r = invoke("scenarios", "--json")
    rows = json.loads(r.stdout)
    assert {row["name"] for row in rows} >= {"default", "warmup-stall", "radix-grid"}
    r = invoke("defects", "--json")
    kinds = [row["kind"] for row in json.loads(r.stdout)]
    assert kinds.count("defect") == 10 and kinds.count("fix") == len(ALL_FIXES)
    listing = invoke("defects").output
    assert "drop-late-staging-req" in listing
    assert "stale-watermark-subscribers" in listing and "#36049" in listing
    r = invoke("walkthrough")
    assert "waits forever" in r.output and "may write" in r.output


# -- traces: summary, room, diff, perfetto, replay --------------------------------------------
@pytest.fixture(scope="module")
def traces(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("traces")
    out = {"wedge": d / "wedge.jsonl", "clean": d / "clean.jsonl.gz",
           "clean2": d / "clean2.jsonl"}
    r = invoke("sim", "--scenario", "warmup-stall", "--scenario-defects", "--trace-out",
               str(out["wedge"]))
    assert r.exit_code == 3
    for key, seed in (("clean", "0"), ("clean2", "1")):
        r = invoke("sim", "--workload", "poisson:n=6,rate=20,input=1024,output=8",
                   "--seed", seed, "--trace-out", str(out[key]))
        assert r.exit_code == 0 and f"trace       {out[key]}" in r.output
    return out


def test_trace_files_are_valid(traces: dict[str, Path]) -> None:
    assert traces["clean"].read_bytes()[:2] == b"\x1f\x8b"
    assert read_trace(traces["clean"]).status == "completed"
    assert read_trace(traces["wedge"]).status == "wedged"


def test_trace_summary(traces: dict[str, Path]) -> None:
    r = invoke("trace", "summary", str(traces["wedge"]))
    assert r.exit_code == 0 and "wedged" in r.output
    r = invoke("trace", "summary", str(traces["clean"]))
    assert r.exit_code == 0 and "completed" in r.output


def test_trace_room(traces: dict[str, Path]) -> None:
    r = invoke("trace", "room", str(traces["clean"]), "0")
    assert r.exit_code == 0
    assert "STAGING_REQ" in r.output or "StagingReq" in r.output
    assert "RoomConcluded" in r.output or "Success" in r.output


def test_trace_diff(traces: dict[str, Path]) -> None:
    same = invoke("trace", "diff", str(traces["clean"]), str(traces["clean"]))
    assert same.exit_code == 0
    other = invoke("trace", "diff", str(traces["clean"]), str(traces["clean2"]))
    assert other.exit_code == 1 and other.output.strip()


def test_perfetto(traces: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "w.json"
    r = invoke("perfetto", str(traces["wedge"]), "-o", str(out))
    assert r.exit_code == 0 and str(out) in r.output
    data = json.loads(out.read_text())
    events = data["traceEvents"] if isinstance(data, dict) else data
    assert len(events) > 50


def test_perfetto_protobuf_and_windows(traces: dict[str, Path], tmp_path: Path) -> None:
    from perfetto.protos.perfetto.trace import perfetto_trace_pb2 as pb

    out = tmp_path / "w.pftrace"
    r = invoke("perfetto", str(traces["wedge"]), "-o", str(out))
    assert r.exit_code == 0 and str(out) in r.output
    trace = pb.Trace()
    trace.ParseFromString(out.read_bytes())
    assert any(p.track_event.type == p.track_event.TYPE_SLICE_BEGIN for p in trace.packet)
    forced = tmp_path / "w.bin"
    r = invoke("perfetto", str(traces["wedge"]), "-o", str(forced), "--format", "json")
    assert r.exit_code == 0 and json.loads(forced.read_text())["traceEvents"]
    assert invoke("perfetto", str(traces["clean"]), "-o", str(tmp_path / "a.json")).exit_code == 0
    full = json.loads((tmp_path / "a.json").read_text())["traceEvents"]
    r = invoke("perfetto", str(traces["clean"]), "-o", str(tmp_path / "r.json"), "--room", "2")
    assert r.exit_code == 0
    room = json.loads((tmp_path / "r.json").read_text())["traceEvents"]
    rooms = {e["args"].get("room") for e in room if e["ph"] == "X" and "room" in e["args"]}
    assert rooms == {2} and len(room) < len(full)
    r = invoke("perfetto", str(traces["clean"]), "-o", str(tmp_path / "x.json"), "--from", "0.5",
               "--to", "0.1")
    assert r.exit_code == 2 and "--to" in r.stderr


def test_trace_files_have_an_index(traces: dict[str, Path]) -> None:
    for path in traces.values():
        assert Path(f"{path}.idx").exists()
    r = invoke("trace", "room", str(traces["clean"]), "1")
    assert r.exit_code == 0 and "RoomConcluded" in r.output


def test_replay_reaches_the_same_outcome(traces: dict[str, Path]) -> None:
    r = invoke("replay", str(traces["wedge"]))
    assert r.exit_code == 3, r.output
    assert "same outcome as recorded" in r.output
    assert "\ncore        pure (TWIN_PURE_PYTHON is set)\n" in r.output
    r = invoke("replay", str(traces["clean"]), "--json")
    assert r.exit_code == 0
    s = _json(r)
    assert s["same_outcome"] is True and s["divergence"] is None and s["completed"] == 6
    assert s["core"] == "pure"


def test_bad_trace_exits_2(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text("not json\n")
    for args in (("trace", "summary", str(bad)), ("replay", str(bad))):
        r = invoke(*args)
        assert r.exit_code == 2 and str(bad) in r.stderr


# -- the installed console script, in a real process ------------------------------------------
def test_console_script_subprocess(tmp_path: Path) -> None:
    assert TWIN.exists(), TWIN
    trace = tmp_path / "w.jsonl"
    p = subprocess.run([str(TWIN), "sim", "--scenario", "warmup-stall", "--scenario-defects",
                        "--json", "--trace-out", str(trace)],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 3, p.stderr
    assert json.loads(p.stdout)["wedged"] is True
    p = subprocess.run([str(TWIN), "replay", str(trace)], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 3 and "same outcome as recorded" in p.stdout
    p = subprocess.run([str(TWIN), "sim", "--defect", "nope"], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 2 and p.stderr.startswith("error: unknown defect 'nope'")


def test_launch_table_in_config_sets_the_deployment(tmp_path: Path) -> None:
    """SGLang launch lines and staging env vars in a ``[launch]`` table shape the deployment."""
    from click.testing import CliRunner

    from twin.cli import cli

    cfg = tmp_path / "launch.toml"
    cfg.write_text(
        "[model]\nnum_layers = 4\nnum_kv_heads = 8\nhead_dim = 64\n\n[launch]\n"
        'prefill = "--tp-size 4 --dp-size 4 --enable-dp-attention --chunked-prefill-size 256"\n'
        'decode = "--tp-size 8"\n'
        'env = { SGLANG_DISAGG_STAGING_POOL_SIZE_MB = "8" }\n')
    res = CliRunner().invoke(cli, ["sim", "--config", str(cfg), "--workload",
                                   "poisson:n=20,rate=10,input=1000"])
    assert res.exit_code == 0, res.output
    assert "prefill TP4 DP4 (DP attention) -> decode TP8, ring 8 MiB" in res.output
    cfg.write_text('[launch]\nprefill = "--tp-size 4 --disaggregation-mode decode"\n')
    res = CliRunner().invoke(cli, ["sim", "--config", str(cfg)])
    assert res.exit_code == 2
    assert "launch.toml: [launch]" in res.output and "--disaggregation-mode" in res.output


OVERLOAD = ["sim", "--workload", "poisson:n=3000,rate=400,input=4000,output=16,seed=1",
            "--env", "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT=3",
            "--env", "SGLANG_DISAGGREGATION_WAITING_TIMEOUT=60"]


def test_an_overload_wedge_has_one_root_and_a_readable_diagnosis() -> None:
    """Decode admits requests after prefill's bootstrap timeout failed them: prefill drops
    their metadata and they wait for a status that never comes. Hundreds of rooms share that
    one root (not a root per room), and the text output shows the roots and 30 detail lines."""
    data = _json(invoke(*OVERLOAD, "--json"))
    assert data["status"] == "wedged"
    roots = [line for line in data["diagnosis"] if line.startswith("root:")]
    assert len(roots) == 1, roots[:3]
    assert "prefill dropped decode's metadata (room already failed)" in roots[0]
    assert "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT" in roots[0]
    rooms = int(roots[0].split(" of ")[-1].split(" room(s)")[0])
    assert rooms > 100
    details = len(data["diagnosis"]) - 2  # the head line and the root
    text = invoke(*OVERLOAD).output.splitlines()
    shown = [line for line in text if line.startswith("wedge ")]
    assert len(shown) == 2 + 30 + 1  # head, root, 30 details, the count of the rest
    assert shown[-1].endswith(f"... {details - 30} more detail line(s) (--json prints them all)")


def test_a_workload_alone_says_why_the_deployment_is_sglangs_defaults() -> None:
    demo = invoke("sim", "--until", "0.01").output.splitlines()
    own = invoke("sim", "--workload", "poisson:n=2,rate=1", "--until", "0.01").output.splitlines()
    named = invoke("sim", "--scenario", "default", "--workload", "poisson:n=2,rate=1",
                   "--until", "0.01").output.splitlines()
    assert "ring 64 MiB" in demo[0] and "(" not in demo[0]
    assert "ring 4096 MiB" in own[0]
    assert own[0].endswith("(SGLang's defaults, as --workload was given without --scenario; "
                           "--scenario default runs it on the demo deployment)")
    assert named[0] == demo[0]
    data = json.loads(invoke("sim", "--workload", "poisson:n=2,rate=1", "--json").output)
    assert "SGLang's defaults" in data["deployment"]


def test_the_serving_line_names_the_demo_model_and_sizes_the_kv_pools() -> None:
    demo = invoke("sim", "--until", "0.01").output.splitlines()[1]
    assert demo.startswith("serving     twin-demo on H200; KV pool 68.6 M tokens (130.8 GiB a "
                           "GPU) x 4096 requests (prefill), 34.3 M tokens (130.7 GiB a GPU)")
    llama = invoke("sim", "--workload", "poisson:n=2,rate=1", "--until", "0.01").output
    # 4072689 tokens x 32 layers x 2 KV heads a rank x 128 x 2 B x K,V = 124.3 GiB
    assert "Llama-3.1-8B on H200; KV pool 4.07 M tokens (124.3 GiB a GPU)" in llama


def test_sim_names_the_core_path_it_ran() -> None:
    # The suite runs the pure-Python reference (conftest); tests/test_compiled.py checks that a
    # compiled installation's `twin sim` says "compiled".
    lines = invoke("sim", "--until", "0.01").output.splitlines()
    assert "core        pure (TWIN_PURE_PYTHON is set)" in lines
    assert json.loads(invoke("sim", "--until", "0.01", "--json").output)["core"] == "pure"
