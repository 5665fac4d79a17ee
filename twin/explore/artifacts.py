"""What a campaign leaves in its directory.

``DIR/findings.md`` and ``DIR/findings.json``: one entry per signature (kind, root, smallest
repro size, first seen after how many runs and seconds, how often hit since, and whether its
trace replayed to the same outcome on real ranks: ``--confirm-hw``). Per finding,
``DIR/findings/NN-kind/``:

* ``repro.jsonl.gz``  the shrunk trial's trace: ``twin replay`` reproduces its verdict (checked
  when written; ``replay`` in the finding's JSON says what the replay concluded);
* ``command.txt``     a ``twin sim`` command line (with ``config.toml`` and ``workload.jsonl``
  beside it) when the simulator's own ordering reproduces the finding from those files alone
  (checked when written); a trial with per-request prefix hits has none (the trace carries them);
* ``test_repro.py``   a self-contained pytest file asserting the signature;
* ``story.md``        the shrunk trial in words: its deployment and requests, the frames,
  allocations, deferrals and watermarks in the order they happened, the diagnosis or the
  violations, and which defects it needs.
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path
from typing import Any

from twin.explore.campaign import Campaign, Finding
from twin.explore.oracles import run_trial
from twin.explore.trial import Base, Trial


def slug_for(sig: tuple[str, str], n: int) -> str:
    kind = re.sub(r"[^a-z0-9]+", "-", sig[0].lower()).strip("-")
    return f"{n + 1:02d}-{kind}"[:48]


def write_summary(campaign: Campaign, out: Path, *, interrupted: bool = False) -> dict[str, Any]:
    """``findings.md`` and ``findings.json``; returns the JSON object."""
    from twin.explore.faultmodel import classes_of

    out.mkdir(parents=True, exist_ok=True)
    p = campaign.progress()
    cov = campaign.coverage_report()
    data = {"status": "interrupted" if interrupted else "completed",
            "exit_code": 1 if interrupted else campaign.exit_status(),
            "seed": campaign.seed, "runs": p.runs, "invalid_trials": p.invalid,
            "seconds": round(p.elapsed, 3),
            "runs_per_second": round(p.runs / p.elapsed, 2) if p.elapsed else None,
            "coverage": {k: {"reached": r, "total": t} for k, (r, t) in cov.items()},
            "corpus": p.corpus, "strategies": campaign.strategies.names(),
            "fault_model": campaign.strategies.fault_model,
            "defects": list(campaign.base.defects), "worker_deaths": campaign.redone,
            "findings": [f.to_json() for f in campaign.findings.values()]}
    (out / "findings.json").write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    lines = ["# Findings", "",
             f"{p.runs} runs in {p.elapsed:.1f} s (seed {campaign.seed}; strategies "
             f"{', '.join(campaign.strategies.names()) or 'none'}; fault model "
             f"{campaign.strategies.fault_model}; defects on: "
             f"{', '.join(campaign.base.defects) or 'none'})"
             + (" — interrupted" if interrupted else "") + ".",
             "Coverage: " + ", ".join(f"{k} {r}/{t}" for k, (r, t) in cov.items()) + ".", ""]
    if not campaign.findings:
        lines.append("No findings.")
    else:
        lines += ["| # | kind | root | smallest repro | faults it needs | first seen | hits | "
                  "needs | SGLang 0.5.23 | hardware | dir |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for i, f in enumerate(campaign.findings.values(), 1):
            s = f.shrunk
            size = (f"{len(s.requests)} req, {len(s.faults)} fault(s), "
                    f"{sum(r.input_len for r in s.requests)} tokens")
            lines.append(f"| {i} | {f.kind} | {f.root.replace('|', '/')} | {size} | "
                         f"{', '.join(classes_of(s.faults)) or 'none'} | run "
                         f"{f.first_run}, {f.first_seconds:.1f} s | {f.hits} | "
                         f"{', '.join(f.needs_defects) or '-'} | "
                         f"{f.exposure.get('label', 'not computed')} | "
                         f"{f.hw.replace('|', '/') or 'not tried'} | findings/{f.slug}/ |")
        lines += ["", "Would SGLang 0.5.23 meet each finding (`exposed`, `not exposed`, "
                  "`unchecked`; docs/explore.md, \"Exposure of SGLang 0.5.23\"):", ""]
        for i, f in enumerate(campaign.findings.values(), 1):
            lines.append(f"{i}. {exposure_text(f.exposure)}")
    (out / "findings.md").write_text("\n".join(lines) + "\n")
    return data


def exposure_text(exposure: dict[str, str]) -> str:
    """A finding's ``sglang_exposure`` in words: the label, then why."""
    if not exposure:
        return "not computed (the finding was recorded before the label existed)"
    return f"**{exposure['label']}**: {exposure.get('detail', '')}".rstrip(": ")


