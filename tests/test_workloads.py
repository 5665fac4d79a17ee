"""Tests for twin.workloads: trace readers, generators, spec strings and PrefixCache."""

from __future__ import annotations

import gzip
import json
import math
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from twin.workloads import (
    PrefixCache,
    Request,
    Workload,
    WorkloadError,
    bursty,
    fixed,
    load_trace,
    parse_workload_spec,
    poisson,
    shared_prefix,
)


def _find_traces() -> Path | None:
    """The public sample traces live in ``shared/traces/`` next to the repository."""
    for parent in Path(__file__).resolve().parents:
        candidate = parent / "shared" / "traces"
        if candidate.is_dir():
            return candidate
    return None


TRACES = _find_traces()
needs_traces = pytest.mark.skipif(
    TRACES is None, reason="sample traces folder shared/traces/ not found next to the repository"
)
MOONCAKE = TRACES / "mooncake" / "synthetic_trace.jsonl" if TRACES else Path("missing")
AZURE = TRACES / "azure2023" / "AzureLLMInferenceTrace_code.csv" if TRACES else Path("missing")

AZURE_HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens"


def _mooncake_line(ts: float, inp: int = 1000, out: int = 10, hashes: list | None = None) -> str:
    if hashes is None:
        hashes = list(range(math.ceil(inp / 512)))
    return json.dumps(
        {"timestamp": ts, "input_length": inp, "output_length": out, "hash_ids": hashes}
    )


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def _write_bytes(path: Path, text: str) -> Path:
    """Write ``text`` as UTF-8 with no newline translation."""
    path.write_bytes(text.encode())
    return path


# --------------------------------------------------------------------------------------------
# Sample traces
# --------------------------------------------------------------------------------------------


@needs_traces
def test_mooncake_sample_loads() -> None:
    w = load_trace(MOONCAKE)
    assert len(w) == 3993
    assert w.duration_s == pytest.approx(1022.025)
    first, last = w.requests[0], w.requests[-1]
    assert (first.rid, first.arrival_s, first.input_len, first.output_len) == (0, 0.0, 40160, 6)
    assert first.prefix_hashes[:3] == (0, 1, 2) and len(first.prefix_hashes) == 79
    assert (last.rid, last.input_len, last.output_len) == (3992, 18440, 83)
    assert last.arrival_s == pytest.approx(1022.025)
    assert all(r.block_tokens == 512 for r in w.requests)
    assert all(len(r.prefix_hashes) == math.ceil(r.input_len / 512) for r in w.requests)
    arrivals = [r.arrival_s for r in w.requests]
    assert arrivals == sorted(arrivals)
    assert w.name == "synthetic_trace"
    assert w.source == str(MOONCAKE)


@needs_traces
def test_mooncake_sample_load_is_fast() -> None:
    best = math.inf
    for _ in range(3):
        t0 = time.perf_counter()
        load_trace(MOONCAKE)
        best = min(best, time.perf_counter() - t0)
    assert best < 0.3


@needs_traces
def test_azure_sample_loads() -> None:
    w = load_trace(AZURE)
    assert len(w) == 8819
    r0, r1, last = w.requests[0], w.requests[1], w.requests[-1]
    assert (r0.arrival_s, r0.input_len, r0.output_len) == (0.0, 4808, 10)
    # 18:17:04.0319600 - 18:17:03.9799600
    assert r1.arrival_s == pytest.approx(0.052, abs=1e-9)
    assert (r1.input_len, r1.output_len) == (3180, 8)
    # 19:14:19.9280160 - 18:17:03.9799600
    assert last.arrival_s == pytest.approx(3435.948056, abs=1e-6)
    assert (last.input_len, last.output_len) == (549, 173)
    assert w.duration_s == pytest.approx(3435.948056, abs=1e-6)
    assert all(r.prefix_hashes == () for r in w.requests)


