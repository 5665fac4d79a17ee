"""An exploration campaign: generate trials, run them (here or on workers), keep what reaches
something new, shrink and record every new finding.

Determinism. Trials are made in rounds of ``ROUND`` trials; trial ``i`` of round ``k`` is drawn
from ``random.Random(f"{seed}:{k}:{i}")`` and the corpus as it stood when round ``k`` began, and
the results of a round are taken in trial order once the whole round is back. So the same seed
and the same budget in runs give the same trials, corpus, findings and shrunk repros, whatever
the number of workers and whichever finishes first. A budget in seconds stops after the round
running when it runs out (and is, by nature, not reproducible run for run).

Memory stays bounded: the corpus holds at most ``corpus_cap`` trials (when full, the oldest
entry that was not a finding's is dropped), the coverage set is bounded by its universe, and
findings are one per signature.

A campaign's state (``state.json`` in its directory) is rewritten after every round, so a
campaign stopped by Ctrl-C, SIGTERM or a crash resumes from the last whole round.
"""

from __future__ import annotations

import json
import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from twin.explore.coverage import coverage_report
from twin.explore.exposure import exposure
from twin.explore.faultmodel import MODELS, classes_of
from twin.explore.oracles import TrialResult, run_trial
from twin.explore.shrink import shrink
from twin.explore.strategies import Strategies, generate, mutate
from twin.explore.trial import Base, Req, Trial

ROUND = 8
LIVELOCK_SHRINK_RUNS = 16
"""Runs a livelock's shrink may take (each runs to the trial bound, 200,000 core inputs)."""
STATE_FILE = "state.json"
STATE_VERSION = 1


@dataclass
class Finding:
    signature: tuple[str, str]
    status: str
    first_run: int
    first_seconds: float
    trial: Trial
    shrunk: Trial
    shrink_runs: int = 0
    hits: int = 1
    diagnosis: list[str] = field(default_factory=list)
    corruption: list[str] = field(default_factory=list)
    failures: dict[str, int] = field(default_factory=dict)
    needs_defects: list[str] = field(default_factory=list)
    slug: str = ""
    hw: str = ""  # the hardware replay's verdict (``twin/explore/confirm.py``); "" not tried
    # Would SGLang 0.5.23 meet it (``twin/explore/exposure.py``): {"label", "detail"}; empty
    # for a finding recorded before the label existed.
    exposure: dict[str, str] = field(default_factory=dict)

    @property
    def kind(self) -> str:
        return self.signature[0]

    @property
    def root(self) -> str:
        return self.signature[1]

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "root": self.root, "status": self.status,
                "first_run": self.first_run, "first_seconds": round(self.first_seconds, 3),
                "trial": self.trial.to_json(), "shrunk": self.shrunk.to_json(),
                "shrunk_size": {"requests": len(self.shrunk.requests),
                                "faults": len(self.shrunk.faults),
                                "tokens": sum(r.input_len for r in self.shrunk.requests),
                                "deploy_changes": self.shrunk.deploy.fields()},
                "shrink_runs": self.shrink_runs, "hits": self.hits,
                "diagnosis": self.diagnosis, "corruption": self.corruption,
                "failures": self.failures, "needs_defects": self.needs_defects,
                "fault_classes": classes_of(self.shrunk.faults),
                "sglang_exposure": self.exposure or None,
                "dir": f"findings/{self.slug}", "hw": self.hw}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Finding:
        return cls((d["kind"], d["root"]), d["status"], d["first_run"], d["first_seconds"],
                   Trial.from_json(d["trial"]), Trial.from_json(d["shrunk"]),
                   d.get("shrink_runs", 0), d.get("hits", 1), d.get("diagnosis", []),
                   d.get("corruption", []), d.get("failures", {}), d.get("needs_defects", []),
                   d["dir"].split("/", 1)[1], d.get("hw", ""),
                   dict(d.get("sglang_exposure") or {}))


class ExploreJob:
    """What each worker runs: a trial (``(index, trial json)``) -> its result row. Fits the
    advisor's executors (``twin/advise/executors.py``), which call ``run`` and ``error_row``."""

    def __init__(self, base: Base) -> None:
        self.base = base

    def run(self, point: tuple[int, dict[str, Any]]) -> dict[str, Any]:
        index, trial = point
        _crash_hook(index)
        res = run_trial(self.base, Trial.from_json(trial))
        return {"index": index, "pid": os.getpid(), **res.to_json()}

    def error_row(self, point: tuple[int, dict[str, Any]], message: str) -> dict[str, Any]:
        return {"index": point[0], "error": message}


