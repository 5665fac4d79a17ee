"""Which host a calibration was fitted on, and whether a trace ran there.

A hardware trace records the host it ran on (``twin.hw.probe.host_record``: hostname, CPU
model, cores and a short probe of its speed, in its config's ``[run]`` table). ``twin
calibrate`` writes the calibration traces' host into the costs file, as one comment line
(``# host: {...}``, JSON), so that the file stays a plain ``[sim]`` config for ``twin sim``
and ``twin hw``. ``twin replay TRACE --config costs.toml`` then compares the two
(``host_check``): costs fitted on another host, or on traces that do not say where they ran,
make the timing comparison a check of one host's costs on another host's run, not a
calibration check, and it says so.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from twin.hw.probe import IDENTITY
from twin.trace.format import Trace, TraceReader

HOST_LINE = "# host: "
"""How the costs file's host line starts; the rest is the host record as JSON, or
``unknown (why)``."""

PROBE_TOLERANCE = 0.15
"""How far the probe's rates (median ratio) may be from the calibration's before the check
says the host ran at another speed when the run started."""

RATES = ("py_ops_per_s", "memcpy_Bps", "scatter_Bps")
"""The probe's rates that the check compares (the wake-up time swings by 10x between two
probes on a quiet host, so it is recorded, not compared)."""


def trace_host(trace: Trace | TraceReader) -> dict[str, Any] | None:
    """The host record of a hardware trace; None for a trace that has none (recorded before
    hosts were recorded, across nodes, or by the simulator)."""
    host = trace.config.extra.get("run", {}).get("host")
    return dict(host) if isinstance(host, dict) else None


def same_host(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    """Whether two host records name the same host (hostname, CPU model and cores)."""
    return all(a.get(k) == b.get(k) for k in IDENTITY)


def describe(host: Mapping[str, Any] | None) -> str:
    """``vm (Intel(R) Xeon(R) Processor, 2 cores)``, or ``an unrecorded host``."""
    if host is None:
        return "an unrecorded host"
    return f"{host.get('hostname', '?')} ({host.get('cpu', '?')}, {host.get('cores', '?')} cores)"


def fitted_host(hosts: Sequence[Mapping[str, Any] | None]) -> tuple[dict[str, Any] | None, str]:
    """The host a calibration on traces with these host records was fitted on: their common
    identity with the median of each probe rate, and ``""``; or None and why there is none
    (a trace without a host record, or traces from several hosts)."""
    if not hosts or any(h is None for h in hosts):
        return None, "a calibration trace does not record its host"
    known = [h for h in hosts if h is not None]
    if not all(same_host(known[0], h) for h in known[1:]):
        return None, "the calibration traces ran on several hosts: " + ", ".join(
            sorted({describe(h) for h in known}))
    rates: dict[str, float] = {}
    for key in sorted({k for h in known for k in h.get("probe", {})}):
        values = [float(h["probe"][key]) for h in known if key in h.get("probe", {})]
        rates[key] = float(f"{np.median(values):.4g}")
    return {**{k: known[0].get(k) for k in IDENTITY}, "probe": rates,
            "traces": len(known)}, ""


def host_line(host: Mapping[str, Any] | None, why: str = "") -> str:
    """The costs file's host line (see ``HOST_LINE``)."""
    if host is None:
        return f"{HOST_LINE}unknown ({why or 'not recorded'})"
    return HOST_LINE + json.dumps(dict(host), sort_keys=True)


def costs_host(path: str | Path | None) -> dict[str, Any] | None:
    """The host record in a costs file's host line; None without a path, a line, or a
    recorded host (``unknown``). ``OSError`` when the file cannot be read."""
    if path is None:
        return None
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        if line.startswith(HOST_LINE):
            try:
                host = json.loads(line[len(HOST_LINE):])
            except ValueError:
                return None
            return host if isinstance(host, dict) else None
        if line.startswith("["):
            break  # the comment block ends at the first table
    return None


def host_check(trace: Mapping[str, Any] | None, costs: Mapping[str, Any] | None
               ) -> dict[str, Any]:
    """Where a trace ran against where the costs compared with it were fitted: ``trace``,
    ``costs`` (described), ``same`` (True, False, or None when either is unrecorded), the
    probe's ``probe_ratio`` (median over ``RATES`` of the trace's rate over the costs', same
    host only) and a ``note`` unless the costs were fitted on this very host at the same
    speed."""
    out: dict[str, Any] = {"trace": describe(trace), "costs": describe(costs), "same": None}
    if costs is None:
        ran = ("this trace does not record its host either" if trace is None
               else f"this trace ran on {describe(trace)}")
        out["note"] = ("the costs do not record the host they were fitted on (fitted on "
                       f"traces without a host record, or written by hand) and {ran}: "
                       "whether they were fitted where it ran is unknown, so this is not "
                       "known to be a calibration check")
        return out
    if trace is None:
        out["note"] = (f"the costs were fitted on {describe(costs)}; this trace does not "
                       "record its host, so this is not known to be a calibration check "
                       "(record the traces with this version's `twin hw`)")
        return out
    out["same"] = same_host(trace, costs)
    if not out["same"]:
        out["note"] = (f"the costs were fitted on another host, {describe(costs)}, and this "
                       f"trace ran on {describe(trace)}: the comparison is not a calibration "
                       "check (fit on traces from this host: `twin calibrate`)")
        return out
    a, b = trace.get("probe", {}), costs.get("probe", {})
    ratios = [float(a[k]) / float(b[k]) for k in RATES if k in a and k in b and b[k] > 0]
    if ratios:
        ratio = float(np.median(ratios))
        out["probe_ratio"] = round(ratio, 3)
        if not 1 / (1 + PROBE_TOLERANCE) <= ratio <= 1 + PROBE_TOLERANCE:
            out["note"] = (f"same host, but its probe ran at {ratio:.2f}x the calibration's "
                           "rates when this run started: the host was at another speed")
    return out
