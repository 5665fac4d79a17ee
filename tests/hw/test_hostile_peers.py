"""Processes outside a hardware run cannot make it run code, corrupt it or crash it.

A run across "nodes" on loopback: a coordinator (``twin hw --listen``) and one joined agent
(``twin agent --join``) that starts every rank, all control sockets within a known port range.
While it runs, two attackers send to every port the run listens on:

* an outsider without the run's secret: pickle payloads whose ``__reduce__`` would create a
  file, in every frame position under every frame tag the project uses and SGLang's own tags
  (a forged ``KV_STATUS`` Success among them), plus garbage, plain and over CurveZMQ with a key
  of its own, plus raw bytes on TCP. Every connection is refused at the handshake and counted;
* an insider that holds the secret (a buggy process of the run): the same payloads under the
  twin's control tags whose bodies must decode. Each is dropped with one note.

The run must complete with every request byte-verified, no payload may run, and nothing may
print a traceback.
"""

from __future__ import annotations

import json
import os
import pickle
import random
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import zmq

from twin.hw import messages
from twin.hw.auth import SECRET_FILE_ENV, RunKey, key_from_env, write_key_file
from twin.hw.nodes import AGENT_LAUNCH, AGENT_PING, AGENT_STOP, AGENT_TAGS, AGENT_WELCOME
from twin.hw.rankspec import ABORT, CMD, DIRECTORY, HELLO, META, PEER, RECORDS, REPORT, STATE
from twin.runtime.outcome import EXIT_OK

pytestmark = pytest.mark.hw

ROOT = Path(__file__).resolve().parents[2]
SMALL = str(ROOT / "examples" / "tp2-tp1-small.toml")
TWIN_TAGS = [CMD, RECORDS, STATE, REPORT, HELLO, DIRECTORY, META, ABORT, PEER, b"TWIN_READY",
             b"TWIN_START", b"TWIN_STOP", b"TWIN_WARM", b"TWIN_BOOTSTRAP", AGENT_LAUNCH,
             AGENT_PING, AGENT_STOP, AGENT_WELCOME, b"TWIN_AGENT_REJECT", *sorted(AGENT_TAGS)]
SGLANG_TAGS = [b"STAGING_REQ", b"STAGING_RSP", b"WATERMARK", b"CHUNK_READY", b"KV_STATUS",
               b"ABORT", b"ABORT_ACK"]
#: Insider frames: twin control kinds whose bodies are decoded (a valid STOP would stop a rank).
INSIDER_TAGS = [CMD, RECORDS, STATE, REPORT, HELLO, META, ABORT, PEER, AGENT_LAUNCH, AGENT_PING]


