"""PNG of the serving loop over time: decode batch size and KV-pool use on both sides."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from twin.sim.metrics import Metrics  # noqa: E402


def write_decode_plot(metrics: Metrics, out_dir: Path, *,
                      stopped_at: float | None = None) -> list[Path]:
    """Write ``decode.png``: decode batch size, decode KV pool and prefill KV pool over time
    (one line per scheduler), with the pool sizes as dashed lines; the time axis ends at
    ``stopped_at`` when given."""
    out_dir.mkdir(parents=True, exist_ok=True)
    fig, (a1, a2, a3) = plt.subplots(3, 1, figsize=(8, 7.5), sharex=True)
    serving = metrics.serving
    for g, loop in enumerate(metrics.loops):
        if not loop.t:
            continue
        t = np.asarray(loop.t)
        a1.step(t, loop.batch, where="post", linewidth=0.8, label=f"decode group {g}")
        a2.step(t, np.asarray(loop.kv_tokens) / 1e3, where="post", linewidth=0.8,
                label=f"decode group {g}")
    for g, series in enumerate(metrics.prefill_pools):
        if series:
            t = np.asarray([x[0] for x in series])
            a3.step(t, np.asarray([x[1] for x in series]) / 1e3, where="post", linewidth=0.8,
                    label=f"prefill group {g}")
    for ax, side in ((a2, "decode"), (a3, "prefill")):
        cap = serving.get(side, {}).get("max_total_tokens")
        if cap:
            ax.axhline(cap / 1e3, color="grey", linestyle="--", linewidth=0.8)
    a1.set_title("Decode batch size (requests per decode step)")
    a1.set_ylabel("requests")
    a2.set_title("Decode KV pool in use (pre-allocated + running)")
    a2.set_ylabel("k tokens")
    a3.set_title("Prefill KV pool in use (held until the transfer is done)")
    a3.set_ylabel("k tokens")
    a3.set_xlabel("simulated time (s)")
    if stopped_at is not None:
        a3.set_xlim(0, max(stopped_at, 1e-9) * 1.01)
    for ax in (a1, a2, a3):
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    fig.tight_layout()
    path = out_dir / "decode.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]
