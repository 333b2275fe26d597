"""Tenants whose loads peak at different times on one host pool smaller than their summed working sets: one shared
LRU, static quotas, and quotas with lending (kvstore.index.quotas, SwiftCache Algorithm 1), against each tenant
alone on a pool of its quota's size (issue 17, item 6).

The trace (seeded, per tenant, the same in every configuration): multi-turn sessions behind the tenant's shared
system prompt (SYSTEM_BLOCKS blocks). Each request revisits a session picked with a Zipf popularity over its live
sessions, appends a turn (1–2 blocks) to its context and asks for the whole chain; a session that reaches
SESSION_MAX blocks ends and a new one takes its rank. Time runs in phases: in phase p, tenant p mod n is hot (HOT
requests over its 32 sessions: a working set well above its quota) and the others are quiet (QUIET requests over
their two most popular sessions). Each request does what a connector does: `lookup` the chain, `get` the hit prefix
(bytes checked), `put` the rest. Blocks are 64 KiB, so the daemon moves real bytes but runs fast. The first cycle of
phases (every tenant hot once) is a warm-up that fills the pool: it is shown phase by phase but left out of the
figures.

Configurations, each a fresh daemon without an SSD tier, tenants driven concurrently (a thread and a client each):
- shared: no quotas, one LRU for all (the behaviour before quotas);
- static: quotas = capacity / n each, `tenancy.lending: false`;
- lending: the same quotas, `tenancy.lending: true`, `window_s` = a quarter of a phase's wall time (measured on the
  shared run, or --window-s);
- alone (the baseline of the lender target): each tenant by itself on a daemon whose capacity is its quota.
Phases run by request count: the hot tenant runs flat out, a quiet tenant sends its j-th request when the hot one
has sent (j + 0.5) × HOT / QUIET of its own; every thread waits for the others at a phase's end. A sampler thread
asks `tenants` every 20 ms (charged bytes against the capacity, held bytes per tenant).

    .venv/bin/python bench/bench_tenants.py [--quick] [--tenants 3] [--cycles 3] [--hot 1500] [--quiet 20]
                                            [--window-s S]
"""
from __future__ import annotations

import argparse
import hashlib
import os
import random
import shutil
import sys
import tempfile
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np
import yaml

BENCH = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(BENCH))
sys.path.insert(0, BENCH)
from common import Daemon, Table, busy_cpus, progress, warn_if_busy, write_json  # noqa: E402

from kvstore.client import Client  # noqa: E402
from kvstore.histogram import bucket_quantile  # noqa: E402
from kvstore.protocol.geometry import Geometry  # noqa: E402
from kvstore.protocol.keys import NamespaceSpec  # noqa: E402

MiB = 1 << 20
GEOM = Geometry(layers=2, tokens=16, kv_heads=8, head_dim=64, dtype="float16")     # 64 KiB per block
BLOCK = GEOM.full_bytes
SEGMENT = 1 * MiB                   # 16 blocks: the elastic unit
SYSTEM_BLOCKS = 4                   # the tenant's system prompt, shared by its sessions
FIRST = (2, 4)                      # a new session's first message, blocks
TURN = (1, 2)                       # blocks appended per request
SESSION_MAX = 36                    # a session this long (own blocks) ends; a new one takes its rank
ZIPF = 1.0
QUIET_SESSIONS = 2                  # a quiet tenant's hot set: its most popular sessions
QUIET = 20                          # a quiet tenant's requests per phase
SAMPLE_S = 0.02
TARGET = 0.95                       # hit rate under lending ÷ alone with its quota
COUNTERS = ("hits", "misses", "evictions", "reclaims", "lent_segments", "taken_back")


# ----- the trace -----
@dataclass(slots=True)
class Request:
    phase: int
    hot: bool
    chain: list[bytes]


def _h(*parts: object) -> bytes:
    return hashlib.blake2b(repr(parts).encode(), digest_size=16).digest()