def _crash_hook(index: int) -> None:
    """``TWIN_EXPLORE_CRASH_ONCE=PATH:INDEX`` makes the worker that runs trial INDEX die once
    (it creates PATH first, so the rerun survives): how the tests check that a dead worker's
    trials are redone."""
    spec = os.environ.get("TWIN_EXPLORE_CRASH_ONCE")
    if not spec:
        return
    path, _, at = spec.rpartition(":")
    if int(at) == index and not os.path.exists(path):
        Path(path).touch()
        os._exit(17)


@dataclass
class Progress:
    runs: int
    rounds: int
    findings: int
    coverage: int
    coverage_total: int
    corpus: int
    elapsed: float
    invalid: int


class Campaign:
    """One campaign's state and its main loop."""

    def __init__(self, base: Base, out: Path, *, seed: int = 0,
                 strategies: Strategies | None = None, user_requests: tuple[Req, ...] = (),
                 corpus_cap: int = 256, shrink_runs: int = 150) -> None:
        self.base = base
        self.out = out
        self.seed = seed
        self.strategies = strategies or Strategies()
        self.user_requests = user_requests
        self.corpus_cap = corpus_cap
        self.shrink_runs = shrink_runs
        self.corpus: list[tuple[Trial, bool]] = []  # (trial, pinned: a finding's)
        self.coverage: set[str] = set()
        self.findings: dict[tuple[str, str], Finding] = {}
        self.runs = 0
        self.rounds = 0
        self.invalid = 0
        self.elapsed = 0.0  # seconds spent in earlier sessions of a resumed campaign
        self.redone: list[str] = []
        self._t0 = time.perf_counter()

    # -- state -------------------------------------------------------------------------------
    def seconds(self) -> float:
        return self.elapsed + time.perf_counter() - self._t0

    def state(self) -> dict[str, Any]:
        return {"version": STATE_VERSION, "seed": self.seed, "base": self.base.to_json(),
                "strategies": self.strategies.names(),
                "fault_model": self.strategies.fault_model,
                "user_requests": [[r.at, r.input_len, r.decode_prefix, r.prefill_prefix]
                                  for r in self.user_requests],
                "corpus_cap": self.corpus_cap, "shrink_runs": self.shrink_runs,
                "runs": self.runs, "rounds": self.rounds, "invalid": self.invalid,
                "seconds": round(self.seconds(), 3),
                "coverage": sorted(self.coverage),
                "corpus": [[t.to_json(), pinned] for t, pinned in self.corpus],
                "findings": [f.to_json() for f in self.findings.values()]}

    def save(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        tmp = self.out / (STATE_FILE + ".tmp")
        tmp.write_text(json.dumps(self.state(), sort_keys=True))
        tmp.replace(self.out / STATE_FILE)

    @classmethod
    def resume(cls, out: Path) -> Campaign:
        d = json.loads((out / STATE_FILE).read_text())
        if d.get("version") != STATE_VERSION:
            raise ValueError(f"{out / STATE_FILE}: state version {d.get('version')!r}, "
                             f"expected {STATE_VERSION}")
        names = set(d["strategies"])
        c = cls(Base.from_json(d["base"]), out, seed=d["seed"],
                strategies=Strategies(**{n: n in names for n in
                                         ("deploy", "workload", "faults", "interleave")},
                                      fault_model=d.get("fault_model", "all")),
                user_requests=tuple(Req(*r) for r in d.get("user_requests", [])),
                corpus_cap=d["corpus_cap"], shrink_runs=d["shrink_runs"])
        c.runs, c.rounds, c.invalid = d["runs"], d["rounds"], d["invalid"]
        c.elapsed = d["seconds"]
        c.coverage = set(d["coverage"])
        c.corpus = [(Trial.from_json(t), bool(p)) for t, p in d["corpus"]]
        for f in d["findings"]:
            finding = Finding.from_json(f)
            c.findings[finding.signature] = finding
        return c

    def coverage_report(self) -> dict[str, tuple[int, int]]:
        """Per coverage family: (reached, total), of the fault kinds this campaign draws."""
        return coverage_report(frozenset(self.coverage), MODELS[self.strategies.fault_model])

    def progress(self) -> Progress:
        cov = self.coverage_report()
        total = sum(t for _, t in cov.values())
        reached = sum(r for r, _ in cov.values())
        return Progress(self.runs, self.rounds, len(self.findings), reached, total,
                        len(self.corpus), self.seconds(), self.invalid)

    # -- trials ------------------------------------------------------------------------------
    def make_round(self, size: int = ROUND) -> list[tuple[int, Trial]]:
        """The next round's trials, numbered from ``runs`` (a pure function of the seed, the
        round number, the corpus and the coverage: fault kinds no trial has fired yet are
        preferred)."""
        out = []
        prefer = tuple(k for k in MODELS[self.strategies.fault_model]
                       if k not in self.coverage)
        for i in range(size):
            rng = random.Random(f"{self.seed}:{self.rounds}:{i}")
            if self.corpus and rng.random() < 0.7:
                parent = self.corpus[rng.randrange(len(self.corpus))][0]
                trial = mutate(rng, self.base, parent, self.strategies, prefer)
            else:
                trial = generate(rng, self.base, self.strategies, self.user_requests, prefer)
            out.append((self.runs + i, trial))
        return out

    def absorb(self, trials: list[tuple[int, Trial]], rows: dict[int, dict[str, Any]],
               stop: Callable[[], bool] | None = None) -> list[Finding]:
        """Take a finished round's results in trial order: coverage, corpus, findings (a new
        signature is shrunk and recorded at once). Returns the new findings."""
        new: list[Finding] = []
        for index, trial in trials:
            row = rows[index]
            res = TrialResult.from_json(row)
            self.runs += 1
            if res.status == "invalid":
                self.invalid += 1
                continue
            fresh = res.coverage - self.coverage
            if fresh:
                self.coverage |= fresh
                self._keep(trial, pinned=False)
            sig = res.signature
            if sig is None:
                continue
            if sig in self.findings:
                self.findings[sig].hits += 1
                continue
            finding = self._record(sig, res, trial, index, stop)
            self._keep(trial, pinned=True)
            new.append(finding)
        self.rounds += 1
        return new

    def _keep(self, trial: Trial, pinned: bool) -> None:
        self.corpus.append((trial, pinned))
        if len(self.corpus) > self.corpus_cap:
            for i, (_, p) in enumerate(self.corpus):
                if not p:
                    del self.corpus[i]
                    break
            else:
                del self.corpus[0]

    def _record(self, sig: tuple[str, str], res: TrialResult, trial: Trial, index: int,
                stop: Callable[[], bool] | None) -> Finding:
        from twin.explore.artifacts import slug_for

        found_at = self.seconds()
        # A livelock's every run goes to the input bound (seconds each): a short shrink.
        budget = min(self.shrink_runs, LIVELOCK_SHRINK_RUNS) if sig[0] == "livelock" else \
            self.shrink_runs
        shrunk = shrink(self.base, trial, sig, max_runs=budget, should_stop=stop)
        needs = list(shrunk.result.needs)
        f = Finding(sig, res.status, index + 1, found_at, trial, shrunk.trial,
                    shrunk.runs, 1, shrunk.result.diagnosis[:12], shrunk.result.corruption[:12],
                    shrunk.result.failures, needs, slug_for(sig, len(self.findings)))
        # Would SGLang 0.5.23 meet it? Once per finding, on its shrunk trial.
        f.exposure = exposure(self.base, shrunk.trial, sig[0], needs_defects=tuple(needs),
                              should_stop=stop).to_json()
        self.findings[sig] = f
        return f

    def exit_status(self) -> int:
        """1 when the twin itself raised or a worker kept dying on a trial (crashed comes
        first, as in ``RunStatus``), else 4 corruption (or an unsafe allocator state), else 3
        a wedge, a livelock or a leak (liveness), else 5 a failure without a cause, else 0."""
        kinds = {f.kind.split(":")[0] for f in self.findings.values()}
        if kinds & {"error", "crashed"}:
            return 1
        if kinds & {"corrupted", "unsafe"}:
            return 4
        if kinds & {"wedged", "livelock", "leak"}:
            return 3
        if "failed-without-cause" in kinds:
            return 5
        return 0