def write_finding(base: Base, f: Finding, out: Path) -> dict[str, Any]:
    """The finding's directory (see the module docstring); returns what was checked."""
    d = out / "findings" / f.slug
    d.mkdir(parents=True, exist_ok=True)
    trial = f.shrunk
    (d / "trial.json").write_text(json.dumps(
        {"base": base.to_json(), "trial": trial.to_json(), "signature": list(f.signature)},
        indent=2, sort_keys=True) + "\n")
    checks: dict[str, Any] = {}
    sim_trial: Trial | None = trial
    res = run_trial(base, trial, log_limit=400)
    if trial.schedule:
        # A loopback interleaving: the simulator's own ordering may show it too, on some seed.
        sim_trial = next((t for t in (trial.with_(schedule="", seed=s) for s in range(8))
                          if run_trial(base, t).signature == f.signature), None)
        checks["simulator"] = (f"reproduces it with seed {sim_trial.seed}" if sim_trial
                               else "no seed of 0-7 reproduces it")
    if sim_trial is None:
        checks["replay"] = ("none: only the loopback schedule shows it (trial.json and "
                            "test_repro.py reproduce it)")
        checks["command"] = "none: only the loopback schedule shows it"
    else:
        trace = d / "repro.jsonl.gz"
        traced = run_trial(base, sim_trial, trace_out=str(trace))
        checks["trace_signature"] = list(traced.signature) if traced.signature else None
        try:
            from twin.replay import replay_sim

            rep = replay_sim(str(trace))
            checks["replay"] = rep.status if rep.divergence is None else "diverged"
        except Exception as exc:  # a replay that cannot run is reported, not fatal
            checks["replay"] = f"error: {exc!r}"[:200]
        checks["command"] = _write_command(base, f, sim_trial, traced.status, d)
    (d / "test_repro.py").write_text(_pytest_text(base, f))
    (d / "story.md").write_text(_story(base, f, res.log, checks))
    (d / "checks.json").write_text(json.dumps(checks, indent=2, sort_keys=True) + "\n")
    return checks


def _write_command(base: Base, f: Finding, trial: Trial, status: str, d: Path) -> str:
    """Write ``config.toml``, ``workload.jsonl`` and ``command.txt`` when a plain ``twin sim``
    reproduces ``trial``'s ``status``; the command, or why there is none."""
    import tomli_w

    from twin.core.config import TwinConfig
    from twin.runtime.params import SimParams
    from twin.workloads import parse_workload_spec

    if trial.overrides():
        return "none: the trial sets per-request prefix hits, which only the trace carries"
    cfg = base.config(trial)
    data = cfg.to_dict()
    for table in ("launch", "run"):
        data.pop(table, None)
    data["sim"] = base.params.to_dict()
    (d / "config.toml").write_text(tomli_w.dumps(data))
    rows = [json.dumps({"timestamp": r.at * 1000.0, "input_length": r.input_len,
                        "output_length": 8, "hash_ids": list(q.prefix_hashes)})
            for r, q in zip(sorted(trial.requests, key=lambda q: q.at),
                            trial.workload().requests, strict=True)]
    (d / "workload.jsonl").write_text("\n".join(rows) + "\n")
    args = ["twin", "sim", "--config", str(d / "config.toml"), "--workload",
            str(d / "workload.jsonl")]
    for x in base.defects:
        args += ["--defect", x]
    for fix in cfg.fixes:
        args += ["--fix", fix]
    for fault in trial.faults:
        args += ["--fault", fault]
    args += ["--seed", str(trial.seed)]
    # Check it: the same files through the same loaders the command uses.
    from twin.runtime.faults import parse_fault
    from twin.sim.runner import run_sim

    cfg2 = TwinConfig.from_toml(d / "config.toml", base=TwinConfig())
    params = SimParams.from_dict(cfg2.extra.get("sim", {}), "config.toml")
    wl = parse_workload_spec(str(d / "workload.jsonl"))
    got = run_sim(cfg2, wl, defects=base.defects_on(), faults=[parse_fault(x) for x in
                                                                trial.faults],
                  seed=trial.seed, params=params).status.value
    if got != status:
        (d / "config.toml").unlink()
        (d / "workload.jsonl").unlink()
        return f"none: the simulator's own ordering from files ends {got}, not {status}"
    text = shlex.join(args)
    (d / "command.txt").write_text(text + "\n")
    return text


