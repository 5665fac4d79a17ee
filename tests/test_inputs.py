"""Inputs mean what the user wrote: layered flags, `twin config show`, one resolution for
`twin sim` and `twin hw`, configurations no request can survive, faults that cannot fire, and
verdicts that say when requests failed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from twin.cli import cli
from twin.core.config import TwinConfig

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "8gpu-tp4-tp2.toml"


def invoke(*args: str) -> Result:
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


def show(*args: str) -> tuple[str, TwinConfig]:
    r = invoke("config", "show", *args)
    assert r.exit_code == 0, r.output
    first, _, body = r.output.partition("\n")
    return first, TwinConfig.from_dict(__import__("tomllib").loads(body), source="show")


# -- layering ---------------------------------------------------------------------------------
def test_env_layers_over_the_config_file() -> None:
    line, cfg = show("--config", str(EXAMPLE), "--env", "SGLANG_DISAGG_STAGING_POOL_SIZE_MB=512")
    assert line.startswith("# prefill TP4 -> decode TP2, ring 512 MiB")
    assert (cfg.prefill.tp_size, cfg.decode.tp_size, cfg.chunked_prefill_size) == (4, 2, 2048)
    assert cfg.model.num_layers == 32 and cfg.ring_bytes == 512 << 20


def test_env_layers_over_a_scenario() -> None:
    r = invoke("sim", "--scenario", "warmup-stall", "--env",
               "SGLANG_DISAGG_STAGING_POOL_SIZE_MB=2", "--json")
    assert r.exit_code == 0, r.output
    line, cfg = show("--scenario", "warmup-stall", "--env", "SGLANG_DISAGG_STAGING_POOL_SIZE_MB=2")
    assert "prefill TP4 DP4 (DP attention) -> decode TP8, ring 2 MiB" in line
    assert cfg.chunked_prefill_size == 256 and cfg.model.num_layers == 4


def test_launch_args_change_only_the_fields_they_name() -> None:
    _, cfg = show("--config", str(EXAMPLE), "--prefill-args", "--chunked-prefill-size 1024")
    assert (cfg.prefill.tp_size, cfg.decode.tp_size) == (4, 2)
    assert cfg.chunked_prefill_size == 1024 and cfg.ring_bytes == 256 << 20
    _, cfg = show("--config", str(EXAMPLE), "--decode-args", "--tp-size 4")
    assert (cfg.prefill.tp_size, cfg.decode.tp_size, cfg.chunked_prefill_size) == (4, 4, 2048)


def test_flags_win_over_the_launch_table(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text('[model]\nnum_layers = 4\n[launch]\nprefill = "--tp-size 2 '
                    '--chunked-prefill-size 256"\ndecode = "--tp-size 1"\n'
                    'env = { SGLANG_DISAGG_STAGING_POOL_SIZE_MB = "8" }\n')
    _, cfg = show("--config", str(path), "--prefill-args", "--tp-size 4",
                  "--env", "SGLANG_DISAGG_STAGING_POOL_SIZE_MB=16")
    assert (cfg.prefill.tp_size, cfg.decode.tp_size, cfg.chunked_prefill_size) == (4, 1, 256)
    assert cfg.ring_bytes == 16 << 20 and cfg.model.num_layers == 4


def test_config_files_layer_in_the_order_given(tmp_path: Path) -> None:
    """A deployment, then a costs file: the later file wins field by field, a later file's
    [model] field over an earlier [launch] line, and each file's [sim] layers on the last."""
    costs = tmp_path / "costs.toml"
    costs.write_text("[sim]\nzmq_latency_s = 0.004\n")
    deploy = tmp_path / "deploy.toml"
    deploy.write_text('chunked_prefill_size = 512\n[launch]\nprefill = "--tp-size 2"\n'
                      "[sim]\nzmq_latency_s = 0.001\nkernel_launch_s = 0.0002\n")
    later = tmp_path / "later.toml"
    later.write_text("[prefill]\ntp_size = 4\n")
    r = invoke("config", "show", "--config", str(deploy), "--config", str(costs),
               "--config", str(later))
    assert r.exit_code == 0, r.output
    body = __import__("tomllib").loads(r.output.partition("\n")[2])
    assert body["sim"]["zmq_latency_s"] == 0.004 and body["sim"]["kernel_launch_s"] == 0.0002
    cfg = TwinConfig.from_dict(body, source="show")
    assert cfg.prefill.tp_size == 4 and cfg.chunked_prefill_size == 512
    _, cfg = show("--config", str(later), "--config", str(deploy))
    assert cfg.prefill.tp_size == 2  # the deployment's launch line, given last, wins


@pytest.mark.parametrize("args", [
    ("sim", "--seed", "1", "--seed", "2"),
    ("sim", "--workload=poisson:n=5", "--workload", "poisson:n=6"),
    ("sim", "--prefill-args", "--tp-size 2", "--prefill-args", "--tp-size 4"),
    ("perfetto", "x.jsonl", "--room", "3", "-o", "a.json", "--room", "4"),
])
def test_an_option_taking_one_value_given_twice_is_rejected(args: tuple[str, ...]) -> None:
    r = invoke(*args)
    assert r.exit_code == 2, r.output
    assert "given 2 times" in r.output and "it takes one value" in r.output


