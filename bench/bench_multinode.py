"""A multi-node agent trace (sessions that move between nodes) with and without the remote tier: hit rate and
recomputed tokens.

The trace is bench_agentic's (seeded agentic multi-turn sessions sharing a system prompt; each turn appends a short
message to the whole context so far; 2 MiB chunks of 256 tokens), replayed on N nodes (default 3), each a kvstore
daemon with its own 256 MiB DRAM pool and no SSD. A seeded router picks each turn's node as a load balancer without
strict affinity does: with probability `--stay` (default 0.5) the session's previous node, else another node at
random (a session's first turn: any node). At each turn the engine side does what the vLLM connector does on that
node: look up the prompt's chunk hashes (the scheduler's question), get the longest cached prefix (the load), then
reserve the whole chain and write the chunks it had to compute (the save).

Two configurations replay the same turns, turn by turn in the same loop (their order alternating per turn):

- local only: N daemons, nothing shared: a session finds its prefix only where it ran before (and not evicted);
- with remote tier: one `mooncake_master` (tests/mooncake_master.py) and N daemons with `remote.placement: both`:
  every committed chunk is put in Mooncake Store at once from its slot (write-through, store lane) and a chunk
  evicted from DRAM that the store lacks is put on its way out (write-back); a get on any node promotes what its
  DRAM lacks from the store. Each node lends the store a segment sized so that the store holds `--store-fraction`
  (default 1) of the trace's working set with 10% to spare below mooncake_master's eviction watermark (90% of its
  segments): printed, as the multiple of the working set the store holds below the watermark. A store smaller than
  the working set refuses the puts that find it at its watermark (Mooncake evicts 5% after such a refusal; kvstore
  offers a refused chunk once more on its eviction from DRAM): counted as put_refused.

"ideal" is every chunk ever stored anywhere still there (computed from the trace, as bench_agentic does); "ideal,
local only" is every chunk ever stored on the same node still there (unbounded DRAM, nothing shared): what moving
alone costs. Per configuration: hit rate (chunks loaded / chunks looked up), recomputed tokens (chunks missed × 256:
the tokens of full chunks; a prompt's partial last chunk is always computed), share of the ideal, and for the remote
configuration the hits that came from the store — the daemons' `hits_remote` (chunks of the lookups' prefixes that
only the store held: from the tier's books or asked of the master) and `acquired_lower` (chunks the gets promoted
from the store) — and the remote tier's own counters (gets, puts).

Waiting for write-through: none (the default), as a real engine does not wait for its saves to reach the store; the
chunks of a turn are in flight while the other sessions' turns run (and while the other configuration replays the
same turn). The table says how many moved turns started while their previous node still had puts queued or on the
wire ("late": the moved turns that could have missed for it; a session's first turn may also race the puts of the
shared system prompt's chunks); `--settle` waits after each turn until its node's puts have landed, for comparison.

    .venv/bin/python bench/bench_multinode.py [--quick] [--nodes N] [--sessions S] [--turns T] [--stay P]
        [--store-fraction F] [--settle] [--seed K]
"""
from __future__ import annotations

import argparse
import math
import os
import random
import shutil
import sys
import time
from typing import Any

import numpy as np

BENCH = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(BENCH))
sys.path.insert(0, BENCH)
from bench_agentic import BLOCK, CHUNK, GEOM, trace  # noqa: E402
from common import Daemon, Table, busy_cpus, progress, summary, warn_if_busy, write_json  # noqa: E402

from kvstore.protocol.keys import NamespaceSpec, chain_hashes  # noqa: E402
from tests.mooncake_master import MooncakeMaster  # noqa: E402

POOL_BYTES = 256 << 20              # each node's DRAM pool
TRAILER = 16                        # bytes that travel after each block in the store (kvstore.tiers.remote.trailer)
WATERMARK = 0.9                     # mooncake_master's default eviction_high_watermark_ratio
HEADROOM = 0.9                      # of the watermark, for the store's allocator: segments hold fraction / 0.81
STAGING_BYTES = 64 << 20            # per node: evictions waiting for their put, and the write-through queue bound
NODE_COUNTERS = ("hits", "hits_lower", "hits_remote", "misses", "acquired_asked", "acquired_host", "acquired_lower",
                 "evictions", "demotions", "dropped", "published", "publish_skipped", "publish_gone", "reads_remote")
