"""`kvstore serve | stats | top | ls | resize | tenants | evict | flush | ping | verify | hint | workflows`: human
tables by default, `--json` for scripts."""
from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from collections.abc import Sequence
from typing import Any

from kvstore.histogram import BUCKETS, bucket_quantile
from kvstore.units import format_size, parse_size


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except ConnectionError as e:
        print(f"kvstore: {e}", file=sys.stderr)
        return 2
    except Exception as e:
        from kvstore.client import KVStoreError
        from kvstore.daemon.config import ConfigError

        if isinstance(e, KVStoreError) and e.code == "forbidden":
            print(f"kvstore: refused by the daemon: {e.message}", file=sys.stderr)
            return 1
        if isinstance(e, (KVStoreError, ConfigError, ValueError)):
            print(f"kvstore: {e}", file=sys.stderr)
            return 1
        raise


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvstore", description="Per-node KV-cache daemon for LLM inference engines.")
    p.add_argument("--socket", help="daemon socket (default: the configured one)")
    p.add_argument("--tenant", help="speak for this tenant (default: KVSTORE_TENANT, else your user's); its secret, "
                                    "if it has one, from KVSTORE_TENANT_SECRET")
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve", help="run the daemon in the foreground")
    s.add_argument("--config", help="YAML file over the embedded default (configs/default.yaml)")
    s.add_argument("--capacity", help="host pool size, e.g. 8GiB (overrides the configuration)")
    s.set_defaults(func=cmd_serve)
    c = sub.add_parser("top", help="live traffic per path and lane: throughput, queues, latency")
    c.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes")
    c.add_argument("--count", type=int, default=0, help="stop after this many refreshes (0: until Ctrl-C)")
    c.add_argument("--json", action="store_true", help="one JSON object per refresh, one per line")
    c.set_defaults(func=cmd_top)
    for name, func, text in (("stats", cmd_stats, "capacity, use and counters per tier"),
                             ("ping", cmd_ping, "check that the daemon answers")):
        c = sub.add_parser(name, help=text)
        c.add_argument("--json", action="store_true")
        c.set_defaults(func=func)
    c = sub.add_parser("ls", help="namespaces and their blocks")
    c.add_argument("--ns", type=int, help="also list this namespace's block hashes")
    c.add_argument("--tier", choices=["host", "ssd"], default="host", help="ssd: blocks on SSD per namespace")
    c.add_argument("--limit", type=int, default=20)
    c.add_argument("--tags", action="store_true", help="with --ns: each block's standing and the workflows (agents) "
                   "that touched it (pool.eviction: workflow)")
    c.add_argument("--json", action="store_true")
    c.set_defaults(func=cmd_ls)
    c = sub.add_parser("resize", help="grow or shrink a tier online: `resize 16GiB` (host), `resize ssd 1TiB`")
    c.add_argument("what", nargs="+", metavar="[TIER] SIZE", help="tier (host or ssd, default host) and capacity")
    c.add_argument("--json", action="store_true")
    c.set_defaults(func=cmd_resize)
    c = sub.add_parser("tenants", help="quota, use, borrowing and lending per tenant; "
                       "`tenants set NAME --host 8GiB --ssd 100GiB`")
    c.add_argument("action", nargs="*", metavar="set NAME", help="set NAME: change a tenant's quota online (admin)")
    c.add_argument("--host", help="with set: the tenant's guaranteed host-pool bytes, e.g. 8GiB (0: none)")
    c.add_argument("--ssd", help="with set: the tenant's guaranteed SSD bytes, e.g. 100GiB (0: none)")
    c.add_argument("--json", action="store_true")
    c.set_defaults(func=cmd_tenants)
    c = sub.add_parser("evict", help="evict unpinned blocks")
    g = c.add_mutually_exclusive_group(required=True)
    g.add_argument("--all", action="store_true")
    g.add_argument("--bytes", help="free at least this much, e.g. 1GiB")
    c.add_argument("--ns", type=int, help="only this namespace")
    c.add_argument("--json", action="store_true")
    c.set_defaults(func=cmd_evict)
    c = sub.add_parser("flush", help="wait until every block your tenant stored is on disk (SSD tier, synced)")
    c.add_argument("--timeout", type=float, help="seconds to wait at most (default: the daemon's "
                                                 "ssd.durable_timeout_s)")
    c.add_argument("--json", action="store_true")
    c.set_defaults(func=cmd_flush)
    _hint_parsers(sub)
    c = sub.add_parser("verify", help="check every record of an SSD directory offline (the daemon stopped)")
    c.add_argument("--dir", required=True, help="the SSD tier's directory")
    c.add_argument("--fix", action="store_true", help="quarantine the bad records")
    c.add_argument("--json", action="store_true")
    c.set_defaults(func=cmd_verify)
    return p