def tenant_trace(t: int, n: int, phases: int, hot: int, quiet: int, sessions: int,
                 seed: int) -> list[list[Request]]:
    """Tenant `t`'s requests, phase by phase (hot in the phases p with p mod n == t)."""
    rng = random.Random(seed * 7919 + t)
    system = [_h(t, "system", i) for i in range(SYSTEM_BLOCKS)]
    sid = 0

    def fresh() -> list[int]:
        nonlocal sid
        sid += 1
        return [sid, rng.randint(*FIRST)]

    live = [fresh() for _ in range(sessions)]
    weights = [1 / (r + 1) ** ZIPF for r in range(sessions)]
    out: list[list[Request]] = []
    for p in range(phases):
        is_hot = p % n == t
        ranks = sessions if is_hot else QUIET_SESSIONS
        reqs = []
        for _ in range(hot if is_hot else quiet):
            r = rng.choices(range(ranks), weights[:ranks])[0]
            s = live[r]
            s[1] += rng.randint(*TURN)
            reqs.append(Request(p, is_hot, system + [_h(t, s[0], j) for j in range(s[1])]))
            if s[1] >= SESSION_MAX:
                live[r] = fresh()
        out.append(reqs)
    return out


def lru_hits(phases: list[list[Request]], capacity_blocks: int, warm: int) -> tuple[int, int]:
    """(blocks hit, blocks looked up) of the phases from `warm` on, the trace replayed offline through an LRU of
    `capacity_blocks` (prefix semantics: a request hits its longest cached prefix, then caches its whole chain)."""
    cache: OrderedDict[bytes, None] = OrderedDict()
    hits = looked = 0
    for p, reqs in enumerate(phases):
        for r in reqs:
            hit = next((k for k, h in enumerate(r.chain) if h not in cache), len(r.chain))
            if p >= warm:
                hits += hit
                looked += len(r.chain)
            for h in r.chain:
                cache[h] = None
                cache.move_to_end(h)
                if len(cache) > capacity_blocks:
                    cache.popitem(last=False)
    return hits, looked


# ----- one tenant's client -----
class Tenant:
    def __init__(self, socket: str, name: str, secret: str, max_chain: int) -> None:
        self.c = Client(socket, tenant=name, secret=secret)
        self.ns = self.c.namespace(NamespaceSpec(model="tenants-bench", geometry=GEOM))
        self.outs = [np.zeros(BLOCK, np.uint8) for _ in range(max_chain)]
        self.ins = [np.full(BLOCK, 7, np.uint8) for _ in range(max_chain)]
        self.phases: dict[int, dict[str, Any]] = {}
        self.quiet: list[list[int]] = []        # [phase, blocks loaded, chain length] of each quiet request
        self.seconds: list[float] = []

    def request(self, r: Request) -> None:
        t0 = time.perf_counter()
        chain = r.chain
        n = self.ns.lookup(chain)
        got = self.ns.get(chain[:n], self.outs[:n]) if n else 0
        for i in range(got):
            if self.outs[i][:16].tobytes() != chain[i]:
                raise AssertionError(f"block {i} of a chain came back with another block's bytes")
        rest = chain[got:]
        for i, h in enumerate(rest):
            self.ins[i][:16] = np.frombuffer(h, np.uint8)
        stored = self.ns.put(rest, self.ins[:len(rest)]).stored if rest else 0
        ph = self.phases.setdefault(r.phase, {"phase": r.phase, "hot": r.hot, "requests": 0, "looked": 0, "hit": 0,
                                              "lookup_hit": 0, "stored": 0})
        ph["requests"] += 1
        ph["looked"] += len(chain)
        ph["hit"] += got
        ph["lookup_hit"] += n
        ph["stored"] += stored
        if not r.hot:
            self.quiet.append([r.phase, got, len(chain)])
        self.seconds.append(time.perf_counter() - t0)

    def spans(self, p: int, reqs: list[Request]) -> None:
        """How many of the tenant's segments the cached blocks of these requests' chains lie in: a chain spread
        over most segments keeps them all touched (none idle), and loses a block to whichever segment goes."""
        keys = self.c.list(self.ns.id, limit=10000)["keys"]
        where = {bytes(k): gid >> 32 for k, gid in keys}
        spanned = [len({where[h] for h in r.chain if h in where}) for r in reqs]
        self.phases[p].update({"segments": len(set(where.values())), "blocks_held": len(where),
                               "chain_segments_mean": float(np.mean(spanned)) if spanned else 0.0})

    def close(self) -> None:
        self.c.close()


