"""Tenants whose loads peak at different times over a host pool far below their working sets and an SSD tier below
their summed working sets: one LRU on the SSD for all, against SSD quotas (kvstore.tiers.ssd.owners), against each
tenant alone on an SSD of its quota's size (issue 17 part 1). The question: do SSD quotas keep a quiet tenant's
SSD-resident working set while a busy tenant floods the tier, and what does the busy tenant pay?

The trace is bench_tenants.py's (imported from it): per tenant, seeded multi-turn sessions of 64 KiB blocks behind
its system prompt; in phase p tenant p mod n is hot (`--hot` requests over its `--sessions` sessions, a working set
above the whole tier) and the others are quiet (`--quiet` requests over their two most popular sessions: a few MiB,
well within a quota). Each request does what a connector does: `lookup` the chain, `get` the hit prefix (bytes
checked), `put` the rest. The first cycle of phases (every tenant hot once) is a warm-up left out of the figures.

Where a hit came from: the daemon counts, per acquire, the blocks found in the host pool and those promoted from the
SSD (`acquired_host`, `acquired_lower` in `stats`; as bench_workflows.py reads them). Those counters are the
daemon's, not a tenant's, so the tenants' requests are replayed one at a time, in a fixed interleaving (the same in
every configuration): the hot tenant's requests in order, a quiet tenant's j-th request of a phase after the hot one
has sent (j + 0.5) × hot / quiet of its own, as bench_tenants.py paces them. A request whose lookup says part of its
prefix lies beyond the host pool's reads `stats` after its get; the growth of `acquired_lower` is its SSD hits, the
rest of what it loaded its host hits. A sampler thread asks `tenants` every 50 ms for each tenant's SSD bytes.

The SSD writer is kept close to the replay: evicted blocks wait in staging for their write and are served from
there, outside any tenant's books, so every PACE requests the replay waits until at most STAGED_MAX blocks are
staged, and at each phase's end until none is (the `tenants` books are read then). `ssd.sync: never` (durability is
not under test; it keeps the writer ahead on a slow disk).

Configurations, each a fresh daemon with a fresh SSD directory under /var/tmp, the host pool shared (no host
quotas, one LRU) in all:
- one LRU: no SSD quotas, one eviction order per block size for every tenant's records (the behaviour before);
- ssd quotas: each tenant's `ssd` = tier / n (whole records); at the cap a write takes the record of the tenant most
  over its quota that stays at or above it, else its own;
- half quotas: the same with tier / 2n each: half the tier is guaranteed, the other half is there to borrow;
- alone (the baseline): each tenant by itself, same host pool, an SSD tier of `ssd quotas`' quota.
Figures per tenant: hit rate (host + SSD) in its hot phases and its quiet phases (all; the one right after its own
hot phase; the others, after another tenant's flood), the first quiet request of each phase (after the hot tenant
has flooded the tier for hot / (2 × quiet) requests); quiet under quotas ÷ alone (target ≥ 0.95, as bench_tenants'
lender target); the busy tenant's hot-phase hit rate under quotas ÷ one LRU (what it pays); SSD bytes per tenant
against its quota: once a tenant has filled its quota it must never be below it at a phase's end (the tier
settled); sampled, it dips by its own write batch in flight (records being rewritten are out of the books until
published: kvstore.tiers.ssd.writes).

    .venv/bin/python bench/bench_ssd_tenants.py [--quick] [--tenants 3] [--cycles 3] [--hot 1200] [--quiet 8]
                                                [--sessions 48] [--host-mib 4] [--ssd-mib 48] [--no-half]
                                                [--no-alone]

About 7 minutes on the 2-core VM; `--quick` (2 cycles, 300 hot / 3 quiet requests a phase) about 90 s.
"""
from __future__ import annotations

import argparse
import itertools
import os
import shutil
import sys
import tempfile
import threading
import time
from typing import Any

import numpy as np
import yaml

