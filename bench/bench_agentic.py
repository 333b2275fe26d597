"""An agentic multi-turn trace replayed through kvstore and through LMCache's daemon, with less capacity than the
working set: hit rate and bytes moved.

The trace (seeded, scaled down from DualPath's agent traces: 157 turns, 32.7 K tokens of context and 429 appended
tokens per turn on average): S sessions that share a system prompt; each starts from its own first message and,
turn after turn, appends a short message (uniform 300–560 tokens, mean ≈ 430) to the whole context so far, then the
model's reply (100 tokens). Sessions take turns in a shuffled round-robin, as agents of one node do. At each turn the
engine side does what a connector does: look up the prompt's full 256-token chunks (2 MiB of KV each), load the hit
prefix, and store the chunks it had to compute. Both systems replay the same turns, one after the other, turn by
turn. The ideal hit rate (every chunk ever stored still there) is computed from the trace itself.

Four systems in the same run: kvstore under LRU, kvstore under its default `history` policy (no hints: issue 34,
at least LMCache's hit rate), kvstore under `pool.eviction: workflow` with each turn's session hint (issue 14: above
LMCache and ≥ 0.9× the ideal with DRAM only), and LMCache. kvstore saves as its vLLM connector
does: the whole chain in one reserve. "capacity bound" is the best hit rate any cache of the DRAM's size can have on
this trace (`capacity_bound`).

Variants: `dram` (kvstore host pool 256 MiB; LMCache L1 256 MiB with its default eviction: at 80% usage it evicts
20%) and `disk` (the same DRAM tiers plus kvstore's SSD tier / LMCache's fs tier, page cache: its default).

    .venv-bench/bin/python bench/bench_agentic.py [--quick] [--runs N] [--sessions S] [--turns T]
"""
from __future__ import annotations

import argparse
import os
import random
import shutil
import sys
import tempfile
import time
from typing import Any

import numpy as np

BENCH = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(BENCH))
sys.path.insert(0, BENCH)
import lmcache_side as lm  # noqa: E402
from common import Daemon, Table, busy_cpus, progress, summary, warn_if_busy, write_json  # noqa: E402

from kvstore.protocol.geometry import Geometry  # noqa: E402
from kvstore.protocol.keys import NamespaceSpec, chain_hashes  # noqa: E402

GEOM = Geometry(layers=4, tokens=256, kv_heads=4, head_dim=128, dtype="bfloat16")   # one LMCache chunk: 2 MiB
BLOCK = GEOM.full_bytes
CHUNK = lm.CHUNK_TOKENS
BASE = 16                                # LMCache client pages: page 0 is its null block


def trace(sessions: int, turns: int, seed: int = 7, system: int = 1024, first: int = 1536,
          append: tuple[int, int] = (300, 560), reply: int = 100) -> list[tuple[int, list[int]]]:
    """(session, prompt tokens) per turn, in the order the node sees them."""
    rng = random.Random(seed)
    shared = [rng.randrange(1, 30000) for _ in range(system)]
    ctx = [shared + [rng.randrange(1, 30000) for _ in range(first)] for _ in range(sessions)]
    out = []
    for _ in range(turns):
        order = list(range(sessions))
        rng.shuffle(order)
        for s in order:
            ctx[s] = ctx[s] + [rng.randrange(1, 30000) for _ in range(rng.randint(*append))]
            out.append((s, list(ctx[s])))
            ctx[s] = ctx[s] + [rng.randrange(1, 30000) for _ in range(reply)]
    return out


def capacity_bound(turns: list[tuple[int, list[int]]], sessions: int, cap_chunks: int) -> float:
    """The best hit rate any cache of `cap_chunks` chunks can have on a round-robin trace (every session once a
    round). A session's private chunk hit in round r was cached since its turn in round r-1, so every such chunk is
    in the cache at the boundary between the two rounds: per round, at most the shared prefix's hits plus
    cap - shared private hits."""
    firsts = [chain_hashes(t, CHUNK) for _, t in turns[:sessions]]
    shared = next((k for k in range(min(map(len, firsts))) if len({f[k] for f in firsts}) > 1), 0)
    seen: set[bytes] = set()
    looked = bound = 0
    for r in range(0, len(turns), sessions):
        common = private = 0
        for _, tokens in turns[r:r + sessions]:
            hs = chain_hashes(tokens, CHUNK)
            looked += len(hs)
            n = next((k for k, h in enumerate(hs) if h not in seen), len(hs))
            seen.update(hs)
            common += min(n, shared)
            private += n - min(n, shared)
        bound += common + min(private, cap_chunks - shared)
    return bound / looked


