"""PNG pictures of a run: latency CDFs, ring occupancy and watermark lag over time, deferrals."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from twin.sim.decode_plots import write_decode_plot  # noqa: E402
from twin.sim.metrics import Metrics  # noqa: E402


def _step_series(ax, series: dict[str, list[tuple[float, int]]], title: str) -> None:
    for node in sorted(series):
        pts = series[node]
        if not pts:
            continue
        t = np.array([p[0] for p in pts])
        v = np.array([p[1] for p in pts]) / (1024 * 1024)
        ax.step(t, v, where="post", label=node, linewidth=0.9)
    ax.set_title(title)
    ax.set_xlabel("simulated time (s)")
    ax.set_ylabel("MiB")
    if series:
        ax.legend(fontsize=7, ncol=2)


def write_plots(metrics: Metrics, out_dir: Path) -> list[Path]:
    """Write ``latency.png``, ``ring.png`` and ``deferrals.png``; return the paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    ok = [r for r in metrics.done if r.status == "Success"]
    fig, ax = plt.subplots(figsize=(7, 4))
    for label, values in (("TTFT", [r.ttft_s for r in ok]),
                          ("KV transfer", [r.last_transfer_s - r.first_transfer_s for r in ok
                                           if r.first_transfer_s >= 0])):
        if values:
            v = np.sort(np.asarray(values))
            ax.plot(v, np.arange(1, len(v) + 1) / len(v), label=label)
    ax.set_xscale("log")
    ax.set_xlabel("seconds")
    ax.set_ylabel("fraction of requests")
    ax.set_title(f"Latency CDF ({len(ok)} completed requests)")
    ax.legend()
    fig.tight_layout()
    paths.append(out_dir / "latency.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    fig, (a1, a2) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    _step_series(a1, metrics.occ, "Bytes allocated and not yet freed (the ring overcommits)")
    ring_mib = metrics.topo.cfg.ring_bytes / (1024 * 1024)
    a1.axhline(ring_mib, color="grey", linestyle="--", linewidth=0.8)
    a1.annotate("ring size", (0, ring_mib), xycoords=("axes fraction", "data"), fontsize=7,
                color="grey", va="bottom")
    _step_series(a2, metrics.lag, "Watermark lag (allocation head minus watermark)")
    fig.tight_layout()
    paths.append(out_dir / "ring.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 3.5))
    nodes = sorted(metrics.deferrals)
    ax.bar(nodes, [metrics.deferrals[n] for n in nodes])
    ax.set_title("Backpressure deferrals per prefill rank")
    ax.set_ylabel("deferrals")
    ax.tick_params(axis="x", rotation=45)
    fig.tight_layout()
    paths.append(out_dir / "deferrals.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    return paths + write_decode_plot(metrics, out_dir)
