"""Agent workflow traces (bench/workflows.py: dynamic code generation and fact checking, a static pipeline, long
chats, and a mix of all) replayed through the real daemon's host pool at 10%, 25% and 50% of each trace's peak live
working set, against the same trace replayed offline through plain LRU and through Belady's farthest-next-use
oracle (the ceiling). Issue 14's yardstick: a workflow-aware policy is judged by the share of the LRU → oracle gap
it closes.

Each request does what the vLLM connector does: get the longest cached prefix of its prompt's 256-token chunks, then
save the request's whole chain in one reserve (the hit blocks are refreshed, the computed ones stored). Blocks are
64 KiB (the policy, not the copy, is under test); the pool holds exactly `capacity` of them (whole 1 MiB segments).
The daemon's clock is real: the trace is replayed at `speed` times its own pace (chosen so that a request's turn
comes every ~12 ms of wall time on average, above what one takes), so the gaps the policy learns are the trace's,
scaled.

Three daemons per cell: `pool.eviction: lru`; `workflow` without hints (it must be LRU's equal); `workflow` with
the trace's hints sent as an engine would (a `call` hint per request, its `(workflow, agent)` context on the get and
the put, the `end` after a workflow's last request). With `--ssd` the same three again over an SSD tier: hits then
come from the host pool or the disk (promoted), and the predictive prefetch may promote ahead of the get.
Issue 14's targets: with hints ≥ 60% of the gap closed on every mix and capacity and never below LRU − 1%; without
hints never below LRU − 1%. `--gap-shape 1` replays memoryless gaps (see workflows.GAP_SHAPE).

    .venv-bench/bin/python bench/bench_workflows.py [--quick] [--mixes codegen,chat,...] [--ssd] [--gap-shape K]
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from typing import Any

import numpy as np

BENCH = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(BENCH))
sys.path.insert(0, BENCH)
import workflows as wf  # noqa: E402
from common import Daemon, Table, busy_cpus, paced, progress, warn_if_busy, write_json  # noqa: E402

from kvstore.protocol.geometry import Geometry  # noqa: E402
from kvstore.protocol.keys import NamespaceSpec  # noqa: E402

GEOM = Geometry(layers=1, tokens=wf.CHUNK, kv_heads=1, head_dim=64, dtype="bfloat16")   # 64 KiB a chunk
BLOCK = GEOM.full_bytes
PER_SEGMENT = (1 << 20) // BLOCK         # the pool holds whole 1 MiB segments: capacities are multiples of this
FRACTIONS = (0.10, 0.25, 0.50)
SIZES = {"codegen": (60, 12), "factcheck": (60, 12), "pipeline": (60, 12), "chat": (16, 6), "mixed": (60, 14)}


POLICIES = {"lru": ("lru", False), "nohints": ("workflow", False), "hints": ("workflow", True)}
TURN_S = 0.012                      # wall seconds a request's turn comes every, on average


def replay(trace: list[wf.Request], capacity: int, ssd: str | None, policy: str, speed: float) -> dict[str, Any]:
    """The trace through a daemon whose host pool holds `capacity` chunks, at `speed` times the trace's pace:
    chunks and tokens hit (host, SSD), stored; with hints, the daemon's predictor accuracy and prefetch figures."""
    eviction, hints = POLICIES[policy]
    env = {"KVSTORE_SERVER_MAX_RESERVED_FRACTION": "1",       # one trusted engine: a put may take the whole pool
           "KVSTORE_POOL_EVICTION": eviction}
    if ssd:
        env.update({"KVSTORE_SSD_DIR": ssd, "KVSTORE_SSD_CAPACITY": "4GiB", "KVSTORE_SSD_EVICTION": eviction})
    d = Daemon(str(capacity * BLOCK), "1MiB", env).start()         # the cap: exactly `capacity` chunks
    try:
        with d.client() as c:
            ns = c.namespace(NamespaceSpec("workflows", GEOM))
            bufs = [np.zeros(BLOCK, np.uint8) for _ in range(max(len(r.hashes) for r in trace))]
            hit = stored = hit_tokens = 0
            start = time.monotonic()                 # (the lag below: how far behind the trace's clock it ended)
            for r in paced(trace, lambda r: r.at, speed):
                ctx = None
                if hints:
                    c.workflow(r.workflow, type=r.family).call(r.agent)
                    ctx = (r.workflow, r.agent)
                chain = bufs[:len(r.hashes)]
                n = ns.get(r.hashes, chain, context=ctx)
                hit += n
                hit_tokens += n * wf.CHUNK
                with ns.reserve(r.hashes, context=ctx) as res:           # as the vLLM connector saves
                    res.write_and_commit(chain)
                stored += len(res.reserved)
                if hints and r.last:
                    c.workflow(r.workflow).end()
            lag = time.monotonic() - start - trace[-1].at / speed
            stats = c.stats()
        out = {"hit": hit, "hit_tokens": hit_tokens, "stored": stored,
               "hit_lower": stats["counters"].get("acquired_lower", 0),
               "dropped": stats["counters"].get("dropped", 0), "lag_s": round(lag, 2)}
        flows = stats.get("workflows") or {}
        if hints:
            out["predictor_top1"] = flows.get("accuracy")
        if flows.get("prefetch"):
            out["prefetch"] = flows["prefetch"]
        return out
    finally:
        d.stop()


