"""kvstore against LMCache's per-node daemon (MP mode), and both against the machine's limits, in one run.

The same workload for both: a client process stores 2 MiB blocks (kvstore blocks, LMCache 256-token chunks of the
same size) in batches of 32 and retrieves them, against a daemon process it started.

- DRAM: kvstore's host pool against LMCache's L1 (DRAM tier, POSIX shared memory, `lmcache_driven`: its faster CPU
  mode); limit: one-thread memcpy of the same blocks (contiguous, and gathered from a paged KV layout).
- disk: kvstore's host pool of 256 MiB plus its SSD tier against LMCache's fs tier behind an L1 of 1 GiB that evicts
  above 25% (≈256 MiB kept: with less free L1 than a 64 MiB batch, its stores fail), run with its default (page
  cache) and with `use_odirect`; 1 GiB of blocks stored batch by batch, each batch followed by a wait until the disk
  writes caught up, then read back in store order so that every block comes from disk; once, the same stored as fast
  as the client can, blocks that never reach the disk counted; limit: O_DIRECT write + fdatasync and read of the
  same bytes, 4 in flight.
- visibility: a lookup issued right after each completed store of 32 blocks; misses counted.
- lookup latency of 32 present blocks; limit: a Unix-socket round trip of the lookup's sizes (bench_pool.EchoServer).
- against the limit itself: store and retrieve over memcpy, repetition by repetition (issue 16: retrieve ≥ 0.95×),
  and the daemon's own time per retrieve batch (acquire + release, from its latency histograms) beside the memcpy
  of the batch: the part of the gap that is book-keeping rather than the copy.

Repetitions take turns (limit, then the two systems in alternating order), after untimed warm-ups; figures are
medians with their spread, ratios are taken repetition by repetition within the run.

    .venv-bench/bin/python bench/bench_vs_lmcache.py [--quick] [--reps N] [--skip-disk]
"""
from __future__ import annotations

import argparse
import glob
import os
import shutil
import sys
import tempfile
import time
import traceback
from typing import Any, Callable

import numpy as np

BENCH = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(BENCH))
sys.path.insert(0, BENCH)
import lmcache_side as lm  # noqa: E402  (sets LMCACHE_TRACK_USAGE=false before lmcache is imported)
from common import Daemon, Table, busy_cpus, progress, summary, warn_if_busy, write_json  # noqa: E402
from limits import Memcpy, ODirect  # noqa: E402

from kvstore.protocol.geometry import Geometry  # noqa: E402
from kvstore.protocol.keys import NamespaceSpec  # noqa: E402

# The LMCache chunk's bytes as a kvstore block: 4 layers × K+V × 256 tokens × 4 KV heads × 128 × bf16 = 2 MiB
GEOM = Geometry(layers=4, tokens=256, kv_heads=4, head_dim=128, dtype="bfloat16")
BLOCK = GEOM.full_bytes
BATCH = 32
SRC, DST = 16, 16 + BATCH * lm.PAGES_PER_CHUNK        # LMCache client pages: page 0 is its null block
PAGES = DST + BATCH * lm.PAGES_PER_CHUNK
assert BLOCK == lm.CHUNK_BYTES


def keys(tag: int, n: int) -> list[bytes]:
    return [(tag << 32 | i).to_bytes(16, "big") for i in range(n)]


class Phases:
    """Runs the benchmark's phases one after the other. A phase that raises is recorded (`failed`: phase, error;
    also as a line in its part's `errors`) with its traceback on stderr, and the next phase runs: one phase's
    failure loses neither the figures the others took nor those it took itself before it failed (they are filled
    into the results as they are measured)."""

    def __init__(self) -> None:
        self.failed: list[dict[str, str]] = []

    def run(self, name: str, fn: Callable[[], Any], errors: list[str] | None = None) -> Any:
        try:
            return fn()
        except Exception as e:             # noqa: BLE001 (recorded, and the run exits non-zero at the end)
            msg = f"{type(e).__name__}: {e}".strip()
            lines = [ln.strip() for ln in msg.splitlines() if ln.strip()]
            short = lines[0] if len(lines) == 1 else f"{lines[0]} … {lines[-1]}"   # e.g. a daemon's log
            self.failed.append({"phase": name, "error": msg})
            if errors is not None:
                errors.append(f"phase {name} failed: {short}")
            progress(f"{name}: FAILED: {short}")
            traceback.print_exc()
            return None


