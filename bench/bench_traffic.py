"""Traffic isolation: the latency of a critical get that hits SSD, idle and under saturating background work, with
the traffic manager's lanes on (weighted) and with a plain FIFO in front of the disk.

Each get asks for one 2 MiB block that only the SSD tier holds (acquire → the daemon reads and verifies the record
into a host slot → the client copies it out → release), paced like an engine (one every few ms). The background
load, from two other processes:
- a writer that stores fresh blocks without pause: every put evicts a block from the small host pool, and the
  daemon demotes it (SSD writes, background lane);
- a prefetcher that frees host space and prefetches random SSD blocks into it (SSD reads, prefetch lane).
Baseline in the same run: a raw O_DIRECT read of 2 MiB from a file on the same file system, idle.
Phases run in turns — lanes idle, lanes loaded, fifo idle, fifo loaded — for several rounds; the SSD directory is
kept across the daemon restarts, so both policies read the same records.

    python bench/bench_traffic.py [--quick]
"""
from __future__ import annotations

import argparse
import atexit
import mmap
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import Daemon, Table, progress, summary, warn_if_busy, write_json  # noqa: E402

from kvstore.protocol.geometry import Geometry  # noqa: E402
from kvstore.protocol.keys import NamespaceSpec  # noqa: E402

GEOM = Geometry(layers=32, tokens=16, kv_heads=8, head_dim=128, dtype="float16")   # 2 MiB
BLOCK = GEOM.full_bytes
SPEC = NamespaceSpec("bench-traffic", GEOM)
ON_SSD = 512                          # blocks the critical gets draw from (1 GiB)
HOST = "64MiB"                        # 32 blocks: almost everything lives on SSD
EXTRA: dict[str, str] = {}
LOAD_KINDS = ("writer", "prefetcher")
STAGING = 256 << 20
WRITER_KEYS = 512                     # the writer's blocks, reused in turn


def key(i: int) -> bytes:
    return i.to_bytes(16, "big")


# ----- load processes: python bench/bench_traffic.py --load writer|prefetcher SOCKET -----
def load(kind: str, sock: str) -> None:
    from kvstore.client import Client, KVStoreError

    rng = random.Random(os.getpid())
    with Client(sock) as c:
        ns = c.namespace(SPEC)
        buf = bytes(BLOCK)
        base = 10_000_000 * (1 + os.getpid() % 1000)
        i = 0
        while True:
            try:
                if kind in ("writer", "flood"):  # fresh blocks: each put evicts, each eviction demotes; the
                    if kind == "writer" and i % 16 == 0:     # writer keeps the demotion queue full, not
                        ssd = c.stats()["tiers"][1]          # overflowing (a flood burns a CPU on drops)
                        if ssd["staged_bytes"] > STAGING * 3 // 4:
                            time.sleep(0.005)
                            continue
                    keys = [key(base + (i + j) % WRITER_KEYS) for j in range(4)]    # key range cycles, each
                    ns.delete(keys)                    # key deleted first so the SSD tier never fills with them
                    ns.put(keys, [buf] * 4)
                    i += 4
                else:                                  # free host space, then prefetch SSD blocks into it
                    c.evict(8 * BLOCK)
                    ns.prefetch([key(rng.randrange(ON_SSD)) for _ in range(8)], wait=True)
            except KVStoreError:                       # busy or no space: the daemon pushes back; try again
                time.sleep(0.001)


def start_load(sock: str) -> list[subprocess.Popen[bytes]]:
    return [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--load", kind, sock])
            for kind in LOAD_KINDS]