BENCH = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(BENCH))
sys.path.insert(0, BENCH)
from bench_tenants import BLOCK, GEOM, MiB, Request, fmt, pct, ratio, tenant_trace  # noqa: E402
from common import Daemon, Table, busy_cpus, progress, warn_if_busy, write_json  # noqa: E402

from kvstore.client import Client  # noqa: E402
from kvstore.protocol.keys import NamespaceSpec, pack_keys  # noqa: E402
from kvstore.tiers.ssd.record import HEADER_BYTES  # noqa: E402

KiB = 1 << 10
RECORD = HEADER_BYTES + BLOCK           # one SSD record of a block
SEGMENT = 1 * MiB
SAMPLE_S = 0.05
PACE = 8                                # every PACE requests, wait until at most STAGED_MAX blocks are staged
STAGED_MAX = 64
TARGET = 0.95                           # a quiet tenant's hit rate under quotas ÷ alone
QUOTAS = {"ssd quotas": 1.0, "half quotas": 0.5}   # the share of the tier the quotas guarantee, n ways
DIR = "/var/tmp" if os.path.isdir("/var/tmp") else None


# ----- the interleaving -----
def schedule(traces: dict[str, list[list[Request]]], hot: int) -> list[tuple[str, Request, bool]]:
    """Every request in the order they are sent: (tenant, request, first quiet request of its phase). A quiet
    tenant's j-th request of a phase goes once the hot tenant has sent int((j + 0.5) × hot / quiet) of its own."""
    out: list[tuple[str, Request, bool]] = []
    names = list(traces)
    for p in range(len(traces[names[0]])):
        hot_name = next((x for x in names if traces[x][p][0].hot), None)      # none: a tenant alone, quiet
        due: list[tuple[int, int, str, Request, bool]] = []   # (hot requests sent before it, then quiet ones first)
        for i, x in enumerate(names):
            reqs = traces[x][p]
            if x == hot_name:
                due += [(k, len(names), x, r, False) for k, r in enumerate(reqs)]
            else:
                step = hot / len(reqs)
                due += [(int((j + 0.5) * step), i, x, r, j == 0) for j, r in enumerate(reqs)]
        out += [(x, r, first) for _, _, x, r, first in sorted(due, key=lambda d: d[:2])]
    return out


# ----- one tenant's client -----
class Lower:
    """The daemon's count of blocks acquires promoted from a lower tier, as last read."""

    def __init__(self, admin: Client) -> None:
        self.admin = admin
        self.value = self.read()
        self.reads = 0

    def read(self) -> int:
        return int(self.admin.stats()["counters"].get("acquired_lower", 0))

    def delta(self) -> int:
        now = self.read()
        self.reads += 1
        d, self.value = now - self.value, now
        return d


class Tenant:
    def __init__(self, socket: str, name: str, lower: Lower, max_chain: int) -> None:
        self.c = Client(socket, tenant=name, secret=f"s-{name}")
        self.ns = self.c.namespace(NamespaceSpec(model="ssd-tenants-bench", geometry=GEOM))
        self.lower = lower
        self.outs = [np.zeros(BLOCK, np.uint8) for _ in range(max_chain)]
        self.ins = [np.full(BLOCK, 7, np.uint8) for _ in range(max_chain)]
        self.phases: dict[int, dict[str, Any]] = {}
        self.firsts: list[dict[str, Any]] = []      # the first quiet request of each phase

    def request(self, r: Request, first: bool) -> None:
        chain = r.chain
        seen = self.c.call("lookup", ns=self.ns.id, keys=pack_keys(chain))
        n, host = int(seen["n"]), int(seen["host"])
        got = self.ns.get(chain[:n], self.outs[:n]) if n else 0
        ssd = self.lower.delta() if n > host else 0
        for i in range(got):
            if self.outs[i][:16].tobytes() != chain[i]:
                raise AssertionError(f"block {i} of a chain came back with another block's bytes")
        rest = chain[got:]
        for i, h in enumerate(rest):
            self.ins[i][:16] = np.frombuffer(h, np.uint8)
        if rest:
            self.ns.put(rest, self.ins[:len(rest)])
        row = {"phase": r.phase, "hot": r.hot, "looked": len(chain), "host": got - ssd, "ssd": ssd}
        ph = self.phases.setdefault(r.phase, {**row, "requests": 0, "looked": 0, "host": 0, "ssd": 0, "lost": 0})
        for k in ("looked", "host", "ssd"):
            ph[k] += row[k]
        ph["requests"] += 1
        ph["lost"] += n - got
        if first:
            self.firsts.append(row)

    def close(self) -> None:
        self.c.close()