def close_all(phases: Phases, errors: list[str], *sides: Any) -> None:
    for side in sides:
        if side is not None:
            phases.run(f"close {type(side).__name__}", side.close, errors)


class KV:
    """kvstore's side: a daemon, one client (one copy thread), the same 32 source blocks for every batch."""

    def __init__(self, capacity: str, env: dict[str, str] | None = None) -> None:
        self.d = Daemon(capacity, "64MiB", env).start()
        self.c = self.d.client()
        self.ns = self.c.namespace(NamespaceSpec("bench-vs-lmcache", GEOM))
        rng = np.random.default_rng(3)
        self.src = [rng.integers(0, 256, BLOCK, dtype=np.uint8) for _ in range(BATCH)]
        self.dst = [np.ones(BLOCK, np.uint8) for _ in range(BATCH)]

    def store(self, tag: int) -> bool:
        return self.ns.put(keys(tag, BATCH), self.src).stored == BATCH

    def lookup(self, tag: int) -> int:
        return self.ns.lookup(keys(tag, BATCH))

    def timed_lookup(self, tag: int) -> tuple[int, float]:
        t0 = time.perf_counter()
        hit = self.ns.lookup(keys(tag, BATCH))
        return hit, time.perf_counter() - t0

    def retrieve(self, tag: int) -> int:
        return self.ns.get(keys(tag, BATCH), self.dst)

    def check(self) -> bool:
        return bool(np.array_equal(self.dst[0], self.src[0]) and np.array_equal(self.dst[-1], self.src[-1]))

    def drop(self, tags: list[int]) -> None:
        for t in tags:
            self.ns.delete(keys(t, BATCH))

    def drain(self, timeout: float = 300) -> float:
        """Until no demoted block waits for its SSD write. Returns perf_counter() then."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            tiers = self.c.stats()["tiers"]
            if len(tiers) < 2 or not tiers[1].get("staged_blocks", 0):
                break
            time.sleep(0.005)
        return time.perf_counter()

    def dropped(self) -> int:
        """Demoted blocks the SSD tier dropped (its staging area was full)."""
        tiers = self.c.stats()["tiers"]
        return int(tiers[1].get("dropped", 0)) if len(tiers) > 1 else 0

    def daemon_seconds(self) -> dict[str, float]:
        """The daemon's own time so far in the ops of a store (reserve, commit) and of a retrieve (acquire,
        release), from its latency histograms."""
        lat = self.c.stats()["latency"]
        return {op: lat.get(op, {}).get("sum", 0.0) for op in ("reserve", "commit", "acquire", "release")}

    def close(self) -> None:
        self.c.close()
        self.d.stop()


class LM:
    """LMCache's side: its daemon and one client whose 32 source chunks live at pages SRC.. (value `fill`)."""

    def __init__(self, l1_gb: float, fs_dir: str | None = None, odirect: bool = False,
                 watermark: float | None = None) -> None:
        self.fs_dir = fs_dir
        self.srv = lm.LMCacheServer(l1_gb, fs_dir, odirect, watermark).start()
        self.c = lm.LMCacheClient(self.srv, PAGES)
        self.value = 0
        self.stored_files = 0

    def tokens(self, tag: int) -> tuple[int, ...]:
        return lm.LMCacheClient.tokens(tag, BATCH)

    def fill(self, value: int) -> None:
        self.value = value
        self.c.fill(SRC, BATCH, value)

    def store(self, tag: int) -> bool:
        return self.c.store(self.tokens(tag), SRC)

    def lookup(self, tag: int) -> int:
        return self.c.lookup(self.tokens(tag))[0]

    def timed_lookup(self, tag: int) -> tuple[int, float]:
        """(chunks hit, seconds of LOOKUP + QUERY_PREFETCH_STATUS); the lookup's read locks are freed and its
        session ended after the clock stops (an engine's connector does that later, off its lookup's path)."""
        t0 = time.perf_counter()
        hit, req = self.c.lookup(self.tokens(tag), end_session=False)
        dt = time.perf_counter() - t0
        self.c.release(req, hit)
        return hit, dt

    def retrieve(self, tag: int) -> int:
        return self.c.lookup_retrieve(self.tokens(tag), DST)

    def check(self) -> bool:
        return self.c.sample(DST, 0) == [float(self.value)] * 4 and self.c.sample(DST, BATCH - 1)[0] == self.value

    def drop(self, tags: list[int]) -> None:
        self.c.clear(self.srv)

    def files(self) -> int:
        return len(glob.glob(os.path.join(self.fs_dir or "", "*.data")))

    def drain(self, expect: int, quiet: float = 2.0) -> float:
        """Until the fs tier holds `expect` chunk files (its L2 writes run behind the store's reply), or no file
        came for `quiet` seconds (a store it dropped never arrives). Returns perf_counter() of the last file."""
        last, n = time.perf_counter(), self.files()
        while n < expect and time.perf_counter() - last < quiet:
            time.sleep(0.005)
            m = self.files()
            if m != n:
                last, n = time.perf_counter(), m
        return last if n < expect else time.perf_counter()

    def close(self) -> None:
        self.c.close()
        self.srv.stop()