def stop_load(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        p.kill()
        p.wait()


# ----- measurement -----
def critical_gets(d: Daemon, n: int, pace_s: float, rng: random.Random) -> list[float]:
    """Latency of n gets of one SSD block each (blocks that are in the host pool at the time are skipped)."""
    out = bytearray(BLOCK)
    lat = []
    with d.client() as c:
        ns = c.namespace(SPEC)
        while len(lat) < n:
            k = key(rng.randrange(ON_SSD))
            if c.call("lookup", ns=ns.id, keys=k)["host"]:      # in the host pool already: not an SSD hit
                continue
            t0 = time.perf_counter()
            got = ns.get([k], [out])
            lat.append(time.perf_counter() - t0)
            assert got == 1, "a block written to SSD went missing"
            time.sleep(pace_s)
    return lat


def raw_reads(path: str, n: int, rng: random.Random) -> list[float]:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    buf = mmap.mmap(-1, BLOCK)
    lat = []
    try:
        for _ in range(n):
            off = rng.randrange(ON_SSD) * BLOCK
            t0 = time.perf_counter()
            os.preadv(fd, [buf], off)
            lat.append(time.perf_counter() - t0)
    finally:
        os.close(fd)
    return lat


def populate(ssd_dir: str) -> None:
    with Daemon(HOST, "16MiB", env=env(ssd_dir, "weighted")) as d, d.client() as c:
        ns = c.namespace(SPEC)
        rng = random.Random(1)
        for i in range(0, ON_SSD, 16):
            blocks = [rng.randbytes(BLOCK) for _ in range(16)]
            ns.put([key(i + j) for j in range(16)], blocks)
        c.evict(everything=True)
        while c.stats()["tiers"][1]["staged_blocks"]:
            time.sleep(0.05)
        assert c.stats()["tiers"][1]["blocks"] >= ON_SSD


def env(ssd_dir: str, policy: str) -> dict[str, str]:
    return {"KVSTORE_SSD_DIR": ssd_dir, "KVSTORE_SSD_CAPACITY": "8GiB", "KVSTORE_SSD_STAGING_BYTES": str(STAGING),
            "KVSTORE_TRAFFIC_POLICY": policy, **EXTRA}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--load", choices=["writer", "flood", "prefetcher"])
    ap.add_argument("socket", nargs="?")
    args = ap.parse_args()
    if args.load:
        return load(args.load, args.socket)
    n, rounds, pace = (60, 1, 0.004) if args.quick else (150, 3, 0.004)
    load_avg = warn_if_busy()
    base = tempfile.mkdtemp(prefix="kvs-traffic-", dir="/var/tmp" if os.path.isdir("/var/tmp") else None)
    atexit.register(shutil.rmtree, base, True)           # gigabytes of records: never left behind
    ssd_dir = os.path.join(base, "ssd")
    raw = os.path.join(base, "raw")
    progress(f"writing {ON_SSD} blocks of {BLOCK >> 20} MiB to the SSD tier and a raw file of the same size")
    populate(ssd_dir)
    with open(raw, "wb") as f:
        for _ in range(ON_SSD):
            f.write(os.urandom(BLOCK))
    rng = random.Random(7)
    samples: dict[str, list[float]] = {"raw O_DIRECT read, idle": []}
    for r in range(rounds):
        samples["raw O_DIRECT read, idle"] += raw_reads(raw, n, rng)
        for policy in ("weighted", "fifo"):
            with Daemon(HOST, "16MiB", env=env(ssd_dir, policy)) as d:
                while d.client().stats()["tiers"][1]["scan"]["state"] != "ready":
                    time.sleep(0.05)
                progress(f"round {r + 1}/{rounds}: {policy}, idle")
                samples.setdefault(f"{policy}, idle", []).extend(critical_gets(d, n, pace, rng))
                procs = start_load(d.socket)
                try:
                    time.sleep(2.0)                       # let the queues fill
                    progress(f"round {r + 1}/{rounds}: {policy}, under demotion + prefetch")
                    samples.setdefault(f"{policy}, loaded", []).extend(critical_gets(d, n, pace, rng))
                    with d.client() as c:
                        lanes = c.stats()["traffic"][0]["lanes"]
                finally:
                    stop_load(procs)
                moved = {lane: lanes[lane]["bytes"] for lane in ("critical", "prefetch", "background")}
                samples.setdefault(f"{policy}, bytes moved by lane", []).append(moved)  # type: ignore[arg-type]
    stats = {k: summary(v, 1e3) for k, v in samples.items() if "bytes" not in k}
    t = Table(["critical get of one SSD block (2 MiB)", "n", "p50 ms", "p99 ms", "p99 / idle p99"])
    for policy in ("weighted", "fifo"):
        idle = stats[f"{policy}, idle"]["p99"]
        for phase in ("idle", "loaded"):
            s = stats[f"{policy}, {phase}"]
            t.add([f"{'lanes' if policy == 'weighted' else 'fifo'}, {phase}", s["n"], f"{s['median']:.2f}",
                   f"{s['p99']:.2f}", f"{s['p99'] / idle:.2f}"])
    s = stats["raw O_DIRECT read, idle"]
    t.add(["raw O_DIRECT read, idle (baseline)", s["n"], f"{s['median']:.2f}", f"{s['p99']:.2f}", "-"])
    print(t)
    moved = {k: v for k, v in samples.items() if "bytes" in k}
    for k, v in moved.items():
        print(f"{k} (per round, while loaded): {v}")
    path = write_json("traffic", {"block_bytes": BLOCK, "samples_per_phase": n * rounds, "pace_s": pace,
                                  "load_average_before": load_avg, "latency_ms": stats, "bytes_by_lane": moved,
                                  "target": "lanes: loaded p99 <= 1.25 x idle p99"})
    progress(f"results in {path}")


if __name__ == "__main__":
    main()
