"""LoRA agents' KV split into a shared base and per-adapter residuals (ForkKV §5.1–5.2; kvstore.client.pairs,
kvstore.index.sharing), against the same agents storing whole blocks each (issue 18, item 6).

Three parts, each against a daemon started for it (`python -m kvstore serve`, no SSD tier), each with its baseline
in the same run:

1. Memory. N = 1, 2, 4, 8, 16, 32 agents (LoRA adapters of one base model) over one shared context of C blocks.
   Unified: each agent puts its whole blocks (xW + xA·B, n wide) in its own namespace. Split: one base namespace
   (xW, keyed by tokens) and one residual namespace per agent (xA, rank r wide); the first agent puts the base, each
   later one forks the context (inheriting the base by reference) and puts only its residuals. Agents are added one
   at a time, on two daemons (one per layout); at each N the bytes held are read from `list()` (namespace rows;
   the pair row's `base_bytes` + `residual_bytes`, and its `unified_bytes`, the daemon's own estimate of the
   baseline) and the host pool's resident bytes from `stats()`. The measured ratio split ÷ unified is set against
   ForkKV's M = 1/N + r/n (r/n = residual bytes ÷ base bytes per block).
2. Costs, full geometry, 32 keys: a pair lookup (one request) against a lookup of one namespace (the baseline) and
   against two lookups (base, then residual); a pair acquire + release against one namespace's, and against two
   acquires; a put of one block's base + residual (two puts) and of 32 blocks' against a unified put of the same
   blocks. The variants take turns repetition by repetition; p50 and p99 in µs, the ratio to the single-namespace
   op, and for puts µs per MiB.
3. Hit rate under memory pressure. A seeded multi-agent trace: CONTEXTS live contexts of C shared blocks, each worked
   on by AGENTS_PER_CONTEXT agents drawn from ADAPTERS adapters; each request picks a context by Zipf(1.0) popularity
   over the live ones and one of its agents at random, whose chain is the context plus the agent's own branch (one
   more block per visit, at most BRANCH_MAX); a context that has had VISITS requests ends and a new one takes its
   rank. The host pool (--pool-mib, 256 MiB) is well below the working set. Per request, as an engine does: split
   layouts — `pair.lookup(chain)` (one request: base prefix b, residual prefix m), `pair.acquire` of the longer prefix
   and release (a load: the acquire makes both parts recent; a lookup changes no recency), then put the base past b
   and the residual past m (what it had to recompute); unified — the agent's own namespace: lookup, acquire + release,
   put the rest. Per block: full hit (both parts), partial (residual kept, base recomputed — ForkKV's partial hit),
   base kept and residual recomputed, or miss. Recompute cost = base blocks recomputed × n + residual blocks
   recomputed × r, as a share of recomputing everything (blocks × (n + r)); a unified miss costs n + r. The same trace
   runs against three daemons: `pool.pair_eviction: decoupled`, `coupled` (a base block leaving the pool takes its
   residuals along), and the unified layout, once per segment size (default 16, 4 and 64 MiB: the pool moves memory
   between its size classes a segment at a time); beside them, the trace through an unbounded cache (compulsory misses
   only) and through an exact byte-granular LRU (offline, one recency order for every block, each mode), to show what
   the daemon's segment-granular, per-size-class eviction changes. What the pool holds is sampled every SAMPLE_EVERY
   requests. The first third of the requests is a warm-up, left out of the figures.

    .venv/bin/python bench/bench_forkkv.py [--quick] [--context 32] [--requests 3000] [--pool-mib 256]
                                           [--segment-mib 16,4,64] [--reps 400] [--seed 18] [--parts 1,2,3]
"""
from __future__ import annotations

import argparse
import hashlib
import os
import random
import sys
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np

BENCH = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(BENCH))
sys.path.insert(0, BENCH)
from common import Daemon, Table, busy_cpus, progress, summary, warn_if_busy, write_json  # noqa: E402

from kvstore.protocol.geometry import Geometry  # noqa: E402
from kvstore.protocol.keys import NamespaceSpec  # noqa: E402

