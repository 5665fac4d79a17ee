"""The transfer backend as a deployment choice (``--disaggregation-transfer-backend``) and
Mooncake's pipeline-parallel writers: every PP stage's prefill rank writes its own layers into
the same staged chunk, STAGING_REQ names its PP rank, STAGING_RSP goes back only to that
stage, CHUNK_READY fan-in counts every writer (SGLang 0.5.23 ``common/staging_handler.py``
``handle_staging_req`` ~895-897, ``num_writers_for`` ~138-147, ``mooncake/conn.py`` ~685)."""

from __future__ import annotations

import json

import pytest

from twin.core import events as ev
from twin.core import wire
from twin.core.config import ConfigError, ModelShape, ServerSide, TwinConfig
from twin.core.decode import DecodeRank
from twin.core.defects import Defects
from twin.core.prefill import PrefillRank
from twin.core.topology import Topology, build_ranks, pp_stage_of
from twin.launch_args import config_from_launch
from twin.trace.format import make_header

MODEL = ModelShape(num_layers=4, num_kv_heads=8, head_dim=4, dtype_bytes=2)
# Prefill TP2 x PP2 -> decode TP4: attention TPs differ, so every room stages (with equal TP
# SGLang writes pages directly, no ring); each decode rank has one TP writer per PP stage.
PP = TwinConfig(prefill=ServerSide(tp_size=2, pp_size=2), decode=ServerSide(tp_size=4),
                model=MODEL, chunked_prefill_size=64, page_size=16,
                staging_pool_size_bytes=1 << 20)


# --- launch lines ----------------------------------------------------------------------------

def test_launch_line_sets_the_backend_and_mooncake_is_the_default() -> None:
    assert config_from_launch("", "").disaggregation_transfer_backend == "mooncake"
    cfg = config_from_launch("--disaggregation-transfer-backend nixl",
                             "--disaggregation-transfer-backend=nixl")
    assert cfg.disaggregation_transfer_backend == "nixl"
    # SGLang's mooncake_tcp is Mooncake with MC_FORCE_TCP=1
    cfg = config_from_launch("--disaggregation-transfer-backend mooncake_tcp", "")
    assert cfg.disaggregation_transfer_backend == "mooncake"


@pytest.mark.parametrize(("prefill", "decode", "reason"), [
    ("--tp-size 2 --pp-size 2 --disaggregation-transfer-backend nixl", "--tp-size 2",
     "SGLANG_DISAGG_STAGING_BUFFER with pp_size > 1 is only supported by Mooncake."),
    ("--disaggregation-transfer-backend nixl", "--disaggregation-transfer-backend mooncake",
     "prefill 'nixl' and decode 'mooncake' differ"),
    ("--disaggregation-transfer-backend fake", "",
     "Prefill server does not support 'fake' as the transfer backend"),
    ("", "--disaggregation-transfer-backend ascend",
     "SGLANG_DISAGG_STAGING_BUFFER requires disaggregation_transfer_backend='mooncake' or "
     "'nixl', got 'ascend'."),
    ("--disaggregation-transfer-backend rdma", "", "invalid choice: 'rdma'"),
])
def test_sglang_start_up_rules_reject_with_sglangs_reason(prefill: str, decode: str,
                                                          reason: str) -> None:
    with pytest.raises(ConfigError) as err:
        config_from_launch(prefill, decode)
    assert reason in str(err.value)


def test_old_trace_headers_read_as_nixl() -> None:
    from twin.trace.format import _check_header

    cfg = TwinConfig().replace(disaggregation_transfer_backend="nixl")
    header = make_header("sim", cfg, [{"id": "p0g0r0", "role": "prefill", "instance": 0,
                                        "dp": 0, "rank": 0}])
    del header["config"]["disaggregation_transfer_backend"]
    assert _check_header(json.loads(json.dumps(header)), "t")[0].disaggregation_transfer_backend \
        == "nixl"
    header["config"]["disaggregation_transfer_backend"] = "mooncake"
    assert _check_header(header, "t")[0].disaggregation_transfer_backend == "mooncake"


# --- topology and the core -------------------------------------------------------------------

def test_each_pp_stage_is_a_writer_of_every_decode_rank_it_feeds() -> None:
    topo = Topology(PP)
    (pg,) = topo.prefill_groups
    assert [n.id for n in pg.nodes] == ["p0g0s0r0", "p0g0s0r1", "p0g0s1r0", "p0g0s1r1"]
    assert [n.unique_rank for n in pg.nodes] == [0, 1, 2, 3]
    assert [pp_stage_of(n.id) for n in pg.nodes] == [0, 0, 1, 1]
    d0 = topo.decode_groups[0].nodes[0]
    assert topo.writers_of(d0, pg) == ("p0g0s0r0", "p0g0s1r0")
    assert PP.num_writers == 2
    # one PP stage: node ids as before
    assert [n.id for n in Topology(TwinConfig()).prefill_groups[0].nodes][0] == "p0g0r0"


def _prefill(cfg: TwinConfig, pp_rank: int) -> PrefillRank:
    return PrefillRank(cfg, f"p0g0s{pp_rank}r0", 0, 2 * pp_rank, Defects(), pp_rank=pp_rank)


def _boot(p: PrefillRank, pages: int) -> list[ev.Effect]:
    target = ev.Target(session="d0g0r0", decode_rank=0, total_pages=pages, decode_prefix_len=0)
    return p.handle(ev.RoomBootstrapped(room=1, targets=(target,)), 0.0)


