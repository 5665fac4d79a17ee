"""Starting rank processes: forked from a server that has already imported torch and NIXL.

A rank's imports (torch, NIXL, the core) cost about 3 CPU seconds; spawning six ranks of a
TP4 -> TP2 run on a 2-core host spent about 9 s of wall time on imports alone, every run. On
Linux, ranks are forked instead from one ``multiprocessing`` forkserver per coordinator (or
agent) process, which imports :data:`PRELOAD` once when first used and then forks each rank in
milliseconds. Elsewhere ranks are spawned as before.

What a fresh process would have inherited from the launching process travels with the rank:
its environment at start (``RankSpec.env``: the log folders, UCX settings and parent pid the
launcher sets just before starting ranks), its working directory and ``sys.path`` (through
``multiprocessing``'s own preparation data). The server, created before any rank exists,
holds no sockets, agents or CUDA context. It lives on while any rank it forked does, so each
rank watches the coordinator's own pid (:func:`twin.hw.lifeline.rank_setup`).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
from multiprocessing.context import BaseContext
from typing import Any

from twin.hw.rankspec import RankSpec

PRELOAD = ["twin.hw.rank", "nixl._api"]
"""Modules the forkserver imports once, before forking any rank."""
FORKSERVER_ENV = "TWIN_HW_FORKSERVER"
"""Set to ``0`` to spawn every rank afresh (the slower path; for comparison)."""

_context: BaseContext | None = None


def forking() -> bool:
    """True when ranks are forked from the preloaded server (Linux, not switched off)."""
    return sys.platform.startswith("linux") and os.environ.get(FORKSERVER_ENV, "1") != "0"


def rank_context() -> BaseContext:
    """The ``multiprocessing`` context ranks start from (one per process, made once)."""
    global _context
    if _context is None:
        if forking():
            ctx = mp.get_context("forkserver")
            ctx.set_forkserver_preload(PRELOAD)
            _context = ctx
        else:
            _context = mp.get_context("spawn")
    return _context


def rank_entry(spec: RankSpec) -> None:
    """A rank process's target: ``twin.hw.rank.rank_main``, imported only here (so the
    starting process need not import torch to name it)."""
    from twin.hw.rank import rank_main

    rank_main(spec)


def start_rank(spec: RankSpec) -> Any:
    """Start the rank ``spec`` describes as a daemon process; ``spec.env`` gets this process's
    environment as it is now (the rank applies it first thing)."""
    spec.env = dict(os.environ)
    proc = rank_context().Process(target=rank_entry, args=(spec,), name=f"twin-{spec.node}",
                                  daemon=True)
    proc.start()
    return proc