# ----- the daemon's books, sampled -----
class Sampler(threading.Thread):
    def __init__(self, socket: str) -> None:
        super().__init__(daemon=True)
        self.c = Client(socket)                 # the daemon's own user: the admin, every tenant's row
        self.stop_ev = threading.Event()
        self.samples = 0
        self.over = 0
        self.max_share = 0.0
        self.timeline: list[dict[str, Any]] = []
        self.t0 = time.monotonic()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            while not self.stop_ev.is_set():
                r = self.c.tenants()
                self.samples += 1
                self.over += r["charged_bytes"] > r["capacity_bytes"]
                self.max_share = max(self.max_share, r["charged_bytes"] / r["capacity_bytes"])
                if self.samples % 5 == 1:       # every ~100 ms in the JSON
                    self.timeline.append({"t": round(time.monotonic() - self.t0, 3), "charged": r["charged_bytes"],
                                          "used": {x["tenant"]: x["used_bytes"] for x in r["tenants"]}})
                self.stop_ev.wait(SAMPLE_S)
        except BaseException as e:  # noqa: BLE001 - raised again by the main thread
            self.error = e

    def stop(self) -> dict[str, Any]:
        self.stop_ev.set()
        self.join()
        self.c.close()
        if self.error is not None:
            raise self.error
        return {"samples": self.samples, "over_capacity_samples": self.over, "max_charged_share": self.max_share,
                "timeline": self.timeline}


class Pace:
    """The hot tenant's progress in the current phase: quiet tenants send their requests against it."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.done = 0
        self.aborted = False

    def reset(self) -> None:
        with self.cond:
            self.done = 0

    def advance(self) -> None:
        with self.cond:
            self.done += 1
            self.cond.notify_all()

    def wait_for(self, k: int) -> None:
        with self.cond:
            self.cond.wait_for(lambda: self.done >= k or self.aborted)

    def abort(self) -> None:
        with self.cond:
            self.aborted = True
            self.cond.notify_all()


# ----- one configuration -----
def write_config(path: str, names: list[str], capacity: int, quota: int | None, lending: bool,
                 window_s: float) -> None:
    tenants = [{"name": x, "secret": f"s-{x}", **({"host": f"{quota // MiB}MiB"} if quota else {})} for x in names]
    conf = {"tenants": tenants, "tenancy": {"lending": lending, "window_s": window_s},
            "pool": {"capacity": f"{capacity // MiB}MiB", "segment_bytes": f"{SEGMENT // MiB}MiB"}}
    with open(path, "w") as f:
        yaml.safe_dump(conf, f)


def run_config(label: str, traces: dict[str, list[list[Request]]], capacity: int, quota: int | None,
               lending: bool, window_s: float, hot: int) -> dict[str, Any]:
    """Replays the tenants' traces (every phase) concurrently against a fresh daemon; the `tenants` reply after
    each phase, the sampler's figures, and per tenant and phase the blocks looked up and loaded."""
    names = list(traces)
    nphases = len(traces[names[0]])
    max_chain = max(len(r.chain) for ph in traces.values() for reqs in ph for r in reqs)
    tmp = tempfile.mkdtemp(prefix="kvs-tenants-", dir="/tmp")
    conf = os.path.join(tmp, "kvstore.yaml")
    write_config(conf, names, capacity, quota, lending, window_s)
    d = Daemon(f"{capacity // MiB}MiB", f"{SEGMENT // MiB}MiB", env={"KVSTORE_CONFIG": conf})
    clients: dict[str, Tenant] = {}
    try:
        d.start()
        clients = {x: Tenant(d.socket, x, f"s-{x}", max_chain) for x in names}
        sampler = Sampler(d.socket)
        pace = Pace()
        barrier = threading.Barrier(len(names) + 1)
        errors: list[BaseException] = []

        def drive(x: str) -> None:
            cl = clients[x]
            try:
                for p in range(nphases):
                    barrier.wait()
                    reqs = traces[x][p]
                    if reqs[0].hot or len(names) == 1:
                        for r in reqs:
                            cl.request(r)
                            pace.advance()
                    else:
                        step = hot / len(reqs)
                        for j, r in enumerate(reqs):
                            pace.wait_for(int((j + 0.5) * step))
                            cl.request(r)
                    cl.spans(p, reqs[-20:])
                    barrier.wait()
            except BaseException as e:  # noqa: BLE001 - raised again by the main thread
                errors.append(e)
                pace.abort()
                barrier.abort()

        threads = [threading.Thread(target=drive, args=(x,), daemon=True) for x in names]
        sampler.start()
        for th in threads:
            th.start()
        phase_s: list[float] = []
        books: list[dict[str, Any]] = []
        with Client(d.socket) as admin:
            try:
                for p in range(nphases):
                    pace.reset()
                    t0 = time.perf_counter()
                    barrier.wait()
                    barrier.wait()
                    phase_s.append(time.perf_counter() - t0)
                    books.append(admin.tenants())
                    progress(f"{label}: phase {p + 1}/{nphases} ({phase_s[-1]:.1f} s)")
            except threading.BrokenBarrierError:
                pass
        for th in threads:
            th.join()
        cap = sampler.stop()
        if errors:
            raise errors[0]
        return {"capacity_bytes": capacity, "quota_bytes": quota, "lending": lending,
                "window_s": window_s if quota and lending else None, "phase_seconds": phase_s, "cap": cap,
                "books": books, "tenants": {x: {"phases": [c.phases[p] for p in sorted(c.phases)],
                                                "quiet_requests": c.quiet,
                                                "request_ms_median": float(np.median(c.seconds)) * 1e3}
                                            for x, c in clients.items()}}
    finally:
        for c in clients.values():
            c.close()
        d.stop()
        shutil.rmtree(tmp, ignore_errors=True)