@needs_traces
def test_first_n_and_slowdown_on_sample() -> None:
    full = load_trace(MOONCAKE)
    cut = load_trace(MOONCAKE, first_n=100, slowdown=2.0)
    assert len(cut) == 100
    for a, b in zip(full.requests[:100], cut.requests, strict=True):
        assert b.arrival_s == pytest.approx(2.0 * a.arrival_s)
        assert (a.input_len, a.output_len, a.prefix_hashes) == (
            b.input_len,
            b.output_len,
            b.prefix_hashes,
        )
    # The source of a cut workload is a spec that reproduces it.
    assert parse_workload_spec(cut.source).digest == cut.digest
    assert parse_workload_spec(str(MOONCAKE)).digest == full.digest


@needs_traces
def test_gzip_sample_same_digest(tmp_path: Path) -> None:
    gz = tmp_path / "azure_copy.bin"
    gz.write_bytes(gzip.compress(AZURE.read_bytes()))
    assert load_trace(gz).digest == load_trace(AZURE).digest


# --------------------------------------------------------------------------------------------
# Small traces: detection, ordering, options
# --------------------------------------------------------------------------------------------


def test_content_detection_ignores_extension(tmp_path: Path) -> None:
    moon = _write(tmp_path / "looks_like.csv", _mooncake_line(0) + "\n" + _mooncake_line(500))
    azure = _write(
        tmp_path / "looks_like.jsonl",
        f"{AZURE_HEADER}\n2023-11-16 18:15:46.6805900,100,5\n2023-11-16 18:15:47.1805900,200,6",
    )
    wm = load_trace(moon)
    assert [r.arrival_s for r in wm.requests] == [0.0, 0.5]
    assert wm.requests[0].prefix_hashes == (0, 1)
    wa = load_trace(azure)
    assert [(r.arrival_s, r.input_len, r.output_len) for r in wa.requests] == [
        (0.0, 100, 5),
        (0.5, 200, 6),
    ]


def test_gzip_detected_by_magic(tmp_path: Path) -> None:
    text = "\n".join(_mooncake_line(t) for t in (0, 10, 20)) + "\n"
    plain = _write(tmp_path / "t.jsonl", text)
    packed = tmp_path / "packed.csv"  # compressed; the name gives no hint
    packed.write_bytes(gzip.compress(text.encode()))
    named = tmp_path / "t.jsonl.gz"
    named.write_bytes(gzip.compress(text.encode()))
    assert load_trace(packed).digest == load_trace(plain).digest == load_trace(named).digest
    assert load_trace(named).name == "t"
    assert len(load_trace(packed)) == 3


def test_mooncake_unsorted_is_sorted_stably(tmp_path: Path) -> None:
    lines = [
        _mooncake_line(3000, inp=1),
        _mooncake_line(1000, inp=2),
        _mooncake_line(2000, inp=3),
        _mooncake_line(1000, inp=4),
        "",
    ]
    w = load_trace(_write(tmp_path / "u.jsonl", "\n".join(lines)))
    assert [r.input_len for r in w.requests] == [2, 4, 3, 1]
    assert [r.arrival_s for r in w.requests] == [0.0, 0.0, 1.0, 2.0]
    assert [r.rid for r in w.requests] == [0, 1, 2, 3]


def test_crlf_and_unicode_separators_keep_line_numbers(tmp_path: Path) -> None:
    text = "\r\n".join([AZURE_HEADER, "2023-11-16 18:15:46.1,1,1", "2023-11-16 18:15:47.1,2,2"])
    assert len(load_trace(_write_bytes(tmp_path / "a.csv", text))) == 2
    moon = '{"timestamp": 0, "input_length": 1, "output_length": 1, "note": "a\u2028b"}'
    bad = '{"timestamp": 0, "input_length": -1, "output_length": 1}'
    path = _write_bytes(tmp_path / "m.jsonl", "\r\n".join([moon, moon, bad]))
    with pytest.raises(WorkloadError, match=r"m\.jsonl:3: field 'input_length'"):
        load_trace(path)


def test_mooncake_extra_keys_and_missing_hashes(tmp_path: Path) -> None:
    text = (
        '{"timestamp": 5, "input_length": 10, "output_length": 1, "session_id": "a"}\n'
        '{"timestamp": 7.5, "input_length": 20.0, "output_length": 2, "hash_ids": [], "delay": 3}'
    )
    w = load_trace(_write(tmp_path / "x", text))
    assert [(r.arrival_s, r.input_len, r.prefix_hashes) for r in w.requests] == [
        (0.0, 10, ()),
        (0.0025, 20, ()),
    ]