class KVAgent:
    """kvstore as the vLLM connector drives it: get the prompt's longest cached prefix, then save the whole chain
    in one reserve (the hit blocks refreshed, the computed ones stored). `hints`: the pool runs
    `pool.eviction: workflow` and each turn is a chat session's turn (a `session` hint and the session's context
    on the get and the save), as an engine passing `kv_transfer_params: {"session": ...}` sends it."""

    def __init__(self, env: dict[str, str] | None, max_chunks: int, hints: bool = False, policy: str = "lru") -> None:
        env = {**(env or {}), "KVSTORE_SERVER_MAX_RESERVED_FRACTION": "1",     # one engine: a save may take it all
               "KVSTORE_POOL_EVICTION": "workflow" if hints else policy, "KVSTORE_SSD_EVICTION": policy}
        self.hints = hints
        self.d = Daemon("256MiB", "64MiB", env).start()
        self.c = self.d.client()
        self.ns = self.c.namespace(NamespaceSpec("agentic", GEOM))
        self.bufs = [np.full(BLOCK, 7, np.uint8) for _ in range(max_chunks)]

    def turn(self, session: int, tokens: list[int]) -> tuple[int, int]:
        hs = chain_hashes(tokens, CHUNK)
        ctx = None
        if self.hints:
            s = self.c.session(f"s{session}")
            s.turn()
            ctx = s.context()
        hit = self.ns.get(hs, self.bufs[:len(hs)], context=ctx)
        with self.ns.reserve(hs, context=ctx) as r:
            r.write_and_commit(self.bufs[:len(hs)])
        return hit, len(r.reserved)

    def close(self) -> None:
        self.c.close()
        self.d.stop()


class LMAgent:
    def __init__(self, fs_dir: str | None, max_chunks: int) -> None:
        self.srv = lm.LMCacheServer(0.25, fs_dir).start()       # 256 MiB, as kvstore's pool
        self.c = lm.LMCacheClient(self.srv, BASE + max_chunks * lm.PAGES_PER_CHUNK)

    def turn(self, session: int, tokens: list[int]) -> tuple[int, int]:
        t = tuple(tokens)
        hit = self.c.lookup_retrieve(t, BASE)
        full = len(t) // CHUNK
        if hit < full and not self.c.store(t, BASE, first_chunk=hit, nchunks=full - hit):
            return hit, 0
        return hit, full - hit

    def close(self) -> None:
        self.c.close()
        self.srv.stop()