# ----- the SSD books, sampled -----
class Sampler(threading.Thread):
    """Each tenant's SSD bytes every SAMPLE_S; once it has filled its quota, the least seen and the samples below
    the quota, separately for the phases it is hot in (its own write batch in flight is out of the books:
    writes.py) and those it is quiet in. `hot`: the hot tenant now (set by the replay)."""

    def __init__(self, socket: str) -> None:
        super().__init__(daemon=True)
        self.c = Client(socket)
        self.stop_ev = threading.Event()
        self.hot = ""
        self.samples = 0
        self.least: dict[str, dict[str, int]] = {"hot": {}, "quiet": {}}     # since it filled its quota
        self.below: dict[str, dict[str, int]] = {"hot": {}, "quiet": {}}
        self.filled: set[str] = set()
        self.timeline: list[dict[str, Any]] = []
        self.t0 = time.monotonic()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            while not self.stop_ev.is_set():
                hot = self.hot
                rows = [r for r in self.c.tenants()["tenants"] if r["tenant"]]
                self.samples += 1
                for r in rows:
                    t, used, quota = r["tenant"], r.get("ssd_used_bytes", 0), r.get("ssd_quota_bytes", 0)
                    if quota and used >= quota:
                        self.filled.add(t)
                    if t in self.filled:
                        when = "hot" if t == hot else "quiet"
                        self.least[when][t] = min(self.least[when].get(t, used), used)
                        self.below[when][t] = self.below[when].get(t, 0) + (used < quota)
                if self.samples % 5 == 1:
                    self.timeline.append({"t": round(time.monotonic() - self.t0, 2), "hot": hot,
                                          "ssd_used": {r["tenant"]: r.get("ssd_used_bytes", 0) for r in rows}})
                self.stop_ev.wait(SAMPLE_S)
        except BaseException as e:  # noqa: BLE001 - raised again by the main thread
            self.error = e

    def stop(self) -> dict[str, Any]:
        self.stop_ev.set()
        self.join()
        self.c.close()
        if self.error is not None:
            raise self.error
        return {"samples": self.samples, "least_once_filled": self.least, "samples_below_quota": self.below,
                "timeline": self.timeline}


# ----- one configuration -----
def write_config(path: str, names: list[str], host: int, ssd_dir: str, ssd: int, quota: int | None) -> None:
    tenants = [{"name": x, "secret": f"s-{x}", **({"ssd": f"{quota // KiB}KiB"} if quota else {})} for x in names]
    conf = {"tenants": tenants, "ssd": {"dir": ssd_dir, "capacity": f"{ssd // KiB}KiB", "sync": "never"},
            "pool": {"capacity": f"{host // MiB}MiB", "segment_bytes": f"{SEGMENT // MiB}MiB"}}
    with open(path, "w") as f:
        yaml.safe_dump(conf, f)


def ssd_tier(admin: Client) -> dict[str, Any]:
    return next(t for t in admin.stats()["tiers"] if t.get("tier") == "ssd")


def drain(admin: Client, limit: int, timeout: float = 60.0) -> int:
    """Wait until at most `limit` evicted blocks wait in staging for their SSD write; how many waited at first."""
    first = staged = ssd_tier(admin)["staged_blocks"]
    deadline = time.monotonic() + timeout
    while staged > limit:
        if time.monotonic() > deadline:
            raise TimeoutError(f"the SSD tier still stages {staged} blocks after {timeout} s")
        time.sleep(0.005)
        staged = ssd_tier(admin)["staged_blocks"]
    return int(first)


