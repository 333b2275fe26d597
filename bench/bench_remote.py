"""The remote tier against Mooncake Store's own client: put and get GB/s of the same bytes through the same store.

One `mooncake_master` (its own HTTP metadata server) and four nodes on loopback, each lending the store a segment:
kvstore daemon A (placement write_through: a put is put in the store at once, from the host slots), kvstore daemon B
(a get promotes the blocks from the store into its host slots), and two raw Mooncake clients R1 and R2 in processes
of their own, each with a registered buffer of the same blocks. Per repetition, with fresh keys:

- kvstore put: a client puts N blocks into A; the remote tier's own time putting them from the host slots (its
  `seconds.put_s`: the CRC check of each block, the transfers with their trailers) — and, beside it, the time from
  the client's put to the last block in the store (the copy into host slots and the commit too: what a user waits
  for before another node can hit them);
- kvstore get: B acquires the N blocks (lookup in the store, promotion into B's host slots, the CRC check of every
  block), timed to the reply, then B's pool is emptied for the next repetition;
- Mooncake put: R1 `batch_put_from` the same N blocks from its registered buffer in one call;
- Mooncake get: R2 `batch_get_into` them into its registered buffer in one call.

The store places each value in any node's segment, so both sides see the same mix of local and remote placements;
the two sides alternate, after one warm-up repetition each (a segment's first transfer is slow). Target (issue 15):
kvstore ≥ 0.9× Mooncake's client for put and for get.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import time
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import Daemon, Table, machine, progress, summary, warn_if_busy, write_json  # noqa: E402
from kvstore.protocol.geometry import Geometry  # noqa: E402
from kvstore.protocol.keys import NamespaceSpec  # noqa: E402
from tests.mooncake_master import MooncakeMaster  # noqa: E402

TARGET = 0.9
# 4 MiB blocks: 32 layers x 2 (K, V) x 32 tokens x 8 KV heads x 128 x bf16 (128 KiB a token)
GEOM = Geometry(layers=32, tokens=32, kv_heads=8, head_dim=128, dtype="bfloat16")


def raw_node(conn: Any, master: str, metadata: str, nblocks: int, block_bytes: int, segment: int) -> None:
    """A raw Mooncake client (R1 or R2): `("put"|"get", tag)` → seconds for one batch call of all blocks."""
    from mooncake.store import MooncakeDistributedStore

    store = MooncakeDistributedStore()
    rc = store.setup("127.0.0.1", metadata, segment, 64 << 20, "tcp", "", master)
    buf = np.zeros(nblocks * block_bytes, dtype=np.uint8)
    buf[:] = np.random.default_rng(1).integers(0, 256, buf.size, dtype=np.uint8)
    rc |= store.register_buffer(buf.ctypes.data, buf.nbytes)
    conn.send(rc)
    ptrs = [buf.ctypes.data + i * block_bytes for i in range(nblocks)]
    sizes = [block_bytes] * nblocks
    while True:
        msg = conn.recv()
        if msg is None:
            break
        op, tag = msg
        keys = [f"raw/{tag}/{i}" for i in range(nblocks)]
        t0 = time.perf_counter()
        codes = store.batch_put_from(keys, ptrs, sizes) if op == "put" else store.batch_get_into(keys, ptrs, sizes)
        dt = time.perf_counter() - t0
        ok = all(c == 0 for c in codes) if op == "put" else all(c == block_bytes for c in codes)
        conn.send((dt, ok))
    store.close()


def remote_stats(c: Any) -> dict[str, Any]:
    return next(t for t in c.stats()["tiers"] if t.get("tier") == "remote")


def kvstore_put(a: Daemon, hashes: list[bytes], blocks: list[np.ndarray]) -> tuple[float, float]:
    """(seconds from the client's put to the last block in the store, seconds the remote tier spent putting)."""
    with a.client() as c:
        ns = c.namespace(NamespaceSpec(model="bench-remote", geometry=GEOM))
        r0 = remote_stats(c)
        t0 = time.perf_counter()
        assert ns.put(hashes, blocks).stored == len(hashes)
        while (r := remote_stats(c))["counters"].get("puts", 0) - r0["counters"].get("puts", 0) < len(hashes):
            time.sleep(0.002)
        dt = time.perf_counter() - t0
        c.evict(everything=True)
    return dt, r["seconds"]["put_s"] - r0["seconds"]["put_s"]


def kvstore_get(b: Daemon, hashes: list[bytes]) -> float:
    with b.client() as c:
        ns = c.namespace(NamespaceSpec(model="bench-remote", geometry=GEOM))
        t0 = time.perf_counter()
        lease = ns.acquire(hashes)
        dt = time.perf_counter() - t0
        n = len(lease)
        lease.release()
        assert n == len(hashes), f"B got {n} of {len(hashes)} blocks from the store"
        c.evict(everything=True)
    return dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--blocks", type=int, default=32, help="blocks of 4 MiB per repetition (default 32)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="3 repetitions of 16 blocks")
    args = ap.parse_args()
    if args.quick:
        args.blocks, args.reps = 16, 3
    load = warn_if_busy()
    n, bb = args.blocks, GEOM.full_bytes
    segment = max(512 << 20, 2 * (args.reps + 1) * n * bb)
    master = MooncakeMaster().start()
    env = master.env(KVSTORE_REMOTE_SEGMENT_BYTES=str(segment), KVSTORE_REMOTE_STAGING_BYTES=str(4 * n * bb),
                     KVSTORE_LOG_LEVEL="warning")
    rng = np.random.default_rng(7)
    blocks = [rng.integers(0, 256, bb, dtype=np.uint8) for _ in range(n)]
    pipes, procs = [], []
    res: dict[str, list[float]] = {"kvstore_put": [], "kvstore_get": [], "mooncake_put": [], "mooncake_get": [],
                                   "kvstore_put_end_to_end": []}
    try:
        a = Daemon(f"{4 * n * bb}", env={**env, "KVSTORE_REMOTE_PLACEMENT": "write_through"}).start()
        b = Daemon(f"{4 * n * bb}", env=env).start()
        for _ in range(2):
            here, there = mp.Pipe()
            p = mp.Process(target=raw_node, args=(there, master.address, master.metadata, n, bb, segment))
            p.start()
            pipes.append(here)
            procs.append(p)
            assert here.recv() == 0, "a raw Mooncake client could not set up"
        with a.client() as c:
            deadline = time.monotonic() + 30
            while not remote_stats(c)["up"] and time.monotonic() < deadline:
                time.sleep(0.05)
        for rep in range(args.reps + 1):                       # rep 0: the warm-up of both sides
            progress(f"repetition {rep}/{args.reps}{' (warm-up)' if rep == 0 else ''}")
            hashes = [os.urandom(16) for _ in range(n)]
            e2e_s, put_s = kvstore_put(a, hashes, blocks)
            get_s = kvstore_get(b, hashes)
            pipes[0].send(("put", rep))
            mput_s, ok1 = pipes[0].recv()
            pipes[1].send(("get", rep))
            mget_s, ok2 = pipes[1].recv()
            assert ok1 and ok2, "Mooncake's own client failed a put or a get"
            if rep:
                res["kvstore_put"].append(put_s)
                res["kvstore_put_end_to_end"].append(e2e_s)
                res["kvstore_get"].append(get_s)
                res["mooncake_put"].append(mput_s)
                res["mooncake_get"].append(mget_s)
        a.stop()
        b.stop()
    finally:
        for pipe in pipes:
            pipe.send(None)
        for p in procs:
            p.join(timeout=30)
        master.close()
    nbytes = n * bb
    gbs = {k: [nbytes / s / 1e9 for s in v] for k, v in res.items()}
    ratio = {op: [k / m for k, m in zip(gbs[f"kvstore_{op}"], gbs[f"mooncake_{op}"])] for op in ("put", "get")}
    t = Table(["op", "kvstore GB/s (median)", "Mooncake client GB/s (median)", "ratio (median per rep)", "target",
               "met"])
    for op in ("put", "get"):
        r = summary(ratio[op])["median"]
        kv, mc = summary(gbs[f"kvstore_{op}"])["median"], summary(gbs[f"mooncake_{op}"])["median"]
        t.add([op, f"{kv:.2f}", f"{mc:.2f}", f"{r:.2f}", f">= {TARGET}", "yes" if r >= TARGET else "no"])
    print(f"{n} blocks of {bb >> 20} MiB per repetition, {args.reps} repetitions, 4 nodes on loopback (tcp)")
    print(t)
    e2e = summary(gbs["kvstore_put_end_to_end"])["median"]
    print(f"kvstore put end to end (client copy into host slots + commit + write-through): {e2e:.2f} GB/s median")
    path = write_json("remote", {"machine": machine(), "load_before": load, "blocks": n, "block_bytes": bb,
                                 "reps": args.reps, "seconds": res, "gbs": {k: summary(v) for k, v in gbs.items()},
                                 "ratio": {k: summary(v) for k, v in ratio.items()}, "target": TARGET})
    print(f"results: {path}")


if __name__ == "__main__":
    main()