def run_pass(side: Any, tags: list[int], check: bool = True) -> dict[str, Any]:
    """Store the batches, then retrieve them; per-batch seconds and blocks retrieved."""
    st, rt, got = [], [], 0
    for t in tags:
        t0 = time.perf_counter()
        if not side.store(t):
            raise RuntimeError(f"{type(side).__name__}: store of batch {t} failed")
        st.append(time.perf_counter() - t0)
    for t in tags:
        t0 = time.perf_counter()
        n = side.retrieve(t)
        rt.append(time.perf_counter() - t0)
        got += n
    ok = side.check() if check else True
    return {"store_s": st, "retrieve_s": rt, "retrieved": got, "ok": ok}


# ----- DRAM -----
VISIBLE_DEADLINE_S = 10.0       # how long the lookup-latency phase waits for its probe batch to become visible


def dram(reps: int, warm: int, batches: int, out: dict[str, Any], phases: Phases) -> None:
    """Fills `out` as it measures: the timed repetitions, then visibility, then lookup latency, each a phase."""
    out.update({"memcpy": [], "memcpy_batch_s": [], "gather": [],
                "kvstore": {"store": [], "retrieve": [], "store_batch_s": [], "retrieve_batch_s": []},
                "lmcache": {"store": [], "retrieve": [], "store_batch_s": [], "retrieve_batch_s": []}})
    errors = out.setdefault("errors", [])
    kv: KV | None = None
    lmc: LM | None = None
    try:
        kv, lmc = KV("1GiB"), LM(2.0)
        phases.run("DRAM store/retrieve", lambda: dram_reps(kv, lmc, reps, warm, batches, out), errors)
        v = phases.run("visibility", lambda: visibility(kv, lmc, 20 if reps < 5 else 40), errors)
        if v is not None:
            out["visibility"] = v
        lk = phases.run("lookup latency", lambda: lookups(kv, lmc, 3 if reps < 5 else 8, 100), errors)
        if lk is not None:
            out.update(lk)
    finally:
        close_all(phases, errors, kv, lmc)


