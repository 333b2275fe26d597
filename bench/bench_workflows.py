"""Agent workflow traces (bench/workflows.py: dynamic code generation and fact checking, a static pipeline, long
chats, and a mix of all) replayed through the real daemon's host pool at 10%, 25% and 50% of each trace's peak live
working set, against the same trace replayed offline through LRU and through Belady's farthest-next-use oracle
(the ceiling). Issue 14's yardstick: a workflow-aware policy is judged by the share of the LRU → oracle gap it closes.

Each request does what a connector does: get the longest cached prefix of its prompt's 256-token chunks, then put
the chunks it had to compute. Blocks are 64 KiB (the policy, not the copy, is under test); the pool holds exactly
`capacity` of them (whole 1 MiB segments). With `--ssd` the daemon also has an SSD tier: hits then come from the
host pool or the disk (promoted), and the table shows how many each.

"kvstore workflow" is the same replay with `pool.eviction: workflow` and the trace's hints sent as an engine would
(a `call` hint per request, its `(workflow, agent)` context on the get and the put, the `end` after a workflow's
last request): issue 14's target is ≥ 60% of the LRU → oracle gap closed on every mix and capacity.

    .venv-bench/bin/python bench/bench_workflows.py [--quick] [--mixes codegen,chat,...] [--ssd]
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
from common import Daemon, Table, busy_cpus, progress, warn_if_busy, write_json  # noqa: E402

from kvstore.protocol.geometry import Geometry  # noqa: E402
from kvstore.protocol.keys import NamespaceSpec  # noqa: E402

GEOM = Geometry(layers=1, tokens=wf.CHUNK, kv_heads=1, head_dim=64, dtype="bfloat16")   # 64 KiB a chunk
BLOCK = GEOM.full_bytes
PER_SEGMENT = (1 << 20) // BLOCK         # the pool holds whole 1 MiB segments: capacities are multiples of this
FRACTIONS = (0.10, 0.25, 0.50)
SIZES = {"codegen": (60, 12), "factcheck": (60, 12), "pipeline": (60, 12), "chat": (16, 6), "mixed": (60, 14)}


def replay(trace: list[wf.Request], capacity: int, ssd: str | None, policy: str = "lru") -> dict[str, Any]:
    """The trace through a daemon whose host pool holds `capacity` chunks: chunks hit (host, SSD), stored. With
    the workflow policy, the trace's hints go with it."""
    env = {"KVSTORE_SERVER_MAX_RESERVED_FRACTION": "1",       # one trusted engine: a put may take the whole pool
           "KVSTORE_POOL_EVICTION": policy}
    hints = policy == "workflow"
    if ssd:
        env.update({"KVSTORE_SSD_DIR": ssd, "KVSTORE_SSD_CAPACITY": "4GiB"})
    d = Daemon(str(capacity * BLOCK), "1MiB", env).start()         # the cap: exactly `capacity` chunks
    try:
        with d.client() as c:
            ns = c.namespace(NamespaceSpec("workflows", GEOM))
            bufs = [np.zeros(BLOCK, np.uint8) for _ in range(max(len(r.hashes) for r in trace))]
            hit = stored = 0
            for r in trace:
                ctx = None
                if hints:
                    c.workflow(r.workflow, type=r.family).call(r.agent)
                    ctx = (r.workflow, r.agent)
                n = ns.get(r.hashes, bufs[:len(r.hashes)], context=ctx)
                hit += n
                if n < len(r.hashes):
                    stored += ns.put(r.hashes[n:], bufs[n:len(r.hashes)], context=ctx).stored
                if hints and r.last:
                    c.workflow(r.workflow).end()
            counters = c.stats()["counters"]
        return {"hit": hit, "stored": stored, "promoted": counters.get("promoted", 0)}
    finally:
        d.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="smaller traces (a third of the workflows)")
    ap.add_argument("--mixes", default=",".join(wf.MIXES))
    ap.add_argument("--ssd", action="store_true", help="also replay with an SSD tier under the pool")
    args = ap.parse_args()
    started = time.perf_counter()
    load_before = warn_if_busy()
    base = tempfile.mkdtemp(prefix="kvs-workflows-", dir="/var/tmp" if os.path.isdir("/var/tmp") else None)
    res: dict[str, Any] = {"chunk_tokens": wf.CHUNK, "block_bytes": BLOCK, "fractions": FRACTIONS, "mixes": {}}
    t = Table(["mix", "capacity", "chunks", "ideal", "oracle", "LRU (offline)", "kvstore LRU", "gap closed",
               "workflow (offline)", "kvstore workflow", "gap closed (workflow)"]
              + (["kvstore+SSD (host/SSD)"] if args.ssd else []))
    try:
        for name in args.mixes.split(","):
            workflows, concurrency = SIZES[name]
            if args.quick:
                workflows = max(concurrency, workflows // 3)
            trace = wf.mix(name, workflows, concurrency)
            looked = sum(len(r.hashes) for r in trace)
            peak = wf.peak_live(trace)
            ideal = wf.ideal_hits(trace)
            m: dict[str, Any] = {"requests": len(trace), "chunks_looked_up": looked, "peak_live_chunks": peak,
                                 "ideal_hit_rate": ideal / looked, "cells": []}
            progress(f"{name}: {len(trace)} requests, {looked} chunks looked up, peak live {peak} chunks")
            for frac in FRACTIONS:
                cap = max(PER_SEGMENT, round(peak * frac / PER_SEGMENT) * PER_SEGMENT)   # whole segments
                lru, oracle = wf.hit_rates(trace, cap, "lru"), wf.hit_rates(trace, cap, "oracle")
                now = replay(trace, cap, None)
                gap = (now["hit"] - lru) / (oracle - lru) if oracle > lru else 1.0
                offline = wf.hit_rates(trace, cap, "workflow")
                wfp = replay(trace, cap, None, "workflow")
                wgap = (wfp["hit"] - lru) / (oracle - lru) if oracle > lru else 1.0
                cell = {"fraction": frac, "capacity_chunks": cap, "oracle_hit_rate": oracle / looked,
                        "lru_offline_hit_rate": lru / looked, "kvstore": {**now, "hit_rate": now["hit"] / looked},
                        "gap_closed": gap, "workflow_offline_hit_rate": offline / looked,
                        "kvstore_workflow": {**wfp, "hit_rate": wfp["hit"] / looked}, "gap_closed_workflow": wgap}
                row = [name, f"{frac:.0%}", cap, f"{ideal / looked:.1%}", f"{oracle / looked:.1%}",
                       f"{lru / looked:.1%}", f"{now['hit'] / looked:.1%}", f"{gap:.0%}",
                       f"{offline / looked:.1%}", f"{wfp['hit'] / looked:.1%}", f"{wgap:.0%}"]
                if args.ssd:
                    d = os.path.join(base, f"{name}-{frac}")
                    withssd = replay(trace, cap, d)
                    shutil.rmtree(d, ignore_errors=True)
                    cell["kvstore_ssd"] = {**withssd, "hit_rate": withssd["hit"] / looked}
                    row.append(f"{withssd['hit'] / looked:.1%} ({withssd['hit'] - withssd['promoted']}"
                               f"/{withssd['promoted']})")
                m["cells"].append(cell)
                t.add(row)
            res["mixes"][name] = m
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print(t)
    res["load_average"] = {"before": load_before, "after": busy_cpus()}
    res["seconds"] = time.perf_counter() - started
    print(f"\nwrote {write_json('workflows', res)}  ({res['seconds']:.0f} s)")


if __name__ == "__main__":
    main()