def run_config(label: str, traces: dict[str, list[list[Request]]], hot: int, host: int, ssd: int,
               quota: int | None) -> dict[str, Any]:
    """Replays the tenants' traces, interleaved, against a fresh daemon and SSD directory: per tenant and phase the
    blocks looked up and loaded from each tier; the `tenants` reply after each phase (the tier settled); the
    sampler's figures."""
    names = list(traces)
    nphases = len(traces[names[0]])
    order = schedule(traces, hot)
    max_chain = max(len(r.chain) for _, r, _ in order)
    tmp = tempfile.mkdtemp(prefix="kvs-ssd-tenants-", dir=DIR)
    conf = os.path.join(tmp, "kvstore.yaml")
    write_config(conf, names, host, os.path.join(tmp, "ssd"), ssd, quota)
    d = Daemon(f"{host // MiB}MiB", f"{SEGMENT // MiB}MiB", env={"KVSTORE_CONFIG": conf})
    clients: dict[str, Tenant] = {}
    try:
        d.start()
        admin = d.client()
        lower = Lower(admin)
        clients = {x: Tenant(d.socket, x, lower, max_chain) for x in names}
        sampler = Sampler(d.socket)
        sampler.start()
        books: list[dict[str, Any]] = []
        phase_s: list[float] = []
        staged: list[int] = []                      # blocks waiting for their SSD write at each pacing check
        for p, group in itertools.groupby(order, key=lambda e: e[1].phase):
            sampler.hot = next((y for y in names if traces[y][p][0].hot), "")
            t0 = time.perf_counter()
            for i, (x, r, first) in enumerate(group):
                if i % PACE == 0:
                    staged.append(drain(admin, STAGED_MAX))
                clients[x].request(r, first)
            phase_s.append(time.perf_counter() - t0)
            staged.append(drain(admin, 0))
            books.append(admin.tenants())
            progress(f"{label}: phase {p + 1}/{nphases} ({phase_s[-1]:.1f} s)")
        s = admin.stats()
        admin.close()
        ssd_stats = next(t for t in s["tiers"] if t.get("tier") == "ssd")
        attributed = sum(ph["ssd"] for c in clients.values() for ph in c.phases.values())
        return {"host_bytes": host, "ssd_bytes": ssd, "ssd_quota_bytes": quota, "phase_seconds": phase_s,
                "books": books, "sampler": sampler.stop(), "stats_reads": lower.reads,
                "staged_blocks": {"max": max(staged), "mean": float(np.mean(staged))},
                "acquired_lower": s["counters"].get("acquired_lower", 0), "ssd_hits_attributed": attributed,
                "ssd_tier": {k: v for k, v in ssd_stats.items() if isinstance(v, (int, float, str))},
                "tenants": {x: {"phases": [c.phases[p] for p in sorted(c.phases)], "first_quiet": c.firsts}
                            for x, c in clients.items()}}
    finally:
        for c in clients.values():
            c.close()
        d.stop()
        shutil.rmtree(tmp, ignore_errors=True)


# ----- figures -----
def rates(rows: list[dict[str, Any]]) -> dict[str, float | None]:
    looked = sum(r["looked"] for r in rows)
    host, ssd = sum(r["host"] for r in rows), sum(r["ssd"] for r in rows)
    if not looked:
        return {"hit": None, "host": None, "ssd": None}
    return {"hit": (host + ssd) / looked, "host": host / looked, "ssd": ssd / looked}


def ssd_row(book: dict[str, Any], x: str) -> dict[str, Any]:
    return next((r for r in book["tenants"] if r["tenant"] == x), {})