def test_an_option_value_that_looks_like_an_option_is_not_counted() -> None:
    r = invoke("config", "show", "--prefill-args", "--seed 3 --tp-size 2", "--decode-args",
               "--prefill-args x")
    assert "given 2 times" not in r.output


def test_pool_size_in_mb_replaces_a_ring_given_in_bytes() -> None:
    # The chunk-ready-error scenario sets its ring in bytes; the env var in MB must win.
    line, cfg = show("--scenario", "chunk-ready-error", "--env",
                     "SGLANG_DISAGG_STAGING_POOL_SIZE_MB=16")
    assert cfg.ring_bytes == 16 << 20 and "ring 16 MiB" in line


def test_env_switches_early_send_of_the_cached_prefix() -> None:
    r = invoke("config", "show", "--env", "SGLANG_DISAGG_PREFILL_EARLY_SEND_CACHED_PREFIX=0")
    assert r.exit_code == 0 and "early_send_cached_prefix = false" in r.output


def test_config_show_round_trips_into_the_same_run(tmp_path: Path) -> None:
    args = ("--scenario", "radix-grid", "--env", "SGLANG_DISAGG_STAGING_POOL_SIZE_MB=32")
    r = invoke("config", "show", *args)
    path = tmp_path / "shown.toml"
    path.write_text(r.output)
    again = invoke("config", "show", "--config", str(path))
    assert again.output == r.output
    a = json.loads(invoke("sim", *args, "--json").output)
    b = json.loads(invoke("sim", "--scenario", "radix-grid", "--config", str(path),
                          "--json").output)
    for key in ("completed", "failed", "events", "sim_seconds", "peak_ring_bytes"):
        assert a[key] == b[key], key


def test_misspelt_launch_option_and_launch_table_key(tmp_path: Path) -> None:
    r = invoke("sim", "--prefill-args", "--tp-szie 4")
    assert r.exit_code == 2 and "did you mean '--tp-size'" in r.stderr
    r = invoke("sim", "--prefill-args", "--ep-size 8 --host 0.0.0.0 --tp-size 4",
               "--workload", "poisson:n=2,rate=10,input=512,output=4")
    assert r.exit_code == 0, r.output  # other SGLang options are ignored
    r = invoke("sim", "--prefill-args", "--model-path x --tp-size 4",
               "--workload", "poisson:n=2,rate=10,input=512,output=4")
    assert r.exit_code == 2 and "--model 'x': not a known model" in r.stderr  # read, checked
    path = tmp_path / "c.toml"
    path.write_text('[launch]\nprefil = "--tp-size 2"\n')
    r = invoke("sim", "--config", str(path))
    assert r.exit_code == 2 and "did you mean 'prefill'" in r.stderr


# -- the same resolution in twin sim and twin hw ----------------------------------------------
class _Captured(Exception):
    pass


def _capture(monkeypatch: pytest.MonkeyPatch, module: str, name: str, store: dict) -> None:
    import importlib

    mod = importlib.import_module(module)

    def fake(cfg, workload, **kw):  # type: ignore[no-untyped-def]
        store.update(cfg=cfg, workload=workload, **kw)
        raise _Captured

    monkeypatch.setattr(mod, name, fake)
    # The hardware mode checks the ranks' memory against the host's; that is not under test.
    monkeypatch.setattr("twin.hw.launcher.available_host_bytes", lambda: 1 << 50)


@pytest.mark.parametrize("flags", [
    ("--workload", "poisson:n=8,rate=10,input=2048,output=4,seed=3"),
    ("--config", str(EXAMPLE), "--workload", "poisson:n=8,rate=10,input=2048,output=4",
     "--env", "SGLANG_DISAGG_STAGING_POOL_SIZE_MB=512", "--until", "3", "--slowdown", "2"),
    ("--scenario", "warmup-stall", "--prefill-args", "--chunked-prefill-size 512",
     "--first-n", "5"),
])
def test_sim_and_hw_resolve_the_same_inputs(monkeypatch: pytest.MonkeyPatch,
                                            flags: tuple[str, ...]) -> None:
    sim: dict = {}
    hw: dict = {}
    _capture(monkeypatch, "twin.cli.sim_cmd", "run_sim", sim)
    _capture(monkeypatch, "twin.hw.run", "run_hw", hw)
    for command in ("sim", "hw"):
        r = CliRunner().invoke(cli, [command, *flags])
        assert isinstance(r.exception, _Captured), (command, r.output)
        if command == "hw":
            assert r.output.splitlines()[0].startswith("deployment  prefill ")
    assert sim["cfg"] == hw["cfg"] and sim["cfg"].to_dict() == hw["cfg"].to_dict()
    assert sim["workload"].requests == hw["workload"].requests
    assert sim["params"] == hw["params"]