def test_azure_timestamp_variants(tmp_path: Path) -> None:
    rows = [
        "2023-11-16T23:59:59.9,1,1",
        "2023-11-17 00:00:00,2,2",  # across midnight, no fraction
        "2023-11-17 00:00:01.123456789123,3,3",  # more than 9 digits: truncated to ns
        "2023-11-17 01:00:02+01:00,4,4",  # offset: 00:00:02 UTC
        "2023-11-17 00:00:03.5Z,5,5",
    ]
    w = load_trace(_write(tmp_path / "a.csv", AZURE_HEADER + "\n" + "\n".join(rows) + "\n"))
    got = [(round(r.arrival_s, 9), r.input_len) for r in w.requests]
    assert got == [(0.0, 1), (0.1, 2), (1.223456789, 3), (2.1, 4), (3.6, 5)]


def test_azure_column_order_and_sorting(tmp_path: Path) -> None:
    text = (
        "GeneratedTokens,ContextTokens,TIMESTAMP,Extra\n"
        "7,70,2024-05-10 00:00:02.000000+00:00,x\n"
        "5,50,2024-05-10 00:00:00.009930+00:00,y\n"
    )
    w = load_trace(_write(tmp_path / "a.csv", text))
    assert [(r.input_len, r.output_len) for r in w.requests] == [(50, 5), (70, 7)]
    assert w.requests[1].arrival_s == pytest.approx(1.99007)


def test_first_n_and_slowdown_small(tmp_path: Path) -> None:
    path = _write(tmp_path / "t.jsonl", "\n".join(_mooncake_line(t * 100) for t in range(10)))
    w = load_trace(path, first_n=4, slowdown=3.0)
    assert [r.arrival_s for r in w.requests] == pytest.approx([0.0, 0.3, 0.6, 0.9])
    assert len(load_trace(path, first_n=1000)) == 10
    with pytest.raises(WorkloadError, match="first_n"):
        load_trace(path, first_n=0)
    with pytest.raises(WorkloadError, match="slowdown"):
        load_trace(path, slowdown=0.0)


# --------------------------------------------------------------------------------------------
# Malformed input
# --------------------------------------------------------------------------------------------

GOOD = _mooncake_line(0)

MOONCAKE_BAD = [
    (
        '{"timestamp": 1, "input_length": "abc", "output_length": 1, "hash_ids": []}',
        "field 'input_length': expected a non-negative integer, got \"abc\"",
    ),
    (
        '{"timestamp": 1, "input_length": 5, "output_length": -3, "hash_ids": [0]}',
        "field 'output_length': expected a non-negative integer, got -3",
    ),
    (
        '{"timestamp": 1, "input_length": 5.5, "output_length": 3, "hash_ids": [0]}',
        "field 'input_length': expected a non-negative integer, got 5.5",
    ),
    (
        '{"input_length": 5, "output_length": 3, "hash_ids": [0]}',
        "field 'timestamp': missing",
    ),
    (
        '{"timestamp": -4, "input_length": 5, "output_length": 3, "hash_ids": [0]}',
        "field 'timestamp': expected a non-negative number (ms), got -4",
    ),
    (
        '{"timestamp": "soon", "input_length": 5, "output_length": 3, "hash_ids": [0]}',
        "field 'timestamp': expected a non-negative number (ms), got \"soon\"",
    ),
    (
        '{"timestamp": 1, "input_length": 5, "output_length": 3, "hash_ids": 7}',
        "field 'hash_ids': expected a list of integers, got 7",
    ),
    (
        '{"timestamp": 1, "input_length": 5, "output_length": 3, "hash_ids": [1, "x"]}',
        "field 'hash_ids': expected a list of integers, got \"x\"",
    ),
    ('{"timestamp": 1, "input_length": 5,', "invalid JSON"),
    ("[1, 2, 3]", "expected a JSON object, got list"),
]