def settled_books(run: dict[str, Any], x: str) -> dict[str, Any]:
    """The tenant's SSD bytes at each phase's end (the tier settled): once at or above its quota, the least seen
    and the phase ends below it."""
    used = [ssd_row(b, x).get("ssd_used_bytes", 0) for b in run["books"]]
    quota = ssd_row(run["books"][-1], x).get("ssd_quota_bytes", 0)
    first = next((p for p, u in enumerate(used) if quota and u >= quota), None)
    after = used[first:] if first is not None else []
    return {"used_at_phase_end": used, "least_once_filled": min(after) if after else None,
            "phase_ends_below_quota": sum(u < quota for u in after)}


def tenant_figures(run: dict[str, Any], x: str, i: int, n: int, warm: int) -> dict[str, Any]:
    """Tenant `x`'s (the i-th of n) hit rates after the warm-up: its hot phases; its quiet phases, all, the one
    right after its own hot phase and the others (after another tenant's hot phase); the first quiet request of
    each phase; its SSD counters over the same phases and its SSD books."""
    t = run["tenants"][x]
    measured = [ph for ph in t["phases"] if ph["phase"] >= warm]
    quiet = [ph for ph in measured if not ph["hot"]]
    last, before = ssd_row(run["books"][-1], x), ssd_row(run["books"][warm - 1], x)
    return {"hot": rates([ph for ph in measured if ph["hot"]]), "quiet": rates(quiet),
            "quiet_after_own": rates([ph for ph in quiet if (ph["phase"] - 1) % n == i]),
            "quiet_after_other": rates([ph for ph in quiet if (ph["phase"] - 1) % n != i]),
            "first_quiet": rates([r for r in t["first_quiet"] if r["phase"] >= warm]),
            "all": rates(measured), "lost_between_lookup_and_get": sum(ph["lost"] for ph in measured),
            **{k: last.get(k, 0) - before.get(k, 0) for k in ("ssd_evictions", "ssd_taken")},
            **{k: last.get(k, 0) for k in ("ssd_used_bytes", "ssd_quota_bytes", "ssd_borrowed_bytes")},
            "settled": settled_books(run, x)}


def split(r: dict[str, float | None]) -> str:
    return "-" if r["hit"] is None else f"{pct(r['hit'])} ({pct(r['host'])} + {pct(r['ssd'])})"


def mib(x: float | None) -> str:
    return "-" if x is None else f"{x / MiB:.1f}"


def hit_table(res: dict[str, Any], names: list[str], cfgs: list[str]) -> Table:
    t = Table(["config", "tenant", "hot phases", "quiet phases", "quiet: after own hot", "quiet: after other's",
               "quiet: 1st of phase", "SSD evictions", "taken by others"])
    for cfg in cfgs:
        for x in names:
            f = res["figures"][cfg][x]
            t.add([cfg, x, *(split(f[k]) for k in ("hot", "quiet", "quiet_after_own", "quiet_after_other",
                                                   "first_quiet")), f["ssd_evictions"], f["ssd_taken"]])
        runs = {x: res["configs"][cfg][x] if cfg == "alone" else res["configs"][cfg] for x in names}
        measured = [ph for x in names for ph in runs[x]["tenants"][x]["phases"]
                    if ph["phase"] >= res["warmup_phases"]]
        t.add([cfg, "all", split(rates([ph for ph in measured if ph["hot"]])),
               split(rates([ph for ph in measured if not ph["hot"]])), "", "", "",
               sum(res["figures"][cfg][x]["ssd_evictions"] for x in names),
               sum(res["figures"][cfg][x]["ssd_taken"] for x in names)])
    for x in names:
        t.add(["ideal", x, pct(res["trace"][x]["ideal_hot"]), pct(res["trace"][x]["ideal_quiet"]), "", "", "", "",
               ""])
    return t


def times(a: float | None, b: float | None) -> str:
    """a ÷ b as a table shows it (∞: b is 0 and a is not)."""
    if a is None or b is None:
        return "-"
    return fmt(a / b) if b else "∞" if a else "-"


