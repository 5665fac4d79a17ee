"""Plots of a result file: heatmaps over two swept fields, the Pareto frontier of ring size
against p99 TTFT, and latency CDFs across points.

Seeds are folded: a cell or point shows the worst verdict and the largest metric over its seeds
(and over any other swept field when more than two vary), so a plot never looks better than the
unluckiest run behind it.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from twin.advise.results import ResultsError, axis_names, json_cell, read_results
from twin.advise.space import AxisError, canonical_name, short_name

SEVERITY = ("clean", "over-budget", "failed", "unfinished", "invalid", "error", "wedged",
            "corrupted")
"""Verdicts from best to worst (a folded cell shows the worst)."""
COLOURS = {"clean": "#4caf50", "over-budget": "#cddc39", "failed": "#ff9800", "unfinished": "#ffeb3b",
           "invalid": "#bdbdbd", "error": "#424242", "wedged": "#e53935",
           "corrupted": "#8e24aa"}
MAX_CDF_CURVES = 12


def _sort_key(v: Any) -> tuple[int, Any]:
    return (0, v) if isinstance(v, (int, float)) else (1, str(v))


def _label(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:g}"
    text = str(v)
    return text if len(text) <= 24 else text[:21] + "..."


def _worst(outcomes: Sequence[str]) -> str:
    return max(outcomes, key=lambda o: SEVERITY.index(o) if o in SEVERITY else len(SEVERITY))


def _max(values: Sequence[Any]) -> float | None:
    nums = [float(v) for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]
    return max(nums) if nums else None


def varying_axes(rows: list[dict[str, Any]]) -> list[str]:
    """Swept fields with more than one value, most values first."""
    counts = {a: len({str(r.get(f"x.{a}")) for r in rows}) for a in axis_names(rows)}
    return sorted((a for a, n in counts.items() if n > 1), key=lambda a: -counts[a])


def _resolve(name: str, rows: list[dict[str, Any]]) -> str:
    names = axis_names(rows)
    if name in names:
        return name
    try:
        full = canonical_name(name)
    except AxisError:
        full = name
    if full not in names:
        raise ValueError(f"{name!r} is not a swept field of this file; swept: "
                         f"{', '.join(names) or 'none'}")
    return full


def write_plots(results_path: str | Path, out_dir: Path, x: str | None = None,
                y: str | None = None) -> list[Path]:
    """Write every plot the file supports into ``out_dir``; return their paths."""
    import matplotlib

    matplotlib.use("Agg")
    rows = read_results(results_path)
    if not rows:
        raise ResultsError(f"{results_path}: no result rows")
    out_dir.mkdir(parents=True, exist_ok=True)
    paths: list[Path] = []
    vary = varying_axes(rows)
    xa = _resolve(x, rows) if x else None
    ya = _resolve(y, rows) if y else None
    rest = [a for a in vary if a not in (xa, ya)]
    xa = xa or (rest.pop(0) if rest else None)
    ya = ya or (rest.pop(0) if rest else None)
    if xa and ya and xa != ya:
        paths += heatmaps(rows, xa, ya, out_dir)
    p = pareto(rows, out_dir)
    if p:
        paths.append(p)
    for series in ("ttft", "tpot"):
        p = cdfs(rows, series, out_dir)
        if p:
            paths.append(p)
    return paths


def heatmaps(rows: list[dict[str, Any]], xa: str, ya: str, out_dir: Path) -> list[Path]:
    """``heatmap_verdict.png``, ``heatmap_ttft_p99.png`` and ``heatmap_deferral_wait.png``."""
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.colors import ListedColormap, LogNorm

    xs = sorted({r.get(f"x.{xa}") for r in rows}, key=_sort_key)
    ys = sorted({r.get(f"x.{ya}") for r in rows}, key=_sort_key)
    cells: dict[tuple[int, int], list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        cells[(xs.index(r.get(f"x.{xa}")), ys.index(r.get(f"x.{ya}")))].append(r)
    folded = len(varying_axes(rows)) > 2 or len({r.get("seed") for r in rows}) > 1
    note = " (worst over seeds" + (" and other fields)" if len(varying_axes(rows)) > 2
                                   else ")") if folded else ""
    paths = []

    def frame(title: str):  # type: ignore[no-untyped-def]
        fig, ax = plt.subplots(figsize=(1.2 + 0.9 * len(xs), 1.2 + 0.6 * len(ys)))
        ax.set_xticks(range(len(xs)), [_label(v) for v in xs], rotation=45, ha="right")
        ax.set_yticks(range(len(ys)), [_label(v) for v in ys])
        ax.set_xlabel(xa)
        ax.set_ylabel(ya)
        ax.set_title(title + note, fontsize=9)
        return fig, ax

    # Verdict
    grid = np.full((len(ys), len(xs)), np.nan)
    fig, ax = frame("verdict")
    for (i, j), rs in cells.items():
        worst = _worst([str(r.get("outcome")) for r in rs])
        grid[j, i] = SEVERITY.index(worst) if worst in SEVERITY else len(SEVERITY) - 1
        ax.text(i, j, worst, ha="center", va="center", fontsize=7)
    cmap = ListedColormap([COLOURS[s] for s in SEVERITY])
    ax.imshow(grid, cmap=cmap, vmin=-0.5, vmax=len(SEVERITY) - 0.5, origin="lower",
              aspect="auto")
    fig.tight_layout()
    paths.append(out_dir / "heatmap_verdict.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    for column, name, unit in (("ttft_p99", "heatmap_ttft_p99.png", "p99 TTFT (s)"),
                               ("deferral_wait_s", "heatmap_deferral_wait.png",
                                "deferral wait (s, deferrals x bounded wait)")):
        grid = np.full((len(ys), len(xs)), np.nan)
        for (i, j), rs in cells.items():
            v = _max([r.get(column) for r in rs])
            if v is not None:
                grid[j, i] = v
        fig, ax = frame(unit)
        finite = grid[np.isfinite(grid) & (grid > 0)]
        norm = LogNorm(vmin=finite.min(), vmax=max(finite.max(), finite.min() * 1.01)) \
            if finite.size else None
        im = ax.imshow(np.where(grid > 0, grid, np.nan), origin="lower", aspect="auto",
                       cmap="viridis", norm=norm)
        for (i, j), _rs in cells.items():
            v = grid[j, i]
            ax.text(i, j, "-" if math.isnan(v) else f"{v:.3g}", ha="center", va="center",
                    fontsize=7, color="white")
        if finite.size:
            fig.colorbar(im, ax=ax, label=unit)
        fig.tight_layout()
        paths.append(out_dir / name)
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    return paths


def _configs(rows: list[dict[str, Any]]) -> dict[tuple[Any, ...], list[dict[str, Any]]]:
    """Rows grouped by everything but the seed."""
    names = axis_names(rows)
    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        groups[tuple(str(r.get(f"x.{a}")) for a in names)].append(r)
    return groups


def pareto_front(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The points no other point beats on both coordinates (smaller is better), by x."""
    front: list[tuple[float, float]] = []
    for x, y in sorted(points):
        if not front or y < front[-1][1]:
            front.append((x, y))
    return front