@pytest.mark.parametrize(("bad", "message"), MOONCAKE_BAD)
def test_mooncake_errors_name_line_and_field(tmp_path: Path, bad: str, message: str) -> None:
    path = _write(tmp_path / "trace.jsonl", "\n".join([GOOD] * 16 + [bad, GOOD]) + "\n")
    with pytest.raises(WorkloadError) as info:
        load_trace(path)
    assert str(info.value).startswith(f"{path}:17: ")
    assert message in str(info.value)


AZURE_BAD = [
    ("2023-11-16 18:15:47.1,abc,5", "field 'ContextTokens': expected a non-negative integer"),
    ("2023-11-16 18:15:47.1,-5,5", "field 'ContextTokens': expected a non-negative integer"),
    ("2023-11-16 18:15:47.1,5,1e3", "field 'GeneratedTokens': expected a non-negative integer"),
    ("yesterday,5,5", "field 'TIMESTAMP': expected a datetime like"),
    ("2023-13-16 18:15:47.1,5,5", "field 'TIMESTAMP'"),
    ("2023-11-16 25:15:47.1,5,5", "field 'TIMESTAMP'"),
    ("2023-11-16 18:15:47.1,5", "expected 3 columns, got 2"),
]


@pytest.mark.parametrize(("bad", "message"), AZURE_BAD)
def test_azure_errors_name_line_and_field(tmp_path: Path, bad: str, message: str) -> None:
    good = "2023-11-16 18:15:46.6805900,100,5"
    path = _write(tmp_path / "trace.csv", "\n".join([AZURE_HEADER, good, good, bad, good]))
    with pytest.raises(WorkloadError) as info:
        load_trace(path)
    assert str(info.value).startswith(f"{path}:4: ")
    assert message in str(info.value)


def test_azure_header_missing_column(tmp_path: Path) -> None:
    path = _write(tmp_path / "t.csv", "TIMESTAMP,ContextTokens,Tokens\n2023-11-16 18:15:46,1,1\n")
    with pytest.raises(WorkloadError, match=r":1: field 'GeneratedTokens': missing"):
        load_trace(path)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"", "empty trace"),
        (b"\n  \n", "empty trace"),
        (b"id,prompt,answer\n1,2,3\n", ":1: unknown trace format; expected Mooncake JSON Lines"),
        (b"\xff\xfe\x00bin", "not UTF-8"),
        (b"\x1f\x8b\x08\x00garbage", "corrupt gzip"),
        (AZURE_HEADER.encode() + b"\n", "no requests"),
    ],
)
def test_unreadable_files(tmp_path: Path, content: bytes, message: str) -> None:
    path = tmp_path / "weird.jsonl"
    path.write_bytes(content)
    with pytest.raises(WorkloadError, match=message) as info:
        load_trace(path)
    assert str(info.value).startswith(str(path))
    assert isinstance(info.value, ValueError)


# --------------------------------------------------------------------------------------------
# Workload, digest, serialisation
# --------------------------------------------------------------------------------------------


def test_digest_is_pinned_and_independent_of_name_and_source() -> None:
    w = fixed([(0.0, 1000, 10, 0), (0.5, 2048, 20, 1024), (1.25, 600, 5, 600, 3)])
    # A canonical-serialisation change must be deliberate: update this value with care.
    assert w.digest == "1e955288dd3d778be251fd46c3f5a1b92c077bebd8a3cae5bbaf3b8b6e79b767"
    again = Workload("other", w.requests, "elsewhere")
    assert again.digest == w.digest
    shifted = fixed([(0.0, 1000, 10, 0), (0.5, 2048, 20, 1024), (1.5, 600, 5, 600, 3)])
    assert shifted.digest != w.digest


def test_workload_validation() -> None:
    r0 = Request(0, 1.0, 10, 1, (), 512)
    r1 = Request(1, 0.5, 10, 1, (), 512)
    with pytest.raises(WorkloadError, match="arrival"):
        Workload("w", (r0, r1), "test")
    with pytest.raises(WorkloadError, match="rid"):
        Workload("w", (Request(5, 0.0, 10, 1, (), 512),), "test")
    with pytest.raises(WorkloadError, match="digest mismatch"):
        Workload("w", (r0,), "test", digest="0" * 64)
    assert Workload("w", (r0,), "test").duration_s == 0.0