def _hint_parsers(sub: Any) -> None:
    c = sub.add_parser("hint", help="tell the daemon a workflow begins, an agent of it runs, or it ends (advice for "
                                    "pool.eviction: workflow)")
    c.add_argument("kind", choices=["begin", "call", "end"])
    c.add_argument("workflow", help="the workflow's id (with --session: the chat session's id)")
    c.add_argument("--session", action="store_true", help="WORKFLOW is a chat session's id")
    c.add_argument("--type", help="the workflow's type or family (begin, call)")
    c.add_argument("--agent", help="the agent invoked (call)")
    c.add_argument("--step", type=int, help="the call's step in its workflow")
    c.add_argument("--next", nargs="+", metavar="AGENT", help="the agents expected next")
    c.add_argument("--priority", help="an integer, or low, normal, high")
    c.add_argument("--json", action="store_true")
    c.set_defaults(func=cmd_hint)
    c = sub.add_parser("workflows", help="active workflows and sessions: type, last agent, steps, idle time")
    c.add_argument("--limit", type=int, default=100)
    c.add_argument("--json", action="store_true")
    c.set_defaults(func=cmd_workflows)


def _client(args: argparse.Namespace) -> Any:
    from kvstore.client import Client

    if args.socket:
        return Client(args.socket, tenant=args.tenant)
    from kvstore.daemon.config import load_config

    return Client(load_config().server.socket, tenant=args.tenant)


