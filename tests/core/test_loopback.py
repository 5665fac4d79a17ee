"""The loopback explorer's logical time: what the core schedules for later waits for the clock.

Before, a re-poll, registration or timeout scheduled for later was either always takeable (polls,
registrations) or fired only once nothing else was pending (timeouts). With lost-control
recovery a chunk that cannot move re-requests its allocation; decode answers with its watermark,
which wakes the worker, which re-polls: something was always pending, so the timeouts that end
such a wait never fired and ``Cluster.run`` went on without bound.
"""

from __future__ import annotations

import pytest

from twin.core import events as ev
from twin.core.config import ModelShape, ServerSide, TwinConfig
from twin.core.fixes import LOST_CONTROL_RECOVERY
from twin.explore.loopback import Cluster, Livelock

MODEL = ModelShape(num_layers=2, num_kv_heads=8, head_dim=4, dtype_bytes=2)


def _tp2_tp1(**kw) -> Cluster:
    """Prefill TP2 -> decode TP1, a one-chunk ring."""
    return Cluster(TwinConfig(prefill=ServerSide(tp_size=2), decode=ServerSide(tp_size=1),
                              model=MODEL, chunked_prefill_size=64, page_size=16,
                              staging_pool_size_bytes=64 * 8 * 8 * 2 * 2, **kw))


def test_a_scheduled_poll_waits_for_the_clock() -> None:
    c = _tp2_tp1()
    p0 = c.topo.prefill_groups[0].nodes[0].id
    c.runtime.poll(p0, 0, at=c.now + 1.0)
    assert not c.choices() and len(c.timers) == 1
    due = c.advance()
    assert due is not None and due.kind == "poll" and c.now == 1.0
    assert [c.pending[i].kind for i in c.choices()] == ["poll"] and not c.timers
    c.runtime.poll(p0, 0, at=c.now + 0.5)  # replaces the poll not yet fed
    c.step(c.choices()[0])  # the stale poll: a no-op
    assert c.advance() is not None and c.now == 1.5


def test_steps_make_scheduled_inputs_due() -> None:
    """Each step moves the clock by ``step_s``: a poll 2.5 steps ahead is a choice after 3."""
    c = _tp2_tp1()
    p0 = c.topo.prefill_groups[0].nodes[0].id
    c.add_request(0, 64)
    at = c.now + 2.5 * c.step_s
    c.runtime.poll(p0, 3, at=at)

    def due() -> bool:
        return any(c.pending[i].kind == "poll" and c.pending[i].at == at for i in c.choices())

    for _ in range(3):
        assert not due()
        c.step(c.choices()[0])
    assert due()


def _held_ring(**kw) -> Cluster:
    """Lost-control recovery on; room 0 holds decode's only staging chunk and its prefill side
    aborts (decode learns it only at its waiting timeout); room 1 waits for the ring."""
    c = _tp2_tp1(fixes=(LOST_CONTROL_RECOVERY,), waiting_timeout_s=2.0, bootstrap_timeout_s=2.0,
                 **kw)
    (d0,) = (n.id for n in c.topo.decode_groups[0].nodes)
    c.add_request(0, 64)
    while not c.ranks[d0].snapshot().live:
        c.step(c.choices()[0])
    for n in c.topo.prefill_groups[0].nodes:
        c._feed(n.id, ev.RoomAborted(room=0, reason="prefill abort"))
    c.add_request(1, 64)
    return c


def test_lost_control_recovery_wait_ends_at_the_timeouts() -> None:
    """Room 1's worker re-requests its chunk every control_retry_s while the ring is held; the
    clock reaches decode's waiting timeouts and the run ends (it used to spin for ever)."""
    c = _held_ring()
    steps = c.run(max_steps=5_000)
    polls = sum(type(e) is ev.WorkerPoll for _, _, e in c.log)
    assert polls > 2.0 / c.cfg.control_retry_s  # it did re-poll all along
    assert c.now >= c.cfg.waiting_timeout_s and steps < 5_000
    assert c.outcome(0) == "Failed" and c.outcome(1) == "Failed"
    for rank in c.ranks.values():
        snap = rank.snapshot()
        assert not snap.rooms and not getattr(snap, "live", ())


def test_run_past_its_budget_names_what_kept_it_busy() -> None:
    c = _held_ring()
    with pytest.raises(Livelock, match=r"still busy after 50 steps: .*unfinished rooms \[0, 1\]"
                                       r".*StagingReq"):
        c.run(max_steps=50)
