"""Every bad value on the command line ends in exit 2 with a message, never a traceback.

Hypothesis generates bad flag values, fault specs, environment items, config files and output
paths and feeds them to `twin sim` and `twin hw` through click's CliRunner. A bad value must be
rejected before anything runs: the workload is tiny anyway, so a value that slips through shows
up as a wrong exit status, not a slow test.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from click.testing import CliRunner, Result
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from twin.cli import cli
from twin.launch_args import KNOWN_ENV

SMALL = ("--workload", "poisson:n=2,rate=10,input=256,output=4,seed=1")
EXAMPLES = settings(max_examples=40, suppress_health_check=[HealthCheck.function_scoped_fixture])


def invoke(*args: str) -> Result:
    return CliRunner().invoke(cli, list(args), catch_exceptions=True)


def assert_rejected(r: Result, *args: str) -> None:
    text = r.output
    assert r.exit_code == 2, (args, r.exit_code, text, r.exception)
    assert "Traceback" not in text, (args, text)
    assert isinstance(r.exception, SystemExit), (args, repr(r.exception))
    assert text.strip(), args


def _not_positive_number(text: str) -> bool:
    try:
        x = float(text)
    except ValueError:
        return True
    return not math.isfinite(x) or x <= 0


BAD_FLOAT = st.one_of(
    st.sampled_from(["-1", "0", "-0.0", "nan", "NaN", "inf", "-inf", "", "1e400", "abc", "1,5"]),
    st.floats(max_value=0).map(repr),
    st.text(max_size=6).filter(_not_positive_number),
)
BAD_INT = st.one_of(st.integers(max_value=0).map(str),
                    st.sampled_from(["", "1.5", "nan", "x", "2e3"]))


@EXAMPLES
@given(flag=st.sampled_from(["--until", "--slowdown"]), value=BAD_FLOAT,
       command=st.sampled_from(["sim", "hw"]))
def test_bad_float_flags(flag: str, value: str, command: str) -> None:
    args = (command, *SMALL, flag, value)
    assert_rejected(invoke(*args), *args)


@EXAMPLES
@given(flag=st.sampled_from(["--max-concurrency", "--first-n"]), value=BAD_INT,
       command=st.sampled_from(["sim", "hw"]))
def test_bad_int_flags(flag: str, value: str, command: str) -> None:
    args = (command, *SMALL, flag, value)
    assert_rejected(invoke(*args), *args)


@EXAMPLES
@given(value=BAD_INT)
def test_bad_kv_pool_pages(value: str) -> None:
    args = ("hw", *SMALL, "--kv-pool-pages", value)
    assert_rejected(invoke(*args), *args)


NODE = st.text(alphabet="pdgr0123456789xz", min_size=1, max_size=8).filter(
    lambda s: s not in ("p0g0r0", "p0g0r1", "p0g0r2", "p0g0r3", "d0g0r0", "d0g0r1"))
KIND = st.sampled_from(["STAGING_REQ", "STAGING_RSP", "WATERMARK", "CHUNK_READY", "KV_STATUS"])
BAD_FAULT = st.one_of(
    st.builds(lambda n: f"crash:{n}:at=1", NODE),
    st.builds(lambda n: f"restart:{n}:at=1:down=1", NODE),
    st.builds(lambda k, n: f"drop:{k}:nth={n}", KIND, st.integers(max_value=0)),
    st.builds(lambda k, ms: f"delay:{k}:ms={ms!r}", KIND,
              st.floats(max_value=-1e-9, allow_nan=False) | st.just(float("nan"))),
    st.builds(lambda r: f"abort:room={r}:at=0.1", st.integers(min_value=2, max_value=10**6)),
    st.builds(lambda a: f"abort:room=0:at={a!r}", st.floats(max_value=-1e-9) |
              st.sampled_from([float("nan"), float("inf")])),
    st.builds(lambda k, p: f"drop:{k}:p={p!r}", KIND,
              st.floats(min_value=1.0001) | st.floats(max_value=-1e-9) | st.just(float("nan"))),
    st.builds(lambda n: f"fail-transfer:node={n}", NODE),
    st.builds(lambda k, key: f"drop:{k}:{key}=1", KIND, st.sampled_from(["at", "down", "ms",
                                                                        "node", "zzz"])),
    st.text(max_size=20).filter(lambda s: s.split(":")[0] not in (
        "drop", "delay", "dup", "reorder", "fail-send", "fail-transfer", "crash", "restart",
        "abort")),
)


@EXAMPLES
@given(spec=BAD_FAULT)
def test_bad_faults(spec: str) -> None:
    args = ("sim", *SMALL, "--fault", spec)
    assert_rejected(invoke(*args), *args)


ENV_KEY = st.text(alphabet="ABCDEFGHIJKLMNOPQRSTUVWXYZ_", min_size=1, max_size=40).filter(
    lambda k: k not in KNOWN_ENV)
BAD_ENV = st.one_of(
    st.builds(lambda k, v: f"{k}={v}", ENV_KEY, st.text(alphabet="0123456789", max_size=4)),
    st.builds(lambda k: f"SGLANG_{k}=1", ENV_KEY),
    st.builds(lambda v: f"SGLANG_DISAGG_STAGING_POOL_SIZE_MB={v}",
              st.sampled_from(["", "x", "1.5", "0", "-4", "nan"])),
    st.builds(lambda v: f"SGLANG_DISAGG_STAGING_BUFFER={v}", st.sampled_from(["0", "no", "x"])),
    st.text(alphabet="ABC_", max_size=10),  # no '='
)


@EXAMPLES
@given(item=BAD_ENV, command=st.sampled_from(["sim", "hw"]))
def test_bad_env(item: str, command: str) -> None:
    args = (command, *SMALL, "--env", item)
    assert_rejected(invoke(*args), *args)


CONFIG_KEY = st.text(alphabet="abcdefghijklmnopqrstuvwxyz_", min_size=1, max_size=20)
KNOWN_TOP = {"model", "prefill", "decode", "sim", "launch", "chunked_prefill_size", "page_size",
             "staging_pool_size_mb", "staging_pool_size_bytes", "transfer_queue_size",
             "prefill_staging_buffer_pages", "waiting_timeout_s", "bootstrap_timeout_s",
             "enable_prefill_context_parallel", "deferral_wait_s", "late_register_delay_s"}
BAD_CONFIG = st.one_of(
    st.binary(min_size=1, max_size=200).map(lambda b: b"\xff\xfe\x00" + b),
    st.builds(lambda k: f"{k} = 1\n".encode(), CONFIG_KEY.filter(lambda k: k not in KNOWN_TOP)),
    st.builds(lambda k: f"[{k}]\nx = 1\n".encode(), CONFIG_KEY.filter(
        lambda k: k not in KNOWN_TOP)),
    st.builds(lambda table, k: f"[{table}]\n{k} = 1\n".encode(),
              st.sampled_from(["model", "prefill", "decode", "sim"]),
              CONFIG_KEY.filter(lambda k: len(k) > 2)).filter(
        lambda b: not any(f"\n{k} =" in b.decode() for k in (
            "num_layers", "num_kv_heads", "head_dim", "dtype_bytes", "is_mla", "tp_size",
            "dp_size", "pp_size", "instances", "zmq_latency_s", "zmq_jitter_s",
            "rdma_latency_s", "ranks_per_nic", "kernel_launch_s", "forward_overhead_s",
            "prefill_s_per_token", "prefill_s_per_token_ctx", "decode_step_s",
            "decode_prealloc_s", "late_register_delay_s", "prefill_radix_tokens",
            "decode_radix_tokens", "wedge_window_s", "deferral_wait_s",
            "decode_poll_interval_s"))),
    st.builds(lambda k, v: f"[sim]\n{k} = {v}\n".encode(),
              st.sampled_from(["nic_bandwidth_Bps", "gather_bandwidth_Bps",
                               "scatter_bandwidth_Bps", "decode_poll_interval_s",
                               "wedge_window_s"]),
              st.sampled_from(["0", "0.0", "nan", "-1", "inf", "-inf", '"fast"'])),
    st.builds(lambda heads, tp: f"[model]\nnum_kv_heads = {heads}\n[prefill]\ntp_size = {tp}\n"
              .encode(), st.sampled_from([4, 8]), st.sampled_from([3, 5, 6, 7])),
)


@EXAMPLES
@given(content=BAD_CONFIG, command=st.sampled_from(["sim", "hw"]))
def test_bad_config_files(tmp_path_factory: pytest.TempPathFactory, content: bytes,
                          command: str) -> None:
    path = tmp_path_factory.mktemp("cfg") / "bad.toml"
    path.write_bytes(content)
    args = (command, *SMALL, "--config", str(path))
    assert_rejected(invoke(*args), *args)


@EXAMPLES
@given(name=st.text(alphabet="abcxyz_-.", min_size=1, max_size=10).filter(
    lambda s: s not in (".", "..")), flag=st.sampled_from(["--trace-out", "--plot",
                                                          "--metrics-out"]))
def test_outputs_in_a_missing_folder(tmp_path_factory: pytest.TempPathFactory, name: str,
                                     flag: str) -> None:
    path = tmp_path_factory.mktemp("out") / "missing" / name
    args = ("sim", *SMALL, flag, str(path))
    assert_rejected(invoke(*args), *args)


@pytest.mark.parametrize("args", [
    ("sim", "--trace-out", "/dev/full"),
    ("hw", "--trace-out", "/nonexistent-folder/t.jsonl"),
    ("sim", "--prefill-args", "--tp-szie 4"),
    ("sim", "--prefill-args", "--tp-size four"),
    ("sim", "--decode-args", "--disaggregation-mode prefill"),
    ("sim", "--prefill-args", "'unclosed"),
    ("sim", "--scenario", "warmup-stal"),
    ("sim", "--scenario-defects"),
    ("hw", "--fault", "crash:d9g0r0:at=1"),
    ("hw", "--fault", "restart:d0g0r0:at=1:down=1"),
    ("hw", "--prefill-gpus", "0,x"),
    ("sim", "--env", "SGLANG_DISAGG_STAGING_POOL_SIZE_MB=1", "--prefill-args",
     "--chunked-prefill-size 8192"),
])
def test_named_bad_inputs(args: tuple[str, ...]) -> None:
    assert_rejected(invoke(*args[:1], *SMALL, *args[1:]), *args)


def test_a_binary_trace_as_workload(tmp_path: Path) -> None:
    blob = tmp_path / "blob.jsonl"
    blob.write_bytes(b"\xff\xfe\x00\x01" * 100)
    assert_rejected(invoke("sim", "--workload", str(blob)), "sim", "--workload")


def test_a_trace_too_big_to_replay_on_this_host(tmp_path: Path) -> None:
    """A hardware replay holds every room's KV at once: a trace that would not fit in host
    memory is refused before any rank starts (it was OOM-killed rank by rank), with the need,
    what is available and what to do."""
    trace = tmp_path / "long.jsonl.zst"
    r = invoke("sim", "--workload", "poisson:n=60,rate=5,input=50000,output=4,seed=1",
               "--trace-out", str(trace))
    assert r.exit_code == 0, r.output
    r = invoke("replay", str(trace), "--mode", "hw")
    assert_rejected(r, "replay", "--mode", "hw")
    for text in ("long.jsonl.zst: the ranks would take", "GiB of host memory",
                 "GiB is available", "replay a shorter trace"):
        assert text in r.output, r.output


def test_until_is_one_word_in_the_console_and_the_trace(tmp_path: Path) -> None:
    """A run stopped by --until says `until` on the console and in the trace's Outcome (the
    trace said `interrupted`, the word for Ctrl-C and signals); the replay agrees, exit 0."""
    from twin.trace.format import read_trace

    trace = tmp_path / "u.jsonl"
    r = invoke("sim", "--workload", "poisson:n=50,rate=5,input=256,output=4,seed=1",
               "--until", "2", "--trace-out", str(trace))
    assert r.exit_code == 0, r.output
    assert "status      until" in r.output, r.output
    outcome = read_trace(trace).outcome
    assert outcome is not None and outcome["status"] == "until", outcome
    assert any("--until" in line for line in outcome["diagnosis"]), outcome
    r = invoke("replay", str(trace))
    assert r.exit_code == 0, r.output
    assert "until" in r.output and "interrupted" not in r.output, r.output


@pytest.mark.parametrize("command", ["sim", "hw"])
def test_an_env_variable_given_twice(command: str) -> None:
    """Every other one-value option given twice is rejected; so is one --env KEY twice (the
    last one won silently)."""
    args = (command, *SMALL, "--env", "SGLANG_DISAGG_STAGING_POOL_SIZE_MB=64",
            "--env", "SGLANG_DISAGG_STAGING_POOL_SIZE_MB=128")
    r = invoke(*args)
    assert_rejected(r, *args)
    assert "--env SGLANG_DISAGG_STAGING_POOL_SIZE_MB given 2 times" in r.output, r.output


@pytest.mark.parametrize("flag", ["--prefill-gpus", "--decode-gpus"])
def test_gpus_for_a_run_on_the_cpu(flag: str) -> None:
    """GPU lists place ranks on GPUs; with --device cpu they were ignored silently."""
    args = ("hw", *SMALL, "--device", "cpu", flag, "0,1,2,3")
    r = invoke(*args)
    assert_rejected(r, *args)
    assert f"{flag} '0,1,2,3'" in r.output and "--device cuda" in r.output, r.output


@pytest.mark.parametrize("command", ["sim", "hw"])
@pytest.mark.parametrize("spec", ["{}", "trace:path={},first_n=1"])
def test_a_trace_out_that_is_the_workload(tmp_path: Path, command: str, spec: str) -> None:
    """--trace-out naming the workload file would overwrite the input (it did)."""
    workload = tmp_path / "w.jsonl"
    text = '{"timestamp": 0, "input_length": 256, "output_length": 4}\n'
    workload.write_text(text)
    args = (command, "--workload", spec.format(workload), "--trace-out", str(workload))
    r = invoke(*args)
    assert_rejected(r, *args)
    assert "--workload file this run reads" in r.output, r.output
    assert workload.read_text() == text


@pytest.mark.parametrize("command", ["sim", "hw"])
@pytest.mark.parametrize("suffix", [".bz2", ".xz", ".zip", ".jsonl.lz4"])
def test_a_trace_out_with_a_compression_the_writer_lacks(tmp_path: Path, command: str,
                                                        suffix: str) -> None:
    """`--trace-out x.bz2` wrote plain text under a bzip2 name."""
    out = tmp_path / f"t{suffix}"
    args = (command, *SMALL, "--trace-out", str(out))
    r = invoke(*args)
    assert_rejected(r, *args)
    assert "gzip (.gz) or zstd (.zst)" in r.output, r.output
    assert not out.exists()


def test_a_workload_that_is_not_a_trace_is_quoted_briefly(tmp_path: Path) -> None:
    """An unknown format quotes a short excerpt of the file, not its first line (which echoed
    /etc/passwd's)."""
    path = tmp_path / "passwd"
    path.write_text("root:x:0:0:root:/root:/bin/bash-AND-THE-REST-OF-THE-LINE\n")
    r = invoke("sim", "--workload", str(path))
    assert_rejected(r, "sim", "--workload", str(path))
    assert f"{path}:1: unknown trace format" in r.output
    assert "root:x:0:0" in r.output and "THE-REST" not in r.output, r.output


@pytest.mark.parametrize(("content", "message"), [
    (b"\0" * (8 << 20), ":1: line longer than 1048576 bytes"),
    (b"\n" * (80 << 20), "decompresses to more than 100x its size"),
])
def test_a_decompression_bomb_as_workload(tmp_path: Path, content: bytes, message: str) -> None:
    """A small gzip that expands enormously is refused while reading, a block at a time (the
    reader held the whole decompressed file: 2.1 GB for a 1 MB gzip of 1 GB)."""
    import gzip
    import tracemalloc

    from twin.workloads import WorkloadError, load_trace

    path = tmp_path / "bomb.jsonl.gz"
    path.write_bytes(gzip.compress(content, 9))
    del content
    tracemalloc.start()
    try:
        with pytest.raises(WorkloadError, match=message):
            load_trace(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 8 << 20, peak
    r = invoke("sim", "--workload", str(path))
    assert_rejected(r, "sim", "--workload", str(path))
    assert message in r.output, r.output


@pytest.mark.parametrize("spec", ["poisson:n=1000000000000,rate=10",
                                  "bursty:n=1000000000000,burst=4,gap=1",
                                  "shared-prefix:groups=1000000,per_group=1000000,system=8,"
                                  "question=8"])
def test_more_requests_than_memory_holds(spec: str) -> None:
    """A workload too large for this host's memory is refused before it is generated (numpy
    raised _ArrayMemoryError with a traceback), naming the limit."""
    r = invoke("sim", "--workload", spec)
    assert_rejected(r, "sim", "--workload", spec)
    assert "requests would take about" in r.output and "at most" in r.output, r.output


def test_absurd_lengths_in_a_trace_row(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text('{"timestamp": 0, "input_length": 16, "output_length": 4}\n'
                    '{"timestamp": 1, "input_length": 1e30, "output_length": 4}\n')
    r = invoke("sim", "--workload", str(path))
    assert_rejected(r, "sim", "--workload", str(path))
    assert f"{path}:2: field 'input_length': expected at most 2147483647 tokens" in r.output
    spec = "poisson:n=5,rate=1,input=99999999999999999999"
    r = invoke("sim", "--workload", spec)
    assert_rejected(r, "sim", "--workload", spec)
    assert "key 'input': expected an integer in [0, 2147483647]" in r.output, r.output


@pytest.mark.parametrize(("command", "side"), [("sim", "prefill"), ("sim", "decode"),
                                               ("hw", "decode")])
def test_a_prompt_larger_than_a_kv_pool(command: str, side: str) -> None:
    """SGLang aborts a prompt of max_total_tokens - 6 tokens or more; the twin wedged on it
    (decode: exit 3, no root) or ran it past the pool (prefill: exit 0, peak 1025 of 10)."""
    args = (command, "--workload", "poisson:n=5,rate=1", f"--{side}-args",
            "--max-total-tokens 10")
    r = invoke(*args)
    assert_rejected(r, *args)
    for text in ("request 0 of 'poisson' has 1024 input tokens", f"the {side} server's KV pool "
                 "is 10 tokens", "aborts a prompt of 4 tokens or more", "5 of 5 request(s)"):
        assert text in r.output, r.output


def test_an_output_the_decode_pool_would_cut() -> None:
    args = ("sim", "--workload", "poisson:n=3,rate=1,input=50,output=1000", "--decode-args",
            "--max-total-tokens 100")
    r = invoke(*args)
    assert_rejected(r, *args)
    assert "would cut its output to 48 tokens" in r.output, r.output


def test_a_pool_sglang_refuses_to_start_with() -> None:
    args = ("sim", *SMALL, "--prefill-args", "--max-total-tokens 6")
    r = invoke(*args)
    assert_rejected(r, *args)
    assert "Memory pool size is too small" in r.output, r.output


def test_requests_that_fit_a_small_pool_complete() -> None:
    """One at a time, requests that fit the decode pool alone all complete (no wedge)."""
    r = invoke("sim", "--workload", "poisson:n=5,rate=100,input=40,output=50",
               "--decode-args", "--max-total-tokens 100", "--prefill-args",
               "--max-total-tokens 60", "--json")
    assert r.exit_code == 0, r.output
    import json

    s = json.loads(r.output)
    assert s["completed"] == 5
    assert s["serving"]["prefill"]["peak_kv_tokens"] <= 60


@pytest.mark.parametrize("command", ["sim", "hw", "config"])
def test_dp_size_without_dp_attention(command: str) -> None:
    """SGLang runs --dp-size 2 without --enable-dp-attention as two independent TP4 servers
    (its data-parallel controller); the twin took it as one TP4 server while `config show` said
    dp_size = 2. It is rejected, naming what SGLang would run and the twin's two ways."""
    args = (*(("config", "show") if command == "config" else (command, *SMALL)),
            "--prefill-args", "--tp-size 4 --dp-size 2")
    r = invoke(*args)
    assert_rejected(r, *args)
    for text in ("'prefill.dp_size'", "2 independent TP4 servers (8 GPUs)",
                 "--enable-dp-attention", "instances = 2"):
        assert text in r.output, r.output
    ok = invoke("config", "show", "--prefill-args",
                "--tp-size 4 --dp-size 2 --enable-dp-attention")
    assert ok.exit_code == 0 and "dp_size = 2" in ok.output, ok.output