def ratio_table(res: dict[str, Any], names: list[str], cfgs: list[str], alone: bool) -> Table:
    t = Table(["config", "tenant", "quiet ÷ one LRU", "after other's", "1st of phase",
               *(["quiet ÷ alone", f"≥ {TARGET}"] if alone else []), "hot ÷ one LRU",
               *(["hot ÷ alone"] if alone else []), "all ÷ one LRU"])
    figs = res["figures"]
    for cfg in (c for c in cfgs if c in QUOTAS):
        for x in names:
            quo, lru = figs[cfg][x], figs["one LRU"][x]
            row = [cfg, x, *(times(quo[k]["hit"], lru[k]["hit"]) for k in ("quiet", "quiet_after_other",
                                                                             "first_quiet"))]
            if alone:
                row += [times(quo["quiet"]["hit"], figs["alone"][x]["quiet"]["hit"]),
                        "PASS" if res["summary"][cfg][x]["pass"] else "FAIL"]
            row.append(times(quo["hot"]["hit"], lru["hot"]["hit"]))
            if alone:
                row.append(times(quo["hot"]["hit"], figs["alone"][x]["hot"]["hit"]))
            t.add(row + [times(quo["all"]["hit"], lru["all"]["hit"])])
    return t


def books_table(res: dict[str, Any], names: list[str], cfgs: list[str]) -> Table:
    t = Table(["config", "tenant", "quota MiB", "MiB at end", "borrowed", "settled: least once filled",
               "ends below", "sampled, quiet: least", "below", "sampled, hot: least", "below", "samples"])
    for cfg in cfgs:
        for x in names:
            f = res["figures"][cfg][x]
            run = res["configs"][cfg][x] if cfg == "alone" else res["configs"][cfg]
            sm = run["sampler"]
            t.add([cfg, x, mib(f["ssd_quota_bytes"] or None), mib(f["ssd_used_bytes"]), mib(f["ssd_borrowed_bytes"]),
                   mib(f["settled"]["least_once_filled"]), f["settled"]["phase_ends_below_quota"],
                   *(v for when in ("quiet", "hot") for v in (mib(sm["least_once_filled"][when].get(x)),
                                                               sm["samples_below_quota"][when].get(x, "-"))),
                   sm["samples"]])
    return t


def phase_table(res: dict[str, Any], names: list[str], cfgs: list[str]) -> Table:
    shown = [c for c in cfgs if c != "alone"]
    t = Table(["phase", "hot", *[f"{x} {k}" for x in names for k in ("SSD MiB", "hit rate")]])
    runs = [res["configs"][c] for c in shown]
    for p in range(res["phases"]):
        row: list[Any] = [f"{p}{' (warm-up)' if p < res['warmup_phases'] else ''}", names[p % len(names)]]
        for x in names:
            used = [mib(ssd_row(run["books"][p], x).get("ssd_used_bytes", 0)) for run in runs]
            hit = [pct(rates([run["tenants"][x]["phases"][p]])["hit"]) for run in runs]
            row += [" / ".join(used), " / ".join(hit)]
        t.add(row)
    return t


def summarize(figs: dict[str, dict[str, Any]], names: list[str], cfgs: list[str]) -> dict[str, Any]:
    """Per quota configuration and tenant: its hit rates ÷ one LRU's (and ÷ alone's, the target)."""
    out: dict[str, Any] = {}
    for cfg in (c for c in cfgs if c in QUOTAS):
        for x in names:
            lru, quo = figs["one LRU"][x], figs[cfg][x]
            s = out.setdefault(cfg, {})[x] = {
                f"{name}_over_lru": ratio(quo[k]["hit"], lru[k]["hit"])
                for name, k in (("quiet", "quiet"), ("after_other", "quiet_after_other"),
                                ("first_quiet", "first_quiet"), ("hot", "hot"), ("all", "all"))}
            if "alone" in figs:
                al = figs["alone"][x]
                s["quiet_over_alone"] = ratio(quo["quiet"]["hit"], al["quiet"]["hit"])
                s["hot_over_alone"] = ratio(quo["hot"]["hit"], al["hot"]["hit"])
                s["pass"] = (s["quiet_over_alone"] or 0) >= TARGET
    return out