def dram_reps(kv: KV, lmc: LM, reps: int, warm: int, batches: int, out: dict[str, Any]) -> None:
    mem = Memcpy(BATCH)
    gb = batches * BATCH * BLOCK / 1e9
    for rep in range(warm + reps):
        tags = [(rep + 1) * 1000 + b for b in range(batches)]
        mc = sum(mem.contiguous() for _ in range(batches))
        mg = sum(mem.gather() for _ in range(batches))
        lmc.fill(rep % 90 + 1)
        res = {}
        for name, side in ((("kvstore", kv), ("lmcache", lmc)) if rep % 2 else
                           (("lmcache", lmc), ("kvstore", kv))):
            before = kv.daemon_seconds() if side is kv else {}
            res[name] = run_pass(side, tags)
            if side is kv:
                after = kv.daemon_seconds()
                res[name]["daemon_s"] = {op: after[op] - before[op] for op in after}
            side.drop(tags)
        if rep < warm:
            continue
        out["memcpy"].append(gb / mc)
        out["gather"].append(gb / mg)
        for name, r in res.items():
            o = out[name]
            if r["retrieved"] != batches * BATCH or not r["ok"]:
                out["errors"].append(f"rep {rep} {name}: retrieved {r['retrieved']}, bytes ok {r['ok']}")
            o["store"].append(gb / sum(r["store_s"]))
            o["retrieve"].append(gb / sum(r["retrieve_s"]))
            o["store_batch_s"] += r["store_s"]
            o["retrieve_batch_s"] += r["retrieve_s"]
            for op, spent in r.get("daemon_s", {}).items():      # the daemon's own time, per batch
                o.setdefault(f"daemon_{op}_batch_s", []).append(spent / batches)
        out["memcpy_batch_s"].append(mc / batches)


def visibility(kv: KV, lmc: LM, n: int) -> dict[str, Any]:
    """A lookup right after each completed store of 32 blocks, systems taking turns. A store that answers failure
    is counted (`failed_stores`) and not looked up."""
    progress(f"visibility: {n} stores of 32 blocks per system, each followed at once by a lookup")
    out = {s: {"lookups": 0, "missed_lookups": 0, "missed_blocks": 0, "failed_stores": 0}
           for s in ("kvstore", "lmcache")}
    for i in range(n):
        for name, side in (("kvstore", kv), ("lmcache", lmc)):
            tag = 900_000 + i
            o = out[name]
            if not side.store(tag):
                o["failed_stores"] += 1
                continue
            hit = side.lookup(tag)
            o["lookups"] += 1
            o["missed_lookups"] += hit < BATCH
            o["missed_blocks"] += BATCH - hit
        if i % 8 == 7:
            kv.drop([900_000 + j for j in range(i - 7, i + 1)])
            lmc.drop([])
    kv.drop([900_000 + j for j in range(n - n % 8, n)])
    lmc.drop([])
    return out


def lookups(kv: KV, lmc: LM, rounds: int, per_round: int) -> dict[str, Any]:
    """Seconds per lookup of 32 present blocks, per system, and per raw Unix-socket round trip of its sizes
    (`lookup_us`, in seconds). The probe batch is stored, then looked up until each system answers the whole batch
    (LMCache commits a STORE after its reply), up to VISIBLE_DEADLINE_S (`lookup_probe`: whether the store
    answered success, when the batch became visible, what was found at the deadline). A system that never shows
    the whole batch is timed anyway; every lookup that found less is counted (`lookup_misses`)."""
    from bench_pool import EchoServer

    progress(f"lookup latency: {rounds} rounds × {per_round} per system and raw socket")
    sides: dict[str, Any] = {"kvstore": kv, "lmcache": lmc}
    probe: dict[str, dict[str, Any]] = {name: {"store_ok": bool(side.store(777))} for name, side in sides.items()}
    t0, pending, found = time.perf_counter(), dict(sides), {}
    while pending:
        for name, side in list(pending.items()):
            found[name] = side.lookup(777)
            if found[name] == BATCH:
                probe[name]["visible_after_s"] = time.perf_counter() - t0
                del pending[name]
        if pending and time.perf_counter() - t0 > VISIBLE_DEADLINE_S:
            break
        if pending:
            time.sleep(0.005)
    for name in pending:
        probe[name]["visible_after_s"] = None
        probe[name]["found_at_deadline"] = found[name]
        progress(f"lookup latency: {name} found {found[name]} of {BATCH} blocks {VISIBLE_DEADLINE_S:.0f} s after "
                 f"its store (store answered {'success' if probe[name]['store_ok'] else 'failure'}); its lookups "
                 "are timed anyway and their misses counted")

    echo = EchoServer(os.path.join(kv.d.dir, "echo"))

    def raw() -> tuple[int, float]:
        t1 = time.perf_counter()
        echo.roundtrip()
        return BATCH, time.perf_counter() - t1

    out: dict[str, list[float]] = {"raw_socket": [], "kvstore": [], "lmcache": []}
    misses = {name: {"lookups": 0, "missed_lookups": 0, "missed_blocks": 0} for name in sides}
    fns = {"raw_socket": raw, "kvstore": lambda: kv.timed_lookup(777), "lmcache": lambda: lmc.timed_lookup(777)}
    try:
        for _ in range(rounds):
            for name, fn in fns.items():
                for i in range(per_round + 10):
                    v, dt = fn()
                    if i < 10:                                # 10 untimed calls after each switch
                        continue
                    out[name].append(dt)
                    if name in misses:
                        m = misses[name]
                        m["lookups"] += 1
                        m["missed_lookups"] += v < BATCH
                        m["missed_blocks"] += BATCH - v
    finally:
        echo.close()
    return {"lookup_us": out, "lookup_probe": probe, "lookup_misses": misses}