def test_jsonable_round_trip() -> None:
    w = shared_prefix(2, 3, 700, 100, 16, 5.0, seed=3)
    obj = json.loads(json.dumps(w.to_jsonable()))
    back = Workload.from_jsonable(obj)
    assert back == w and back.digest == w.digest
    summary = w.to_jsonable(include_requests=False)
    assert summary["num_requests"] == 6 and "requests" not in summary
    with pytest.raises(WorkloadError, match="summary only"):
        Workload.from_jsonable(summary)
    obj["requests"][0][2] += 1
    with pytest.raises(WorkloadError, match="digest mismatch"):
        Workload.from_jsonable(obj)


def test_request_uses_slots() -> None:
    r = Request(0, 0.0, 1, 1, (), 512)
    assert not hasattr(r, "__dict__")
    with pytest.raises(AttributeError):
        r.input_len = 2  # type: ignore[misc]


# --------------------------------------------------------------------------------------------
# Generators
# --------------------------------------------------------------------------------------------


def test_poisson_deterministic_and_shaped() -> None:
    a = poisson(2000, 10.0, (2048, 512), 128, seed=7)
    b = poisson(2000, 10.0, (2048, 512), 128, seed=7)
    c = poisson(2000, 10.0, (2048, 512), 128, seed=8)
    assert a.digest == b.digest != c.digest
    assert a.requests[0].arrival_s == 0.0
    assert a.duration_s == pytest.approx(200, rel=0.1)
    ins = [r.input_len for r in a.requests]
    assert sum(ins) / len(ins) == pytest.approx(2048, rel=0.05)
    assert all(r.output_len == 128 and r.prefix_hashes == () for r in a.requests)
    assert all(type(r.arrival_s) is float and type(r.input_len) is int for r in a.requests)
    burst = poisson(5, math.inf, 10, 1)
    assert [r.arrival_s for r in burst.requests] == [0.0] * 5


def test_poisson_100k() -> None:
    # Speed is measured in benchmarks/bench_sim.py, not here.
    w = poisson(100_000, 50.0, (2048, 512), (128, 64), seed=1)
    assert len(w) == 100_000 and w.requests[-1].rid == 99_999


def test_bursty_arrivals() -> None:
    w = bursty(7, 3, burst_gap_s=1.0, intra_gap_s=0.1, input_len=100, output_len=10)
    assert [r.arrival_s for r in w.requests] == pytest.approx([0, 0.1, 0.2, 1.2, 1.3, 1.4, 2.4])
    assert bursty(7, 3, 1.0, 0.1, (100, 30), 10, seed=2).digest == (
        bursty(7, 3, 1.0, 0.1, (100, 30), 10, seed=2).digest
    )


def test_shared_prefix_groups() -> None:
    w = shared_prefix(4, 8, system_prompt_len=4096, question_len=256, output_len=32, rate_per_s=5)
    assert len(w) == 32
    by_group: dict[int, list[Request]] = {}
    for r in w.requests:
        assert r.input_len == 4096 + 256 and r.shared_prefix_len == 4096
        assert len(r.prefix_hashes) == math.ceil(r.input_len / 512)
        by_group.setdefault(r.prefix_group, []).append(r)  # type: ignore[arg-type]
    assert sorted(by_group) == [0, 1, 2, 3] and all(len(v) == 8 for v in by_group.values())
    for members in by_group.values():
        assert len({r.prefix_hashes[:8] for r in members}) == 1  # 4096 / 512 shared blocks
        assert len({r.prefix_hashes[8] for r in members}) == 8  # then unique
    heads = {members[0].prefix_hashes[0] for members in by_group.values()}
    assert len(heads) == 4
    # Shuffled: not all of one group first.
    assert [r.prefix_group for r in w.requests[:8]] != [w.requests[0].prefix_group] * 8