def _table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    cells = [[str(h) for h in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _out(args: argparse.Namespace, data: Any, human: str) -> None:
    print(json.dumps(data, indent=2, default=str) if args.json else human)


def cmd_serve(args: argparse.Namespace) -> int:
    import os

    from kvstore.daemon.config import load_config
    from kvstore.daemon.server import Daemon, StartupError

    if args.socket:
        os.environ["KVSTORE_SERVER_SOCKET"] = args.socket
    if args.capacity:
        os.environ["KVSTORE_POOL_CAPACITY"] = args.capacity
    cfg = load_config(args.config or os.environ.get("KVSTORE_CONFIG"))
    if cfg.remote.master and cfg.remote.bind_address not in ("0.0.0.0", "::"):   # Mooncake's ports bind there
        from kvstore.tiers.remote.address import reexec_with_bind_guard
        reexec_with_bind_guard()
    logging.basicConfig(level=cfg.log.level.upper(), format="%(asctime)s kvstore %(levelname)s %(message)s")
    try:
        Daemon(cfg).serve()
    except StartupError as e:
        print(f"kvstore: {e}", file=sys.stderr)
        return 1
    return 0


def cmd_ping(args: argparse.Namespace) -> int:
    with _client(args) as c:
        t0 = time.perf_counter()
        c.ping()
        rtt = time.perf_counter() - t0
    _out(args, {"ok": True, "rtt_us": rtt * 1e6}, f"pong from {c.path} in {rtt * 1e6:.0f} µs")
    return 0


def cmd_stats(args: argparse.Namespace) -> int:
    with _client(args) as c:
        s = c.stats()
    tiers = _table(["tier", "capacity", "mapped", "used", "resident", "blocks", "segments"],
                   [[t["tier"], format_size(t["capacity_bytes"]), format_size(t["mapped_bytes"]),
                     format_size(t["used_bytes"]), format_size(t["resident_bytes"]), t["blocks"], t["segments"]]
                    for t in s["tiers"]])
    counters = _table(["counter", "value"], [[k, v] for k, v in s["counters"].items()]
                      + [["errors." + k, v] for k, v in sorted(s["errors"].items())])
    lat = _table(["op", "count", "p50", "p99", "mean"],
                 [[op, h["count"], _us(h["p50"]), _us(h["p99"]), _us(h["sum"] / max(h["count"], 1))]
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
    _out(args, s, f"{text}\n\n{counters}\n\n{lat}")
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
            f"lag commit→synced p50 {_us(lag.get('p50'))}, p99 {_us(lag.get('p99'))}, "
            f"max {wt.get('max_lag_s', 0.0) * 1e3:.1f} ms over {lag.get('count', 0)} block(s)")


def _workflows_lines(w: dict[str, Any], rates: dict[str, Any]) -> str:
    """Hints, the predictor, the hit rate per op and tier, and how far the cache is from the best it could do."""
    acc = w["accuracy"]
    ceiling = w["ceiling"]
    lines = [f"workflows: {w['active']} active, {w['retired']} retired "
             f"({', '.join(f'{k} {n}' for k, n in w['retired_by'].items())}); hints ignored: "
             f"{', '.join(f'{k} {n}' for k, n in sorted(w['ignored'].items())) or 'none'}",
             f"predictor top-1 accuracy: {_pct(acc['top1_1'])} at 1 step, {_pct(acc['top1_3'])} at 3 steps"]
    if "blocks" in w:
        lines.append(f"host blocks: {w['blocks']['retired']} retired, {w['blocks']['active']} active")
    for op, r in rates.items():
        lines.append(f"{op} hit rate: host {_pct(r['host'])}, lower tiers {_pct(r['lower'])}, miss {_pct(r['miss'])}")
    lines.append(f"hit-rate ceiling: {_pct(ceiling['hit_rate'])} ({ceiling['distinct']} distinct of "
                 f"{ceiling['looked_up']} blocks looked up)")
    return "\n".join(lines)


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v * 100:.1f}%"


def _traffic_table(paths: list[dict[str, Any]]) -> str:
    rows = [[p["path"], lane, r["queued"], r["in_flight"], r["transfers"], format_size(r["bytes"]), r["rejected"],
             r["cancelled"], _us(r["latency"]["p50"]), _us(r["latency"]["p99"])]
            for p in paths for lane, r in p["lanes"].items()]
    return _table(["path", "lane", "queued", "in flight", "transfers", "bytes", "busy", "cancelled", "p50", "p99"],
                  rows)


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
    with _client(args) as c:
        before, t0 = c.stats(), time.monotonic()
        while args.count <= 0 or n < args.count:
            time.sleep(args.interval)
            after, t1 = c.stats(), time.monotonic()
            rows = traffic_rates(before, after, t1 - t0)
            before, t0, n = after, t1, n + 1
            if args.json:
                print(json.dumps({"time": time.time(), "paths": rows}), flush=True)
                continue
            table = _table(["path", "lane", "MB/s", "ops/s", "queued", "in flight", "p50", "p99", "busy"],
                           [[r["path"], r["lane"], f"{r['bytes_per_s'] / 1e6:.1f}", f"{r['transfers_per_s']:.0f}",
                             r["queued"], r["in_flight"], _us(r["p50_s"]), _us(r["p99_s"]), r["rejected"]]
                            for r in rows]) if rows else "no traffic paths (this daemon has no SSD tier)"
            host = after["tiers"][0]
            head = (f"kvstore top — every {args.interval:g} s; host {format_size(host['used_bytes'])} of "
                    f"{format_size(host['capacity_bytes'])}, {after['connections']} connection(s)")
            print(("\x1b[H\x1b[2J" if sys.stdout.isatty() else "") + head + "\n\n" + table, flush=True)
    return 0


def _us(seconds: float | None) -> str:
    return f">{BUCKETS[-1]:g} s" if seconds is None else f"≤{seconds * 1e6:.0f} µs"


def cmd_ls(args: argparse.Namespace) -> int:
    with _client(args) as c:
        data = c.list(args.ns, args.limit, tags=args.tags)
    if args.tier == "ssd":
        if "ssd" not in data:
            raise ValueError("this daemon has no SSD tier (set ssd.dir)")
        rows = [[r["ns"] if r["ns"] is not None else "-", r["digest"][:12], r["blocks"]] for r in data["ssd"]]
        _out(args, data["ssd"], _table(["ns", "digest", "blocks on ssd"], rows))
        return 0
    rows = [[n["id"], n["model"], n["group"], n["adapter"] or "-", n["tp"], n["role"], n["digest"][:12],
             n["blocks"], format_size(n["bytes"]), format_size(n["slot_bytes"])] for n in data["namespaces"]]
    headers = ["ns", "model", "group", "adapter", "tp", "role", "digest", "blocks", "bytes", "block"]
    if any(n.get("tenant") for n in data["namespaces"]):     # tenants configured: say whose each one is
        headers.insert(1, "tenant")
        for row, n in zip(rows, data["namespaces"]):
            row.insert(1, n.get("tenant") or "-")
    text = _table(headers, rows) + _sharing_tables(data)
    if "keys" in data:
        krows = [[k.hex(), f"{gid >> 32}:{gid & 0xFFFFFFFF}"] for k, gid in data["keys"]]
        kheads = ["hash", "slot"]
        if "tags" in data:
            kheads += ["standing", "touched by", "workflows (agents)"]
            for row, t in zip(krows, data["tags"]):
                row += [t["standing"], t["touched"], _workflows_cell(t["workflows"])] if t else ["-", "-", "-"]
        text += "\n\n" + _table(kheads, krows)
        data["keys"] = [[k.hex(), gid] for k, gid in data["keys"]]
    _out(args, data, text)
    return 0


def _sharing_tables(data: dict[str, Any]) -> str:
    """Share groups that more than one model used or that engines declared, base/residual pairs and forks."""
    text = ""
    groups = [g for g in data.get("groups", []) if g["declared"] or len(g["models"]) > 1]
    if groups:
        text += "\n\nshare groups\n" + _table(
            ["group", "models", "namespaces", "blocks", "bytes"],
            [[g["group"], ", ".join(g["models"]), g["namespaces"], g["blocks"], format_size(g["bytes"])]
             for g in groups])
    if data.get("pairs"):
        text += "\n\nbase/residual pairs (bytes as held, and as whole blocks per agent)\n" + _table(
            ["base ns", "group", "agents", "base", "residuals", "held", "as whole blocks"],
            [[p["base"], p["group"], ", ".join(a or "-" for a in p["adapters"]), format_size(p["base_bytes"]),
              format_size(p["residual_bytes"]), format_size(p["base_bytes"] + p["residual_bytes"]),
              format_size(p["unified_bytes"])] for p in data["pairs"]])
    if data.get("forks"):
        text += "\n\nforks (context blocks: inherited at the fork; base and own residuals held now)\n" + _table(
            ["child ns", "adapter", "parent ns", "base ns", "context", "inherited", "base held", "residuals held"],
            [[f["child"], f["adapter"] or "-", "-" if f["parent"] is None else f["parent"], f["base"],
              f["context_blocks"], f["inherited"], f["base_held"], f["residual_held"]] for f in data["forks"]])
    return text


def _workflows_cell(flows: dict[str, list[str]]) -> str:
    return ", ".join(f"{w} ({'/'.join(a) or '-'})" for w, a in flows.items()) or "-"


def cmd_resize(args: argparse.Namespace) -> int:
    if len(args.what) > 2 or (len(args.what) == 2 and args.what[0] not in ("host", "ssd")):
        raise ValueError("usage: kvstore resize [host|ssd] SIZE")
    tier = args.what[0] if len(args.what) == 2 else "host"
    with _client(args) as c:
        r = c.resize(parse_size(args.what[-1]), tier)
    if tier == "ssd":
        _out(args, r, f"ssd tier capacity {format_size(r['capacity'])} (files {format_size(r['mapped_bytes'])}): "
                      f"evicted {r['evicted']} block(s), in {r['seconds'] * 1e3:.2f} ms")
        return 0
    _out(args, r, f"host pool capacity {format_size(r['capacity'])} (mapped {format_size(r['mapped_bytes'])}): "
                  f"released {r['released_segments']} segment(s), evicted {r['evicted']} block(s), "
                  f"{format_size(r['draining_bytes'])} draining behind pins, in {r['seconds'] * 1e3:.2f} ms")
    return 0


def _ms(seconds: float | None) -> str:
    return "over 10 s" if seconds is None else f"{seconds * 1e3:.2f} ms"


def cmd_tenants(args: argparse.Namespace) -> int:
    if args.action:
        if len(args.action) != 2 or args.action[0] != "set" or (args.host is None and args.ssd is None):
            raise ValueError("usage: kvstore tenants set NAME [--host SIZE] [--ssd SIZE] (the default tenant's NAME "
                             "is '')")
        with _client(args) as c:
            r = c.set_quota(args.action[1], None if args.host is None else parse_size(args.host),
                            None if args.ssd is None else parse_size(args.ssd))
        said = [f"{tier} quota {format_size(r[tier + '_before'])} -> {format_size(r[tier])}"
                for tier in ("host", "ssd") if tier in r]
        _out(args, r, f"tenant {r['tenant'] or '(default)'}: {', '.join(said)} (it holds "
                      f"{format_size(r['used_bytes'])} of host memory; memory moves as loads need it, nothing moves "
                      "now)")
        return 0
    with _client(args) as c:
        r = c.tenants()
    if args.json:
        print(json.dumps(r))
        return 0
    rows = [[t["tenant"] or "(default)", format_size(t["quota_bytes"]), format_size(t["used_bytes"]),
             format_size(t["borrowed_bytes"]), format_size(t["lent_bytes"]),
             "-" if t["hit_rate"] is None else f"{t['hit_rate']:.1%}", t["evictions"], t["reclaims"],
             t["taken_back"], t.get("policy", "-")] for t in r["tenants"]]
    print(_table(["tenant", "quota", "used", "borrowed", "lent", "hit rate", "evictions", "reclaimed",
                  "taken back", "policy"], rows))
    ssd = [[t["tenant"] or "(default)", format_size(t["ssd_quota_bytes"]), format_size(t["ssd_used_bytes"]),
            format_size(t["ssd_borrowed_bytes"]), t["ssd_evictions"], t["ssd_taken"]]
           for t in r["tenants"] if "ssd_used_bytes" in t]
    if ssd:
        print("\nSSD tier" + ("" if r.get("ssd_quotas") else " (no SSD quotas: one LRU per block size)"))
        print(_table(["tenant", "quota", "used", "borrowed", "evictions", "taken by others"], ssd))
    rs = r["reclaim_seconds"]
    mode = "quotas with lending" if r["lending"] and r["active"] else "static partitions" if r["active"] else \
        "one shared LRU (no quota set)"
    print(f"\nhost pool {format_size(r['charged_bytes'])} of {format_size(r['capacity_bytes'])}; {mode}; "
          f"idle after {r['window_s']:g} s; reclaims {r['reclaims']} (p50 {_ms(rs['p50'])}, p99 {_ms(rs['p99'])}"
          " each, bucket bounds)")
    return 0


def cmd_evict(args: argparse.Namespace) -> int:
    with _client(args) as c:
        r = c.evict(parse_size(args.bytes) if args.bytes else 0, args.all, args.ns)
    _out(args, r, f"evicted {r['blocks']} block(s), {format_size(r['bytes'])}")
    return 0


def cmd_flush(args: argparse.Namespace) -> int:
    """Exit status 0 when everything is durable (or written, under ssd.sync never), 1 otherwise."""
    t0 = time.perf_counter()
    with _client(args) as c:
        r = c.flush_durable(args.timeout)
    took = time.perf_counter() - t0
    says = {"durable": "on disk and synced", "unsynced": "written, not synced (ssd.sync is never)",
            "timeout": f"not all on disk by the deadline: {r['pending']} still on their way",
            "failed": f"{r['failed']} could not be written (see the daemon's log)",
            "no_ssd_tier": "this daemon has no SSD tier (set ssd.dir): nothing can be made durable"}
    _out(args, {**r, "seconds": took}, f"{r['durability']}: {r['blocks']} block(s) {says.get(r['durability'], '')} "
                                       f"in {took:.2f} s")
    return 0 if r["durability"] in ("durable", "unsynced") else 1


def cmd_hint(args: argparse.Namespace) -> int:
    """Exit status 0 whether the daemon took the hint or ignored it (it says which); 1 if it refused it."""
    kind = f"session_{args.kind}" if args.session and args.kind != "call" else args.kind
    fields: dict[str, Any] = {"session" if args.session else "workflow": args.workflow}
    for name in ("type", "agent", "step", "next"):
        if getattr(args, name) is not None:
            fields[name] = getattr(args, name)
    if args.priority is not None:
        fields["priority"] = int(args.priority) if args.priority.isdigit() else args.priority
    with _client(args) as c:
        r = c.hint(kind, **fields)
    state = "active" if r["active"] else "not active"
    text = f"{r['workflow']}: {state}, {r['steps']} step(s)"
    _out(args, r, f"{text} — ignored: {r['ignored']}" if "ignored" in r else text)
    return 0


def cmd_workflows(args: argparse.Namespace) -> int:
    with _client(args) as c:
        rows = c.workflows(args.limit)
    headers = ["workflow", "type", "last agent", "steps", "idle", "priority", "next"]
    table = [[w["workflow"], w["type"] or "-", w["agent"] or "-", w["steps"], f"{w['idle_s']:.1f} s",
              "-" if w["priority"] is None else w["priority"], " ".join(w["next"]) or "-"] for w in rows]
    if any(w["tenant"] for w in rows):                   # tenants configured: say whose each one is
        headers.insert(1, "tenant")
        for row, w in zip(table, rows):
            row.insert(1, w["tenant"] or "-")
    _out(args, rows, _table(headers, table) if rows else "no active workflows")
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    from kvstore.tiers.ssd.store import SsdStore, StoreLocked

    try:
        store = SsdStore(args.dir, capacity=1 << 62).open()
    except StoreLocked as e:
        print(f"kvstore: {e}; stop the daemon before verifying", file=sys.stderr)
        return 1
    except OSError as e:                # a directory refused (kvstore.private_dir.NotPrivateDir) or unreadable
        print(f"kvstore: cannot verify {args.dir}: {e.strerror or e}", file=sys.stderr)
        return 1
    try:
        bad = store.verify(fix=args.fix)
        data = {"records": len(store.index) + (len(bad) if args.fix else 0), "bad": [
            {"file": f, "record": r, "reason": why} for f, r, why in bad], "fixed": args.fix,
            "skipped_files": store.counters["skipped_files"]}
    finally:
        store.close()
    text = _table(["file", "record", "reason"], [[b["file"], b["record"], b["reason"]] for b in data["bad"]])
    summary = (f"{data['records']} record(s) checked, {len(bad)} bad"
               + (", quarantined" if args.fix and bad else ("; run with --fix to quarantine them" if bad else "")))
    _out(args, data, f"{text}\n\n{summary}" if bad else summary)
    return 1 if bad and not args.fix else 0
