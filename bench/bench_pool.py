"""Host pool through the daemon, against the hardware in the same run.

- put / get of 2 MiB blocks from this process (the daemon is another), batches of 32, 1 and 2 copy threads,
  against numpy memcpy of the same blocks with 1 and 2 threads;
- lookup round trip of 32 keys, against a raw Unix-socket 64-byte round trip between two processes;
- resize (release 256 MiB of a full pool, then grow back) at 1 GiB and 8 GiB.

Each figure is the median of several timed repetitions after an untimed warm-up (first touches of shared pages are
page faults: the warm-up fills and empties the slots the timed runs use). Targets: put and get ≥ 0.9× one-thread
memcpy with one copy thread and ≥ 0.8× two-thread memcpy with two; lookup p50 ≤ 2× the raw round trip; resize at
8 GiB ≤ 1.2× resize at 1 GiB.

    python bench/bench_pool.py [--quick]
"""
from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import Table, progress, write_json  # noqa: E402

from kvstore.geometry import Geometry  # noqa: E402
from kvstore.keys import NamespaceSpec  # noqa: E402
from tests.conftest import DaemonProc  # noqa: E402

GEOM = Geometry(layers=32, tokens=16, kv_heads=8, head_dim=128, dtype="float16")   # 2 MiB
BLOCK = GEOM.full_bytes
BATCH = 32
MiB, GiB = 1 << 20, 1 << 30


def hashes(n: int, start: int) -> list[bytes]:
    return [(start + i).to_bytes(16, "big") for i in range(n)]


def spread(xs: list[float]) -> dict[str, float]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


# ----- baselines -----
def memcpy_gbps(srcs: list[np.ndarray], dsts: list[np.ndarray], threads: int, reps: int) -> list[float]:
    def copy(pairs: list[tuple[np.ndarray, np.ndarray]]) -> None:
        for d, s in pairs:
            np.copyto(d, s)

    pairs = list(zip(dsts, srcs))
    shares = [pairs[i::threads] for i in range(threads)]
    pool = ThreadPoolExecutor(threads)
    out = []
    for _ in range(reps + 1):
        t0 = time.perf_counter()
        list(pool.map(copy, shares))
        out.append(len(pairs) * BLOCK / (time.perf_counter() - t0) / 1e9)
    pool.shutdown()
    return out[1:]


def raw_socket_rtt(n: int) -> list[float]:
    a, b = socket.socketpair()
    pid = os.fork()
    if pid == 0:
        a.close()
        while True:
            m = b.recv(64)
            if not m:
                os._exit(0)
            b.sendall(m)
    b.close()
    msg, out = b"x" * 64, []
    for _ in range(n):
        t0 = time.perf_counter()
        a.sendall(msg)
        got = 0
        while got < 64:
            got += len(a.recv(64 - got))
        out.append(time.perf_counter() - t0)
    a.close()
    os.waitpid(pid, 0)
    return out


# ----- through the daemon -----
def put_get_gbps(d: DaemonProc, threads: int, reps: int) -> tuple[list[float], list[float], list[float]]:
    """Put and get GB/s, each repetition right after a memcpy of the same blocks (the baseline, interleaved so
    that both see the same machine)."""
    srcs = [np.random.default_rng(i).integers(0, 256, BLOCK, dtype=np.uint8) for i in range(BATCH)]
    dsts = [np.ones(BLOCK, np.uint8) for _ in range(BATCH)]
    puts, gets, base = [], [], []
    with d.client(copy_threads=threads) as c:
        ns = c.namespace(NamespaceSpec("bench", GEOM))
        warm = hashes(BATCH * 4, 10**9)                # touch the slots the timed runs reuse
        ns.put(warm, srcs * 4)
        ns.delete(warm)
        for rep in range(reps + 1):
            hs = hashes(BATCH, rep * BATCH)
            mc = memcpy_gbps(srcs, dsts, threads, 1)[0]
            t0 = time.perf_counter()
            r = ns.put(hs, srcs, batch=BATCH)
            t1 = time.perf_counter()
            assert r.stored == BATCH
            assert ns.get(hs, dsts, batch=BATCH) == BATCH
            t2 = time.perf_counter()
            assert all(np.array_equal(a, b) for a, b in zip(srcs[:2], dsts[:2]))
            ns.delete(hs)
            if rep:
                base.append(mc)
                puts.append(BATCH * BLOCK / (t1 - t0) / 1e9)
                gets.append(BATCH * BLOCK / (t2 - t1) / 1e9)
    return puts, gets, base


def lookup_rtt(d: DaemonProc, n: int) -> list[float]:
    with d.client() as c:
        ns = c.namespace(NamespaceSpec("bench", GEOM))
        hs = hashes(BATCH, 5 * 10**9)
        ns.put(hs, [np.zeros(BLOCK, np.uint8)] * BATCH)
        out = []
        for _ in range(n + 200):
            t0 = time.perf_counter()
            assert ns.lookup(hs) == BATCH
            out.append(time.perf_counter() - t0)
    return out[200:]