# ----- figures -----
def rate(phases: list[dict[str, Any]], keep: Any) -> float | None:
    sel = [ph for ph in phases if keep(ph)]
    looked = sum(ph["looked"] for ph in sel)
    return sum(ph["hit"] for ph in sel) / looked if looked else None


def tenant_figures(run: dict[str, Any], x: str, t: int, n: int, warm: int) -> dict[str, Any]:
    """One tenant's hit rates after the warm-up: overall, in its hot phases, in the quiet phase right after a hot
    one (it gives back what it borrowed) and in its other quiet phases (a lender); the daemon's counters over the
    same phases (the `tenants` reply after the last phase less the one after the warm-up)."""
    phases = run["tenants"][x]["phases"]
    measured = [ph for ph in phases if ph["phase"] >= warm]
    last = next(r for r in run["books"][-1]["tenants"] if r["tenant"] == x)
    first = next((r for r in run["books"][warm - 1]["tenants"] if r["tenant"] == x), None) if warm else None
    daemon = {k: last[k] - (first[k] if first else 0) for k in COUNTERS}
    asked = daemon["hits"] + daemon["misses"]
    daemon["hit_rate"] = daemon["hits"] / asked if asked else None
    return {"hit_rate": rate(measured, lambda ph: True), "hit_rate_hot": rate(measured, lambda ph: ph["hot"]),
            "hit_rate_quiet": rate(measured, lambda ph: not ph["hot"]),
            "hit_rate_after_hot": rate(measured, lambda ph: not ph["hot"] and (ph["phase"] - 1) % n == t),
            "hit_rate_other_quiet": rate(measured, lambda ph: not ph["hot"] and (ph["phase"] - 1) % n != t),
            "lost_between_lookup_and_get": sum(ph["lookup_hit"] - ph["hit"] for ph in measured),
            "daemon": daemon}


