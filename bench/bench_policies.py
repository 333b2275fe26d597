"""Eviction policies without hints on the public Mooncake trace (issue 34), through the real daemon and client, beside
offline LRU and the offline per-block Belady oracle at the same pool sizes: hit rate, the share of the LRU→Belady gap
each policy closes, and what each costs per request.

The trace: ../shared/traces/mooncake-synthetic.jsonl.gz (3,993 requests of Mooncake's FAST'25 release, each a chain
of 512-token prefix blocks by `hash_ids`; no sessions, no hints). Each request does what kvstore's vLLM connector
does: read the longest held prefix of its chain (`get`: a lookup and an acquire of the hit blocks), then save the
whole chain in one reserve (held blocks refreshed tail first, the rest stored). Every policy replays the same
requests on a fresh daemon with a host pool of the same size: a share of the trace's 43,924 distinct blocks, rounded
to the pool's 1 MiB segments (16 blocks of 64 KiB; the offline replays use the same count). Offline LRU replays the
same model in Python (it must equal the daemon's LRU: a check of the replay); offline Belady evicts the block used
farthest in the future and bypasses blocks never used again. Two more offline columns say how far knowing a block's
future *without its timing* gets (what a reuse-aware order estimates from the past): the reuse oracle is told
whether each block is used again and keeps those by LRU; the count oracle is told how many more times, keeps the
most-used by that count (LRU among equals); both bypass blocks never used again. `--trace` takes any Mooncake trace,
e.g. the FAST'25 release's conversation_trace.jsonl, plain or gzip'd.

    .venv/bin/python bench/bench_policies.py [--quick] [--fractions 0.005,0.01,0.02,0.05,0.1] [--policies lru,history]

`--families` replays the agent-trace families instead (bench/agent_families.py; bench/family_replay.py): each
through `lru`, `history` and `workflow` with the framework's hints, under three save modes (whole chains as the vLLM
connector; missed blocks only, as `Namespace.put` without `after` and the SGLang backend; missed blocks naming the
prefix hit, `after`), at 10/25/50% of the family's peak live working set, beside offline LRU (per save mode) and
offline Belady.

    .venv/bin/python bench/bench_policies.py --families [--quick] [--only toolloop,debate]
"""
from __future__ import annotations

import argparse
import gzip
import heapq
import json
import math
import os
import sys
import time
from collections import OrderedDict
from typing import Any

import numpy as np

BENCH = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(BENCH))
sys.path.insert(0, BENCH)
from common import Daemon, Table, busy_cpus, progress, warn_if_busy, write_json  # noqa: E402

from kvstore import Geometry, NamespaceSpec  # noqa: E402

TRACE = os.path.join(os.path.dirname(os.path.dirname(BENCH)), "shared", "traces", "mooncake-synthetic.jsonl.gz")
GEOM = Geometry(layers=1, tokens=16, kv_heads=16, head_dim=64, dtype="float16")    # 64 KiB a block
SEGMENT = 1 << 20                                                                    # 16 blocks: the pool's grain


def load(path: str, limit: int | None) -> list[list[int]]:
    """A Mooncake trace's chains: JSON lines with `hash_ids`, gzip'd (.gz) or not (the FAST'25 release's own
    files, e.g. its conversation_trace.jsonl)."""
    with (gzip.open(path, "rt") if path.endswith(".gz") else open(path)) as f:
        reqs = [json.loads(line)["hash_ids"] for line in f]
    return reqs[:limit] if limit else reqs


def key(b: int) -> bytes:
    return b.to_bytes(16, "little")


def offline_lru(reqs: list[list[int]], cap: int, again: list[list[bool]] | None = None) -> float:
    """Offline LRU; with `again` (per request, per block: used again later), a block not used again is not kept."""
    held: OrderedDict[int, None] = OrderedDict()
    hit = total = 0
    for i, chain in enumerate(reqs):
        n = next((j for j, b in enumerate(chain) if b not in held), len(chain))
        hit, total = hit + n, total + len(chain)
        reused = again[i] if again is not None else [True] * len(chain)
        for b, r in zip(reversed(chain), reversed(reused)):    # tail first: the head ends the most recent
            if not r:
                held.pop(b, None)
                continue
            held[b] = None
            held.move_to_end(b)
            while len(held) > cap:
                held.popitem(last=False)
    return hit / total