def test_fixed_sorts_and_validates() -> None:
    w = fixed([(2.0, 10, 1, 0), (1.0, 20, 2, 0)], name="scenario")
    assert [(r.rid, r.input_len) for r in w.requests] == [(0, 20), (1, 10)]
    assert w.requests[0].arrival_s == 1.0 and w.name == "scenario"
    with pytest.raises(ValueError, match="shared_prefix_len"):
        fixed([(0.0, 10, 1, 11)])
    with pytest.raises(ValueError, match="row 0"):
        fixed([(0.0, 10, 1)])  # type: ignore[list-item]


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(1, 300),
    rate=st.floats(0.01, 1e4),
    mean=st.floats(1, 1e5),
    std=st.floats(0, 1e5),
    seed=st.integers(0, 2**32),
)
def test_poisson_properties(n: int, rate: float, mean: float, std: float, seed: int) -> None:
    w = poisson(n, rate, (mean, std), 16, seed=seed)
    assert len(w) == n and w.requests[0].arrival_s == 0.0
    assert [r.rid for r in w.requests] == list(range(n))
    arrivals = [r.arrival_s for r in w.requests]
    assert arrivals == sorted(arrivals) and all(math.isfinite(t) for t in arrivals)
    assert all(r.input_len >= 1 for r in w.requests)
    assert poisson(n, rate, (mean, std), 16, seed=seed).digest == w.digest


# --------------------------------------------------------------------------------------------
# Spec strings
# --------------------------------------------------------------------------------------------


def test_spec_round_trips() -> None:
    for spec in (
        "poisson:n=100,rate=5,input=2048,output=128,seed=1",
        "poisson:n=50,rate=inf,input=2048~300.5",
        "bursty:n=20,burst=4,gap=1.5,intra=0.01,input=512,output=8,seed=2",
        "shared-prefix:groups=4,per_group=8,system=4096,question=256,output=64,rate=10,seed=3",
        "shared_prefix:groups=1,per_group=2,system=10,question=5",
    ):
        w = parse_workload_spec(spec)
        assert parse_workload_spec(w.source).digest == w.digest
        assert parse_workload_spec(spec).digest == w.digest
    w = parse_workload_spec("poisson:n=100,rate=5,input=2048,output=128,seed=1")
    assert w.digest == poisson(100, 5.0, 2048, 128, seed=1).digest


def test_spec_trace_forms(tmp_path: Path) -> None:
    folder = tmp_path / "a,b"
    folder.mkdir()
    path = _write(folder / "t.jsonl", "\n".join(_mooncake_line(t * 10) for t in range(5)))
    assert len(parse_workload_spec(str(path))) == 5
    w = parse_workload_spec(f"trace:path={path},first_n=3,slowdown=2")
    assert len(w) == 3 and w.requests[-1].arrival_s == pytest.approx(0.04)
    assert parse_workload_spec(w.source).digest == w.digest


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("poisson:n=10,rat=5", "poisson: unknown key 'rat'"),
        ("poisson:n=10,rate=fast", "poisson: key 'rate': expected a number > 0"),
        ("poisson:n=-1,rate=5", "poisson: key 'n': expected an integer >= 1"),
        ("poisson:rate=5", "poisson: missing key 'n'"),
        ("poisson:n=10,rate=5,input=abc", "poisson: key 'input'"),
        ("poisson:n=10,rate=5,input=0~3", "poisson: key 'input'"),
        ("poisson:n=10,rate=5,seed", "is not KEY=VALUE"),
        ("poisson:n=10,n=11,rate=5", "key 'n' given twice"),
        ("bursty:n=10,burst=0,gap=1", "bursty: key 'burst'"),
        ("shared-prefix:groups=2,per_group=2,system=x,question=1", "key 'system'"),
        ("trace:path=/nonexistent/file.jsonl", "trace: key 'path': no such file"),
        ("gamma:n=1", "not a file or known generator"),
        ("no/such/file.jsonl", "not a file or known generator"),
    ],
)
def test_spec_errors_name_the_key(spec: str, message: str) -> None:
    with pytest.raises(WorkloadError) as info:
        parse_workload_spec(spec)
    assert message in str(info.value)