def resize_seconds(pools: list[int], reps: int) -> dict[int, tuple[list[float], list[float]]]:
    """Daemon-side and client-side seconds to release 256 MiB of a full pool, for each pool size, the sizes
    taking turns so that all see the same machine."""
    daemons = {p: DaemonProc(capacity=str(p), segment="64MiB", env={"KVSTORE_LOG_LEVEL": "warning"}).start()
               for p in pools}
    out: dict[int, tuple[list[float], list[float]]] = {p: ([], []) for p in pools}
    src = [np.zeros(BLOCK, np.uint8)] * BATCH
    try:
        clients = {p: d.client() for p, d in daemons.items()}
        spaces = {p: c.namespace(NamespaceSpec("bench", GEOM)) for p, c in clients.items()}
        n = 0
        for _ in range(reps):
            for pool, c in clients.items():
                while c.stats()["tiers"][0]["used_bytes"] < pool:   # fill every segment
                    spaces[pool].put(hashes(BATCH, n), src, batch=BATCH)
                    n += BATCH
                t0 = time.perf_counter()
                r = c.resize(pool - 256 * MiB)
                out[pool][1].append(time.perf_counter() - t0)
                out[pool][0].append(r["seconds"])
                assert r["released_segments"] == 4, r
                c.resize(pool)
        for c in clients.values():
            c.close()
    finally:
        for d in daemons.values():
            d.cleanup()
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true", help="fewer repetitions, no 8 GiB pool")
    args = p.parse_args()
    reps = 3 if args.quick else 9
    res: dict[str, object] = {}
    d = DaemonProc(capacity="1GiB", segment="64MiB", env={"KVSTORE_LOG_LEVEL": "warning"}).start()
    try:
        progress("put/get, 1 copy thread")
        p1, g1, mc1 = put_get_gbps(d, 1, reps)
        progress("put/get, 2 copy threads")
        p2, g2, mc2 = put_get_gbps(d, 2, reps)
        progress("lookup round trips")
        lk = lookup_rtt(d, 2000 if args.quick else 10000)
    finally:
        d.cleanup()
    progress("raw socket round trips")
    raw = raw_socket_rtt(2000 if args.quick else 10000)
    sizes = [GiB] if args.quick else [GiB, 8 * GiB]
    progress(f"resize at {', '.join(f'{p // GiB} GiB' for p in sizes)}")
    rz = resize_seconds(sizes, 3 if args.quick else 7)

    m = statistics.median
    t = Table(["figure", "kvstore", "baseline", "ratio", "target"])

    def row(name: str, ours: float, base: float, unit: str, target: str, ok: bool) -> None:
        t.add([name, f"{ours:.2f} {unit}", f"{base:.2f} {unit}", f"{ours / base:.2f}",
               f"{target}: {'PASS' if ok else 'FAIL'}"])

    row("put, 1 copy thread", m(p1), m(mc1), "GB/s", "≥0.9× memcpy(1)", m(p1) >= 0.9 * m(mc1))
    row("get, 1 copy thread", m(g1), m(mc1), "GB/s", "≥0.9× memcpy(1)", m(g1) >= 0.9 * m(mc1))
    row("put, 2 copy threads", m(p2), m(mc2), "GB/s", "≥0.8× memcpy(2)", m(p2) >= 0.8 * m(mc2))
    row("get, 2 copy threads", m(g2), m(mc2), "GB/s", "≥0.8× memcpy(2)", m(g2) >= 0.8 * m(mc2))
    lk_p50, raw_p50 = m(lk) * 1e6, m(raw) * 1e6
    row("lookup 32 keys p50", lk_p50, raw_p50, "µs", "≤2× raw socket", lk_p50 <= 2 * raw_p50)
    q = lambda xs: sorted(xs)[int(len(xs) * 0.99)] * 1e6  # noqa: E731
    t.add(["lookup 32 keys p99", f"{q(lk):.2f} µs", f"{q(raw):.2f} µs", f"{q(lk) / q(raw):.2f}", ""])
    if 8 * GiB in rz:
        a, b = m(rz[GiB][0]) * 1e3, m(rz[8 * GiB][0]) * 1e3
        row("resize −256 MiB at 8 GiB (daemon)", b, a, "ms", "≤1.2× at 1 GiB", b <= 1.2 * a)
        a, b = m(rz[GiB][1]) * 1e3, m(rz[8 * GiB][1]) * 1e3
        t.add(["resize −256 MiB at 8 GiB (client)", f"{b:.2f} ms", f"{a:.2f} ms", f"{b / a:.2f}", ""])
    else:
        t.add(["resize −256 MiB at 1 GiB (daemon)", f"{m(rz[GiB][0]) * 1e3:.2f} ms", "", "", ""])
    print(t)
    res = {"memcpy_1t_gbps": spread(mc1), "memcpy_2t_gbps": spread(mc2), "put_1t_gbps": spread(p1),
           "get_1t_gbps": spread(g1), "put_2t_gbps": spread(p2), "get_2t_gbps": spread(g2),
           "lookup32_us": {"p50": lk_p50, "p99": q(lk)}, "raw_socket_us": {"p50": raw_p50, "p99": q(raw)},
           "resize_release_256MiB_s": {f"{k // GiB}GiB": {"daemon": spread(v[0]), "client": spread(v[1])}
                                       for k, v in rz.items()},
           "block_bytes": BLOCK, "batch": BATCH}
    print(f"\nwrote {write_json('pool', res)}")


if __name__ == "__main__":
    main()
