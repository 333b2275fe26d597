"""bench_policies' `--families` mode (issue 34 parts 2–3): each agent-trace family (bench/agent_families.py) replayed
through the real daemon and client for `lru`, `history` (no hints) and `workflow` with the framework's hints, under
the three save modes, beside offline LRU (per save mode) and offline Belady (bench/family_offline.py) at the same
pools.

The pool holds `cap` blocks of 128 KiB (whole 1 MiB segments: caps are multiples of PER_SEGMENT), `cap` = 10, 25,
50% of the family's peak live working set. Each request reads the longest held prefix of its chain (`get`, with its
context), then saves: `whole` reserves the whole chain in one reserve (the vLLM connector), `missed` puts the
blocks after the hit prefix (`Namespace.put` without `after`; the SGLang backend), `named` puts them naming the
prefix hit (`after`). Hints, with
`workflow` only, as a framework sends them (agent_families.Event.hint): begin, each call (agent, step, the possible
next agents), the end after the last call returned. The daemon's clock is real: the trace runs at `speed` times its
own pace (a call every TURN_S of wall time on average), so the gaps the policy learns are the trace's, scaled.

Printed per cell: hit rates, gap closed (policy − offline LRU of the same save mode) / (Belady − that LRU),
recomputed tokens (blocks missed × CHUNK), and per-operation cost: the client's wall time in get + save calls per
request, against LRU's in the same cell.
"""
from __future__ import annotations

import time
from typing import Any

import agent_families as af
import family_offline as fo
import numpy as np
from common import Daemon, Table, busy_cpus, paced, progress, warn_if_busy, write_json

from kvstore import Geometry, NamespaceSpec

GEOM = Geometry(layers=1, tokens=af.CHUNK, kv_heads=2, head_dim=64, dtype="bfloat16")    # 128 KiB a block
PER_SEGMENT = (1 << 20) // GEOM.full_bytes
FRACTIONS = (0.10, 0.25, 0.50)
POLICIES = ("lru", "history", "workflow")
TURN_S = 0.012


def key(b: int) -> bytes:
    return b.to_bytes(16, "little")


def daemon_replay(events: list[af.Event], cap: int, policy: str, save: str, speed: float) -> dict[str, Any]:
    """The trace through a daemon whose pool holds `cap` blocks: blocks hit, looked up, seconds in calls."""
    hints = policy == "workflow"
    d = Daemon(str(cap * GEOM.full_bytes), "1MiB", {"KVSTORE_POOL_EVICTION": policy,
                                                    "KVSTORE_SERVER_MAX_RESERVED_FRACTION": "1"}).start()
    hit = total = 0
    busy = 0.0
    try:
        with d.client() as c:
            ns = c.namespace(NamespaceSpec("families", GEOM))
            bufs = [np.zeros(GEOM.full_bytes, np.uint8) for _ in range(max(len(e.blocks) for e in events))]
            start = time.monotonic()                 # (the lag below: how far behind the trace's clock it ended)
            for e in paced(events, lambda e: e.at, speed):
                ctx = None
                if hints:
                    h = e.hint()
                    w = c.workflow(e.workflow, type=e.family)
                    if e.kind == "begin":
                        w.begin()
                    elif e.kind == "end":
                        w.end()
                    else:
                        w.call(e.agent, step=h["step"], next=h["next"])
                    ctx = (e.workflow, e.agent)
                if e.kind != "call":
                    continue
                hs = [key(b) for b in e.blocks]
                t0 = time.perf_counter()
                n = ns.get(hs, bufs[:len(hs)], context=ctx)
                if save == "whole":
                    with ns.reserve(hs, context=ctx) as r:
                        r.write_and_commit(bufs[:len(hs)])
                elif n < len(hs):
                    ns.put(hs[n:], bufs[n:len(hs)], context=ctx, after=hs[:n] if save == "named" else ())
                busy += time.perf_counter() - t0
                hit, total = hit + n, total + len(hs)
            lag = time.monotonic() - start - events[-1].at / speed
    finally:
        d.stop()
    return {"hit": hit, "looked_up": total, "hit_rate": hit / total, "busy_s": busy, "lag_s": round(lag, 2),
            "recomputed_tokens": (total - hit) * af.CHUNK}


def sizes(quick: bool) -> tuple[int, float, tuple[float, ...]]:
    """Workflows a family, wall seconds a call, pool fractions."""
    return (24, 0.008, (0.25,)) if quick else (80, TURN_S, FRACTIONS)