class Payload:
    """Unpickling this runs ``touch MARKER``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (os.system, (f"touch {self.marker}",))


def _free_range(n: int) -> tuple[int, int]:
    """``n`` consecutive free TCP ports on loopback."""
    rng = random.Random(os.getpid())
    for _ in range(200):
        lo = rng.randrange(30000, 60000 - n)
        try:
            for p in range(lo, lo + n + 1):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
        except OSError:
            continue
        return lo, lo + n - 1
    raise RuntimeError("no free port range")


def _frames(marker_dir: Path, tags: list[bytes]) -> list[list[bytes]]:
    """Every tag with a pickle payload in each frame position (1..4), and with garbage."""
    out = []
    for i, tag in enumerate(tags):
        for pos in range(1, 5):
            frames = [tag] + [b"0"] * 4
            frames[pos] = pickle.dumps(Payload(marker_dir / f"ran-{i}-{pos}"))
            out.append(frames)
        out.append([tag, b"\x80\x04garbage", b"\xff" * 64])
    # A forged SGLang status: Success for rooms not written yet.
    out += [[b"KV_STATUS", str(room).encode(), b"0", b"Success"] for room in range(20)]
    return out


def _send_all(ctx: zmq.Context[Any], ports: list[int], frames: list[list[bytes]],
              key: RunKey | None, wrong_key: bool = False) -> int:
    sent = 0
    for port in ports:
        s = ctx.socket(zmq.PUSH)
        s.setsockopt(zmq.LINGER, 500)
        s.setsockopt(zmq.SNDTIMEO, 200)
        if key is not None:
            key.join(s)
        elif wrong_key:
            pub, sec = zmq.curve_keypair()
            s.curve_secretkey, s.curve_publickey, s.curve_serverkey = sec, pub, pub
        s.connect(f"tcp://127.0.0.1:{port}")
        for f in frames:
            try:
                s.send_multipart(f)
                sent += 1
            except zmq.Again:
                break
        s.close()
    return sent


def _raw_garbage(ports: list[int]) -> None:
    for port in ports:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5) as c:
                c.sendall(b"\xff\x00\x00\x00\x00\x00\x00\x00\x01\x7f" + os.urandom(200))
        except OSError:
            pass


def _listening(ports: list[int]) -> list[int]:
    up = []
    for port in ports:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                up.append(port)
        except OSError:
            pass
    return up


def test_peers_outside_the_run_cannot_run_code_or_corrupt_it(tmp_path: Path) -> None:
    key = RunKey.new()
    secret = write_key_file(key, tmp_path / "run-secret")
    env = {**os.environ, "PYTHONPATH": str(ROOT), SECRET_FILE_ENV: str(secret)}
    lo, hi = _free_range(12)
    listen = hi + 1
    markers = tmp_path / "markers"
    markers.mkdir()
    agent = subprocess.Popen(
        [sys.executable, "-m", "twin", "agent", "--join", f"127.0.0.1:{listen}", "--name",
         "node-a", "--address", "127.0.0.1", "--control-ports", f"{lo}-{hi}"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path)
    coord = subprocess.Popen(
        [sys.executable, "-m", "twin", "hw", "--config", SMALL, "--workload",
         "poisson:n=30,rate=3,input=600,output=4", "--listen", f"127.0.0.1:{listen}",
         "--agents", "1", "--control-ports", f"{lo}-{hi}", "--fix", "drop-late-staging-req",
         "--timeout", "200", "--json"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path)
    ports = [listen, *range(lo, hi + 1)]
    outsider = _frames(markers, TWIN_TAGS + SGLANG_TAGS)
    insider = [f for f in _frames(markers, INSIDER_TAGS) if f[0] != b"KV_STATUS"]
    ctx: zmq.Context[Any] = zmq.Context()
    insider_to_coordinator = 0
    rounds = 0
    try:
        deadline = time.monotonic() + 240
        while coord.poll() is None and time.monotonic() < deadline:
            up = _listening(ports)
            if len(up) >= 3:  # the coordinator, the agent and at least one rank
                _send_all(ctx, up, outsider, None)
                _send_all(ctx, up, outsider[:40], None, wrong_key=True)
                _raw_garbage(up)
                if rounds < 2:  # a buggy insider: a few rounds are enough to see every note
                    insider_to_coordinator += _send_all(ctx, [listen], insider, key)
                    _send_all(ctx, [p for p in up if p != listen], insider, key)
                rounds += 1
            time.sleep(0.3)
        out, _ = coord.communicate(timeout=60)
        agent_out, _ = agent.communicate(timeout=60)
    finally:
        for p in (coord, agent):
            if p.poll() is None:
                p.kill()
        ctx.term()
    assert rounds >= 2, out
    assert "Traceback" not in out and "Traceback" not in agent_out, out + agent_out
    assert list(markers.iterdir()) == [], "a payload ran"
    assert coord.returncode == EXIT_OK, out[-3000:]
    s = json.loads(out[out.index("{"):])
    assert s["status"] == "completed" and s["completed"] == 30 and s["verified"] == 30, s
    # Refused at the handshake, counted on the coordinator's socket and the ranks'.
    assert s["refused_connections"].get("coordinator", 0) > 0, s["refused_connections"]
    assert any(k != "coordinator" for k in s["refused_connections"]), s["refused_connections"]
    assert any("refused" in n and "without this run's key" in n for n in s["notes"]), s["notes"]
    # The insider's frames to the coordinator: each one dropped, each one note.
    dropped = [n for n in s["notes"] if n.startswith("dropped a ")]
    assert s["dropped_frames"] == len(dropped) == insider_to_coordinator, (
        s["dropped_frames"], len(dropped), insider_to_coordinator)
    assert "refused" in agent_out, agent_out


def test_control_messages_never_unpickle(tmp_path: Path) -> None:
    """The decoders refuse a pickle (and garbage) as a :class:`messages.BadFrame`, for every
    body kind; nothing runs."""
    marker = tmp_path / "ran"
    blob = pickle.dumps(Payload(marker))
    for kind in (messages.Command, messages.Records, messages.RankState, messages.Launch):
        for data in (blob, b"", b"\x80", b"\xc1", b"\x93\x01\x02\x03", b"\xff" * 64):
            with pytest.raises(messages.BadFrame):
                messages.decode(data, kind)
    with pytest.raises(messages.BadFrame):
        messages.decode_records(messages.encode(messages.Records(
            records=[(0.0, {"type": "os.system"}, [])], reports=[], upto=0.0)), "test")
    with pytest.raises(messages.BadFrame):
        messages.decode_launch(messages.encode(messages.Launch(specs=[{"node": 1}])), "test")
    with pytest.raises(messages.BadFrame):
        messages.json_object(blob)
    assert not marker.exists()


def test_no_unpickling_of_what_a_socket_or_user_file_delivers() -> None:
    """Nothing in the package unpickles, evaluates, builds code with ``exec`` or reads
    ``marshal``: what crosses a pipe or a socket is typed msgpack (``msgspec``). One ``exec``
    is by design: the reference loader runs SGLang 0.5.23's own staging source out of its
    released wheel (the code the exposure check and the differential tests compare against),
    as installing that wheel would; no frame, trace or config reaches it."""
    def grep(pattern: str) -> list[str]:
        return subprocess.run(["grep", "-rnE", pattern, "twin/", "--include=*.py"],
                              cwd=ROOT, capture_output=True, text=True).stdout.splitlines()

    hits = grep(r"pickle\.loads?\(|[^_.a-z]eval\(|exec\(|marshal\.loads?\(")
    assert [h.split(":", 1)[0] for h in hits] == ["twin/reference/sglang_wheel.py"], hits
    assert hits[0].endswith("exec(code, module.__dict__)"), hits


def test_run_secret_sources_are_checked(tmp_path: Path) -> None:
    key = RunKey.new()
    assert key_from_env({}) is None
    assert key_from_env({"TWIN_RUN_SECRET": key.secret.decode()}) == key
    f = write_key_file(key, tmp_path / "s")
    assert f.stat().st_mode & 0o777 == 0o600
    assert key_from_env({SECRET_FILE_ENV: str(f)}) == key
    f.chmod(0o644)
    with pytest.raises(ValueError, match="other users can read it"):
        key_from_env({SECRET_FILE_ENV: str(f)})
    with pytest.raises(ValueError, match="cannot read it"):
        key_from_env({SECRET_FILE_ENV: str(tmp_path / "missing")})
    with pytest.raises(ValueError, match="40 characters"):
        key_from_env({"TWIN_RUN_SECRET": "short"})
    assert key.secret.decode() not in repr(key)


def test_an_agent_without_the_secret_is_told_how_to_get_it() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TWIN_RUN_SECRET")}
    r = subprocess.run([sys.executable, "-m", "twin", "agent", "--join", "127.0.0.1:9"],
                       env={**env, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 2, r.stdout + r.stderr
    assert SECRET_FILE_ENV in r.stdout + r.stderr and "Traceback" not in r.stderr