def offline_belady(reqs: list[list[int]], cap: int) -> float:
    """Per block: keep those used soonest, never keep one not used again (bypass)."""
    nxt: dict[int, int] = {}
    uses: list[list[float]] = [[]] * len(reqs)
    for i in range(len(reqs) - 1, -1, -1):
        uses[i] = [nxt.get(b, math.inf) for b in reqs[i]]
        for b in reqs[i]:
            nxt[b] = i
    held: dict[int, float] = {}
    heap: list[tuple[float, int]] = []
    hit = total = 0
    for chain, nexts in zip(reqs, uses):
        n = next((i for i, b in enumerate(chain) if b not in held), len(chain))
        hit, total = hit + n, total + len(chain)
        for b, nu in zip(chain, nexts):
            if nu == math.inf:
                held.pop(b, None)
                continue
            held[b] = nu
            heapq.heappush(heap, (-nu, b))
            while len(held) > cap:
                neg, v = heapq.heappop(heap)
                if held.get(v) == -neg:
                    del held[v]
    return hit / total


def offline_reuse_oracle(reqs: list[list[int]], cap: int) -> float:
    """LRU over the blocks that will be used again, told by an oracle (not when: only whether); a block never used
    again is not kept. The ceiling of a policy that orders by reuse alone."""
    again: list[list[bool]] = [[]] * len(reqs)
    later: set[int] = set()
    for i in range(len(reqs) - 1, -1, -1):
        again[i] = [b in later for b in reqs[i]]
        later.update(reqs[i])
    return offline_lru(reqs, cap, again)


def offline_count_oracle(reqs: list[list[int]], cap: int) -> float:
    """Keep the blocks with the most uses still to come (told by an oracle; not when), the least recent of equals
    first out, none never used again; a block that would be the first out is not stored (bypass)."""
    uses: dict[int, int] = {}
    left: list[list[int]] = [[]] * len(reqs)
    for i in range(len(reqs) - 1, -1, -1):
        left[i] = [uses.get(b, 0) for b in reqs[i]]
        for b in reqs[i]:
            uses[b] = uses.get(b, 0) + 1
    held: dict[int, tuple[int, int, int]] = {}
    heap: list[tuple[tuple[int, int, int], int]] = []
    hit = total = 0
    for i, (chain, counts) in enumerate(zip(reqs, left)):
        n = next((j for j, b in enumerate(chain) if b not in held), len(chain))
        hit, total = hit + n, total + len(chain)
        for depth in range(len(chain) - 1, -1, -1):            # tail first
            b, k = chain[depth], counts[depth]
            if k == 0:
                held.pop(b, None)
                continue
            rank = (k, i, -depth)
            if b not in held and len(held) >= cap:
                while heap and held.get(heap[0][1]) != heap[0][0]:
                    heapq.heappop(heap)
                if heap[0][0] > rank:
                    continue
                del held[heapq.heappop(heap)[1]]
            held[b] = rank
            heapq.heappush(heap, (rank, b))
    return hit / total