def test_own_workload_runs_on_sglang_defaults_in_both_modes(monkeypatch) -> None:
    hw: dict = {}
    _capture(monkeypatch, "twin.hw.run", "run_hw", hw)
    r = CliRunner().invoke(cli, ["hw", "--workload", "poisson:n=2,rate=10,input=512,output=4"])
    assert isinstance(r.exception, _Captured)
    assert hw["cfg"] == TwinConfig()  # 8B-class model, 4096 MiB ring, chunk 8192


# -- configurations in which nothing can succeed ----------------------------------------------
def test_a_ring_smaller_than_one_chunk_is_rejected_naming_the_ring_that_works() -> None:
    r = invoke("sim", "--config", str(EXAMPLE), "--env", "SGLANG_DISAGG_STAGING_POOL_SIZE_MB=64")
    assert r.exit_code == 2
    assert "no request can succeed" in r.stderr
    assert "SGLANG_DISAGG_STAGING_POOL_SIZE_MB=128" in r.stderr
    r = invoke("sim", "--config", str(EXAMPLE), "--env", "SGLANG_DISAGG_STAGING_POOL_SIZE_MB=128",
               "--json")
    assert r.exit_code == 0, r.output


def test_a_ring_too_small_for_some_requests_runs_and_says_so() -> None:
    """SGLang's default deployment: a token is 64 KiB on one decode rank, so a 64 MiB ring
    holds 1024-token chunks; longer prompts fail (exit 5) and the run says so up front."""
    args = ("sim", "--workload", "poisson:n=20,rate=20,input=1000~800,output=4,seed=2",
            "--env", "SGLANG_DISAGG_STAGING_POOL_SIZE_MB=64")
    r = invoke(*args)
    assert r.exit_code == 5, r.output
    assert "request(s) send a chunk larger than the ring" in r.output and "will fail" in r.output
    s = json.loads(invoke(*args, "--json").output)
    assert s["completed"] > 0 and s["failed"] > 0 and s["status"] == "failed"


# -- verdicts ---------------------------------------------------------------------------------
def test_every_request_failing_exits_5_and_says_failed() -> None:
    r = invoke("sim", "--fault", "fail-transfer:p=1", "--prefill-args",
               "--disaggregation-transfer-backend nixl")
    assert r.exit_code == 5
    assert "status      failed" in r.output and "0 completed, 128 failed" in r.output
    assert "fault       fail-transfer:p=1: fired" in r.output


def test_fault_report_flags_a_fault_that_never_fired() -> None:
    r = invoke("sim", "--fault", "drop:WATERMARK:nth=3", "--fault", "abort:room=5:at=1000",
               "--json")
    s = json.loads(r.output)
    report = {f["fault"]: f for f in s["fault_report"]}
    assert report["drop:WATERMARK:nth=3"]["fired"] == 1
    assert report["abort:room=5:at=1000"] == {"fault": "abort:room=5:at=1000", "fired": 0,
                                              "note": "never fired"}
    r = invoke("sim", "--fault", "abort:room=5:at=1000")
    assert "abort:room=5:at=1000: fired 0 times  <- never fired" in r.output


@pytest.mark.parametrize(("spec", "needle"), [
    ("crash:zzz:at=1", "'zzz' is not a node"),
    ("crash:d0g0r9:at=1", "did you mean"),
    ("drop:WATERMARK:nth=0", "counts from 1"),
    ("delay:CHUNK_READY:ms=-5", "'ms': must not be negative"),
    ("abort:room=128:at=1", "room 128 does not exist"),
    ("drop:WATERMARK:room=1", "carry no room"),
    ("drop:STAGING_RSP:chunk=99", "chunk 99 does not exist"),
    ("fail-transfer:node=d0g0r0", "transfers start on prefill ranks"),
    ("drop:WATERMARK:p=0.5:nth=2", "not both"),
])
def test_faults_that_cannot_fire_are_rejected(spec: str, needle: str) -> None:
    r = invoke("sim", "--fault", spec)
    assert r.exit_code == 2 and needle in r.stderr, r.stderr


def test_hw_rejects_a_pool_smaller_than_one_request() -> None:
    r = invoke("hw", "--workload", "poisson:n=4,rate=10,input=4096,output=4",
               "--config", str(ROOT / "examples" / "tp2-tp1-small.toml"), "--kv-pool-pages", "100")
    assert r.exit_code == 2
    assert "--kv-pool-pages 100: the longest request needs 256 pages" in r.stderr
    assert "--kv-pool-pages 256" in r.stderr


def test_sim_says_where_it_wrote(tmp_path: Path) -> None:
    r = invoke("sim", "--workload", "poisson:n=4,rate=10,input=512,output=4",
               "--plot", str(tmp_path / "p"), "--metrics-out", str(tmp_path / "m"))
    assert r.exit_code == 0
    assert (f"plots       {tmp_path / 'p'}/ (decode.png, deferrals.png, latency.png, ring.png)"
            in r.output)
    assert f"metrics     {tmp_path / 'm'}/ (decode_batch.csv, metrics.json" in r.output