def ideal(phases: list[list[Request]], warm: int) -> dict[str, float]:
    """Hit rates of the phases from `warm` on, hot and quiet, through an unbounded cache."""
    seen: set[bytes] = set()
    hit = {True: 0, False: 0}
    looked = {True: 0, False: 0}
    for p, reqs in enumerate(phases):
        for r in reqs:
            if p >= warm:
                hit[r.hot] += next((k for k, h in enumerate(r.chain) if h not in seen), len(r.chain))
                looked[r.hot] += len(r.chain)
            seen.update(r.chain)
    return {"ideal_hot": hit[True] / looked[True], "ideal_quiet": hit[False] / looked[False]}


def describe_traces(res: dict[str, Any], traces: dict[str, list[list[Request]]], warm: int) -> None:
    """Each tenant's bytes of records per hot and quiet phase, and its ideal hit rates, into `res["trace"]`."""
    for x, ph in traces.items():
        sets = {h: [len({b for r in reqs for b in r.chain}) * RECORD for reqs in ph if reqs[0].hot == h]
                for h in (True, False)}
        res["trace"][x] = {"hot_phase_bytes": sets[True], "quiet_phase_bytes": sets[False], **ideal(ph, warm)}
    hs = [s for t in res["trace"].values() for s in t["hot_phase_bytes"]]
    qs = [s for t in res["trace"].values() for s in t["quiet_phase_bytes"]]
    progress(f"{res['tenants']} tenants, {res['phases']} phases ({warm} of warm-up) of "
             f"{res['hot_requests_per_phase']} hot + {res['quiet_requests_per_phase']} quiet requests; a hot phase "
             f"touches {min(hs) / MiB:.0f}–{max(hs) / MiB:.0f} MiB of records, a quiet one {min(qs) / MiB:.1f}–"
             f"{max(qs) / MiB:.1f} MiB; host pool {res['host_bytes'] // MiB} MiB, SSD {res['ssd_bytes'] // MiB} MiB")