MiB = 1 << 20
RANK = 16                       # LoRA rank r (ForkKV's configurations: 16)
# Parts 1 and 2: a Llama-3-8B-like block (32 layers × 8 KV heads × 128, bf16, 16 tokens): 2 MiB; its residual
# (xA for K and V, r wide): 16 tokens × 32 layers × 2 × 16 × 2 B = 32 KiB; r/n = 16 / (8 × 128) = 1/64.
GEOM = Geometry(layers=32, tokens=16, kv_heads=8, head_dim=128, dtype="bfloat16")
RES = Geometry(layers=32, tokens=16, kv_heads=1, head_dim=RANK, dtype="bfloat16")
# Part 3: the same shape on 8 layers (512 KiB and 8 KiB, r/n unchanged), so that the trace runs in a minute; with
# 16 MiB segments a segment holds 32 base blocks, as a default 64 MiB segment holds 32 blocks of 2 MiB.
PGEOM = Geometry(layers=8, tokens=16, kv_heads=8, head_dim=128, dtype="bfloat16")
PRES = Geometry(layers=8, tokens=16, kv_heads=1, head_dim=RANK, dtype="bfloat16")
MODEL = "llama-8b"
GROUP = "llama-8b-lora"
NS_AGENTS = (1, 2, 4, 8, 16, 32)
KEYS = 32                       # keys per lookup / acquire in part 2
# part 3's trace
CONTEXTS = 24                   # live contexts
AGENTS_PER_CONTEXT = 4
ADAPTERS = 8
VISITS = 24                     # requests a context gets before it ends
BRANCH_MAX = 8                  # an agent's own blocks after the context
ZIPF = 1.0
SAMPLE_EVERY = 25               # requests between two samples of what the pool holds (part 3, after the warm-up)


def h(*parts: object) -> bytes:
    return hashlib.blake2b(repr(parts).encode(), digest_size=16).digest()


def base_spec(g: Geometry) -> NamespaceSpec:
    return NamespaceSpec(model=MODEL, geometry=g, group=GROUP, role="base")


def res_spec(g: Geometry, adapter: str) -> NamespaceSpec:
    return NamespaceSpec(model=MODEL, geometry=g, group=GROUP, adapter=adapter, role="residual")


def unified_spec(g: Geometry, adapter: str) -> NamespaceSpec:
    """An agent's whole blocks (xW + xA·B, n wide): the model's geometry, its own adapter's namespace."""
    return NamespaceSpec(model=MODEL, geometry=g, adapter=adapter)


def resident(c: Any) -> int:
    return int(c.stats()["tiers"][0]["resident_bytes"])


# ----- part 1: bytes held for N agents -----
def memory(context: int) -> dict[str, Any]:
    ctx = [h("ctx", i) for i in range(context)]
    base_blocks = [np.full(GEOM.full_bytes, i & 0xFF, np.uint8) for i in range(context)]
    res_blocks = [np.full(RES.full_bytes, i & 0xFF, np.uint8) for i in range(context)]
    top = max(NS_AGENTS)
    cap = f"{(top + 2) * context * GEOM.full_bytes // MiB + 512}MiB"
    rows: list[dict[str, Any]] = []
    with Daemon(cap) as du, Daemon(cap) as ds, du.client() as cu, ds.client() as cs:
        first = None
        for k in range(top):
            adapter = f"agent{k}"
            cu.namespace(unified_spec(GEOM, adapter)).put(ctx, base_blocks)
            pair = cs.pair(base_spec(GEOM), res_spec(RES, adapter))
            if first is None:
                pair.base.put(ctx, base_blocks)
                pair.lookup(ctx)                         # books the pair (a lookup or acquire of it does)
                first = pair
            else:
                view = pair.fork(ctx, parent=first.residual)
                assert view.base == context, view        # inherited by reference: nothing to put for the base
            pair.residual.put(ctx, res_blocks)
            n = k + 1
            if n not in NS_AGENTS:
                continue
            lu, ls = cu.list(), cs.list()
            unified = sum(r["bytes"] for r in lu["namespaces"])
            prow = next(p for p in ls["pairs"] if p["base"] == first.base.id)
            split = prow["base_bytes"] + prow["residual_bytes"]
            rn = RES.full_bytes / GEOM.full_bytes
            rows.append({"agents": n, "unified_bytes": unified, "base_bytes": prow["base_bytes"],
                         "residual_bytes": prow["residual_bytes"], "split_bytes": split,
                         "daemon_unified_estimate": prow["unified_bytes"], "ratio": split / unified,
                         "forkkv_M": 1 / n + rn, "resident_unified": resident(cu), "resident_split": resident(cs),
                         "forks": len(ls["forks"])})
            progress(f"memory: {n} agents: split ÷ unified {split / unified:.4f} (1/N + r/n = {1 / n + rn:.4f})")
    return {"context_blocks": context, "rows": rows}


