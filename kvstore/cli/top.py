"""`kvstore top`: the daemon's traffic, refreshed: rates per interval from two snapshots of `stats`."""
from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from kvstore.cli.common import client, table_of, us
from kvstore.histogram import bucket_quantile
from kvstore.units import format_size


def traffic_rates(before: dict[str, Any], after: dict[str, Any], seconds: float) -> list[dict[str, Any]]:
    """Per path and lane, what happened between two stats snapshots: throughput, transfers per second, and the
    latency percentiles of just the transfers in between (from the histograms' bucket differences)."""
    old = {(p["path"], lane): r for p in before.get("traffic", []) for lane, r in p["lanes"].items()}
    rows = []
    for p in after.get("traffic", []):
        for lane, r in p["lanes"].items():
            o = old.get((p["path"], lane))
            buckets = [a - b for a, b in zip(r["latency"]["buckets"], o["latency"]["buckets"])] if o else \
                r["latency"]["buckets"]
            moved = r["bytes"] - (o["bytes"] if o else 0)
            done = r["transfers"] - (o["transfers"] if o else 0)
            rows.append({"path": p["path"], "lane": lane, "bytes_per_s": moved / seconds,
                         "transfers_per_s": done / seconds, "queued": r["queued"], "in_flight": r["in_flight"],
                         "p50_s": _bucket_quantile(buckets, 0.5), "p99_s": _bucket_quantile(buckets, 0.99),
                         "rejected": r["rejected"] - (o["rejected"] if o else 0)})
    return rows


def _bucket_quantile(buckets: list[int], q: float) -> float | None:
    seconds = bucket_quantile(buckets, q)
    return None if seconds == float("inf") else seconds


def cmd_top(args: argparse.Namespace) -> int:
    """Refresh a table of traffic rates every interval; clears the screen only on a terminal."""
    n = 0
    with client(args) as c:
        before, t0 = c.stats(), time.monotonic()
        while args.count <= 0 or n < args.count:
            time.sleep(args.interval)
            after, t1 = c.stats(), time.monotonic()
            rows = traffic_rates(before, after, t1 - t0)
            before, t0, n = after, t1, n + 1
            if args.json:
                print(json.dumps({"time": time.time(), "paths": rows}), flush=True)
                continue
            table = table_of(["path", "lane", "MB/s", "ops/s", "queued", "in flight", "p50", "p99", "busy"],
                           [[r["path"], r["lane"], f"{r['bytes_per_s'] / 1e6:.1f}", f"{r['transfers_per_s']:.0f}",
                             r["queued"], r["in_flight"], us(r["p50_s"]), us(r["p99_s"]), r["rejected"]]
                            for r in rows]) if rows else "no traffic paths (this daemon has no SSD tier)"
            host = after["tiers"][0]
            head = (f"kvstore top — every {args.interval:g} s; host {format_size(host['used_bytes'])} of "
                    f"{format_size(host['capacity_bytes'])}, {after['connections']} connection(s)")
            print(("\x1b[H\x1b[2J" if sys.stdout.isatty() else "") + head + "\n\n" + table, flush=True)
    return 0
