"""`kvstore ping` and `kvstore stats`: one snapshot of the daemon, as tables (or `--json`)."""
from __future__ import annotations

import argparse
import time
from typing import Any

from kvstore.cli.common import client, out, pct, table_of, us
from kvstore.units import format_size


def cmd_ping(args: argparse.Namespace) -> int:
    with client(args) as c:
        t0 = time.perf_counter()
        c.ping()
        rtt = time.perf_counter() - t0
    out(args, {"ok": True, "rtt_us": rtt * 1e6}, f"pong from {c.path} in {rtt * 1e6:.0f} µs")
    return 0


def cmd_stats(args: argparse.Namespace) -> int:
    with client(args) as c:
        s = c.stats()
    tiers = table_of(["tier", "capacity", "mapped", "used", "resident", "blocks", "segments"],
                   [[t["tier"], format_size(t["capacity_bytes"]), format_size(t["mapped_bytes"]),
                     format_size(t["used_bytes"]), format_size(t["resident_bytes"]), t["blocks"], t["segments"]]
                    for t in s["tiers"]])
    counters = table_of(["counter", "value"], [[k, v] for k, v in s["counters"].items()]
                      + [["errors." + k, v] for k, v in sorted(s["errors"].items())])
    lat = table_of(["op", "count", "p50", "p99", "mean"],
                 [[op, h["count"], us(h["p50"]), us(h["p99"]), us(h["sum"] / max(h["count"], 1))]
                  for op, h in sorted(s["latency"].items())])
    head = (f"kvstore {s['version']} pid {s['pid']} up {s['uptime_s']:.0f} s — {s['connections']} connection(s), "
            f"{s['namespaces']} namespace(s), {s['pinned']} pinned, {s['reserved']} reserved")
    text = f"{head}\n\n{tiers}"
    for t in s["tiers"]:
        if "scan" in t:
            sc = t["scan"]
            text += (f"\nssd scan: {sc['state']}, {sc['scanned']} of {sc['records']} records in "
                     f"{sc['seconds']:.1f} s")
    for t in s["tiers"]:
        if t["tier"] == "remote":
            text += "\n" + _remote_line(t)
    if s.get("write_through"):
        text += "\n" + _durable_line(s["write_through"])
    if s.get("workflows"):
        text += "\n\n" + _workflows_lines(s["workflows"], s["hit_rates"])
    if s.get("traffic"):
        text += "\n\n" + _traffic_table(s["traffic"])
    out(args, s, f"{text}\n\n{counters}\n\n{lat}")
    return 0


def _remote_line(t: dict[str, Any]) -> str:
    """The remote tier in one line: whether the store answers, what this node put there, what it got back."""
    c = t.get("counters", {})
    state = "up" if t["up"] else f"DOWN for {t['down_s']:.0f} s ({t['last_error']})"
    bad = c.get("crc_mismatch", 0) + c.get("bad_value", 0)
    ep = t.get("endpoint") or {}
    where = (f"; this node at {ep['advertised']}, listening on {', '.join(ep['listening']) or '?'}"
             if ep.get("advertised") else "")
    skipped = c.get("write_skipped", 0)
    return (f"remote store at {t['master']}: {state}; {t['placement']}, {t['replicas']} replica(s){where}; "
            f"{t['blocks_put_here']} block(s) put from here, {t['staged_blocks']} staged; "
            f"gets {c.get('gets', 0)}, puts {c.get('puts', 0)}, bad values {bad}, unreachable "
            f"{c.get('unreachable', 0)}, lookups asked {c.get('probes', 0)}"
            + (f"; {skipped} block(s) not published (store down: local only)" if skipped else ""))


def _durable_line(wt: dict[str, Any]) -> str:
    """The durable path in one line: write-through on or off, blocks on their way, the oldest one's age, the lag
    from commit to synced."""
    lag = wt.get("lag") or {}
    return (f"write-through: {'on' if wt.get('enabled') else 'off (durable puts and flushes only)'}, "
            f"{wt.get('pending', 0)} block(s) on their way to disk, oldest {wt.get('oldest_pending_s', 0.0):.2f} s; "
            f"lag commit→synced p50 {us(lag.get('p50'))}, p99 {us(lag.get('p99'))}, "
            f"max {wt.get('max_lag_s', 0.0) * 1e3:.1f} ms over {lag.get('count', 0)} block(s)")


def _workflows_lines(w: dict[str, Any], rates: dict[str, Any]) -> str:
    """Hints, the predictor, the hit rate per op and tier, and how far the cache is from the best it could do."""
    acc = w["accuracy"]
    ceiling = w["ceiling"]
    lines = [f"workflows: {w['active']} active, {w['retired']} retired "
             f"({', '.join(f'{k} {n}' for k, n in w['retired_by'].items())}); hints ignored: "
             f"{', '.join(f'{k} {n}' for k, n in sorted(w['ignored'].items())) or 'none'}",
             f"predictor top-1 accuracy: {pct(acc['top1_1'])} at 1 step, {pct(acc['top1_3'])} at 3 steps"]
    if "blocks" in w:
        lines.append(f"host blocks: {w['blocks']['retired']} retired, {w['blocks']['active']} active")
    for op, r in rates.items():
        lines.append(f"{op} hit rate: {hit_split(r)}")
    lines.append(f"hit-rate ceiling: {pct(ceiling['hit_rate'])} ({ceiling['distinct']} distinct of "
                 f"{ceiling['looked_up']} blocks looked up)")
    return "\n".join(lines)


def hit_split(r: dict[str, float | None]) -> str:
    """A hit rate as `stats` and `top` both say it: the shares found in the host pool, in a lower tier, missed
    (kvstore.daemon.admin.hit_rates defines them; `top` applies it to an interval's counters)."""
    return f"host {pct(r['host'])}, lower tiers {pct(r['lower'])}, miss {pct(r['miss'])}"


def _traffic_table(paths: list[dict[str, Any]]) -> str:
    rows = [[p["path"], lane, r["queued"], r["in_flight"], r["transfers"], format_size(r["bytes"]), r["rejected"],
             r["cancelled"], us(r["latency"]["p50"]), us(r["latency"]["p99"])]
            for p in paths for lane, r in p["lanes"].items()]
    return table_of(["path", "lane", "queued", "in flight", "transfers", "bytes", "busy", "cancelled", "p50", "p99"],
                  rows)