# ----- part 2: costs -----
def timed(fn: Any) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def costs(reps: int, put_reps: int) -> dict[str, Any]:
    keys = [h("cost", i) for i in range(KEYS)]
    b = [np.full(GEOM.full_bytes, 3, np.uint8) for _ in range(KEYS)]
    r = [np.full(RES.full_bytes, 5, np.uint8) for _ in range(KEYS)]
    raw: dict[str, list[float]] = {}

    def add(name: str, dt: float) -> None:
        raw.setdefault(name, []).append(dt)

    with Daemon("2GiB") as d, d.client() as c:
        single = c.namespace(unified_spec(GEOM, "solo"))
        pair = c.pair(base_spec(GEOM), res_spec(RES, "agent0"))
        single.put(keys, b)
        pair.base.put(keys, b)
        pair.residual.put(keys, r)
        assert single.lookup(keys) == KEYS and pair.lookup(keys).full == KEYS

        def acq_single() -> None:
            single.acquire(keys).release()
            c.flush()

        def acq_pair() -> None:
            lb, lr = pair.acquire(keys)
            lr.release()
            lb.release()
            c.flush()

        def acq_two() -> None:
            lb = pair.base.acquire(keys)
            lr = pair.residual.acquire(keys)
            lr.release()
            lb.release()
            c.flush()

        ops = {"lookup single": lambda: single.lookup(keys), "lookup pair": lambda: pair.lookup(keys),
               "lookup two": lambda: (pair.base.lookup(keys), pair.residual.lookup(keys)),
               "acquire single": acq_single, "acquire pair": acq_pair, "acquire two": acq_two}
        progress(f"costs: lookups and acquires of {KEYS} keys, {reps} repetitions each (+ {reps // 10} warm-up), "
                 "variants in turns")
        for i in range(reps + reps // 10):
            for name, fn in ops.items():
                dt = timed(fn)
                if i >= reps // 10:
                    add(name, dt)
        progress(f"costs: puts of 1 and {KEYS} blocks (fresh keys, deleted untimed), {put_reps} repetitions")
        for i in range(put_reps + 3):
            for nb in (1, KEYS):
                ks = [h("put", i, nb, j) for j in range(nb)]
                tu = timed(lambda ks=ks, nb=nb: single.put(ks, b[:nb]))
                tb = timed(lambda ks=ks, nb=nb: pair.base.put(ks, b[:nb]))
                tr = timed(lambda ks=ks, nb=nb: pair.residual.put(ks, r[:nb]))
                single.delete(ks)
                pair.base.delete(ks)
                pair.residual.delete(ks)
                if i >= 3:
                    add(f"put{nb} single", tu)
                    add(f"put{nb} base", tb)
                    add(f"put{nb} residual", tr)
                    add(f"put{nb} pair", tb + tr)
    return {k: summary(v, 1e6) for k, v in raw.items()}


# ----- part 3: hit rate under pressure -----
@dataclass(slots=True)
class Request:
    context: int
    adapter: str
    chain: list[bytes]


def make_trace(n: int, context: int, seed: int) -> list[Request]:
    rng = random.Random(seed)
    cid = 0

    def fresh() -> dict[str, Any]:
        nonlocal cid
        cid += 1
        return {"id": cid, "agents": rng.sample(range(ADAPTERS), AGENTS_PER_CONTEXT), "visits": 0, "branch": {}}

    live = [fresh() for _ in range(CONTEXTS)]
    weights = [1 / (k + 1) ** ZIPF for k in range(CONTEXTS)]
    out = []
    for _ in range(n):
        rank = rng.choices(range(CONTEXTS), weights)[0]
        c = live[rank]
        a = rng.choice(c["agents"])
        c["branch"][a] = nb = min(BRANCH_MAX, c["branch"].get(a, 0) + 1)
        chain = [h("ctx", c["id"], i) for i in range(context)] + [h("own", c["id"], a, j) for j in range(nb)]
        out.append(Request(c["id"], f"agent{a}", chain))
        c["visits"] += 1
        if c["visits"] >= VISITS:
            live[rank] = fresh()
    return out


class Tally:
    """Blocks per outcome and recompute cost (in units of r: a base block costs n/r, a residual 1)."""

    def __init__(self, nr: int) -> None:
        self.nr = nr
        self.blocks = self.full = self.partial = self.base_only = self.miss = 0
        self.base_recomputed = self.res_recomputed = 0
        self.requests = 0

    def split(self, length: int, b: int, m: int) -> None:
        self.requests += 1
        self.blocks += length
        self.full += min(b, m)
        self.partial += max(0, m - b)
        self.base_only += max(0, b - m)
        self.miss += length - max(b, m)
        self.base_recomputed += length - b
        self.res_recomputed += length - m

    def unified(self, length: int, u: int) -> None:
        self.split(length, u, u)

    def figures(self) -> dict[str, Any]:
        cost = self.base_recomputed * self.nr + self.res_recomputed
        b = self.blocks or 1
        return {"requests": self.requests, "blocks": self.blocks, "full": self.full, "partial": self.partial,
                "base_kept_residual_recomputed": self.base_only, "miss": self.miss,
                "base_recomputed": self.base_recomputed, "residual_recomputed": self.res_recomputed,
                "full_rate": self.full / b, "partial_rate": self.partial / b, "base_only_rate": self.base_only / b,
                "miss_rate": self.miss / b, "base_hit_rate": 1 - self.base_recomputed / b,
                "residual_hit_rate": 1 - self.res_recomputed / b,
                "recompute_cost": cost / (b * (self.nr + 1))}


def offline(trace: list[Request], capacity: int, mode: str, warm: int, nr: int) -> dict[str, Any]:
    """The trace through an exact LRU over bytes (one order for every block, whatever its size; acquire and put
    make blocks recent), `capacity` in units of r; `coupled`: a base block evicted takes its residuals along."""
    lru: OrderedDict[tuple[Any, ...], int] = OrderedDict()
    residuals: dict[bytes, set[tuple[Any, ...]]] = {}
    used = 0
    t = Tally(nr)
    for i, rq in enumerate(trace):
        if mode == "unified":
            ks: list[tuple[Any, ...]] = [("u", rq.adapter, k) for k in rq.chain]
            u = next((j for j, k in enumerate(ks) if k not in lru), len(ks))
            if i >= warm:
                t.unified(len(ks), u)
            for k in ks:
                used += 0 if k in lru else nr + 1
                lru[k] = nr + 1
                lru.move_to_end(k)
        else:
            bk: list[tuple[Any, ...]] = [("b", k) for k in rq.chain]
            rk: list[tuple[Any, ...]] = [("r", rq.adapter, k) for k in rq.chain]
            b = next((j for j, k in enumerate(bk) if k not in lru), len(bk))
            m = next((j for j, k in enumerate(rk) if k not in lru), len(rk))
            if i >= warm:
                t.split(len(bk), b, m)
            for k in bk[:b] + rk[:m] + bk[b:] + rk[m:]:
                used += 0 if k in lru else lru.setdefault(k, nr if k[0] == "b" else 1)
                lru.move_to_end(k)
                if k[0] == "r":
                    residuals.setdefault(k[2], set()).add(k)
        while used > capacity:
            k, size = lru.popitem(last=False)
            used -= size
            if mode == "coupled" and k[0] == "b":
                for rk_ in residuals.pop(k[1], set()):
                    used -= lru.pop(rk_, 0)
    return t.figures()


def pressure(trace: list[Request], layout: str, pool: int, segment: int, warm: int, nr: int) -> dict[str, Any]:
    env = {"KVSTORE_POOL_PAIR_EVICTION": "coupled" if layout == "coupled" else "decoupled"}
    t = Tally(nr)
    maxlen = max(len(r.chain) for r in trace)
    bblk = [np.full(PGEOM.full_bytes, 1, np.uint8)] * maxlen
    rblk = [np.full(PRES.full_bytes, 2, np.uint8)] * maxlen
    t0 = time.perf_counter()
    with Daemon(f"{pool // MiB}MiB", f"{segment // MiB}MiB", env=env) as d, d.client() as c:
        pairs: dict[str, Any] = {}
        spaces: dict[str, Any] = {}
        before = None
        samples: list[list[int]] = []                   # [base or unified bytes, residual bytes] held
        for i, rq in enumerate(trace):
            if i == warm:
                before = c.stats()["counters"]
            chain = rq.chain
            if layout == "unified":
                ns = spaces.get(rq.adapter) or spaces.setdefault(rq.adapter,
                                                                  c.namespace(unified_spec(PGEOM, rq.adapter)))
                u = ns.lookup(chain)
                if u:
                    lease = ns.acquire(chain[:u])
                    u = len(lease)
                    lease.release()
                if u < len(chain):
                    ns.put(chain[u:], bblk[:len(chain) - u])
                if i >= warm:
                    t.unified(len(chain), u)
            else:
                p = pairs.get(rq.adapter) or pairs.setdefault(rq.adapter,
                                                               c.pair(base_spec(PGEOM), res_spec(PRES, rq.adapter)))
                hit = p.lookup(chain)
                b, m = hit.base, hit.residual
                if max(b, m):
                    lb, lr = p.acquire(chain[:max(b, m)])
                    b, m = len(lb), len(lr)
                    lr.release()
                    lb.release()
                if b < len(chain):
                    p.base.put(chain[b:], bblk[:len(chain) - b])
                if m < len(chain):
                    p.residual.put(chain[m:], rblk[:len(chain) - m])
                if i >= warm:
                    t.split(len(chain), b, m)
            if i >= warm and (i - warm) % SAMPLE_EVERY == 0:
                rows = c.list()["namespaces"]
                samples.append([sum(r["bytes"] for r in rows if layout == "unified" or r["role"] == "base"),
                                sum(r["bytes"] for r in rows if layout != "unified" and r["role"] == "residual")])
            if (i + 1) % 500 == 0:
                progress(f"pressure {layout}: {i + 1}/{len(trace)} requests")
        st = c.stats()
        listed = c.list()
    seconds = time.perf_counter() - t0
    counters = {k: st["counters"][k] - (before or {}).get(k, 0)
                for k in ("evictions", "evictions_coupled", "segment_moves", "segment_moves_inline")}
    host = st["tiers"][0]
    held: dict[str, int] = {"base": 0, "residual": 0, "unified": 0}
    for row in listed["namespaces"]:
        kind = "unified" if layout == "unified" else row["role"]
        held[kind] += row["bytes"]
    classes = [{k: cl[k] for k in ("slot_bytes", "segments", "slots", "free")} for cl in host["classes"]]
    held_over_time = {k: summary([float(x[j]) for x in samples], 1 / MiB) for j, k in enumerate(("base", "residual"))}
    return {**t.figures(), "daemon_counters": counters, "held_bytes_at_end": held, "classes_at_end": classes,
            "held_mib_sampled": held_over_time, "sample_every": SAMPLE_EVERY,
            "resident_bytes_at_end": host["resident_bytes"], "seconds": seconds}


# ----- output -----
def f_us(s: dict[str, float], q: str) -> str:
    return f"{s[q]:.0f}" if s[q] >= 100 else f"{s[q]:.1f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="context 8 blocks, 100 repetitions, 900 requests")
    ap.add_argument("--context", type=int, help="context blocks, parts 1 and 3 (default 32, quick 8; part 3: 16)")
    ap.add_argument("--requests", type=int, help="part 3's trace length, a third of it warm-up (default 3000, "
                                                   "quick 900)")
    ap.add_argument("--pool-mib", type=int, default=256, help="part 3's host pool (default 256)")
    ap.add_argument("--segment-mib", help="part 3's pool.segment_bytes, MiB, one daemon run per size (default "
                                          "16,4,64; quick 16)")
    ap.add_argument("--reps", type=int, help="part 2's repetitions of each lookup and acquire (default 400, quick "
                                             "100); puts a tenth")
    ap.add_argument("--seed", type=int, default=18)
    ap.add_argument("--parts", default="1,2,3", help="which parts to run (default 1,2,3)")
    args = ap.parse_args()
    parts = {int(x) for x in args.parts.split(",") if x}
    started = time.perf_counter()
    load_before = warn_if_busy()
    context = args.context or (8 if args.quick else 32)
    pctx = args.context or (8 if args.quick else 16)
    nreq = args.requests or (900 if args.quick else 3000)
    reps = args.reps or (100 if args.quick else 400)
    nr = GEOM.full_bytes // RES.full_bytes                # n / r: 64
    res: dict[str, Any] = {
        "quick": args.quick, "rank": RANK, "n_over_r": nr, "r_over_n": 1 / nr,
        "geometry": GEOM.to_dict(), "residual_geometry": RES.to_dict(), "block_bytes": GEOM.full_bytes,
        "residual_bytes": RES.full_bytes, "pressure_geometry": PGEOM.to_dict(),
        "pressure_residual_geometry": PRES.to_dict(), "seed": args.seed}
    print(f"\nbase block: {GEOM.tokens} tokens × {GEOM.layers} layers × 2 (K, V) × {GEOM.kv_heads} heads × "
          f"{GEOM.head_dim} × bf16 = {GEOM.full_bytes // 1024} KiB (n = {GEOM.kv_heads * GEOM.head_dim}); residual "
          f"xA: {RES.tokens} × {RES.layers} × 2 × r = {RANK} × bf16 = {RES.full_bytes // 1024} KiB; r/n = 1/{nr}")

    if 1 in parts:
        progress(f"part 1: memory of 1…{max(NS_AGENTS)} agents over one context of {context} blocks, "
                 "unified and split, one daemon each")
        mem = res["memory"] = memory(context)
        t = Table(["agents N", "unified MiB", "base MiB", "residual MiB", "base+res MiB", "split ÷ unified",
                   "1/N + r/n", "measured ÷ formula", "daemon's unified est. MiB", "resident unified MiB",
                   "resident split MiB"])
        for r in mem["rows"]:
            t.add([r["agents"], f"{r['unified_bytes'] / MiB:.0f}", f"{r['base_bytes'] / MiB:.0f}",
                   f"{r['residual_bytes'] / MiB:.2f}", f"{r['split_bytes'] / MiB:.2f}", f"{r['ratio']:.4f}",
                   f"{r['forkkv_M']:.4f}", f"{r['ratio'] / r['forkkv_M']:.3f}",
                   f"{r['daemon_unified_estimate'] / MiB:.0f}", f"{r['resident_unified'] / MiB:.0f}",
                   f"{r['resident_split'] / MiB:.2f}"])
        print(f"\n1. bytes held for N agents over one context of {context} blocks ({context * GEOM.tokens} tokens): "
              "each agent's whole blocks in its own namespace (unified) vs one base + N residual namespaces "
              "(list(); resident: the host pool's, stats())")
        print(t)

    if 2 in parts:
        progress("part 2: costs")
        cs = res["costs_us"] = costs(reps, max(10, reps // 10))
        t = Table(["operation", "variant", "p50 µs", "p99 µs", "p50 ÷ single", "p99 ÷ single", "MiB moved",
                   "p50 µs/MiB"])
        for op, variants, mib in (
                ("lookup 32 keys", ("single", "pair", "two"), None),
                ("acquire + release 32", ("single", "pair", "two"), None),
                ("put 1 block", ("single", "pair", "base", "residual"),
                 {"single": GEOM.full_bytes, "pair": GEOM.full_bytes + RES.full_bytes, "base": GEOM.full_bytes,
                  "residual": RES.full_bytes}),
                (f"put {KEYS} blocks", ("single", "pair", "base", "residual"),
                 {"single": KEYS * GEOM.full_bytes, "pair": KEYS * (GEOM.full_bytes + RES.full_bytes),
                  "base": KEYS * GEOM.full_bytes, "residual": KEYS * RES.full_bytes})):
            key = {"lookup 32 keys": "lookup", "acquire + release 32": "acquire", "put 1 block": "put1",
                   f"put {KEYS} blocks": f"put{KEYS}"}[op]
            s0 = cs[f"{key} single"]
            for v in variants:
                s = cs[f"{key} {v}"]
                label = {"single": "one namespace (baseline)", "pair": "pair: one request" if mib is None else
                         "pair: base + residual puts", "two": "base, then residual (two requests)",
                         "base": "base part alone", "residual": "residual part alone"}[v]
                nbytes = mib[v] if mib else None
                t.add([op, label, f_us(s, "median"), f_us(s, "p99"), f"{s['median'] / s0['median']:.2f}",
                       f"{s['p99'] / s0['p99']:.2f}", "-" if nbytes is None else f"{nbytes / MiB:.3f}",
                       "-" if nbytes is None else f"{s['median'] / (nbytes / MiB):.0f}"])
        print(f"\n2. costs (full geometry; {reps} repetitions of lookups and acquires, {max(10, reps // 10)} of "
              "puts; variants in turns; single = one namespace of whole blocks)")
        print(t)

    if 3 in parts:
        trace = make_trace(nreq, pctx, args.seed)
        warm = nreq // 3
        pnr = PGEOM.full_bytes // PRES.full_bytes
        pool = args.pool_mib * MiB
        segs = [int(x) for x in (args.segment_mib or ("16" if args.quick else "16,4,64")).split(",")]
        contexts = len({r.context for r in trace})
        ws_base = len({k for r in trace for k in r.chain}) * PGEOM.full_bytes
        ws_res = len({(r.adapter, k) for r in trace for k in r.chain}) * PRES.full_bytes
        ws_uni = len({(r.adapter, k) for r in trace for k in r.chain}) * PGEOM.full_bytes
        res["pressure"] = {"requests": nreq, "warmup": warm, "context_blocks": pctx, "contexts_live": CONTEXTS,
                           "contexts_total": contexts, "agents_per_context": AGENTS_PER_CONTEXT,
                           "adapters": ADAPTERS, "visits": VISITS, "branch_max": BRANCH_MAX, "zipf": ZIPF,
                           "pool_bytes": pool, "segment_bytes": [m * MiB for m in segs],
                           "block_bytes": PGEOM.full_bytes, "residual_bytes": PRES.full_bytes,
                           "trace_bytes": {"base": ws_base, "residual": ws_res, "unified": ws_uni}, "runs": {}}
        progress(f"part 3: {nreq} requests ({warm} warm-up) over {contexts} contexts; everything the trace "
                 f"touches: base {ws_base / MiB:.0f} MiB + residual {ws_res / MiB:.0f} MiB, unified "
                 f"{ws_uni / MiB:.0f} MiB; pool {args.pool_mib} MiB, segments of {', '.join(map(str, segs))} MiB")
        runs = res["pressure"]["runs"]
        capacity = pool // PRES.full_bytes             # in units of r
        runs["unbounded"] = offline(trace, 1 << 62, "decoupled", warm, pnr)
        for mode in ("decoupled", "coupled", "unified"):
            runs[f"exact LRU {mode}"] = offline(trace, capacity, mode, warm, pnr)
        daemon_runs = []
        for seg in segs:
            for layout in ("decoupled", "coupled", "unified"):
                name = f"{layout}, {seg} MiB segments"
                daemon_runs.append(name)
                runs[name] = pressure(trace, layout, pool, seg * MiB, warm, pnr)
                runs[name]["segment_bytes"] = seg * MiB
                progress(f"pressure {name}: {runs[name]['seconds']:.0f} s, recompute cost "
                         f"{runs[name]['recompute_cost']:.3f}")
        t = Table(["layout", "full hit", "partial: base recomputed", "residual recomputed", "miss",
                   "base hit", "residual hit", "recompute cost", "÷ decoupled", "÷ unbounded", "evictions",
                   "coupled evictions", "segment moves"])
        floor = runs["unbounded"]["recompute_cost"]
        for name in daemon_runs + ["exact LRU decoupled", "exact LRU coupled", "exact LRU unified", "unbounded"]:
            f = runs[name]
            dc = f.get("daemon_counters", {})
            seg = f.get("segment_bytes")
            ref = runs[f"decoupled, {seg // MiB} MiB segments" if seg else "exact LRU decoupled"]["recompute_cost"]
            t.add([f"daemon: {name}" if seg else name,
                   f"{f['full_rate']:.1%}", f"{f['partial_rate']:.1%}", f"{f['base_only_rate']:.1%}",
                   f"{f['miss_rate']:.1%}", f"{f['base_hit_rate']:.1%}", f"{f['residual_hit_rate']:.1%}",
                   f"{f['recompute_cost']:.3f}", f"{f['recompute_cost'] / ref:.3f}",
                   f"{f['recompute_cost'] / floor:.2f}", dc.get("evictions", ""), dc.get("evictions_coupled", ""),
                   dc.get("segment_moves", "") if dc else ""])
        print(f"\n3. hit rate under pressure: {nreq} requests ({warm} warm-up, left out), {CONTEXTS} live contexts "
              f"of {pctx} blocks, {AGENTS_PER_CONTEXT} of {ADAPTERS} adapters each, Zipf {ZIPF}, branch ≤ "
              f"{BRANCH_MAX}; blocks {PGEOM.full_bytes // 1024} KiB + {PRES.full_bytes // 1024} KiB; pool "
              f"{args.pool_mib} MiB (everything the trace touches: split {(ws_base + ws_res) / MiB:.0f} MiB, unified "
              f"{ws_uni / MiB:.0f} MiB). Shares of blocks looked up; recompute cost = (base recomputed × n + "
              "residual recomputed × r) ÷ (blocks × (n + r)); ÷ decoupled: against the daemon's decoupled run with "
              "the same segments (exact LRU: against exact LRU decoupled)")
        print(t)
        t = Table(["daemon run", "base (or whole) MiB held: min", "median", "max", "residual MiB held: min",
                   "median", "max", "classes at the end (slot KiB: segments)"])
        for name in daemon_runs:
            f = runs[name]
            hb, hr = f["held_mib_sampled"]["base"], f["held_mib_sampled"]["residual"]
            t.add([name, f"{hb['min']:.0f}", f"{hb['median']:.0f}", f"{hb['max']:.0f}", f"{hr['min']:.2f}",
                   f"{hr['median']:.2f}", f"{hr['max']:.2f}",
                   ", ".join(f"{cl['slot_bytes'] // 1024}: {cl['segments']}" for cl in f["classes_at_end"])])
        print(f"\nwhat the pool held, sampled every {SAMPLE_EVERY} requests after the warm-up (list())")
        print(t)

    res["load_average"] = {"before": load_before, "after": busy_cpus()}
    res["seconds"] = time.perf_counter() - started
    print(f"\nwrote {write_json('forkkv', res)}  ({res['seconds']:.0f} s)")


if __name__ == "__main__":
    main()