def reclaim_latency(run: dict[str, Any], warm: int) -> dict[str, Any]:
    """The daemon's reclaim-latency histogram over the measured phases (bucket bounds: p50 and p99 are upper
    bounds)."""
    last = run["books"][-1]["reclaim_seconds"]
    first = run["books"][warm - 1]["reclaim_seconds"] if warm else {"buckets": [0] * len(last["buckets"]),
                                                                      "count": 0, "sum": 0.0}
    counts = [a - b for a, b in zip(last["buckets"], first["buckets"])]
    count, total = last["count"] - first["count"], last["sum"] - first["sum"]
    q = {k: bucket_quantile(counts, v) for k, v in (("p50", 0.5), ("p99", 0.99))}
    return {"count": count, "mean": total / count if count else None, "buckets": counts,
            **{k: (None if v == float("inf") else v) for k, v in q.items()},
            "since_start": {k: last[k] for k in ("count", "p50", "p99")}}


def pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.1%}"


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def fmt(x: float | None, spec: str = ".3f") -> str:
    return "-" if x is None else format(x, spec)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="2 cycles of phases (1 warm-up), 400 hot requests a phase")
    ap.add_argument("--tenants", type=int, default=3, choices=(2, 3, 4))
    ap.add_argument("--cycles", type=int, help="each tenant hot this many times, the first a warm-up (default 3, "
                                                "quick 2)")
    ap.add_argument("--hot", type=int, help="a hot tenant's requests per phase (default 1500, quick 400)")
    ap.add_argument("--quiet", type=int, default=QUIET, help=f"a quiet tenant's requests per phase (default {QUIET})")
    ap.add_argument("--sessions", type=int, default=32, help="a tenant's live sessions (default 32)")
    ap.add_argument("--quota-mib", type=int, default=16, help="each tenant's quota; pool = n × quota (default 16)")
    ap.add_argument("--window-s", type=float, help="tenancy.window_s (default: a quarter of a shared phase)")
    ap.add_argument("--seed", type=int, default=17)
    args = ap.parse_args()
    started = time.perf_counter()
    load_before = warn_if_busy()
    n = args.tenants
    cycles = args.cycles or (2 if args.quick else 3)
    if cycles < 2:
        ap.error("--cycles must be at least 2 (the first is a warm-up)")
    hot = args.hot or (400 if args.quick else 1500)
    quota = args.quota_mib * MiB
    capacity = n * quota
    nphases = n * cycles
    warm = n                                    # the first cycle fills the pool: left out of the figures
    names = [chr(ord("a") + i) for i in range(n)]
    traces = {x: tenant_trace(i, n, nphases, hot, args.quiet, args.sessions, args.seed) for i, x in enumerate(names)}

    res: dict[str, Any] = {"tenants": n, "cycles": cycles, "phases": nphases, "warmup_phases": warm,
                           "hot_requests_per_phase": hot, "quiet_requests_per_phase": args.quiet,
                           "sessions": args.sessions, "quiet_sessions": QUIET_SESSIONS, "zipf": ZIPF,
                           "block_bytes": BLOCK, "segment_bytes": SEGMENT, "capacity_bytes": capacity,
                           "quota_bytes": quota, "seed": args.seed, "target": TARGET, "trace": {}, "configs": {}}
    for x, ph in traces.items():
        sets = {hot_: [len({h for r in reqs for h in r.chain}) * BLOCK for reqs in ph if reqs[0].hot == hot_]
                for hot_ in (True, False)}
        lru_q = lru_hits(ph, quota // BLOCK, warm)
        res["trace"][x] = {"requests": sum(map(len, ph)), "hot_phase_blocks_bytes": sets[True],
                           "quiet_phase_blocks_bytes": sets[False],
                           "offline_lru_hit_rate_at_quota": lru_q[0] / lru_q[1],
                           "offline_lru_hit_rate_at_capacity": (lambda h: h[0] / h[1])(
                               lru_hits(ph, capacity // BLOCK, warm)),
                           "ideal_hit_rate": (lambda h: h[0] / h[1])(lru_hits(ph, 1 << 40, warm))}
    hs = [s for t in res["trace"].values() for s in t["hot_phase_blocks_bytes"]]
    qs = [s for t in res["trace"].values() for s in t["quiet_phase_blocks_bytes"]]
    progress(f"{n} tenants, {nphases} phases ({warm} of warm-up) of {hot} hot + {args.quiet} quiet requests per "
             f"tenant; a hot phase touches {min(hs) / MiB:.0f}–{max(hs) / MiB:.0f} MiB of blocks, a quiet one "
             f"{min(qs) / MiB:.1f}–{max(qs) / MiB:.1f} MiB; quota {quota // MiB} MiB each, "
             f"pool {capacity // MiB} MiB")

    # the baseline: each tenant alone on a pool of its quota; then the three configurations
    alone = {x: run_config(f"alone {x}", {x: traces[x]}, quota, quota, False, 60.0, hot) for x in names}
    res["configs"]["alone"] = alone
    shared = run_config("shared", traces, capacity, None, True, 60.0, hot)
    res["configs"]["shared"] = shared
    phase_s = float(np.median(shared["phase_seconds"]))
    window = args.window_s or max(0.05, round(phase_s / 4, 2))
    progress(f"lending: window_s = {window} s (a shared phase took {phase_s:.2f} s, median)")
    res["window_s"] = window
    res["configs"]["static"] = run_config("static", traces, capacity, quota, False, window, hot)
    res["configs"]["lending"] = run_config("lending", traces, capacity, quota, True, window, hot)

    figs: dict[str, dict[str, Any]] = {}
    for cfg in ("alone", "shared", "static", "lending"):
        figs[cfg] = {x: tenant_figures(alone[x] if cfg == "alone" else res["configs"][cfg], x, i, n, warm)
                     for i, x in enumerate(names)}
    res["figures"] = figs

    # table 1: hit rates per configuration and tenant
    t1 = Table(["config", "tenant", "hit rate", "hot phases", "quiet: after hot", "quiet: other", "daemon's",
                "evictions", "reclaims", "lent segs", "taken back", "lost lookup→get"])
    for cfg in ("alone", "shared", "static", "lending"):
        for x in names:
            f = figs[cfg][x]
            dm = f["daemon"]
            t1.add([cfg, x, pct(f["hit_rate"]), pct(f["hit_rate_hot"]), pct(f["hit_rate_after_hot"]),
                    pct(f["hit_rate_other_quiet"]), pct(dm["hit_rate"]), dm["evictions"], dm["reclaims"],
                    dm["lent_segments"], dm["taken_back"], f["lost_between_lookup_and_get"]])
    for x in names:
        tr = res["trace"][x]
        t1.add(["offline", x, f"{tr['offline_lru_hit_rate_at_quota']:.1%} LRU@quota",
                f"{tr['offline_lru_hit_rate_at_capacity']:.1%} LRU@pool", f"{tr['ideal_hit_rate']:.1%} ideal",
                "", "", "", "", "", "", ""])

    # table 2: the targets
    t2 = Table(["tenant", "hot: lending ÷ static", "lending ÷ alone", f"≥ {TARGET}", "quiet: lending ÷ alone",
                f"≥ {TARGET}", "after hot", "other quiet", "shared ÷ alone", "quiet: shared ÷ alone"])
    summary: dict[str, Any] = {}
    for x in names:
        le, st, sh, al = (figs[c][x] for c in ("lending", "static", "shared", "alone"))
        s = summary[x] = {
            "hot_gain_lending_over_static": ratio(le["hit_rate_hot"], st["hit_rate_hot"]),
            "lending_over_alone": ratio(le["hit_rate"], al["hit_rate"]),
            "quiet_lending_over_alone": ratio(le["hit_rate_quiet"], al["hit_rate_quiet"]),
            "after_hot_lending_over_alone": ratio(le["hit_rate_after_hot"], al["hit_rate_after_hot"]),
            "other_quiet_lending_over_alone": ratio(le["hit_rate_other_quiet"], al["hit_rate_other_quiet"]),
            "shared_over_alone": ratio(sh["hit_rate"], al["hit_rate"]),
            "quiet_shared_over_alone": ratio(sh["hit_rate_quiet"], al["hit_rate_quiet"])}
        s["pass"] = (s["lending_over_alone"] or 0) >= TARGET
        s["quiet_pass"] = (s["quiet_lending_over_alone"] or 0) >= TARGET
        t2.add([x, fmt(s["hot_gain_lending_over_static"], ".2f") + "×", fmt(s["lending_over_alone"]),
                "PASS" if s["pass"] else "FAIL", fmt(s["quiet_lending_over_alone"]),
                "PASS" if s["quiet_pass"] else "FAIL", fmt(s["after_hot_lending_over_alone"]),
                fmt(s["other_quiet_lending_over_alone"]), fmt(s["shared_over_alone"]),
                fmt(s["quiet_shared_over_alone"])])
    res["summary"] = summary
    res["targets_met"] = all(s["pass"] and s["quiet_pass"] for s in summary.values())

    # table 3: the daemon's books per configuration
    t3 = Table(["config", "reclaims", "reclaim p50 ms", "p99 ms", "mean ms", "lent segs", "max charged/cap",
                "samples", "over cap", "seg tail share", "phase s (median)"])
    for cfg in ("shared", "static", "lending"):
        r = res["configs"][cfg]
        rl = r["reclaim_latency"] = reclaim_latency(r, warm)
        final = r["books"][-1]
        lent = final["lent_segments"] - r["books"][warm - 1]["lent_segments"]
        t3.add([cfg, rl["count"], "-" if not rl["count"] else f"≤{rl['p50'] * 1e3:.3g}",
                "-" if not rl["count"] else f"≤{rl['p99'] * 1e3:.3g}" if rl["p99"] is not None else ">10000",
                "-" if rl["mean"] is None else f"{rl['mean'] * 1e3:.3g}", lent,
                f"{r['cap']['max_charged_share']:.3f}", r["cap"]["samples"], r["cap"]["over_capacity_samples"],
                f"{final['fragmentation']['tail_share']:.1%}", f"{np.median(r['phase_seconds']):.2f}"])
    for x in names:
        c = alone[x]["cap"]
        t3.add([f"alone {x}", "", "", "", "", "", f"{c['max_charged_share']:.3f}", c["samples"],
                c["over_capacity_samples"], "", ""])

    # table 4: phase by phase under lending, beside alone
    t4 = Table(["phase", "hot",
                *[c for x in names for c in (f"{x} MiB", f"{x} hit", f"{x} alone", f"{x} seg/chain")]])
    le_run = res["configs"]["lending"]
    for p in range(nphases):
        row: list[Any] = [f"{p}{' (warm-up)' if p < warm else ''}", names[p % n]]
        held = {r["tenant"]: r["used_bytes"] for r in le_run["books"][p]["tenants"]}
        for x in names:
            ph = le_run["tenants"][x]["phases"][p]
            ph_alone = alone[x]["tenants"][x]["phases"][p]
            row += [f"{held.get(x, 0) / MiB:.0f}", pct(ph["hit"] / ph["looked"]),
                    pct(ph_alone["hit"] / ph_alone["looked"]), f"{ph['chain_segments_mean']:.1f}/{ph['segments']}"]
        t4.add(row)

    print(f"\n{n} tenants, quota {quota // MiB} MiB each, pool {capacity // MiB} MiB, segments {SEGMENT // MiB} MiB, "
          f"blocks {BLOCK // 1024} KiB; {nphases} phases of {hot} hot / {args.quiet} quiet requests, the first "
          f"{warm} a warm-up (left out of the figures); lending window_s {window} s\n")
    print("hit rates (blocks loaded / blocks looked up; `daemon's`: the tenants op, counted at the lookup; quiet: "
          "after hot = the phase right after its own hot phase)")
    print(t1)
    print(f"\ntargets: hit rate under lending ÷ alone with its quota ≥ {TARGET} (overall, and in its quiet phases, "
          "where it gives back and lends)")
    print(t2)
    print("\nthe daemon's books (reclaim latency: histogram bucket bounds; the cap sampled every 20 ms, warm-up "
          "included)")
    print(t3)
    print("\nunder lending, phase by phase: held at the phase's end (MiB), the phase's hit rate, alone's, and the "
          "segments a request's cached chain lies in / the tenant's segments (its last 20 requests)")
    print(t4)
    res["load_average"] = {"before": load_before, "after": busy_cpus()}
    res["seconds"] = time.perf_counter() - started
    print(f"\nwrote {write_json('tenants', res)}  ({res['seconds']:.0f} s)")


if __name__ == "__main__":
    main()
