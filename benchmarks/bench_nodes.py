"""A staged chunk across two nodes versus a raw NIXL WRITE of the same bytes across them.

The two nodes are two network namespaces joined by a veth pair (``twin.hw.netns``; needs root,
else both run on loopback and the output says so). The decode side (namespace b) registers a
ring; the prefill side (namespace a) times, per chunk size and interleaved so that both see the
same load:

* raw: one NIXL WRITE of ``n`` contiguous registered bytes into the ring, polled until DONE;
* staged: what a prefill transfer worker does for one chunk in the hardware mode: gather the
  writer's head slice of every layer's K and V from scattered KV pages into its staging buffer
  (torch kernel), then the same WRITE.

UCX uses its TCP transport over the veth (``UCX_TLS=tcp``, ``UCX_NET_DEVICES`` the veth end:
on one kernel UCX would otherwise take shared memory between the namespaces). The last WRITE of
each size is checked byte for byte (a hash of the ring against the source). The ratio
staged/raw says what the gather costs on top of the network.

Run (as root): ``python benchmarks/bench_nodes.py [--sizes-mib 4 16 64] [--repeat 5]
[--json out.json]``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    sys.path.insert(0, str(Path(__file__).resolve().parent))

MIB = 1 << 20
PORT = 29531


def _hash(t: object) -> str:
    import torch

    assert isinstance(t, torch.Tensor)
    return hashlib.blake2b(t.numpy().tobytes(), digest_size=16).hexdigest()


def serve(address: str, max_bytes: int) -> None:
    """The decode side: a registered ring; answers CHECK n with the hash of ``ring[:n]``."""
    import torch

    from twin.hw.control import BootstrapInfo, ControlSocket, exchange_bootstrap
    from twin.hw.nixl_transport import NixlEndpoint

    ring = torch.zeros(max_bytes, dtype=torch.uint8)
    with ControlSocket(f"tcp://{address}:{PORT}") as cs, NixlEndpoint("bench-ring") as ep:
        region = ep.register(ring)
        peer = exchange_bootstrap(cs, None, BootstrapInfo(ep.name, cs.endpoint, ep.metadata(),
                                                          (region,)), timeout_s=120)
        ep.add_peer(peer.metadata)
        while True:
            frames = cs.recv_frames(300_000)
            if frames is None or frames[0] == b"STOP":
                break
            if frames[0] == b"CHECK":
                n = int(frames[1])
                cs.send(peer.endpoint, [b"CHECKED", _hash(ring[:n]).encode()])
        cs.close(linger_ms=1000)


def measure(address: str, target: str, sizes: Sequence[int], repeat: int,
            warmup: int = 2) -> list[dict[str, float]]:
    """The prefill side: raw and staged WRITEs into the target's ring, interleaved."""
    import torch
    from bench_staged import BYTES_PER_TOKEN, HEADS, PAGE, _pool

    from twin.hw.control import BootstrapInfo, ControlSocket, exchange_bootstrap
    from twin.hw.kernels import get_kernels
    from twin.hw.nixl_transport import NixlEndpoint

    torch.set_num_threads(1)
    kernels = get_kernels(torch.device("cpu"), None)
    max_bytes = max(sizes)
    rows = []
    with ControlSocket(host=address) as cs, NixlEndpoint("bench-init") as ep:
        src = torch.randint(0, 255, (max_bytes,), dtype=torch.uint8)
        staging = torch.zeros(max_bytes, dtype=torch.uint8)
        ep.register(src)
        ep.register(staging)
        me = BootstrapInfo(ep.name, cs.endpoint, ep.metadata())
        info = exchange_bootstrap(cs, f"tcp://{target}:{PORT}", me, timeout_s=120)
        peer, ring = ep.add_peer(info.metadata), info.regions[0]
        ep.connect(peer)

        def write(buf: torch.Tensor, n: int) -> float:
            t0 = time.perf_counter()
            h = ep.write(buf, peer, ring, 0, n)
            ep.wait(h, timeout_s=300)
            ep.release(h)
            return time.perf_counter() - t0

        def staged(pool: object, pages: list[int], n: int) -> tuple[float, float]:
            """(gather + WRITE, gather alone) in seconds."""
            t0 = time.perf_counter()
            k, v = pool.k, pool.v  # type: ignore[attr-defined]
            got = kernels.gather_to_staging(k, v, pages, PAGE, 0, HEADS, staging)
            assert got == n, (got, n)
            gather = time.perf_counter() - t0
            return gather + write(staging, n), gather

        def check(buf: torch.Tensor, n: int) -> None:
            cs.send(info.endpoint, [b"CHECK", str(n).encode()])
            frames = cs.recv_frames(300_000)
            assert frames is not None and frames[0] == b"CHECKED"
            if frames[1].decode() != _hash(buf[:n]):
                raise RuntimeError(f"the ring does not hold the {n} bytes written")

        for n in sizes:
            pool, pages = _pool(n // BYTES_PER_TOKEN, torch.device("cpu"))
            raw_s, staged_s, gather_s = [], [], []
            for k in range(warmup + repeat):
                r = write(src, n)
                s, g = staged(pool, pages, n)
                if k >= warmup:
                    raw_s.append(r)
                    staged_s.append(s)
                    gather_s.append(g)
            check(staging, n)
            write(src, n)
            check(src, n)
            raw, stg = n / statistics.median(raw_s) / 1e9, n / statistics.median(staged_s) / 1e9
            rows.append({"bytes": n, "raw_gbps": raw, "staged_gbps": stg,
                         "staged_ratio": stg / raw,
                         "gather_gbps": n / statistics.median(gather_s) / 1e9})
        cs.send(info.endpoint, [b"STOP"])
        cs.close(linger_ms=1000)
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes-mib", type=int, nargs="+", default=[4, 16, 64])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--serve", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--measure", nargs=2, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    sizes = [m * MIB for m in args.sizes_mib]
    if args.serve:
        serve(args.serve, max(sizes))
        return 0
    if args.measure:
        rows = measure(args.measure[0], args.measure[1], sizes, args.repeat)
        print(json.dumps(rows))
        return 0

    from twin.hw.netns import two_nodes

    me = [sys.executable, str(Path(__file__).resolve()), "--sizes-mib",
          *map(str, args.sizes_mib), "--repeat", str(args.repeat)]
    with two_nodes() as net:
        where = (f"two network namespaces joined by a veth pair ({net.addr['a']} -> "
                 f"{net.addr['b']})" if net.isolated else f"loopback: {net.reason}")
        print(f"nodes: {where}; UCX over TCP")

        def env(node: str) -> dict[str, str]:
            return {**os.environ, "UCX_TLS": "tcp", "UCX_NET_DEVICES": net.iface[node],
                    "PYTHONPATH": str(Path(__file__).resolve().parents[1])}

        target = net.popen("b", [*me, "--serve", net.addr["b"]], env=env("b"))
        time.sleep(2)
        out = net.run("a", [*me, "--measure", net.addr["a"], net.addr["b"]], env=env("a"),
                      capture_output=True, text=True, timeout=1800)
        target.wait(60)
        if out.returncode != 0:
            print(out.stdout, out.stderr, file=sys.stderr)
            return 1
        rows = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"{'MiB':>5} | {'raw WRITE GB/s':>14} | {'staged GB/s':>11} | {'staged/raw':>10} | "
          f"{'gather alone GB/s':>17}")
    for r in rows:
        print(f"{r['bytes'] // MIB:5d} | {r['raw_gbps']:14.3f} | {r['staged_gbps']:11.3f} | "
              f"{r['staged_ratio']:10.2f} | {r['gather_gbps']:17.2f}")
    print("every size's last raw and staged WRITE checked byte for byte on the decode side")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