# ----- disk -----
def disk(reps: int, nblocks: int, base: str, out: dict[str, Any], phases: Phases) -> None:
    """Per repetition and system (in turns): store `nblocks` batch by batch, each batch followed by a wait until the
    system's disk writes have caught up (so nothing is dropped), then read them back in store order (every block
    then comes from disk). Last, one burst: the same amount stored as fast as the client can, with the blocks that
    never reached the disk counted. Fills `out` as it measures (a failure keeps the repetitions done)."""
    batches = nblocks // BATCH
    ssd_env = {"KVSTORE_SSD_DIR": os.path.join(base, "kvstore-ssd"), "KVSTORE_SSD_CAPACITY": "8GiB"}
    names = ("kvstore", "lmcache_fs", "lmcache_fs_odirect")
    out.update({"odirect_write": [], "odirect_read": [], "odirect_write_depth1": [], "odirect_read_depth1": [],
                "blocks": nblocks})
    errors = out.setdefault("errors", [])
    for s in names:
        out[s] = {"store": [], "store_to_disk": [], "retrieve": [], "missed_blocks": [], "store_batch_s": [],
                  "retrieve_batch_s": [], "burst_store": None, "burst_not_on_disk": None}
    systems: dict[str, Any] = {}
    raw = None
    try:
        systems["kvstore"] = KV("256MiB", ssd_env)
        systems["lmcache_fs"] = LM(1.0, os.path.join(base, "lmcache-fs"), watermark=0.25)
        systems["lmcache_fs_odirect"] = LM(1.0, os.path.join(base, "lmcache-fs-odirect"), odirect=True,
                                           watermark=0.25)
        raw = ODirect(base, nblocks)
        disk_reps(systems, raw, reps, batches, out)
    finally:
        close_all(phases, errors, raw, *systems.values())