def _pytest_text(base: Base, f: Finding) -> str:
    data = json.dumps({"base": base.to_json(), "trial": f.shrunk.to_json()}, sort_keys=True)
    return f'''"""Explorer finding: {f.kind} — {f.root}

Shrunk repro; the test asserts that the trial still shows this signature (kind, root).
"""

import json

from twin.explore.oracles import run_trial
from twin.explore.trial import Base, Trial

DATA = json.loads({data!r})
SIGNATURE = {tuple(f.signature)!r}


def test_finding_reproduces():
    result = run_trial(Base.from_json(DATA["base"]), Trial.from_json(DATA["trial"]))
    assert result.signature == SIGNATURE, (result.status, result.diagnosis, result.corruption)
'''


def _story(base: Base, f: Finding, log: list[tuple[float, str, str]],
           checks: dict[str, Any]) -> str:
    from twin.cli.common import describe

    t = f.shrunk
    cfg = base.config(t)
    lines = [f"# {f.kind}: {f.root}", "",
             f"Found after {f.first_run} run(s), {f.first_seconds:.1f} s; shrunk in "
             f"{f.shrink_runs} run(s) from {len(f.trial.requests)} request(s) and "
             f"{len(f.trial.faults)} fault(s) to {len(t.requests)} and {len(t.faults)}.", "",
             "## The trial", "", f"- deployment: {describe(cfg)}",
             f"- defects on: {', '.join(base.defects) or 'none'}"
             + (f" (needed: {', '.join(f.needs_defects) or 'none of them'})"
                if base.defects else ""),
             f"- seed: {t.seed}" + (f"; interleaving: loopback cluster, scheduler "
                                    f"`{t.schedule}` (all rooms start at once, logical time)"
                                    if t.schedule else "")]
    for i, r in enumerate(sorted(t.requests, key=lambda q: q.at)):
        extra = []
        if r.decode_prefix:
            extra.append(f"decode prefix {r.decode_prefix}")
        if r.prefill_prefix:
            extra.append(f"prefill radix hit {r.prefill_prefix}")
        lines.append(f"- room {i}: {r.input_len} tokens at {r.at:g} s"
                     + (f" ({', '.join(extra)})" if extra else ""))
    for fault in t.faults:
        lines.append(f"- fault: `{fault}`")
    lines += ["", "## What happened, in order", "",
              "Frames (`->` sent, `<-` arrived), allocations, writes, scatters, deferrals and "
              "watermark moves as the ranks saw them:", "", "```"]
    for at, node, text in log[:200]:
        lines.append(f"{at * 1e3:9.3f} ms  {node:8s} {text}")
    if len(log) > 200:
        lines.append(f"... ({len(log) - 200} more)")
    lines += ["```", ""]
    if f.diagnosis:
        lines += ["## Diagnosis (what waits on what; roots first)", ""]
        lines += [f"- {x}" for x in f.diagnosis] + [""]
    if f.corruption:
        lines += ["## Integrity violations", ""] + [f"- {x}" for x in f.corruption] + [""]
    if f.failures:
        lines += ["## Failed requests", ""]
        lines += [f"- {n} x {reason}" for reason, n in f.failures.items()] + [""]
    if f.exposure:
        lines += ["## Would SGLang 0.5.23 meet it?", "", exposure_text(f.exposure), ""]
    lines += ["## Reproduce", "", f"- `twin replay repro.jsonl.gz`: {checks.get('replay')}",
              f"- `twin sim`: {checks.get('command')}", "- `pytest test_repro.py`", ""]
    if "simulator" in checks:
        lines.insert(-1, f"- the simulator's own ordering: {checks['simulator']}")
    return "\n".join(lines)