def pareto(rows: list[dict[str, Any]], out_dir: Path) -> Path | None:
    """``pareto_ring_ttft.png``: ring size against p99 TTFT of the points that ran clean on every
    seed, coloured by chunk size, with the frontier."""
    import matplotlib.pyplot as plt

    pts: dict[Any, list[tuple[float, float]]] = defaultdict(list)
    for rs in _configs(rows).values():
        if any(r.get("outcome") != "clean" for r in rs):
            continue
        ring = rs[0].get("ring_mb")
        ttft = _max([r.get("ttft_p99") for r in rs])
        if isinstance(ring, (int, float)) and ttft is not None:
            pts[rs[0].get("chunked_prefill_size")].append((float(ring), ttft))
    allpts = [p for v in pts.values() for p in v]
    if not allpts:
        return None
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for cps in sorted(pts, key=_sort_key):
        xs, ys = zip(*sorted(pts[cps]), strict=True)
        ax.scatter(xs, ys, s=18, alpha=0.6, label=f"cps {cps}")
    front = pareto_front(allpts)
    fx, fy = zip(*front, strict=True)
    ax.step(fx, fy, where="post", color="black", lw=1.5, label="Pareto frontier")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("decode staging ring (MiB per rank)")
    ax.set_ylabel("p99 TTFT (s, worst seed)")
    ax.set_title("ring size vs p99 TTFT (clean points only)", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    path = out_dir / "pareto_ring_ttft.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def cdfs(rows: list[dict[str, Any]], series: str, out_dir: Path) -> Path | None:
    """``cdf_ttft.png`` (or ``cdf_tpot.png``): one CDF per point (its first seed), from the
    point's quantile sketch; at most 12 curves, spread over the points."""
    import matplotlib.pyplot as plt

    from twin.advise.evaluate import QUANTILES

    curves = []
    names = axis_names(rows)
    vary = set(varying_axes(rows))
    for rs in _configs(rows).values():
        r = min(rs, key=lambda r: r.get("seed") or 0)
        q = json_cell(r, f"{series}_q")
        if isinstance(q, list) and len(q) == len(QUANTILES):
            label = " ".join(f"{short_name(a)}={_label(r.get(f'x.{a}'))}" for a in names
                             if a in vary)
            curves.append((label or "point", q))
    if not curves:
        return None
    if len(curves) > MAX_CDF_CURVES:
        step = (len(curves) - 1) / (MAX_CDF_CURVES - 1)
        curves = [curves[round(i * step)] for i in range(MAX_CDF_CURVES)]
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    colours = plt.get_cmap("tab20" if len(curves) > 10 else "tab10")
    for i, (label, q) in enumerate(curves):
        ax.plot([max(v, 1e-6) for v in q], QUANTILES, lw=1.2, label=label, color=colours(i))
    ax.set_xscale("log")
    ax.set_xlabel(f"{series.upper()} (s)")
    ax.set_ylabel("fraction of requests")
    ax.set_title(f"{series.upper()} CDF per point (first seed)", fontsize=9)
    ax.legend(fontsize=6)
    fig.tight_layout()
    path = out_dir / f"cdf_{series}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