def daemon_replay(reqs: list[list[int]], cap: int, policy: str) -> dict[str, Any]:
    capacity = cap * GEOM.full_bytes
    d = Daemon(str(capacity), str(SEGMENT), {"KVSTORE_POOL_EVICTION": policy,
                                             "KVSTORE_SERVER_MAX_RESERVED_FRACTION": "1"}).start()
    hit = total = 0
    busy = 0.0
    buf = np.zeros(GEOM.full_bytes, np.uint8)
    try:
        with d.client() as c:
            ns = c.namespace(NamespaceSpec("mooncake-trace", GEOM))
            outs = [np.empty(GEOM.full_bytes, np.uint8) for _ in range(max(map(len, reqs)))]
            t0 = time.perf_counter()
            for chain in reqs:
                hs = [key(b) for b in chain]
                n = ns.get(hs, outs[:len(hs)])
                hit, total = hit + n, total + len(chain)
                with ns.reserve(hs) as r:
                    r.write_and_commit([buf] * len(hs))
            busy = time.perf_counter() - t0
            stats = c.stats()
    finally:
        d.stop()
    return {"hit_rate": hit / total, "seconds": busy, "us_per_block": 1e6 * busy / total,
            "evictions": stats["counters"]["evictions"], "capacity_blocks": capacity // GEOM.full_bytes}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="the first 1,000 requests, two pool sizes")
    ap.add_argument("--fractions", default=None, help="pool sizes as shares of the distinct blocks")
    ap.add_argument("--policies", default=None, help="lru,history (the trace); lru,history,workflow (--families)")
    ap.add_argument("--trace", default=TRACE)
    ap.add_argument("--families", action="store_true", help="replay the agent-trace families instead")
    ap.add_argument("--only", default=None, help="with --families: these families only")
    ap.add_argument("--seeds", default="1", help="with --families: the traces' seeds (several: a summary over them)")
    ap.add_argument("--saves", default=None, help="with --families: whole,missed,named (all three by default)")
    args = ap.parse_args()
    if args.families:
        from family_offline import SAVES
        from family_replay import run_families
        saves = tuple(args.saves.split(",")) if args.saves else SAVES
        if not set(saves) <= set(SAVES):
            ap.error(f"--saves: each of {', '.join(SAVES)}, got {args.saves}")
        if not all(x.strip().isdigit() for x in args.seeds.split(",")):
            ap.error(f"--seeds: whole numbers separated by commas, got {args.seeds}")
        run_families(args.quick, args.only.split(",") if args.only else None,
                     args.policies.split(",") if args.policies else None,
                     tuple(int(x) for x in args.seeds.split(",")), saves)
        return
    load_before = warn_if_busy()
    started = time.perf_counter()
    reqs = load(args.trace, 1000 if args.quick else None)
    distinct = len({b for c in reqs for b in c})
    fractions = [float(f) for f in (args.fractions or ("0.01,0.05" if args.quick else
                                                         "0.005,0.01,0.02,0.05,0.1")).split(",")]
    policies = (args.policies or "lru,history").split(",")
    res: dict[str, Any] = {"trace": os.path.basename(args.trace), "requests": len(reqs), "distinct_blocks": distinct,
                           "cells": []}
    t = Table(["pool", "offline LRU", "offline Belady", "reuse oracle (gap closed)", "count oracle (gap closed)",
               *[f"{p} (gap closed)" for p in policies],
               *[f"{p} µs/block" for p in policies]])
    for frac in fractions:
        per = SEGMENT // GEOM.full_bytes
        cap = max(1, round(distinct * frac / per)) * per
        progress(f"{frac:.1%} of {distinct} blocks = {cap}: offline LRU and Belady")
        cell: dict[str, Any] = {"fraction": frac, "blocks": cap, "offline_lru": offline_lru(reqs, cap),
                                "offline_belady": offline_belady(reqs, cap),
                                "offline_reuse_oracle": offline_reuse_oracle(reqs, cap),
                                "offline_count_oracle": offline_count_oracle(reqs, cap), "daemon": {}}
        lru, bel = cell["offline_lru"], cell["offline_belady"]
        for o in ("reuse", "count"):
            x = cell[f"offline_{o}_oracle"]
            cell[f"{o}_oracle_gap_closed"] = (x - lru) / (bel - lru) if bel > lru else 0.0
        for p in policies:
            progress(f"{frac:.1%}: {p} through the daemon")
            r = cell["daemon"][p] = daemon_replay(reqs, cap, p)
            r["gap_closed"] = (r["hit_rate"] - lru) / (bel - lru) if bel > lru else 0.0
        res["cells"].append(cell)
        d = cell["daemon"]
        t.add([f"{frac:.1%} ({d[policies[0]]['capacity_blocks']})", f"{lru:.2%}", f"{bel:.2%}",
               *[f"{cell[f'offline_{o}_oracle']:.2%} ({cell[f'{o}_oracle_gap_closed']:+.1%})"
                 for o in ("reuse", "count")],
               *[f"{d[p]['hit_rate']:.2%} ({d[p]['gap_closed']:+.1%})" for p in policies],
               *[f"{d[p]['us_per_block']:.1f}" for p in policies]])
    print(t)
    res["load_average"] = {"before": load_before, "after": busy_cpus()}
    res["seconds"] = time.perf_counter() - started
    print(f"\nwrote {write_json('policies', res)}  ({res['seconds']:.0f} s)")


if __name__ == "__main__":
    main()