def _staging_reqs(p: PrefillRank) -> list[wire.StagingReq]:
    out = _boot(p, 8)
    out += p.handle(ev.Prefetch(room=1), 0.0)
    return [e.msg for e in out if isinstance(e, ev.Send) and isinstance(e.msg, wire.StagingReq)]


def test_staging_req_names_its_pp_rank_on_mooncake_only() -> None:
    reqs = _staging_reqs(_prefill(PP, 1))
    assert reqs and {r.pp_rank for r in reqs} == {1}
    assert wire.encode(reqs[0])[-1] == b"1"  # [b"STAGING_REQ", room, chunk, pages, session, pp]
    nixl = PP.replace(prefill=ServerSide(tp_size=2), disaggregation_transfer_backend="nixl")
    reqs = _staging_reqs(_prefill(nixl, 0))
    assert reqs and {r.pp_rank for r in reqs} == {None}
    assert len(wire.encode(reqs[0])) == 5


def test_each_stage_writes_its_own_layers_of_the_same_region() -> None:
    ranks = [_prefill(PP, s) for s in (0, 1)]
    spans = []
    for p in ranks:
        _boot(p, 4)
        p.handle(ev.MessageArrived(src="d0g0r0", msg=wire.StagingRsp(
            room=1, chunk_idx=0, offset=0, round=0, end=4096, session_id="d0g0r0")), 0.0)
        out = p.handle(ev.SendKV(room=1, end_idx=64, last=True), 0.0)
        (t,) = [e for e in out if isinstance(e, ev.StartTransfer)]
        spans.append((t.dst_offset, t.dst_offset + t.nbytes))
    region = PP.region_layout(0, 4)[2]
    # two halves of one region: layers [0, 2) then [2, 4)
    assert spans == [(0, region // 2), (region // 2, region)]


def test_staging_rsp_goes_only_to_the_requesting_pp_stage() -> None:
    d = DecodeRank(PP, "d0g0r0", 0, Defects())
    writers = ("p0g0s0r0", "p0g0s1r0")
    d.handle(ev.DecodeRoomInit(room=1, prefill_ranks=writers, prefill_attn_tp=2,
                               decode_prefix_len=0, total_pages=4), 0.0)

    def rsp_to(pp_rank: int | None) -> list[str]:
        out = d.handle(ev.MessageArrived(src="p0g0s0r0", msg=wire.StagingReq(
            room=1, chunk_idx=0, chunk_pages=4, session_id="d0g0r0", pp_rank=pp_rank)), 0.0)
        return [e.dst for e in out
                if isinstance(e, ev.Send) and isinstance(e.msg, wire.StagingRsp)]

    assert rsp_to(1) == ["p0g0s1r0"]
    assert rsp_to(0) == ["p0g0s0r0"]
    assert rsp_to(None) == list(writers)  # NIXL's request names no PP rank: every writer
    # CHUNK_READY fan-in counts every PP stage's writer before the scatter starts
    def ready(src: str, rank: int) -> list[ev.Effect]:
        return d.handle(ev.MessageArrived(src=src, msg=wire.ChunkReady(
            room=1, chunk_idx=0, page_start=0, num_pages=4, writer_id="d0g0r0",
            prefill_rank=rank)), 0.0)

    assert not [e for e in ready("p0g0s0r0", 0) if isinstance(e, ev.StartScatter)]
    assert [e for e in ready("p0g0s1r0", 2) if isinstance(e, ev.StartScatter)]


def test_pp_ranks_build_and_differ_only_in_stage() -> None:
    ranks = build_ranks(Topology(PP), Defects())
    stages = sorted((r.pp_rank, r.rank) for r in ranks.values() if isinstance(r, PrefillRank))
    assert stages == [(0, 0), (0, 1), (1, 0), (1, 1)]


# --- the command line ------------------------------------------------------------------------

def test_sim_runs_mooncake_pp_writers_clean_and_rejects_them_on_nixl(tmp_path) -> None:
    from click.testing import CliRunner

    from twin.cli import cli
    from twin.trace.format import read_trace

    trace = tmp_path / "pp.jsonl"
    args = ["sim", "--prefill-args", "--tp-size 2 --pp-size 2", "--decode-args", "--tp-size 2",
            "--workload", "poisson:n=20,rate=20", "--trace-out", str(trace)]
    r = CliRunner().invoke(cli, args, catch_exceptions=False)
    assert r.exit_code == 0, r.output  # completed: no wedge, no integrity violation
    assert "PP2" in r.output and "backend mooncake" in r.output
    t = read_trace(trace)
    assert t.config.disaggregation_transfer_backend == "mooncake"
    assert {n for n in t.nodes if n.startswith("p")} == {
        "p0g0s0r0", "p0g0s0r1", "p0g0s1r0", "p0g0s1r1"}
    r = CliRunner().invoke(cli, [*args[:2], args[2] + " --disaggregation-transfer-backend nixl",
                                 *args[3:]], catch_exceptions=False)
    assert r.exit_code == 2
    assert "SGLANG_DISAGG_STAGING_BUFFER with pp_size > 1 is only supported by Mooncake." \
        in r.stderr


def test_config_show_names_the_backend() -> None:
    from click.testing import CliRunner

    from twin.cli import cli

    r = CliRunner().invoke(cli, ["config", "show", "--prefill-args",
                                 "--disaggregation-transfer-backend nixl"])
    assert r.exit_code == 0, r.output
    assert 'disaggregation_transfer_backend = "nixl"' in r.output
