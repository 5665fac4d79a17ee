"""Replay a trace (from the simulator or hardware) on real rank processes.

Every rank gets the recorded inputs of its node as a script and feeds them in order. Driver
inputs (scheduler sends, timers, polls, decode room starts) are fed when their turn comes; real
happenings (frames, metadata, WRITE and scatter completions) are produced by the real run and
each is held until it is the next recorded input at that rank. So the cores see exactly the
recorded sequence while the bytes really move through NIXL and the kernels, and every finished
room is byte-verified. The result has the simulator replay's shape (``twin.replay``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from twin.core import events as ev
from twin.core.defects import Defects
from twin.core.grid import pages_for_tokens
from twin.hw.launcher import HwOptions, Launcher, check_fits, open_hub, rank_allocations
from twin.hw.run import HwInputError, check_supported, check_transport, pp_direct_refusal
from twin.replay import Divergence, ReplayResult, verdict
from twin.runtime.diagnosis import diagnose, note_fault_record
from twin.runtime.runtime import note_dropped
from twin.trace.codec import event_to_json
from twin.trace.format import Trace


def _scripts(trace: Trace, fault_notes: dict[int, list[str]]
             ) -> tuple[dict[str, list[Any]], dict[str, list[dict[str, Any]]],
                        dict[int, dict[str, Any]]]:
    """Each rank's recorded inputs, each rank's requests to set up and the rooms by number;
    the recorded faults that touched a room are noted in ``fault_notes``."""
    scripts: dict[str, list[Any]] = {n: [] for n in trace.nodes}
    requests: dict[str, list[dict[str, Any]]] = {n: [] for n in trace.nodes}
    rooms: dict[int, dict[str, Any]] = {}
    for rec in trace.events:
        if rec.dir == "in":
            scripts[rec.node].append(rec.event)
        elif rec.dir == "sys" and rec.type == "RequestArrived":
            d = rec.data
            rooms[d["room"]] = d
            setup = {"op": "request", "room": d["room"], "rid": int(d["rid"]),
                     "input_len": d["input_len"], "decode_prefix_len": d["decode_prefix_len"]}
            for n in (*d["prefill_node"], *d["decode_node"]):
                requests[n].append(setup)
        elif rec.dir == "sys" and rec.type == "FaultInjected":
            note_fault_record(fault_notes, rec.data)
    return scripts, requests, rooms


def replay_hw(trace: Trace, options: HwOptions | None = None,
              stall_s: float = 10.0, echo: Callable[[str], None] | None = None
              ) -> ReplayResult:
    """Replay ``trace`` on real processes; see the module docstring. With ``options.listen``
    the ranks run on the nodes of the agents that join (placement printed through ``echo``)."""
    options = options or HwOptions()
    defects = Defects.of(trace.header.get("defects", []))
    check_supported(defects, [])
    check_transport(trace.config, options)
    if trace.config.worker_polls != "fed":
        raise HwInputError("the trace was recorded with coalesced deferral polls (its header's "
                           "worker_polls); the hardware mode feeds real polls: record it again "
                           "with --trace-out (a traced run feeds every poll) or replay it with "
                           "--mode sim")
    refusal = pp_direct_refusal(trace.config)
    if refusal is not None:
        raise HwInputError(f"the trace writes equal-TP rooms page by page (no staging) from "
                           f"a pipeline-parallel prefill ({refusal}): replay it with "
                           f"--mode sim")
    fault_notes: dict[int, list[str]] = {}  # room -> recorded faults that touched it
    dropped: dict[int, list[str]] = {}  # room -> inputs its ranks dropped
    scripts, requests, rooms = _scripts(trace, fault_notes)
    page = trace.config.page_size
    need = max((sum(pages_for_tokens(r["input_len"], page) for r in reqs)
                for reqs in requests.values()), default=0)
    options.kv_pool_pages = max(options.kv_pool_pages, need + 16)
    # every room of the trace holds its pages at once: a long trace can outgrow the host
    options.rank_bytes = rank_allocations(trace.config, options.kv_pool_pages)
    check_fits(trace.config, options.rank_bytes, options, options.kv_pool_pages,
               "replay a shorter trace (record one with twin sim --first-n N --trace-out "
               "...) or one of a smaller model or ring")
    done: set[str] = set()
    concluded: dict[int, dict[str, str]] = {}
    corruption: list[str] = []
    crashed: dict[str, str] = {}

    def on_report(r: dict[str, Any]) -> None:
        kind = r.get("kind")
        if kind == "script-done":
            done.add(r["node"])
        elif kind == "concluded" and r["node"].startswith("d"):
            concluded.setdefault(r["room"], {})[r["node"]] = r["status"]
            if r.get("mismatch"):
                corruption.append(f"{r['node']} room {r['room']}: {r['mismatch']}")
        elif kind == "crashed":
            crashed[r["node"]] = r["reason"]

    last = [time.monotonic()]

    def on_records(node: str, records: list[Any]) -> None:
        if records:
            last[0] = time.monotonic()
        for _t, _event, effects in records:
            for e in effects:
                if type(e) is ev.Dropped:
                    note_dropped(dropped, node, e)

    hub = open_hub(trace.config, options, echo)
    with Launcher(trace.config, defects=defects, faults=[], seed=trace.header.get("seed") or 0,
                  options=options, scripts=scripts, requests=requests, hub=hub) as launcher:
        launcher.on_report = on_report
        launcher.on_records = on_records
        last[0] = time.monotonic()
        while len(done) < len(scripts) and not launcher.errors:
            launcher.pump(20)
            if time.monotonic() - last[0] > stall_s:
                break
        launcher.settle_unreachable()
        states = launcher.request_states()
        inputs = launcher.inputs
        errors = list(launcher.errors)
    divergence = None
    stuck = sorted(n for n in scripts if n not in done)
    if stuck or errors:
        node = stuck[0] if stuck else ""
        st = states.get(node)
        nxt = st.next if st is not None else None
        divergence = Divergence(
            line=0, node=node, t=0.0,
            expected=("the next recorded input: " + str(event_to_json(nxt))) if nxt is not None
            else "(rank error)",
            got=(f"nothing matching arrived for {stall_s:g} s on real hardware"
                 if not errors else errors[0][:2000]))
    snapshots = {n: st.snapshot for n, st in states.items()}
    # Wrong bytes the decode ranks' per-scatter checks found in rooms that never concluded,
    # as a hardware run reports them (a replay that wedges can have corrupted them first).
    for node, st in sorted(states.items()):
        for room, text in sorted(st.mismatch.items()):
            if node not in concluded.get(room, {}):
                corruption.append(f"{node} room {room} (unfinished): {text}")
    status, completed, failed, unfinished = verdict(rooms, concluded, corruption, trace.outcome)
    diagnosis = (diagnose(snapshots, crashed, unfinished, dropped, fault_notes).lines()
                 if unfinished else [])
    return ReplayResult(inputs, divergence, status, completed, failed, diagnosis, corruption,
                        trace.outcome, version=trace.header["version"])