def gap(x: float, lru: float, oracle: float) -> float:
    return (x - lru) / (oracle - lru) if oracle > lru else 1.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="smaller traces (a third of the workflows)")
    ap.add_argument("--mixes", default=",".join(wf.MIXES))
    ap.add_argument("--ssd", action="store_true", help="also replay with an SSD tier under the pool")
    ap.add_argument("--gap-shape", type=float, default=wf.GAP_SHAPE,
                    help=f"gamma shape of the gaps between a workflow's calls (1: memoryless; {wf.GAP_SHAPE})")
    ap.add_argument("--speed", type=float, default=0.0, help="trace seconds per wall second (0: a turn every 12 ms)")
    args = ap.parse_args()
    started = time.perf_counter()
    load_before = warn_if_busy()
    base = tempfile.mkdtemp(prefix="kvs-workflows-", dir="/var/tmp" if os.path.isdir("/var/tmp") else None)
    res: dict[str, Any] = {"chunk_tokens": wf.CHUNK, "block_bytes": BLOCK, "fractions": FRACTIONS,
                           "gap_shape": args.gap_shape, "mixes": {}}
    t = Table(["mix", "capacity", "chunks", "ideal", "oracle", "LRU", "kvstore LRU", "workflow, no hints",
               "workflow + hints", "gap closed", "tokens hit", "recomputed tokens"]
              + (["+SSD: LRU / no hints / hints (host+SSD)"] if args.ssd else []))
    try:
        for name in args.mixes.split(","):
            workflows, concurrency = SIZES[name]
            if args.quick:
                workflows = max(concurrency, workflows // 3)
            trace = wf.mix(name, workflows, concurrency, shape=args.gap_shape)
            looked = sum(len(r.hashes) for r in trace)
            tokens = sum(len(r.tokens) for r in trace)
            peak = wf.peak_live(trace)
            ideal = wf.ideal_hits(trace)
            speed = args.speed or max(1.0, trace[-1].at / len(trace) / TURN_S)
            m: dict[str, Any] = {"requests": len(trace), "chunks_looked_up": looked, "prompt_tokens": tokens,
                                 "peak_live_chunks": peak, "ideal_hit_rate": ideal / looked, "speed": speed,
                                 "cells": []}
            progress(f"{name}: {len(trace)} requests, {looked} chunks looked up, peak live {peak} chunks, "
                     f"replayed at {speed:.0f}x")
            for frac in FRACTIONS:
                cap = max(PER_SEGMENT, round(peak * frac / PER_SEGMENT) * PER_SEGMENT)   # whole segments
                lru, oracle = wf.hit_rates(trace, cap, "lru"), wf.hit_rates(trace, cap, "oracle")
                cell: dict[str, Any] = {"fraction": frac, "capacity_chunks": cap, "oracle_hit_rate": oracle / looked,
                                        "lru_offline_hit_rate": lru / looked,
                                        "workflow_offline_hit_rate": wf.hit_rates(trace, cap, "workflow") / looked}
                runs = {p: replay(trace, cap, None, p, speed) for p in POLICIES}
                for run in runs.values():
                    run.update(hit_rate=run["hit"] / looked, token_hit_rate=run["hit_tokens"] / tokens,
                               recomputed_tokens=tokens - run["hit_tokens"], gap_closed=gap(run["hit"], lru, oracle))
                cell["kvstore"] = runs
                row = [name, f"{frac:.0%}", cap, f"{ideal / looked:.1%}", f"{oracle / looked:.1%}",
                       f"{lru / looked:.1%}"] + [f"{runs[p]['hit_rate']:.1%}" for p in POLICIES] + [
                       f"{runs['hints']['gap_closed']:.0%}", f"{runs['hints']['token_hit_rate']:.1%}",
                       runs["hints"]["recomputed_tokens"]]
                if args.ssd:
                    below = {}
                    for p in POLICIES:
                        d = os.path.join(base, f"{name}-{frac}-{p}")
                        run = replay(trace, cap, d, p, speed)
                        shutil.rmtree(d, ignore_errors=True)
                        run.update(hit_rate=run["hit"] / looked, token_hit_rate=run["hit_tokens"] / tokens,
                                   recomputed_tokens=tokens - run["hit_tokens"])
                        below[p] = run
                    cell["kvstore_ssd"] = below
                    row.append(" / ".join(f"{below[p]['hit_rate']:.1%} ({below[p]['hit'] - below[p]['hit_lower']}"
                                          f"+{below[p]['hit_lower']})" for p in POLICIES))
                m["cells"].append(cell)
                t.add(row)
                progress(" ".join(str(x) for x in row))
            res["mixes"][name] = m
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print(t)
    res["load_average"] = {"before": load_before, "after": busy_cpus()}
    res["seconds"] = time.perf_counter() - started
    print(f"\nwrote {write_json('workflows', res)}  ({res['seconds']:.0f} s)")


if __name__ == "__main__":
    main()