def run_families(quick: bool, only: list[str] | None, policies: list[str] | None,
                 seeds: tuple[int, ...] = (1,), saves: tuple[str, ...] = fo.SAVES) -> None:
    """Every family × seed × pool × save through the daemon; with several seeds, a summary of each cell's gap closed
    over them (mean and lowest): at 10% a single trace's cell moves by ±10 points of gap closed when the requests
    come a tenth of a second of trace time earlier or later (the gap is a point or two of hit rate there), so one
    seed cannot tell a change from the noise."""
    load_before = warn_if_busy()
    started = time.perf_counter()
    workflows, turn, fractions = sizes(quick)
    policies = policies or list(POLICIES)
    res: dict[str, Any] = {"block_bytes": GEOM.full_bytes, "chunk_tokens": af.CHUNK, "held_out": af.HELD_OUT,
                           "fractions": fractions, "seeds": seeds, "saves": saves, "families": {}}
    t = Table(["family", "seed", "pool", "save", "Belady", "offline LRU", *[f"{p} (gap)" for p in policies],
               "recomputed tokens", *[f"{p} cost" for p in policies if p != "lru"]])
    for fam in only or af.FAMILIES:
        runs = res["families"][fam] = [_family(fam, seed, workflows, turn, fractions, saves, policies, t)
                                       for seed in seeds]
        if len(seeds) == 1:
            res["families"][fam] = runs[0]
    print(t)
    if len(seeds) > 1:
        print(_over_seeds(res["families"], fractions, saves, policies))
    res["load_average"] = {"before": load_before, "after": busy_cpus()}
    res["seconds"] = time.perf_counter() - started
    print(f"\nwrote {write_json('policies-families', res)}  ({res['seconds']:.0f} s)")


def _family(fam: str, seed: int, workflows: int, turn: float, fractions: tuple[float, ...], saves: tuple[str, ...],
            policies: list[str], t: Table) -> dict[str, Any]:
    """One family's trace of one seed: its cells, each a row of `t`."""
    events = af.trace(fam, workflows, seed=seed, concurrency=2 * af.CONCURRENCY[fam])
    reqs = af.calls(events)
    peak = af.peak_live(events)
    speed = max(1.0, events[-1].at / len(reqs) / turn)
    progress(f"{fam} seed {seed}: {len(reqs)} calls, peak live {peak} blocks, at {speed:.0f}x")
    out: dict[str, Any] = {"seed": seed, "calls": len(reqs), "peak_live": peak, "speed": speed, "cells": []}
    for frac in fractions:
        cap = max(PER_SEGMENT, round(peak * frac / PER_SEGMENT) * PER_SEGMENT)
        bel = fo.belady(events, cap)
        for save in saves:
            lru = fo.lru(events, cap, save)
            cell: dict[str, Any] = {"fraction": frac, "blocks": cap, "save": save, "belady": bel[0] / bel[1],
                                    "offline_lru": lru[0] / lru[1], "daemon": {}}
            for p in policies:
                r = cell["daemon"][p] = daemon_replay(events, cap, p, save, speed)
                r["gap_closed"] = (r["hit"] - lru[0]) / (bel[0] - lru[0]) if bel[0] > lru[0] else 0.0
            base = cell["daemon"].get("lru")
            for r in cell["daemon"].values():
                r["cost_vs_lru"] = r["busy_s"] / base["busy_s"] if base and base["busy_s"] else None
            out["cells"].append(cell)
            d = cell["daemon"]
            row = [fam + (" (held out)" if fam in af.HELD_OUT else ""), str(seed), f"{frac:.0%} ({cap})", save,
                   f"{cell['belady']:.1%}", f"{cell['offline_lru']:.1%}",
                   *[f"{d[p]['hit_rate']:.1%} ({d[p]['gap_closed']:+.0%})" for p in policies],
                   " / ".join(str(d[p]["recomputed_tokens"]) for p in policies),
                   *[f"{d[p]['cost_vs_lru']:.2f}x" if d[p]["cost_vs_lru"] else "-" for p in policies if p != "lru"]]
            t.add(row)
            progress("  ".join(row))
    return out


def _over_seeds(families: dict[str, list[dict[str, Any]]], fractions: tuple[float, ...], saves: tuple[str, ...],
                policies: list[str]) -> Table:
    """Per family, pool and save: each policy's gap closed over the seeds, mean (lowest), and its hit rate against
    the daemon's LRU in points, mean (lowest)."""
    t = Table(["family", "pool", "save", *[f"{p} gap: mean (min)" for p in policies if p != "lru"],
               *[f"{p} - lru pts: mean (min)" for p in policies if p != "lru"]])
    for fam, runs in families.items():
        for frac in fractions:
            for save in saves:
                cells = [c["daemon"] for r in runs for c in r["cells"] if c["fraction"] == frac and c["save"] == save]
                gaps = {p: [c[p]["gap_closed"] for c in cells] for p in policies if p != "lru"}
                pts = {p: [100 * (c[p]["hit_rate"] - c["lru"]["hit_rate"]) for c in cells if "lru" in c]
                       for p in gaps}
                t.add([fam + (" (held out)" if fam in af.HELD_OUT else ""), f"{frac:.0%}", save,
                       *[f"{sum(g) / len(g):+.0%} ({min(g):+.0%})" for g in gaps.values()],
                       *[f"{sum(v) / len(v):+.1f} ({min(v):+.1f})" if v else "-" for v in pts.values()]])
    return t