TIER_COUNTERS = ("gets", "puts", "put_refused", "written_through", "demoted", "dropped", "absent", "bad_value",
                 "crc_mismatch", "staged_reads", "probes", "probe_failed", "timeouts", "write_skipped")


def route(turns: list[tuple[int, list[int]]], nodes: int, stay: float, seed: int) -> list[int]:
    """Each turn's node: a session's first turn goes to any node; later ones stay on its previous node with
    probability `stay`, else go to another node at random."""
    rng = random.Random(seed * 7919 + 1)
    where: dict[int, int] = {}
    out = []
    for session, _ in turns:
        prev = where.get(session)
        if prev is None:
            node = rng.randrange(nodes)
        elif nodes == 1 or rng.random() < stay:
            node = prev
        else:
            node = rng.choice([n for n in range(nodes) if n != prev])
        where[session] = node
        out.append(node)
    return out


def tier_row(stats: dict[str, Any]) -> dict[str, Any] | None:
    return next((t for t in stats["tiers"] if t.get("tier") == "remote"), None)


class Node:
    """One node's daemon and its engine: the vLLM connector's calls for one turn (lookup, get, save the chain)."""

    def __init__(self, env: dict[str, str], bufs: list[np.ndarray]) -> None:
        env = {**env, "KVSTORE_SERVER_MAX_RESERVED_FRACTION": "1", "KVSTORE_POOL_EVICTION": "lru"}
        self.d = Daemon(f"{POOL_BYTES}", "64MiB", env).start()
        self.c = self.d.client()
        self.ns = self.c.namespace(NamespaceSpec("multinode", GEOM))     # one model: the nodes share its chunks
        self.bufs = bufs

    def turn(self, hs: list[bytes]) -> tuple[int, int, int]:
        """(chunks the lookup found, chunks loaded, chunks stored)."""
        found = self.ns.lookup(hs)
        hit = self.ns.get(hs, self.bufs[:len(hs)])
        with self.ns.reserve(hs) as r:
            r.write_and_commit(self.bufs[:len(hs)])
        return found, hit, len(r.reserved)

    def publishing(self) -> int:
        """Chunks queued for the store or on the wire now."""
        p = self.c.stats().get("publish") or {}
        return int(p.get("queued", 0)) + int(p.get("writing", 0))

    def close(self) -> None:
        self.c.close()
        self.d.stop()


