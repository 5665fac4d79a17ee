"""PNG pictures of a run: latency CDFs, ring occupancy and watermark lag over time, deferrals.

``ring.png`` has one row per decode rank (fill on the left, watermark lag on the right), so two
ranks with the same fill never hide each other. A long series is drawn as its per-bin minimum
to maximum band plus the maximum, so thousands of allocations stay readable instead of a solid
wall. The time axis runs to where the run stopped; a wedged run shades the stretch without
progress and marks where the wedge was declared. ``latency.png`` marks p50 and p99 of TTFT.
Every figure is saved with its labels inside the image.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from twin.sim.decode_plots import write_decode_plot  # noqa: E402
from twin.sim.metrics import Metrics  # noqa: E402

MAX_POINTS = 2000   # a series with more points is drawn as a per-bin band
BINS = 400
MAX_ROWS = 8        # decode ranks drawn in their own row; more share rows
MiB = 1024 * 1024


def envelope(t: np.ndarray, v: np.ndarray, t_end: float, bins: int = BINS
             ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Bin a step series over ``[0, t_end]``: ``(bin starts, min, max, mean)`` of the values
    held in each bin (a bin with no change holds the previous value)."""
    edges = np.linspace(0.0, max(t_end, float(t[-1]), 1e-9), bins + 1)
    idx = np.clip(np.searchsorted(edges, t, side="right") - 1, 0, bins - 1)
    lo = np.full(bins, np.nan)
    hi = np.full(bins, np.nan)
    np.fmin.at(lo, idx, v)
    np.fmax.at(hi, idx, v)
    # The value held at the start of each bin (the last change before it) also counts.
    held_i = np.searchsorted(t, edges[:-1], side="right") - 1
    held = np.where(held_i >= 0, v[np.clip(held_i, 0, len(v) - 1)], np.nan)
    lo = np.fmin(lo, held)
    hi = np.fmax(hi, held)
    total = np.zeros(bins)
    count = np.zeros(bins)
    np.add.at(total, idx, v)
    np.add.at(count, idx, 1)
    has = ~np.isnan(held)
    total[has] += held[has]
    count[has] += 1
    with np.errstate(invalid="ignore", divide="ignore"):
        mean = total / count
    return edges[:-1], lo, hi, mean


def _series(ax, pts: list[tuple[float, int]], t_end: float, color: str, scale: float) -> None:
    if not pts:
        ax.text(0.5, 0.5, "no data", transform=ax.transAxes, ha="center", va="center",
                color="grey", fontsize=8)
        return
    t = np.array([p[0] for p in pts], dtype=float)
    v = np.array([p[1] for p in pts], dtype=float) / scale
    if len(t) <= MAX_POINTS:
        t = np.append(t, max(t_end, t[-1]))
        v = np.append(v, v[-1])
        ax.step(t, v, where="post", color=color, linewidth=0.9)
        return
    starts, lo, hi, mean = envelope(t, v, t_end)
    ax.fill_between(starts, lo, hi, step="post", color=color, alpha=0.25, linewidth=0,
                    label="min to max")
    ax.step(starts, mean, where="post", color=color, linewidth=0.9, label="mean")
    ax.legend(fontsize=6, loc="upper right", framealpha=0.6)


def _mark_stop(ax, t_end: float, wedged: bool, last_progress: float | None) -> None:
    ax.set_xlim(0, max(t_end, 1e-9) * 1.01)
    if not wedged:
        return
    if last_progress is not None and last_progress < t_end:
        ax.axvspan(last_progress, t_end, color="tab:red", alpha=0.08, linewidth=0)
    ax.axvline(t_end, color="tab:red", linestyle="--", linewidth=1.0)


def write_plots(metrics: Metrics, out_dir: Path, *, stopped_at: float | None = None,
                wedged: bool = False, last_progress: float | None = None) -> list[Path]:
    """Write ``latency.png``, ``ring.png``, ``deferrals.png`` and ``decode.png`` (decode batch
    and KV pools, ``twin.sim.decode_plots``); return the paths.

    ``stopped_at``: where the run stopped (the time axis ends there; default: the last sample).
    ``wedged`` marks the wedge at ``stopped_at`` and shades from ``last_progress``.
    """
    out_dir.mkdir(exist_ok=True)
    paths = [_latency(metrics, out_dir / "latency.png"),
             _ring(metrics, out_dir / "ring.png", stopped_at, wedged, last_progress),
             _deferrals(metrics, out_dir / "deferrals.png")]
    return paths + write_decode_plot(metrics, out_dir, stopped_at=stopped_at)


