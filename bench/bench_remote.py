"""The remote tier against Mooncake Store's own client: put and get GB/s of the same bytes through the same store.

One `mooncake_master` (its own HTTP metadata server) and seven nodes on loopback, of which one, the store node, lends
the store its only segment (every other node lends none: every value of every side crosses TCP to the same place,
and no side gains from a value landing in its own segment, a local memcpy): kvstore daemon A (placement
write_through: a put is put in the store at once, from the host slots), kvstore daemon B
(a get promotes the blocks from the store into its host slots), two raw Mooncake clients R1 and R2 in processes
of their own, each with a registered buffer of the same blocks, and two LMCache engines L1 and L2 (below). Per
repetition, with fresh keys:

- kvstore put: a client puts N blocks into A; the remote tier's own time putting them from the host slots (its
  `seconds.put_s`: the CRC check of each block, the transfers with their trailers) — and, beside it, the time from
  the client's put to the last block in the store (the copy into host slots and the commit too: what a user waits
  for before another node can hit them);
- kvstore get: B acquires the N blocks (lookup in the store, promotion into B's host slots, the CRC check of every
  block), timed to the reply — and, beside it, with the copy out into the client's buffers and the release — then
  B's pool is emptied for the next repetition;
- Mooncake put: R1 `batch_put_from` the same N blocks from its registered buffer in one call;
- Mooncake get: R2 `batch_get_into` them into its registered buffer in one call;
- LMCache put: an LMCache engine process L1 (the writer node) `store()`s a fresh token sequence of N chunks of 256
  tokens, 4 MiB each (the same bytes as N blocks), from its paged CPU KV cache, and polls
  `lookup(search_range=["RemoteBackend"])` every 2 ms until Mooncake holds every token (LMCache's remote put is
  asynchronous: `store()` returns before it lands);
- LMCache get: a second LMCache engine process L2 (the reader node) `lookup()`s then `retrieve()`s that sequence
  into its zeroed paged KV cache; the bytes are checked against the writer's (sha256, untimed).

The LMCache side is LMCache 0.5.6's in-process engine (`LMCacheEngine`, its vLLM connector's path) with its
Mooncake backend (`remote_url="mooncakestore://"`: `RemoteBackend` → `MooncakestoreConnector` →
`mooncake.store`'s `batch_put_from` / `batch_get_into`, zero-copy, `local_cpu=False` so every get comes from the
store), in two processes of `.venv-bench`'s python driven over a pipe (`lmcache_mooncake_side.py`; kvstore's `.venv`
never imports torch or LMCache). LMCache's MP daemon, the one bench_vs_lmcache drives, cannot do this from the PyPI
wheel (its Mooncake L2 adapter needs a C++ extension the wheel lacks). Ours on that side is only the "GPU"
connector: a subclass of LMCache's `MockGPUConnector` that copies the bytes with torch between LMCache's memory
objects and the paged CPU cache (a gather on store, a scatter on retrieve; on a GPU, LMCache's CUDA kernels). Its
time is measured apart, so the table has LMCache both ways:

- "store side" rows: kvstore's tier time (put) / B's acquire (get), Mooncake's batch calls, and LMCache's time less
  our connector's copy: from LMCache's memory objects to every chunk visible in the store (put), lookup plus
  retrieve into its memory objects (get);
- "end to end" rows: from the caller's buffers to the store and back: kvstore's put from the client's put to the last
  block in the store, its get as B's acquire + the copy out into the client's buffers (CRC-checked, as
  `Namespace.get` does) + release; LMCache's with our copy (its store()/retrieve() calls as an engine makes them).
  Mooncake's client has no such row (it reads and writes a registered buffer directly).

Without `.venv-bench` (or with one lacking lmcache, mooncake or torch) the LMCache side is skipped, saying so in the
output and the JSON; `bench/run_all.sh` builds it. The sides take turns within each repetition, after one warm-up
repetition each (a segment's first transfer is slow). Target (issue 15):
kvstore ≥ 0.9× Mooncake's client for put and for get (the store-side rows); kvstore/LMCache is for reference.

    .venv/bin/python bench/bench_remote.py [--quick] [--blocks N] [--reps R] [--no-lmcache] [--lmcache-python PY]
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import shutil
import sys
import tempfile
import time
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import lmcache_mooncake_side as lmc  # noqa: E402
from bench.common import Daemon, Table, machine, progress, summary, warn_if_busy, write_json  # noqa: E402
from kvstore.protocol.geometry import Geometry  # noqa: E402
from kvstore.protocol.keys import NamespaceSpec  # noqa: E402
from kvstore.tiers.remote.address import reexec_with_bind_guard  # noqa: E402
from tests.mooncake_master import MooncakeMaster, master_binary, setup_on_loopback  # noqa: E402

TARGET = 0.9
# 4 MiB blocks: 32 layers x 2 (K, V) x 32 tokens x 8 KV heads x 128 x bf16 (128 KiB a token)
GEOM = Geometry(layers=32, tokens=32, kv_heads=8, head_dim=128, dtype="bfloat16")


def raw_node(conn: Any, master: str, metadata: str, nblocks: int, block_bytes: int, segment: int) -> None:
    """A raw Mooncake client (R1 or R2): `("put"|"get", tag)` → seconds for one batch call of all blocks."""
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")   # its setup's INFO lines and the first metadata 404 (harmless)
    from mooncake.store import MooncakeDistributedStore

    store = MooncakeDistributedStore()
    rc = setup_on_loopback(store, metadata, master, segment, 64 << 20)
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


def kvstore_get(b: Daemon, hashes: list[bytes], outs: list[np.ndarray]) -> tuple[float, float]:
    """(seconds of B's acquire, seconds of the acquire + the CRC-checked copy out into `outs` + the release)."""
    with b.client() as c:
        ns = c.namespace(NamespaceSpec(model="bench-remote", geometry=GEOM))
        t0 = time.perf_counter()
        lease = ns.acquire(hashes)
        dt = time.perf_counter() - t0
        n = len(lease)
        ok = lease.read_verified(outs[:n])
        lease.release()                  # sent without waiting, as Namespace.get does
        e2e = time.perf_counter() - t0
        assert n == len(hashes), f"B got {n} of {len(hashes)} blocks from the store"
        assert ok == n, f"B's copies of {n - ok} blocks failed their CRC check"
        c.evict(everything=True)
    return dt, e2e


class LMCacheSide:
    """The two LMCache engine processes (lmcache_mooncake_side.py): writer L1, reader L2; `status` is "ran",
    "skipped" (no usable .venv-bench: `reason`) or "failed" (`reason`, the bench goes on without it)."""

    def __init__(self, python: str, enabled: bool) -> None:
        self.python = python
        self.versions: dict[str, str] = {}
        self.status, self.reason = "ran", ""
        self.workers: list[lmc.Worker] = []
        self.digest = ""
        self.dir = tempfile.mkdtemp(prefix="kvsb-lmc-", dir="/tmp")
        if not enabled:
            self.status, self.reason = "skipped", "--no-lmcache"
            return
        versions, why = lmc.probe(python)
        if versions is None:
            self.status, self.reason = "skipped", why
        else:
            self.versions = versions

    @property
    def on(self) -> bool:
        return self.status == "ran"

    def fail(self, e: BaseException) -> None:
        self.status, self.reason = "failed", f"{type(e).__name__}: {e}"
        progress(f"LMCache side failed, going on without it (logs in {self.dir}):\n{self.reason}")
        self.close()

    def start(self, master: MooncakeMaster, n: int, bb: int, segment: int) -> None:
        if not self.on:
            return
        try:
            for role in ("writer", "reader"):
                self.workers.append(lmc.Worker(self.python, role, master.address, master.metadata, n, bb, segment,
                                               os.path.join(self.dir, f"{role}.log")))
        except OSError as e:
            self.fail(e)

    def ready(self) -> None:
        if not self.on:
            return
        try:
            w, r = (x.ready() for x in self.workers)
            assert "error" not in w and "error" not in r, w.get("error") or r.get("error")
            self.digest = w["digest"]
        except (AssertionError, RuntimeError, TimeoutError, ValueError) as e:
            self.fail(e)

    def rep(self, tag: int) -> tuple[float, float, float, float] | None:
        """(put s, put s less our copy, get s, get s less our copy), or None when the side is off."""
        if not self.on:
            return None
        try:
            p = self.workers[0].call("put", tag)
            assert p["tokens"] == p["of"], f"Mooncake holds {p['tokens']} of the writer's {p['of']} tokens"
            g = self.workers[1].call("get", tag)
            assert g["tokens"] == g["of"], f"the reader retrieved {g['tokens']} of {g['of']} tokens"
            assert g["digest"] == self.digest, "the reader's bytes differ from the writer's"
            return p["s"], p["s"] - p["copy_s"], g["s"], g["s"] - g["copy_s"]
        except (AssertionError, RuntimeError, TimeoutError, ValueError, OSError) as e:
            self.fail(e)
            return None

    def close(self) -> None:
        for w in self.workers:
            w.close()
        self.workers = []

    def cleanup(self) -> None:
        self.close()
        if self.status != "failed":
            shutil.rmtree(self.dir, ignore_errors=True)

    def describe(self) -> dict[str, Any]:
        return {"status": self.status, "reason": self.reason, "python": self.python, "versions": self.versions,
                "engine": "LMCacheEngine (in-process), remote_url=mooncakestore://, local_cpu=False, "
                          "save_chunk_meta=False, chunk 256 tokens = 4 MiB (8 layers x (2, 256, 4, 128) bf16)",
                "ours": "PagedCPUConnector(MockGPUConnector): torch copies between LMCache's memory objects and a "
                        "paged CPU KV cache; the *_store_side figures leave its time out"}


def mooncake_client() -> bool:
    """Whether mooncake.store is installed, found without importing it: an import here would set up Mooncake's
    logging in this process before raw_node sets MC_LOG_LEVEL (its forked children would log at INFO)."""
    import glob
    from importlib.util import find_spec

    spec = find_spec("mooncake")
    return any(glob.glob(os.path.join(d, "store*")) for d in (spec.submodule_search_locations or [])) \
        if spec else False


def ratio_of(a: list[float], b: list[float]) -> list[float]:
    return [x / y for x, y in zip(a, b)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--blocks", type=int, default=32, help="blocks of 4 MiB per repetition (default 32)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="3 repetitions of 16 blocks")
    ap.add_argument("--no-lmcache", action="store_true", help="leave the LMCache side out")
    ap.add_argument("--lmcache-python", default=lmc.default_python(),
                    help="the python with torch, lmcache and mooncake (default: .venv-bench's)")
    args = ap.parse_args()
    reexec_with_bind_guard()       # the raw nodes' Mooncake clients (forked) bind their ports on loopback only
    if args.quick:
        args.blocks, args.reps = 16, 3
    missing = "" if mooncake_client() else "Mooncake's Python client (mooncake.store)"
    missing = missing or ("" if master_binary() else "the mooncake_master binary")
    if missing:                                          # exit 77: run_all.sh lists it as skipped, with this line
        print(f"cannot run here: {missing} is missing: pip install 'kvstore[mooncake]' (make test does)")
        sys.exit(77)
    load = warn_if_busy()
    n, bb = args.blocks, GEOM.full_bytes
    side = LMCacheSide(args.lmcache_python, not args.no_lmcache)
    if side.status == "skipped":
        print(f"LMCache side skipped: {side.reason}", flush=True)
    segment = 4 * (args.reps + 1) * n * bb + (256 << 20)   # every side's values, below Mooncake's 90% watermark
    master = MooncakeMaster().start()
    # Every node of the run lends the store nothing but one, the store node (a raw client that only holds its
    # segment): every value of every side crosses TCP to the same place, so no side is favoured by a value that
    # happens to land in its own segment (a local memcpy) — the figures compare the data paths alone.
    env = master.env(KVSTORE_REMOTE_SEGMENT_BYTES="0", KVSTORE_REMOTE_STAGING_BYTES=str(4 * n * bb),
                     KVSTORE_LOG_LEVEL="warning")
    rng = np.random.default_rng(7)
    blocks = [rng.integers(0, 256, bb, dtype=np.uint8) for _ in range(n)]
    outs = [np.ones(bb, dtype=np.uint8) for _ in range(n)]           # touched: no page faults in the timed copy
    pipes, procs = [], []
    daemons: list[Daemon] = []
    res: dict[str, list[float]] = {k: [] for k in (
        "kvstore_put", "kvstore_get", "mooncake_put", "mooncake_get", "kvstore_put_end_to_end",
        "kvstore_get_end_to_end", "lmcache_put_end_to_end", "lmcache_put_store_side", "lmcache_get_end_to_end",
        "lmcache_get_store_side")}
    try:
        side.start(master, n, bb, 0)                # LMCache's engines take a while to import: they start first
        here, there = mp.Pipe()                     # the store node: the one segment of the run
        p = mp.Process(target=raw_node, args=(there, master.address, master.metadata, 1, 4096, segment))
        p.start()
        pipes.append(here)
        procs.append(p)
        assert here.recv() == 0, "the store node could not set up"
        a = Daemon(f"{4 * n * bb}", env={**env, "KVSTORE_REMOTE_PLACEMENT": "write_through"})
        daemons.append(a.start())
        b = Daemon(f"{4 * n * bb}", env=env)
        daemons.append(b.start())
        for _ in range(2):
            here, there = mp.Pipe()
            p = mp.Process(target=raw_node, args=(there, master.address, master.metadata, n, bb, 0))
            p.start()
            pipes.append(here)
            procs.append(p)
            assert here.recv() == 0, "a raw Mooncake client could not set up"
        with a.client() as c:
            deadline = time.monotonic() + 30
            while not remote_stats(c)["up"] and time.monotonic() < deadline:
                time.sleep(0.05)
        side.ready()
        for rep in range(args.reps + 1):                       # rep 0: the warm-up of every side
            progress(f"repetition {rep}/{args.reps}{' (warm-up)' if rep == 0 else ''}")
            hashes = [os.urandom(16) for _ in range(n)]
            e2e_s, put_s = kvstore_put(a, hashes, blocks)
            get_s, get_e2e_s = kvstore_get(b, hashes, outs)
            pipes[1].send(("put", rep))
            mput_s, ok1 = pipes[1].recv()
            pipes[2].send(("get", rep))
            mget_s, ok2 = pipes[2].recv()
            assert ok1 and ok2, "Mooncake's own client failed a put or a get"
            lm = side.rep(rep)
            if rep:
                res["kvstore_put"].append(put_s)
                res["kvstore_put_end_to_end"].append(e2e_s)
                res["kvstore_get"].append(get_s)
                res["kvstore_get_end_to_end"].append(get_e2e_s)
                res["mooncake_put"].append(mput_s)
                res["mooncake_get"].append(mget_s)
                if lm is not None:
                    for k, v in zip(("lmcache_put_end_to_end", "lmcache_put_store_side", "lmcache_get_end_to_end",
                                     "lmcache_get_store_side"), lm):
                        res[k].append(v)
    finally:
        for d in daemons:                   # stopped whatever happened: no daemon outlives the run
            d.stop()
        for pipe in pipes:
            pipe.send(None)
        for p in procs:
            p.join(timeout=30)
        side.cleanup()
        master.close()
    if side.status != "ran":                # a failure part way through: its figures would not be comparable
        for k in res:
            if k.startswith("lmcache_"):
                res[k] = []
    nbytes = n * bb
    gbs = {k: [nbytes / s / 1e9 for s in v] for k, v in res.items() if v}
    ratio = {op: ratio_of(gbs[f"kvstore_{op}"], gbs[f"mooncake_{op}"]) for op in ("put", "get")}
    # kvstore / LMCache, per repetition: the store-side rows against LMCache less our copy, end to end with it
    pairs = {"put": ("kvstore_put", "lmcache_put_store_side"), "get": ("kvstore_get", "lmcache_get_store_side"),
             "put_end_to_end": ("kvstore_put_end_to_end", "lmcache_put_end_to_end"),
             "get_end_to_end": ("kvstore_get_end_to_end", "lmcache_get_end_to_end")}
    vs_lmc = {op: ratio_of(gbs[k], gbs[lk]) for op, (k, lk) in pairs.items() if lk in gbs}

    def med(key: str) -> str:
        return f"{summary(gbs[key])['median']:.2f}" if key in gbs else "-"

    def rmed(d: dict[str, list[float]], op: str) -> str:
        return f"{summary(d[op])['median']:.2f}" if op in d else "-"

    t = Table(["op", "kvstore GB/s", "Mooncake client GB/s", "kvstore/Mooncake", "target", "met", "LMCache GB/s",
               "kvstore/LMCache"])
    for op, label in (("put", "put, store side"), ("get", "get, store side"), ("put_end_to_end", "put, end to end"),
                      ("get_end_to_end", "get, end to end")):
        if op in ratio:
            r = summary(ratio[op])["median"]
            mc = [med(f"mooncake_{op}"), f"{r:.2f}", f">= {TARGET}", "yes" if r >= TARGET else "no"]
        else:
            mc = ["-", "-", "-", "-"]
        t.add([label, med(pairs[op][0]), *mc, med(pairs[op][1]), rmed(vs_lmc, op)])
    print(f"{n} blocks of {bb >> 20} MiB per repetition, {args.reps} repetitions, 7 nodes on loopback (tcp), every "
          "value in the store node's segment; GB/s and ratios are medians")
    print(t)
    print("store side: kvstore's tier put time (CRC check + transfers from the host slots) / B's acquire "
          "(promotion into its slots); Mooncake's batch_put_from / batch_get_into; LMCache less our connector copy")
    print("end to end: from / into the caller's buffers: kvstore's client put until the last block is in the store, "
          "acquire + CRC-checked copy out + release; LMCache store() until lookup covers all tokens, "
          "lookup + retrieve()")
    if side.status == "ran":
        v = side.versions
        print(f"LMCache {v.get('lmcache')} in-process engine + mooncakestore:// (mooncake "
              f"{v.get('mooncake-transfer-engine-non-cuda')}, torch {v.get('torch')}), two processes of "
              f"{side.python}; bytes checked every repetition")
    else:
        print(f"LMCache side {side.status}: {side.reason}")
    path = write_json("remote", {"machine": machine(), "load_before": load, "blocks": n, "block_bytes": bb,
                                 "reps": args.reps, "seconds": res, "gbs": {k: summary(v) for k, v in gbs.items()},
                                 "ratio": {k: summary(v) for k, v in ratio.items()},
                                 "kvstore_over_lmcache": {k: summary(v) for k, v in vs_lmc.items()},
                                 "lmcache": side.describe(), "target": TARGET})
    print(f"results: {path}")
    if side.status == "failed":
        sys.exit(1)


if __name__ == "__main__":
    main()
