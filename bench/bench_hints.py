"""Hint cost under the state lock, and the hint state's size, against a hostile tenant (issue 29 part 3).

The daemon's hint op (kvstore.daemon.hints.Hints.apply) run in process, as the daemon runs it under its lock, for
two configurations in the same run: `bounded` (the defaults: hints.model_successors 16, model_keys 4096,
model_bytes 4 MiB per tenant) and `unbounded` (every model bound lifted: the computation as it was before issue 29,
a lookahead over every successor ever seen, counts never forgotten).

- Fan-out: a `fan` workflow type whose `router` agent has been followed by N distinct agents (N = 10 .. 10 000,
  taught straight to the tenant's model: a daemon would take N hints); then `--calls` new workflows each call
  `router`, timed one by one: each call learns its transition and recomputes the lookahead from `router`.
- Distinct workflows: D distinct workflow ids (D = 1 000 .. 100 000, hints.max_workflows 1 000), each of its own
  type, each called twice (`coder`, `tester`): the hint's median cost, and the hint state's bytes per distinct id
  (tracemalloc growth over the run, in a second pass) beside the daemon's own estimate (`stats().state.bytes`).

    .venv/bin/python bench/bench_hints.py [--quick] [--calls 200]
"""
from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
import tracemalloc
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common import Table, progress, write_json  # noqa: E402

from kvstore.daemon.config import HintsConfig  # noqa: E402
from kvstore.daemon.hints import Hints  # noqa: E402
from kvstore.workflows import Workflows  # noqa: E402

TENANT = "b"
UNBOUNDED = {"model_keys": 10 ** 9, "model_successors": 10 ** 9, "model_bytes": 10 ** 15}


def make(bounded: bool, max_workflows: int = 100_000) -> Hints:
    cfg = HintsConfig(max_workflows=max_workflows, tenant_workflows=max_workflows,
                      **({} if bounded else UNBOUNDED))  # type: ignore[arg-type]
    return Hints(Workflows(idle_s=cfg.idle_s), cfg)


def call(h: Hints, wid: str, agent: str, wtype: str) -> None:
    h.apply(TENANT, {"kind": "call", "workflow": wid, "agent": agent, "type": wtype})


def fan_out(bounded: bool, n: int, calls: int) -> dict[str, Any]:
    """Median and p99 µs of a `call router` hint once `router` has n successors."""
    h = make(bounded)
    model = h.flows.model(TENANT).predictor
    for i in range(n):
        model.observe("fan", "router", f"tool-{i}")
    times = []
    for j in range(calls):
        t0 = time.perf_counter_ns()
        call(h, f"probe-{j}", "router", "fan")
        times.append((time.perf_counter_ns() - t0) / 1e3)
    s = h.stats()["state"]
    return {"median_us": statistics.median(times), "p99_us": sorted(times)[int(0.99 * (len(times) - 1))],
            "max_expansions": s["max_expansions"], "successors_kept": s["successors"], "pooled": s["pooled"]}


def flood(bounded: bool, d: int, traced: bool) -> dict[str, Any]:
    """d distinct workflows of d types, two calls each, max_workflows 1000: hint cost, or the state's bytes."""
    gc.collect()
    if traced:
        tracemalloc.start()
    h = make(bounded, max_workflows=1000)
    base = tracemalloc.get_traced_memory()[0] if traced else 0
    times = []
    for i in range(d):
        wid, wtype = f"flood-{i:07d}", f"type-{i:07d}"
        t0 = time.perf_counter_ns()
        call(h, wid, "coder", wtype)
        call(h, wid, "tester", wtype)
        times.append((time.perf_counter_ns() - t0) / 2e3)
    out: dict[str, Any] = {"median_us": statistics.median(times), "state": h.stats()["state"]}
    if traced:
        gc.collect()
        out["bytes_per_id"] = (tracemalloc.get_traced_memory()[0] - base) / d
        tracemalloc.stop()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fan-outs up to 1000, floods up to 10 000")
    ap.add_argument("--calls", type=int, default=200, help="timed hints per fan-out")
    args = ap.parse_args()
    started = time.perf_counter()
    fans = [10, 100, 1000] + ([] if args.quick else [10_000])
    floods = [1000, 10_000] + ([] if args.quick else [100_000])
    res: dict[str, Any] = {"calls": args.calls, "fan_out": {}, "flood": {}}

    t = Table(["successors", "unbounded µs/hint (p99)", "bounded µs/hint (p99)", "expansions: unbounded",
               "bounded", "successors kept: unbounded", "bounded"])
    for n in fans:
        progress(f"fan-out {n}")
        got = {k: fan_out(k == "bounded", n, args.calls) for k in ("unbounded", "bounded")}
        res["fan_out"][n] = got
        u, b = got["unbounded"], got["bounded"]
        t.add([n, f"{u['median_us']:.1f} ({u['p99_us']:.1f})", f"{b['median_us']:.1f} ({b['p99_us']:.1f})",
               u["max_expansions"], b["max_expansions"], u["successors_kept"], b["successors_kept"]])
    print(t)

    t = Table(["distinct workflows", "unbounded µs/hint", "bounded µs/hint", "unbounded B/id (estimate)",
               "bounded B/id (estimate)", "bounded: pairs kept, pending"])
    for d in floods:
        progress(f"flood {d}")
        got = {}
        for k in ("unbounded", "bounded"):
            timed, traced = flood(k == "bounded", d, False), flood(k == "bounded", d, True)
            got[k] = {**timed, "bytes_per_id": traced["bytes_per_id"]}
        res["flood"][d] = got
        u, b = got["unbounded"], got["bounded"]
        t.add([d, f"{u['median_us']:.1f}", f"{b['median_us']:.1f}",
               f"{u['bytes_per_id']:.0f} ({u['state']['bytes'] / d:.0f})",
               f"{b['bytes_per_id']:.0f} ({b['state']['bytes'] / d:.0f})",
               f"{b['state']['keys']}, {b['state']['pending']}"])
    print(t)
    res["seconds"] = time.perf_counter() - started
    print(f"\nwrote {write_json('hints', res)}  ({res['seconds']:.0f} s)")


if __name__ == "__main__":
    main()