def _latency(metrics: Metrics, path: Path) -> Path:
    ok = [r for r in metrics.done if r.status == "Success"]
    failed = sum(r.status == "Failed" for r in metrics.done)
    fig, ax = plt.subplots(figsize=(7, 4))
    series = (("TTFT", [r.ttft_s for r in ok], "tab:blue"),
              ("KV transfer", [r.last_transfer_s - r.first_transfer_s for r in ok
                               if r.first_transfer_s >= 0 and r.last_transfer_s > r.first_transfer_s],
               "tab:orange"))
    drawn = False
    for label, values, color in series:
        if not values:
            continue
        v = np.sort(np.asarray(values))
        ax.plot(v, np.arange(1, len(v) + 1) / len(v), label=label, color=color)
        drawn = True
        if label == "TTFT":
            for q, style in ((50, ":"), (99, "--")):
                x = float(np.percentile(v, q))
                ax.axvline(x, color=color, linestyle=style, linewidth=0.9)
                ax.plot([x], [q / 100], marker="o", color=color, markersize=4)
                ax.annotate(f"p{q} {_secs(x)}", (x, q / 100), xytext=(-4, 4),
                            textcoords="offset points", fontsize=8, color=color, ha="right")
    if drawn:
        ax.set_xscale("log")
        ax.legend(loc="lower right")
    else:
        ax.text(0.5, 0.5, "no completed requests", transform=ax.transAxes, ha="center",
                va="center")
    ax.set_xlabel("seconds")
    ax.set_ylabel("fraction of completed requests")
    extra = f", {failed} failed" if failed else ""
    ax.set_title(f"Latency CDF ({len(ok)} completed requests{extra})")
    ax.set_ylim(0, 1.05)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


def _secs(x: float) -> str:
    return f"{x * 1e3:.1f} ms" if x < 1 else f"{x:.2f} s"


def _ring(metrics: Metrics, path: Path, stopped_at: float | None, wedged: bool,
          last_progress: float | None) -> Path:
    nodes = sorted(set(metrics.occ) | set(metrics.lag)) or ["(no decode rank)"]
    t_end = stopped_at if stopped_at is not None else max(
        [p[-1][0] for p in (*metrics.occ.values(), *metrics.lag.values()) if p] or [1.0])
    groups = [[n] for n in nodes] if len(nodes) <= MAX_ROWS else \
        [nodes[i::MAX_ROWS] for i in range(MAX_ROWS)]
    rows = len(groups)
    fig, axes = plt.subplots(rows, 2, figsize=(11, 1.9 * rows + 1.2), sharex=True,
                             squeeze=False)
    ring_mib = metrics.topo.cfg.ring_bytes / MiB
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for row, group in enumerate(groups):
        fill_ax, lag_ax = axes[row]
        for k, node in enumerate(group):
            color = colors[(row + k) % len(colors)]
            _series(fill_ax, metrics.occ.get(node, []), t_end, color, MiB)
            _series(lag_ax, metrics.lag.get(node, []), t_end, color, MiB)
        label = ", ".join(group)
        fill_ax.set_ylabel(f"{label}\nMiB", fontsize=8)
        lag_ax.set_ylabel("MiB", fontsize=8)
        fill_ax.axhline(ring_mib, color="grey", linestyle="--", linewidth=0.8)
        fill_ax.annotate(f"ring {ring_mib:g} MiB", (0.005, ring_mib),
                         xycoords=("axes fraction", "data"), fontsize=7, color="grey",
                         va="bottom")
        for ax in (fill_ax, lag_ax):
            _mark_stop(ax, t_end, wedged, last_progress)
            ax.tick_params(labelsize=7)
    axes[0][0].set_title("Allocated, not yet freed (may exceed the ring: it overcommits)",
                         fontsize=9)
    axes[0][1].set_title("Watermark lag (allocation head minus watermark)", fontsize=9)
    for ax in axes[-1]:
        ax.set_xlabel("simulated time (s)")
    if wedged:
        axes[0][1].annotate("wedge declared", (t_end, 0.97), xycoords=("data", "axes fraction"),
                            xytext=(-4, 0), textcoords="offset points", fontsize=7,
                            color="tab:red", ha="right", va="top")
        if last_progress is not None:
            axes[0][0].annotate("no progress", (last_progress, 0.97),
                                xycoords=("data", "axes fraction"), xytext=(4, 0),
                                textcoords="offset points", fontsize=7, color="tab:red",
                                va="top")
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


def _deferrals(metrics: Metrics, path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(7, 3.5))
    nodes = sorted(metrics.deferrals)
    if nodes:
        ax.bar(nodes, [metrics.deferrals[n] for n in nodes])
        ax.tick_params(axis="x", rotation=45)
    else:
        ax.text(0.5, 0.5, "no deferrals", transform=ax.transAxes, ha="center", va="center")
    ax.set_title("Backpressure deferrals per prefill rank")
    ax.set_ylabel("deferrals")
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path