def report(res: dict[str, Any], names: list[str], cfgs: list[str]) -> None:
    alone = "alone" in cfgs
    quotas = ", ".join(f"{c} {res['quotas'][c] / MiB:.1f} MiB" for c in cfgs if c in QUOTAS)
    print(f"\n{res['tenants']} tenants, host pool {res['host_bytes'] // MiB} MiB (one LRU), SSD "
          f"{res['ssd_bytes'] // MiB} MiB ({RECORD // KiB} KiB records of {BLOCK // KiB} KiB blocks), SSD quota "
          f"each: {quotas}; {res['phases']} phases of {res['hot_requests_per_phase']} hot / "
          f"{res['quiet_requests_per_phase']} quiet requests, the first {res['warmup_phases']} a warm-up\n")
    print("hit rates after the warm-up: blocks loaded / looked up (from the host pool + from the SSD); quiet: all, "
          "the phase right after its own hot one, the others; 1st of phase: a quiet tenant's first request of each "
          "phase; ideal: an unbounded cache")
    print(f"{hit_table(res, names, cfgs)}\n")
    print("ratios: a quiet tenant's gain from SSD quotas, the busy tenant's loss"
          + (f"; target quiet ÷ alone ≥ {TARGET}" if alone else ""))
    print(f"{ratio_table(res, names, cfgs, alone)}\n")
    print("SSD MiB per tenant: at the end; once it had filled its quota, the least at a phase's end (the tier "
          f"settled) and sampled every {SAMPLE_S * 1e3:.0f} ms while quiet and while hot (a write batch in flight "
          "is out of its writer's books), with the phase ends / samples below the quota")
    print(f"{books_table(res, names, cfgs)}\n")
    shown = [c for c in cfgs if c != "alone"]
    print(f"phase by phase: SSD MiB held at the phase's end (settled) and the phase's hit rate, {' / '.join(shown)}")
    print(f"{phase_table(res, names, cfgs)}\n")
    print("staged blocks at the pacing checks (max), SSD hits attributed / the daemon's acquired_lower: "
          + "; ".join(f"{c} {res['configs'][c]['staged_blocks']['max']}, {res['configs'][c]['ssd_hits_attributed']}"
                      f"/{res['configs'][c]['acquired_lower']}" for c in shown))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="2 cycles of phases (1 warm-up), 300 hot and 3 quiet "
                                                         "requests a phase")
    ap.add_argument("--tenants", type=int, default=3, choices=(2, 3, 4))
    ap.add_argument("--cycles", type=int, help="each tenant hot this many times, the first a warm-up (default 3, "
                                                "quick 2)")
    ap.add_argument("--hot", type=int, help="a hot tenant's requests per phase (default 1200, quick 300)")
    ap.add_argument("--quiet", type=int, help="a quiet tenant's requests per phase (default 8, quick 3)")
    ap.add_argument("--sessions", type=int, default=48, help="a tenant's live sessions (default 48)")
    ap.add_argument("--host-mib", type=int, default=4, help="the host pool (default 4)")
    ap.add_argument("--ssd-mib", type=int, default=48, help="the SSD tier (default 48)")
    ap.add_argument("--no-half", action="store_true", help="skip `half quotas` (quotas guarantee half the tier)")
    ap.add_argument("--no-alone", action="store_true", help="skip the baseline of each tenant alone")
    ap.add_argument("--seed", type=int, default=17)
    args = ap.parse_args()
    started = time.perf_counter()
    load_before = warn_if_busy()
    n = args.tenants
    cycles = args.cycles or (2 if args.quick else 3)
    if cycles < 2:
        ap.error("--cycles must be at least 2 (the first is a warm-up)")
    hot = args.hot or (300 if args.quick else 1200)
    quiet = args.quiet or (3 if args.quick else 8)
    host, ssd = args.host_mib * MiB, args.ssd_mib * MiB
    nphases, warm = n * cycles, n
    names = [chr(ord("a") + i) for i in range(n)]
    cfgs = ["one LRU", "ssd quotas", *([] if args.no_half else ["half quotas"])]
    quotas = {c: int(ssd * QUOTAS[c]) // n // RECORD * RECORD for c in cfgs if c in QUOTAS}   # whole records
    traces = {x: tenant_trace(i, n, nphases, hot, quiet, args.sessions, args.seed) for i, x in enumerate(names)}
    res: dict[str, Any] = {"tenants": n, "cycles": cycles, "phases": nphases, "warmup_phases": warm,
                           "hot_requests_per_phase": hot, "quiet_requests_per_phase": quiet,
                           "sessions": args.sessions, "block_bytes": BLOCK, "record_bytes": RECORD,
                           "host_bytes": host, "ssd_bytes": ssd, "quotas": quotas, "seed": args.seed,
                           "target": TARGET, "trace": {}, "configs": {}}
    describe_traces(res, traces, warm)
    for cfg in cfgs:
        res["configs"][cfg] = run_config(cfg, traces, hot, host, ssd, quotas.get(cfg))
    if not args.no_alone:
        q = quotas["ssd quotas"]
        res["configs"]["alone"] = {x: run_config(f"alone {x}", {x: traces[x]}, hot, host, q, q) for x in names}
        cfgs.append("alone")
    res["figures"] = {cfg: {x: tenant_figures(res["configs"][cfg][x] if cfg == "alone" else res["configs"][cfg],
                                              x, i, n, warm) for i, x in enumerate(names)} for cfg in cfgs}
    res["summary"] = summarize(res["figures"], names, cfgs)
    report(res, names, cfgs)
    res["load_average"] = {"before": load_before, "after": busy_cpus()}
    res["seconds"] = time.perf_counter() - started
    print(f"\nwrote {write_json('ssd_tenants', res)}  ({res['seconds']:.0f} s)")


if __name__ == "__main__":
    main()