# --------------------------------------------------------------------------------------------
# PrefixCache
# --------------------------------------------------------------------------------------------


def _req(rid: int, input_len: int, hashes: tuple[int, ...], **kw: int) -> Request:
    return Request(rid, float(rid), input_len, 1, hashes, 512, **kw)


def test_prefix_cache_readme_example() -> None:
    base = tuple(range(46, 58))
    a = _req(0, 6955, (*base, 2353, 2354))
    b = _req(1, 6472, (*base, 2366))
    cache = PrefixCache(1000)
    assert cache.match(a) == 0
    cache.insert(a)
    assert cache.match(b) == 12 * 512
    assert cache.match(a) == 6954  # whole prompt cached: capped at input_len - 1
    assert cache.used_blocks == 14 and len(cache) == 14


def test_prefix_cache_lru_evicts_suffix_first() -> None:
    cache = PrefixCache(4)
    a = _req(0, 3 * 512, (1, 2, 3))
    b = _req(1, 3 * 512, (7, 8, 9))
    cache.insert(a)
    cache.insert(b)  # needs 2 more blocks: evicts a's tail blocks 3 then 2
    assert cache.used_blocks == 4
    assert cache.match(_req(2, 4000, (1, 2, 3, 4))) == 512
    assert cache.match(_req(3, 4000, (7, 8, 9, 4))) == 3 * 512
    big = _req(4, 10 * 512, tuple(range(100, 110)))
    cache.insert(big)  # larger than the cache: keeps its leading blocks
    assert cache.match(big) == 4 * 512
    empty = PrefixCache(0)
    empty.insert(a)
    assert empty.match(a) == 0 and empty.used_blocks == 0


def test_prefix_cache_shared_prefix_inside_a_block() -> None:
    w = shared_prefix(2, 3, system_prompt_len=1000, question_len=300, output_len=4, rate_per_s=1)
    cache = PrefixCache(100)
    seen: set[int] = set()
    for r in w.requests:
        expected = 1000 if r.prefix_group in seen else 0
        assert cache.match(r) == expected
        cache.insert(r)
        seen.add(r.prefix_group)  # type: ignore[arg-type]
    short = shared_prefix(1, 2, system_prompt_len=100, question_len=50, output_len=4, rate_per_s=1)
    cache = PrefixCache(10)
    cache.insert(short.requests[0])
    assert cache.match(short.requests[1]) == 100


def test_prefix_cache_nested_fixed_prefixes() -> None:
    w = fixed([(0.0, 2500, 1, 2000), (1.0, 1500, 1, 1000), (2.0, 3000, 1, 2600), (3.0, 800, 1, 0)])
    r0, r1, r2, r3 = w.requests
    cache = PrefixCache(64)
    cache.insert(r0)
    assert cache.match(r1) == 1000
    assert cache.match(r2) == 2000
    assert cache.match(r3) == 0
    cache.insert(r2)
    assert cache.match(fixed([(0.0, 4000, 1, 3000)]).requests[0]) == 2600


@settings(max_examples=30, deadline=None)
@given(
    capacity=st.integers(0, 40),
    prompts=st.lists(
        st.tuples(st.integers(1, 6000), st.lists(st.integers(0, 12), max_size=12)), max_size=30
    ),
)
def test_prefix_cache_invariants(capacity: int, prompts: list[tuple[int, list[int]]]) -> None:
    cache = PrefixCache(capacity)
    for i, (input_len, hashes) in enumerate(prompts):
        r = _req(i, input_len, tuple(hashes))
        hit = cache.match(r)
        assert 0 <= hit <= max(0, input_len - 1) and hit % 512 in (0, (input_len - 1) % 512)
        cache.insert(r)
        assert cache.used_blocks <= capacity


@needs_traces
def test_prefix_cache_on_mooncake_sample() -> None:
    w = load_trace(MOONCAKE)
    cache = PrefixCache(10**6)
    hit = 0
    for r in w.requests:
        hit += cache.match(r)
        cache.insert(r)
    # The README: about 65% of input tokens are reusable cached prefix.
    assert hit / sum(r.input_len for r in w.requests) == pytest.approx(0.65, abs=0.02)
