"""Run metrics: latency distributions (TTFT, TPOT, end to end, transfer), ring occupancy and
watermark lag, decode batch and KV pools over time, deferrals, NIC use."""

from __future__ import annotations

import csv
import json
from collections import defaultdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from twin.core.topology import Topology
from twin.runtime.requests import RequestState

if TYPE_CHECKING:
    from twin.sim.decode_loop import LoopSeries


class Metrics:
    """Collects time series and per-request results while a simulation runs."""

    def __init__(self, topo: Topology) -> None:
        self.topo = topo
        self.done: list[RequestState] = []
        self.occ: dict[str, list[tuple[float, int]]] = defaultdict(list)
        self._occ_now: dict[str, int] = defaultdict(int)
        self.lag: dict[str, list[tuple[float, int]]] = defaultdict(list)
        self.deferrals: dict[str, int] = defaultdict(int)
        self.nic_busy_s: dict[str, float] = defaultdict(float)
        self.nic_bytes: dict[str, int] = defaultdict(int)
        self.transfer_s: list[float] = []
        self.bytes_moved = 0
        self._nic_cache: dict[str, str] = {}
        self.loops: list[LoopSeries] = []  # decode loop of each decode group
        self.prefill_pools: list[list[tuple[float, int, int]]] = []  # per prefill group
        self.serving: dict[str, Any] = {}  # pools, retractions, blocked time (set at the end)
        # seconds each rank's threads sat in sends blocked on a dead peer (set at the end)
        self.send_blocked_s: dict[str, float] = {}
        self.send_blocked_by_frame: dict[str, float] = {}  # by the kind of frame sent
        self.send_blocked_by_thread: dict[str, float] = {}  # by the thread that sent it

    def nic_of(self, node: str, ranks_per_nic: int) -> str:
        nic = self._nic_cache.get(node)
        if nic is None:
            n = self.topo.nodes[node]
            nic = f"{node[0]}{n.instance}nic{n.unique_rank // ranks_per_nic}"
            self._nic_cache[node] = nic
        return nic

    def nic_busy(self, nic: str, seconds: float, nbytes: int) -> None:
        self.nic_busy_s[nic] += seconds
        self.nic_bytes[nic] += nbytes

    def transfer(self, seconds: float, nbytes: int) -> None:
        self.transfer_s.append(seconds)
        self.bytes_moved += nbytes

    def deferral(self, node: str) -> None:
        self.deferrals[node] += 1

    def occupancy(self, node: str, t: float, delta: int) -> None:
        self._occ_now[node] += delta
        self.occ[node].append((t, self._occ_now[node]))

    def watermark_lag(self, node: str, t: float, lag: int) -> None:
        self.lag[node].append((t, lag))

    def request_done(self, req: RequestState) -> None:
        self.done.append(req)

    # -- summaries ---------------------------------------------------------------------------
    def latency_percentiles(self) -> dict[str, dict[str, float]]:
        ok = [r for r in self.done if r.status == "Success"]
        out: dict[str, dict[str, float]] = {}
        series = {
            "ttft_s": [r.ttft_s for r in ok],
            "tpot_s": [r.tpot_s for r in ok if r.tpot_s >= 0],
            "e2e_s": [r.e2e_s for r in ok if r.e2e_s >= 0],
            "transfer_s": [r.last_transfer_s - r.first_transfer_s for r in ok
                           if r.first_transfer_s >= 0],
            "kv_wait_s": [r.kv_done_s - r.prefill_done_s for r in ok if r.prefill_done_s >= 0],
        }
        for name, values in series.items():
            if values:
                a = np.asarray(values)
                out[name] = {f"p{q}": round(float(np.percentile(a, q)), 6) for q in (50, 90, 99)}
                out[name]["mean"] = round(float(a.mean()), 6)
            else:
                out[name] = {}
        return out

    def nic_utilisation(self, sim_seconds: float) -> dict[str, float]:
        if sim_seconds <= 0:
            return {}
        return {nic: round(b / sim_seconds, 4) for nic, b in sorted(self.nic_busy_s.items())}

    def write(self, out_dir: Path) -> list[Path]:
        """Write ``requests.csv``, ``occupancy.csv``, ``watermark_lag.csv`` and
        ``metrics.json`` into ``out_dir``; return the paths."""
        out_dir.mkdir(parents=True, exist_ok=True)
        paths = []
        p = out_dir / "requests.csv"
        with p.open("w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["rid", "status", "arrival_s", "input_len", "output_len",
                        "decode_prefix_len", "prefill_prefix_len", "prefill_done_s", "kv_done_s",
                        "first_token_s", "end_s", "ttft_s", "tpot_s", "e2e_s", "deferrals",
                        "retractions", "reason"])
            for r in sorted(self.done, key=lambda r: r.rid):
                w.writerow([r.rid, r.status, f"{r.arrival_s:.6f}", r.input_len, r.output_len,
                            r.decode_prefix_len, r.prefill_prefix_len, f"{r.prefill_done_s:.6f}",
                            f"{r.kv_done_s:.6f}", f"{r.first_token_s:.6f}", f"{r.end_s:.6f}",
                            f"{r.ttft_s:.6f}", f"{r.tpot_s:.6f}", f"{r.e2e_s:.6f}", r.deferrals,
                            r.retractions, r.reason])
        paths.append(p)
        p = out_dir / "decode_batch.csv"
        with p.open("w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["group", "t_s", "batch", "kv_tokens", "queued", "retracted"])
            for g, loop in enumerate(self.loops):
                for row in zip(loop.t, loop.batch, loop.kv_tokens, loop.queued, loop.retracted,
                               strict=True):
                    w.writerow([g, f"{row[0]:.6f}", *row[1:]])
        paths.append(p)
        p = out_dir / "prefill_pool.csv"
        with p.open("w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["group", "t_s", "kv_tokens", "requests"])
            for g, series in enumerate(self.prefill_pools):
                for t, tokens, reqs in series:
                    w.writerow([g, f"{t:.6f}", tokens, reqs])
        paths.append(p)
        for name, by_node in (("occupancy.csv", self.occ), ("watermark_lag.csv", self.lag)):
            p = out_dir / name
            with p.open("w", newline="") as f:
                w = csv.writer(f)
                w.writerow(["node", "t_s", "bytes"])
                for node in sorted(by_node):
                    for t, v in by_node[node]:
                        w.writerow([node, f"{t:.6f}", v])
            paths.append(p)
        p = out_dir / "metrics.json"
        p.write_text(json.dumps(self.summary(), indent=2, sort_keys=True) + "\n")
        paths.append(p)
        return paths

    def decode_summary(self) -> dict[str, Any]:
        """Decode batch size and KV-pool use over the run, per decode group (time-weighted
        means over the time the loop ran a batch, and peaks)."""
        out: dict[str, Any] = {}
        for g, loop in enumerate(self.loops):
            if len(loop.t) < 2:
                out[str(g)] = {"steps": loop.steps}
                continue
            t = np.asarray(loop.t)
            dt = np.diff(t)
            b = np.asarray(loop.batch[:-1])
            kv = np.asarray(loop.kv_tokens[:-1])
            busy = dt[b > 0].sum()
            out[str(g)] = {
                "steps": loop.steps,
                "mean_batch": round(float((b * dt).sum() / busy), 3) if busy > 0 else 0.0,
                "peak_batch": int(max(loop.batch)),
                "mean_kv_tokens": round(float((kv * dt).sum() / dt.sum()), 1)
                if dt.sum() > 0 else 0.0,
                "peak_kv_tokens": int(max(loop.kv_tokens)),
                "peak_queued": int(max(loop.queued)),
            }
        return out

    def summary(self) -> dict[str, Any]:
        return {
            "latency": self.latency_percentiles(),
            "decode": self.decode_summary(),
            "serving": self.serving,
            "deferrals": dict(sorted(self.deferrals.items())),
            "send_blocked_s": dict(self.send_blocked_s),
            "send_blocked_by_frame": dict(self.send_blocked_by_frame),
            "send_blocked_by_thread": dict(self.send_blocked_by_thread),
            "nic_bytes": dict(sorted(self.nic_bytes.items())),
            "peak_ring_bytes": {n: max((v for _, v in s), default=0)
                                for n, s in sorted(self.occ.items())},
            "bytes_moved": self.bytes_moved,
        }