def disk_reps(systems: dict[str, Any], raw: ODirect, reps: int, batches: int, out: dict[str, Any]) -> None:
    files = {s: 0 for s in systems}

    def settle(name: str, side: Any) -> tuple[float, int]:
        """Wait for the disk writes; (perf_counter then, blocks that will never be written)."""
        if isinstance(side, LM):
            done = side.drain(files[name] + BATCH)
            now = side.files()
            lost, files[name] = files[name] + BATCH - now, now
            return done, lost
        d0 = side.dropped()
        return side.drain(), side.dropped() - d0

    for rep in range(reps + 2):                    # 0: warm-up of 4 batches, untimed; last: the burst
        burst = rep == reps + 1
        n = 4 if rep == 0 else batches
        tags = [(rep + 1) * 10_000 + b for b in range(n)]
        gb = n * BATCH * BLOCK / 1e9
        if not burst:
            w1, r1 = raw.write(0, n * BATCH), raw.read(0, n * BATCH)
            w = raw.write(0, n * BATCH, depth=4)
            r = raw.read(0, n * BATCH, depth=4)
        order = list(systems.items())
        order = order[rep % len(order):] + order[:rep % len(order)]
        for name, side in order:
            progress(f"  disk {'burst' if burst else f'rep {rep}'}: {name}, {n * BATCH} blocks")
            if isinstance(side, LM):
                side.fill(rep + 1)
            st, lost, busy = [], 0, 0.0
            d0 = side.dropped() if isinstance(side, KV) else 0
            t0 = time.perf_counter()
            done = t0
            for t in tags:
                t1 = time.perf_counter()
                if not side.store(t):
                    raise RuntimeError(f"{name}: store failed")
                st.append(time.perf_counter() - t1)
                if not burst:
                    done, k = settle(name, side)
                    busy += done - t1                      # a lost batch's quiet wait is not counted
                    lost += k
            if burst:
                stored = time.perf_counter() - t0
                if isinstance(side, LM):
                    expect = files[name] + n * BATCH
                    side.drain(expect, quiet=3.0)
                    files[name] = side.files()
                    lost = expect - files[name]
                else:
                    side.drain()
                    lost = side.dropped() - d0
                out[name]["burst_store"] = gb / stored
                out[name]["burst_not_on_disk"] = lost
                continue
            rt, got = [], 0
            for t in tags:
                t1 = time.perf_counter()
                got += side.retrieve(t)
                rt.append(time.perf_counter() - t1)
            ok = side.check()
            if rep == 0:
                continue
            o = out[name]
            o["store"].append(gb / sum(st))
            o["store_to_disk"].append(gb / busy)
            o["retrieve"].append(got * BLOCK / 1e9 / sum(rt))
            o["missed_blocks"].append(n * BATCH - got)
            o["store_batch_s"] += st
            o["retrieve_batch_s"] += rt
            if lost:
                out["errors"].append(f"rep {rep} {name}: {lost} blocks never reached the disk (paced store)")
            if not ok:
                out["errors"].append(f"rep {rep} {name}: retrieved bytes differ")
        if rep and not burst:
            out["odirect_write"].append(gb / w)
            out["odirect_read"].append(gb / r)
            out["odirect_write_depth1"].append(gb / w1)
            out["odirect_read_depth1"].append(gb / r1)


# ----- report -----
def per_rep_ratio(a: list[float], b: list[float]) -> dict[str, float]:
    return summary([x / y for x, y in zip(a, b)])


def fmt(s: dict[str, float], d: int = 2) -> str:
    return f"{s['median']:.{d}f} ({s['p25']:.{d}f}–{s['p75']:.{d}f})"