def replay(turns: list[tuple[int, list[int]]], variant: str, base: str, run: int) -> dict[str, Any]:
    max_chunks = max(len(t) for _, t in turns) // CHUNK + 1
    kv_env = {"KVSTORE_SSD_DIR": os.path.join(base, f"kv-{run}"), "KVSTORE_SSD_CAPACITY": "8GiB"} \
        if variant == "disk" else None
    fs = os.path.join(base, f"lm-{run}") if variant == "disk" else None
    hinted_env = {**kv_env, "KVSTORE_SSD_DIR": kv_env["KVSTORE_SSD_DIR"] + "-h"} if kv_env else None
    history_env = {**kv_env, "KVSTORE_SSD_DIR": kv_env["KVSTORE_SSD_DIR"] + "-r"} if kv_env else None
    systems: dict[str, KVAgent | LMAgent] = {"kvstore lru": KVAgent(kv_env, max_chunks),
                                             "kvstore (default)": KVAgent(history_env, max_chunks, policy="history"),
                                             "lmcache": LMAgent(fs, max_chunks),
                                             "kvstore+hints": KVAgent(hinted_env, max_chunks, hints=True)}
    seen: set[bytes] = set()
    out: dict[str, dict[str, Any]] = {s: {"hit": 0, "stored": 0, "seconds": 0.0, "turn_s": []} for s in systems}
    looked = ideal = 0
    try:
        for i, (session, tokens) in enumerate(turns):
            hs = chain_hashes(tokens, CHUNK)
            looked += len(hs)
            ideal += next((k for k, h in enumerate(hs) if h not in seen), len(hs))
            seen.update(hs)
            names = list(systems) if i % 2 else list(systems)[::-1]
            for name in names:
                t0 = time.perf_counter()
                hit, stored = systems[name].turn(session, tokens)
                dt = time.perf_counter() - t0
                o = out[name]
                o["hit"] += hit
                o["stored"] += stored
                o["seconds"] += dt
                o["turn_s"].append(dt)
    finally:
        for s in systems.values():
            s.close()
    res: dict[str, Any] = {"chunks_looked_up": looked, "ideal_hit_chunks": ideal,
                           "ideal_hit_rate": ideal / looked}
    for name, o in out.items():
        res[name] = {**o, "hit_rate": o["hit"] / looked, "of_ideal": o["hit"] / max(ideal, 1),
                     "bytes_loaded": o["hit"] * BLOCK, "bytes_stored": o["stored"] * BLOCK,
                     "bytes_recomputed": (looked - o["hit"]) * BLOCK}
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="1 run, 4 sessions × 16 turns")
    ap.add_argument("--runs", type=int, help="replays per variant (default 3, quick 1)")
    ap.add_argument("--sessions", type=int)
    ap.add_argument("--turns", type=int)
    ap.add_argument("--variants", default="dram,disk")
    args = ap.parse_args()
    runs = args.runs or (1 if args.quick else 3)
    sessions = args.sessions or 4
    nturns = args.turns or (16 if args.quick else 24)
    started = time.perf_counter()
    load_before = warn_if_busy()
    turns = trace(sessions, nturns)
    ctx = [len(t) for _, t in turns]
    working = len({h for _, t in turns for h in chain_hashes(t, CHUNK)})
    res: dict[str, Any] = {"sessions": sessions, "turns": nturns, "runs": runs, "chunk_tokens": CHUNK,
                           "block_bytes": BLOCK, "mean_prompt_tokens": sum(ctx) / len(ctx),
                           "max_prompt_tokens": max(ctx),
                           "working_set_bytes": working * BLOCK, "capacity_dram_bytes": 256 << 20,
                           "capacity_bound_hit_rate": capacity_bound(turns, sessions, (256 << 20) // BLOCK),
                           "versions": {"lmcache": lm.version()}, "variants": {}}
    progress(f"trace: {sessions} sessions × {nturns} turns, prompts {min(ctx)}–{max(ctx)} tokens "
             f"(mean {res['mean_prompt_tokens']:.0f}), working set {working * BLOCK >> 20} MiB vs 256 MiB of DRAM")
    base = tempfile.mkdtemp(prefix="kvs-agentic-", dir="/var/tmp" if os.path.isdir("/var/tmp") else None)
    t = Table(["variant", "system", "hit rate (runs)", "of ideal", "GB loaded", "GB stored", "GB recomputed",
               "replay s (median)"])
    try:
        for variant in args.variants.split(","):
            rs = []
            for run in range(runs):
                progress(f"{variant}: replay {run + 1}/{runs}")
                rs.append(replay(turns, variant, base, run))
            res["variants"][variant] = rs
            for name in ("kvstore lru", "kvstore (default)", "kvstore+hints", "lmcache"):
                hr = [r[name]["hit_rate"] for r in rs]
                s = summary(hr)
                t.add([variant, name, f"{s['median']:.1%} ({s['min']:.1%}–{s['max']:.1%})",
                       f"{summary([r[name]['of_ideal'] for r in rs])['median']:.1%}",
                       f"{rs[0][name]['bytes_loaded'] / 1e9:.2f}", f"{rs[0][name]['bytes_stored'] / 1e9:.2f}",
                       f"{rs[0][name]['bytes_recomputed'] / 1e9:.2f}",
                       f"{summary([r[name]['seconds'] for r in rs])['median']:.1f}"])
            t.add([variant, "ideal", f"{rs[0]['ideal_hit_rate']:.1%}", "100%", "", "", "", ""])
            if variant == "dram":
                t.add([variant, "capacity bound", f"{res['capacity_bound_hit_rate']:.1%}",
                       f"{res['capacity_bound_hit_rate'] / rs[0]['ideal_hit_rate']:.1%}", "", "", "", ""])
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print(t)
    res["load_average"] = {"before": load_before, "after": busy_cpus()}
    res["seconds"] = time.perf_counter() - started
    print(f"\nwrote {write_json('agentic', res)}  ({res['seconds']:.0f} s)")


if __name__ == "__main__":
    main()