class Cluster:
    """A configuration: N nodes, with or without a remote tier on one mooncake_master."""

    def __init__(self, name: str, nodes: int, bufs: list[np.ndarray], segment: int | None) -> None:
        self.name = name
        self.remote = segment is not None
        self.master: MooncakeMaster | None = None
        self.nodes: list[Node] = []
        env: dict[str, str] = {}
        try:
            if self.remote:
                self.master = MooncakeMaster().start()
                env = self.master.env(KVSTORE_REMOTE_PLACEMENT="both", KVSTORE_REMOTE_SEGMENT_BYTES=str(segment),
                                      KVSTORE_REMOTE_STAGING_BYTES=str(STAGING_BYTES))
            for _ in range(nodes):
                self.nodes.append(Node(env, bufs))
            if self.master is not None:
                self._wait_linked()
        except BaseException:
            self.close()
            raise

    def _wait_linked(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        for i, n in enumerate(self.nodes):
            while not (tier_row(n.c.stats()) or {}).get("up"):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"node {i} did not link to the store in {timeout} s:\n{n.d.read_log()}")
                time.sleep(0.1)

    def settle(self, node: int, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while self.nodes[node].publishing() and time.monotonic() < deadline:
            time.sleep(0.002)

    def stats(self) -> list[dict[str, Any]]:
        out = []
        for n in self.nodes:
            s = n.c.stats()
            row = tier_row(s)
            host = s["tiers"][0]
            out.append({"counters": {k: s["counters"].get(k, 0) for k in NODE_COUNTERS},
                        "host_blocks": host["blocks"], "host_used_bytes": host["used_bytes"],
                        "publish": s.get("publish"),
                        "remote": None if row is None else
                        {"counters": row["counters"], "seconds": row["seconds"], "up": row["up"],
                         "blocks_put_here": row["blocks_put_here"], "blocks_known": row["blocks_known"],
                         "staged_blocks": row["staged_blocks"]}})
        return out

    def close(self) -> None:
        for n in self.nodes:
            n.close()
        self.nodes = []
        if self.master is not None:
            self.master.stop()
            shutil.rmtree(self.master.dir, ignore_errors=True)
            self.master = None


def replay(turns: list[tuple[int, list[int]]], where: list[int], nodes: int, segment: int,
           settle: bool) -> dict[str, Any]:
    max_chunks = max(len(t) for _, t in turns) // CHUNK + 1
    bufs = [np.full(BLOCK, 7, np.uint8) for _ in range(max_chunks)]      # one engine's buffers, shared by all
    clusters: dict[str, Cluster] = {}
    try:
        progress("starting the local-only nodes")
        clusters["local only"] = Cluster("local only", nodes, bufs, None)
        progress("starting mooncake_master and the nodes with the remote tier")
        clusters["with remote tier"] = Cluster("with remote tier", nodes, bufs, segment)
        out = {name: {"found": 0, "hit": 0, "stored": 0, "seconds": 0.0, "late": 0, "turn_s": []}
               for name in clusters}
        seen: set[bytes] = set()
        seen_on: list[set[bytes]] = [set() for _ in range(nodes)]
        last: dict[int, int] = {}
        looked = ideal = ideal_local = moved = again = 0
        step = max(1, len(turns) // 10)
        for i, (session, tokens) in enumerate(turns):
            if i % step == 0:
                progress(f"turn {i + 1}/{len(turns)}")
            hs = chain_hashes(tokens, CHUNK)
            node = where[i]
            prev = last.get(session)
            looked += len(hs)
            ideal += next((k for k, h in enumerate(hs) if h not in seen), len(hs))
            ideal_local += next((k for k, h in enumerate(hs) if h not in seen_on[node]), len(hs))
            seen.update(hs)
            seen_on[node].update(hs)
            if prev is not None:
                again += 1
                moved += prev != node
            names = list(clusters) if i % 2 else list(clusters)[::-1]
            for name in names:
                cl, o = clusters[name], out[name]
                if cl.remote and prev is not None and prev != node and cl.nodes[prev].publishing():
                    o["late"] += 1
                t0 = time.perf_counter()
                found, hit, stored = cl.nodes[node].turn(hs)
                dt = time.perf_counter() - t0
                o["found"] += found
                o["hit"] += hit
                o["stored"] += stored
                o["seconds"] += dt
                o["turn_s"].append(dt)
                if settle and cl.remote:
                    cl.settle(node)
            last[session] = node
        for name, cl in clusters.items():
            if cl.remote:
                for n in range(nodes):
                    cl.settle(n)
            out[name]["nodes"] = cl.stats()
    finally:
        for cl in clusters.values():
            cl.close()
    res: dict[str, Any] = {"chunks_looked_up": looked, "ideal_hit_chunks": ideal, "ideal_hit_rate": ideal / looked,
                           "ideal_local_hit_chunks": ideal_local, "ideal_local_hit_rate": ideal_local / looked,
                           "turns_after_first": again, "turns_moved": moved,
                           "moved_share": moved / again if again else 0.0, "configs": {}}
    for name, o in out.items():
        node_sum = {k: sum(n["counters"][k] for n in o["nodes"]) for k in NODE_COUNTERS}
        tier_sum = {k: sum((n["remote"] or {"counters": {}})["counters"].get(k, 0) for n in o["nodes"])
                    for k in TIER_COUNTERS}
        res["configs"][name] = {
            **o, "turn_s": summary(o["turn_s"]), "hit_rate": o["hit"] / looked,
            "lookup_hit_rate": o["found"] / looked, "of_ideal": o["hit"] / max(ideal, 1),
            "recomputed_chunks": looked - o["hit"], "recomputed_tokens": (looked - o["hit"]) * CHUNK,
            "node_counters": node_sum, "remote_counters": tier_sum if clusters[name].remote else None}
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a smoke run: 6 sessions × 8 turns")
    ap.add_argument("--nodes", type=int, default=3)
    ap.add_argument("--sessions", type=int, help="default 6")
    ap.add_argument("--turns", type=int, help="per session (default 24, quick 8)")
    ap.add_argument("--stay", type=float, default=0.5, help="probability a turn stays on the session's last node")
    ap.add_argument("--store-fraction", type=float, default=1.0,
                    help="of the working set the store holds below its eviction watermark (default 1)")
    ap.add_argument("--settle", action="store_true", help="wait after each turn until its node's puts have landed")
    ap.add_argument("--seed", type=int, default=7)
    args = ap.parse_args()
    sessions = args.sessions or 6
    nturns = args.turns or (8 if args.quick else 24)
    started = time.perf_counter()
    load_before = warn_if_busy()
    turns = trace(sessions, nturns, seed=args.seed)
    where = route(turns, args.nodes, args.stay, args.seed)
    ctx = [len(t) for _, t in turns]
    working = len({h for _, t in turns for h in chain_hashes(t, CHUNK)})
    held = math.ceil(args.store_fraction * working)                       # chunks the store is to hold
    segment = math.ceil(held * (BLOCK + TRAILER) / (WATERMARK * HEADROOM) / args.nodes / (1 << 20)) << 20
    res: dict[str, Any] = {"nodes": args.nodes, "sessions": sessions, "turns": nturns, "stay": args.stay,
                           "seed": args.seed, "settle": args.settle, "chunk_tokens": CHUNK, "block_bytes": BLOCK,
                           "mean_prompt_tokens": sum(ctx) / len(ctx), "max_prompt_tokens": max(ctx),
                           "working_set_chunks": working, "working_set_bytes": working * BLOCK,
                           "dram_per_node_bytes": POOL_BYTES, "store_fraction": args.store_fraction,
                           "store_segment_bytes": segment, "store_bytes": segment * args.nodes,
                           "store_staging_bytes": STAGING_BYTES}
    progress(f"trace: {sessions} sessions × {nturns} turns on {args.nodes} nodes (stay {args.stay}), prompts "
             f"{min(ctx)}–{max(ctx)} tokens (mean {res['mean_prompt_tokens']:.0f}), working set {working} chunks = "
             f"{working * BLOCK >> 20} MiB vs {POOL_BYTES >> 20} MiB of DRAM per node")
    print(f"store: {args.nodes} segments of {segment >> 20} MiB = {segment * args.nodes >> 20} MiB; below "
          f"mooncake_master's {WATERMARK:.0%} eviction watermark that is "
          f"{segment * args.nodes * WATERMARK / (working * (BLOCK + TRAILER)):.2f}× the working set "
          f"({working * BLOCK >> 20} MiB; --store-fraction {args.store_fraction})")
    r = replay(turns, where, args.nodes, segment, args.settle)
    res.update(r)
    print(f"{r['turns_moved']} of {r['turns_after_first']} turns after a session's first moved to another node "
          f"({r['moved_share']:.1%}); {r['chunks_looked_up']} chunks looked up")
    t = Table(["configuration", "hit rate", "of ideal", "recomputed tokens", "store hits: lookup / loaded",
               "store gets / puts", "late", "turn ms (median)"])
    for name, c in r["configs"].items():
        nc, rc = c["node_counters"], c["remote_counters"]
        t.add([name, f"{c['hit_rate']:.1%}", f"{c['of_ideal']:.1%}", f"{c['recomputed_tokens']:,}",
               f"{nc['hits_remote']} / {nc['acquired_lower']}" if rc else "-",
               f"{rc['gets']} / {rc['puts']}" if rc else "-", c["late"] if rc else "-",
               f"{c['turn_s']['median'] * 1e3:.1f}"])
    for name, key in (("ideal, local only (unbounded DRAM)", "ideal_local_hit_chunks"),
                      ("ideal (every chunk ever stored)", "ideal_hit_chunks")):
        n = r[key]
        t.add([name, f"{n / r['chunks_looked_up']:.1%}", f"{n / max(r['ideal_hit_chunks'], 1):.1%}",
               f"{(r['chunks_looked_up'] - n) * CHUNK:,}", "", "", "", ""])
    print(t)
    rem = r["configs"]["with remote tier"]
    if rem["found"] != rem["hit"]:
        print(f"note: with the remote tier the lookups found {rem['found']} chunks and the gets loaded {rem['hit']}")
    odd = {k: v for k, v in rem["remote_counters"].items()
           if k in ("put_refused", "dropped", "absent", "bad_value", "crc_mismatch", "probe_failed", "timeouts",
                    "write_skipped") and v}
    skipped = rem["node_counters"]["publish_skipped"]
    if odd or skipped:
        print(f"remote tier: {odd}{f', publish_skipped {skipped}' if skipped else ''}")
    res["load_average"] = {"before": load_before, "after": busy_cpus()}
    res["seconds"] = time.perf_counter() - started
    print(f"\nwrote {write_json('multinode', res)}  ({res['seconds']:.0f} s)")


if __name__ == "__main__":
    main()