def report(res: dict[str, Any]) -> dict[str, Any]:
    """Summaries, ratios and verdicts; prints the table."""
    t = Table(["figure", "kvstore", "LMCache", "limit", "kvstore/LMCache", "kvstore/limit", "target", "result"])
    verdicts: dict[str, Any] = {}

    def row(name: str, ours: list[float], theirs: list[float], limit: list[float], unit: str, target: float | None,
            higher_better: bool = True) -> None:
        if not ours or not theirs:                     # a failed phase: no figures for one side or both
            t.add([name, "–" if not ours else f"{fmt(summary(ours))} {unit}",
                   "–" if not theirs else f"{fmt(summary(theirs))} {unit}", "", "", "", "", "no figures"])
            verdicts[name] = {"pass": None, "missing": [s for s, x in (("kvstore", ours), ("lmcache", theirs))
                                                         if not x]}
            return
        so, st, sl = summary(ours), summary(theirs), summary(limit) if limit else None
        ratio = per_rep_ratio(ours, theirs)
        ok = None if target is None else ratio["median"] >= target
        t.add([name, f"{fmt(so)} {unit}", f"{fmt(st)} {unit}", f"{fmt(sl)} {unit}" if sl else "",
               f"{ratio['median']:.2f}", f"{so['median'] / sl['median']:.2f}" if sl else "",
               f"≥ {target}×" if target else "", "" if ok is None else ("PASS" if ok else "FAIL")])
        verdicts[name] = {"kvstore": so, "lmcache": st, "limit": sl, "ratio": ratio, "unit": unit,
                          "target": target, "pass": ok}

    dr = res.get("dram")
    if dr:
        row("DRAM store", dr["kvstore"]["store"], dr["lmcache"]["store"], dr["memcpy"], "GB/s", 4)
        row("DRAM retrieve", dr["kvstore"]["retrieve"], dr["lmcache"]["retrieve"], dr["memcpy"], "GB/s", 4)
        for what, limit_target in (("store", None), ("retrieve", 0.95)):
            if not dr["kvstore"][what] or not dr["memcpy"]:
                continue
            vs = per_rep_ratio(dr["kvstore"][what], dr["memcpy"])
            ok = None if limit_target is None else vs["median"] >= limit_target
            verdict = "" if ok is None else ("PASS" if ok else "FAIL")
            t.add([f"DRAM {what} vs memcpy (per rep)", fmt(summary(dr["kvstore"][what])), "",
                   fmt(summary(dr["memcpy"])), "", f"{vs['median']:.2f}",
                   f"≥ {limit_target}× limit" if limit_target else "", verdict])
            verdicts[f"DRAM {what} vs memcpy"] = {"ratio": vs, "target": limit_target, "pass": ok}
        kv = dr["kvstore"]
        if kv.get("daemon_acquire_batch_s") and dr["memcpy_batch_s"]:
            spent = summary([a + b for a, b in zip(kv["daemon_acquire_batch_s"], kv["daemon_release_batch_s"])], 1e6)
            copy = summary(dr["memcpy_batch_s"], 1e6)
            t.add(["daemon time per retrieve batch (acquire+release) vs memcpy of the batch, µs",
                   fmt(spent, 0), "", fmt(copy, 0), "", f"{spent['median'] / copy['median']:.3f}", "", ""])
            verdicts["daemon time per retrieve batch"] = {"daemon_us": spent, "memcpy_us": copy}
        v = dr.get("visibility")
        if v:
            for s in ("kvstore", "lmcache"):
                verdicts[f"misses after store, {s}"] = v[s]
            k, m = v["kvstore"], v["lmcache"]

            def seen(o: dict[str, int]) -> str:
                failed = f" ({o['failed_stores']} stores failed)" if o.get("failed_stores") else ""
                return f"{o['missed_lookups']}/{o['lookups']}{failed}"

            t.add(["lookups right after a store that missed", seen(k), seen(m), "", "", "", "0",
                   "PASS" if k["missed_lookups"] == 0 and not k.get("failed_stores") else "FAIL"])
        raw_lk = dr.get("lookup_us")
        if raw_lk and all(raw_lk.get(n) for n in ("kvstore", "lmcache", "raw_socket")):
            lk = {k: summary(x, 1e6) for k, x in raw_lk.items()}
            miss = dr.get("lookup_misses", {})
            verdicts["lookup 32 blocks"] = {**lk, "misses": miss, "probe": dr.get("lookup_probe")}

            def missed(s: str) -> str:
                m = miss.get(s, {})
                return f" ({m['missed_lookups']}/{m['lookups']} missed)" if m.get("missed_lookups") else ""

            kvl, lml, raw = lk["kvstore"]["median"], lk["lmcache"]["median"], lk["raw_socket"]["median"]
            t.add(["lookup of 32 present blocks, p50 µs", f"{kvl:.0f}{missed('kvstore')}",
                   f"{lml:.0f}{missed('lmcache')}", f"{raw:.0f} (socket)", f"{lml / kvl:.1f}× faster", "", "", ""])
            t.add(["lookup of 32 present blocks, p99 µs", f"{lk['kvstore']['p99']:.0f}",
                   f"{lk['lmcache']['p99']:.0f}", f"{lk['raw_socket']['p99']:.0f} (socket)", "", "", "", ""])
            probe = dr.get("lookup_probe", {})
            vis = {s: probe.get(s, {}).get("visible_after_s") for s in ("kvstore", "lmcache")}
            t.add(["lookup probe (32 blocks) whole after its store, ms",
                   *("never" if vis[s] is None else f"{vis[s] * 1e3:.1f}" for s in ("kvstore", "lmcache")),
                   "", "", "", f"≤ {VISIBLE_DEADLINE_S:.0f} s", ""])
    dk = res.get("disk")
    if dk:
        for lmname, label in (("lmcache_fs", "fs"), ("lmcache_fs_odirect", "fs O_DIRECT")):
            target = 2 if label == "fs O_DIRECT" else None
            row(f"disk store (reply) vs LMCache {label}", dk["kvstore"]["store"], dk[lmname]["store"],
                dk["odirect_write"], "GB/s", None)
            row(f"disk store (on disk) vs LMCache {label}", dk["kvstore"]["store_to_disk"],
                dk[lmname]["store_to_disk"], dk["odirect_write"], "GB/s", target)
            row(f"disk retrieve vs LMCache {label}", dk["kvstore"]["retrieve"], dk[lmname]["retrieve"],
                dk["odirect_read"], "GB/s", target)
        if dk["kvstore"]["missed_blocks"] or dk["lmcache_fs"]["missed_blocks"]:
            t.add(["disk: blocks missing on read-back (per rep)", str(dk["kvstore"]["missed_blocks"]),
                   f"fs {dk['lmcache_fs']['missed_blocks']}, O_DIRECT {dk['lmcache_fs_odirect']['missed_blocks']}",
                   "", "", "", "0", "PASS" if not any(dk["kvstore"]["missed_blocks"]) else "FAIL"])
    print(t)
    return verdicts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a smoke run: 3 repetitions, 256 disk blocks")
    ap.add_argument("--reps", type=int, help="timed repetitions (default 7, quick 3; disk: 3, quick 1)")
    ap.add_argument("--skip-disk", action="store_true")
    ap.add_argument("--dir", help="directory for the disk tiers (default: a new one under /var/tmp)")
    args = ap.parse_args()
    reps = args.reps or (3 if args.quick else 7)
    started = time.perf_counter()
    load_before = warn_if_busy()
    res: dict[str, Any] = {"block_bytes": BLOCK, "batch": BATCH, "reps": reps, "quick": args.quick,
                           "versions": {"lmcache": lm.version(), "torch": _v("torch"), "kvstore": _v("kvstore")},
                           "lmcache_transfer_mode": "lmcache_driven"}
    phases = Phases()
    res["phase_errors"] = phases.failed       # every phase that raised: {"phase", "error"}; the run then exits 1
    batches = 4
    progress(f"DRAM: {batches} batches of 32 × 2 MiB per repetition, 2 warm-up + {reps} reps, systems in turns")
    res["dram"] = {"errors": []}
    phases.run("DRAM", lambda: dram(reps, 2, batches, res["dram"], phases), res["dram"]["errors"])
    if not args.skip_disk:
        tmp = "/var/tmp" if os.path.isdir("/var/tmp") else None
        base = args.dir or tempfile.mkdtemp(prefix="kvs-vs-lmc-", dir=tmp)
        nblocks = 256 if args.quick else 512
        dreps = 1 if args.quick else max(2, min(3, reps))
        progress(f"disk: {nblocks} blocks through a 256 MiB DRAM tier, 1 warm-up + {dreps} reps, systems in turns")
        res["disk"] = {"errors": []}
        try:
            phases.run("disk", lambda: disk(dreps, nblocks, base, res["disk"], phases), res["disk"]["errors"])
        finally:
            if not args.dir:
                shutil.rmtree(base, ignore_errors=True)
    res["verdicts"] = phases.run("report", lambda: report(res))
    for part in ("dram", "disk"):
        for e in res.get(part, {}).get("errors", []):
            print("ERROR:", e)
    res["load_average"] = {"before": load_before, "after": busy_cpus()}
    res["seconds"] = time.perf_counter() - started
    print(f"\nwrote {write_json('vs_lmcache', res)}  ({res['seconds']:.0f} s)")
    if phases.failed:
        print(f"{len(phases.failed)} phase(s) failed: " + "; ".join(f["phase"] for f in phases.failed)
              + " (the figures of the others are above and in the JSON)")
        sys.exit(1)


def _v(pkg: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(pkg)
    except PackageNotFoundError:
        return ""


if __name__ == "__main__":
    main()
