"""The operator's commands on the books: `ls`, `resize`, `tenants`, `evict`, `flush`, `verify`."""
from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Collection
from typing import Any

from kvstore.cli.common import client, ms, out, table_of
from kvstore.units import format_size, parse_size


def cmd_ls(args: argparse.Namespace) -> int:
    with client(args) as c:
        data = c.list(args.ns, args.limit, tags=args.tags)
    if args.tier == "ssd":
        if "ssd" not in data:
            raise ValueError("this daemon has no SSD tier (set ssd.dir)")
        rows = [[r["ns"] if r["ns"] is not None else "-", r["digest"][:12], r["blocks"]] for r in data["ssd"]]
        out(args, data["ssd"], table_of(["ns", "digest", "blocks on ssd"], rows))
        return 0
    rows = [[n["id"], n["model"], n["group"], n["adapter"] or "-", n["tp"], n["role"], n["digest"][:12],
             n["blocks"], format_size(n["bytes"]), format_size(n["slot_bytes"])] for n in data["namespaces"]]
    headers = ["ns", "model", "group", "adapter", "tp", "role", "digest", "blocks", "bytes", "block"]
    if any(n.get("kv_group") for n in data["namespaces"]):   # a hybrid model: which of its KV groups each holds
        headers.insert(3, "kv group")
        for row, n in zip(rows, data["namespaces"]):
            row.insert(3, n.get("kv_group") or "-")
    if any(n.get("tenant") for n in data["namespaces"]):     # tenants configured: say whose each one is
        headers.insert(1, "tenant")
        for row, n in zip(rows, data["namespaces"]):
            row.insert(1, n.get("tenant") or "-")
    text = table_of(headers, rows) + _sharing_tables(data)
    if "keys" in data:
        krows = [[k.hex(), f"{gid >> 32}:{gid & 0xFFFFFFFF}"] for k, gid in data["keys"]]
        kheads = ["hash", "slot"]
        if "tags" in data:
            kheads += ["standing", "touched by", "workflows (agents)"]
            for row, t in zip(krows, data["tags"]):
                row += ([t["standing"], t["touched"], _workflows_cell(t["workflows"], t.get("done", ()))] if t
                        else ["-", "-", "-"])
        text += "\n\n" + table_of(kheads, krows)
        data["keys"] = [[k.hex(), gid] for k, gid in data["keys"]]
    out(args, data, text)
    return 0


def _sharing_tables(data: dict[str, Any]) -> str:
    """Share groups that more than one model used or that engines declared, base/residual pairs and forks."""
    text = ""
    groups = [g for g in data.get("groups", []) if g["declared"] or len(g["models"]) > 1]
    if groups:
        text += "\n\nshare groups\n" + table_of(
            ["group", "models", "namespaces", "blocks", "bytes"],
            [[g["group"], ", ".join(g["models"]), g["namespaces"], g["blocks"], format_size(g["bytes"])]
             for g in groups])
    if data.get("pairs"):
        text += "\n\nbase/residual pairs (bytes as held, and as whole blocks per agent)\n" + table_of(
            ["base ns", "group", "agents", "base", "residuals", "held", "as whole blocks"],
            [[p["base"], p["group"], ", ".join(a or "-" for a in p["adapters"]), format_size(p["base_bytes"]),
              format_size(p["residual_bytes"]), format_size(p["base_bytes"] + p["residual_bytes"]),
              format_size(p["unified_bytes"])] for p in data["pairs"]])
    if data.get("forks"):
        text += "\n\nforks (context blocks: inherited at the fork; base and own residuals held now)\n" + table_of(
            ["child ns", "adapter", "parent ns", "base ns", "context", "inherited", "base held", "residuals held"],
            [[f["child"], f["adapter"] or "-", "-" if f["parent"] is None else f["parent"], f["base"],
              f["context_blocks"], f["inherited"], f["base_held"], f["residual_held"]] for f in data["forks"]])
    return text


def _workflows_cell(flows: dict[str, list[str]], done: Collection[str] = ()) -> str:
    """Each workflow with its agents; "done" where the workflow is done with the block (goes first)."""
    return ", ".join(f"{w} ({'/'.join(a) or '-'}{', done' if w in done else ''})" for w, a in flows.items()) or "-"


def cmd_resize(args: argparse.Namespace) -> int:
    if len(args.what) > 2 or (len(args.what) == 2 and args.what[0] not in ("host", "ssd")):
        raise ValueError("usage: kvstore resize [host|ssd] SIZE")
    tier = args.what[0] if len(args.what) == 2 else "host"
    with client(args) as c:
        r = c.resize(parse_size(args.what[-1]), tier)
    if tier == "ssd":
        out(args, r, f"ssd tier capacity {format_size(r['capacity'])} (files {format_size(r['mapped_bytes'])}): "
                      f"evicted {r['evicted']} block(s), in {r['seconds'] * 1e3:.2f} ms")
        return 0
    out(args, r, f"host pool capacity {format_size(r['capacity'])} (mapped {format_size(r['mapped_bytes'])}): "
                  f"released {r['released_segments']} segment(s), evicted {r['evicted']} block(s), "
                  f"{format_size(r['draining_bytes'])} draining behind pins, in {r['seconds'] * 1e3:.2f} ms")
    return 0


def cmd_tenants(args: argparse.Namespace) -> int:
    if args.action:
        if len(args.action) != 2 or args.action[0] != "set" or (args.host is None and args.ssd is None):
            raise ValueError("usage: kvstore tenants set NAME [--host SIZE] [--ssd SIZE] (the default tenant's NAME "
                             "is '')")
        with client(args) as c:
            r = c.set_quota(args.action[1], None if args.host is None else parse_size(args.host),
                            None if args.ssd is None else parse_size(args.ssd))
        said = [f"{tier} quota {format_size(r[tier + '_before'])} -> {format_size(r[tier])}"
                for tier in ("host", "ssd") if tier in r]
        out(args, r, f"tenant {r['tenant'] or '(default)'}: {', '.join(said)} (it holds "
                      f"{format_size(r['used_bytes'])} of host memory; memory moves as loads need it, nothing moves "
                      "now)")
        return 0
    with client(args) as c:
        r = c.tenants()
    if args.json:
        print(json.dumps(r))
        return 0
    rows = [[t["tenant"] or "(default)", format_size(t["quota_bytes"]), format_size(t["used_bytes"]),
             format_size(t["borrowed_bytes"]), format_size(t["lent_bytes"]),
             "-" if t["hit_rate"] is None else f"{t['hit_rate']:.1%}", t["evictions"], t["reclaims"],
             t["taken_back"], t.get("policy", "-")] for t in r["tenants"]]
    print(table_of(["tenant", "quota", "used", "borrowed", "lent", "hit rate", "evictions", "reclaimed",
                  "taken back", "policy"], rows))
    ssd = [[t["tenant"] or "(default)", format_size(t["ssd_quota_bytes"]), format_size(t["ssd_used_bytes"]),
            format_size(t["ssd_borrowed_bytes"]), t["ssd_evictions"], t["ssd_taken"]]
           for t in r["tenants"] if "ssd_used_bytes" in t]
    if ssd:
        print("\nSSD tier" + ("" if r.get("ssd_quotas") else " (no SSD quotas: one LRU per block size)"))
        print(table_of(["tenant", "quota", "used", "borrowed", "evictions", "taken by others"], ssd))
    rs = r["reclaim_seconds"]
    mode = "quotas with lending" if r["lending"] and r["active"] else "static partitions" if r["active"] else \
        "one shared LRU (no quota set)"
    print(f"\nhost pool {format_size(r['charged_bytes'])} of {format_size(r['capacity_bytes'])}; {mode}; "
          f"idle after {r['window_s']:g} s; reclaims {r['reclaims']} (p50 {ms(rs['p50'])}, p99 {ms(rs['p99'])}"
          " each, bucket bounds)")
    return 0


def cmd_evict(args: argparse.Namespace) -> int:
    with client(args) as c:
        r = c.evict(parse_size(args.bytes) if args.bytes else 0, args.all, args.ns)
    out(args, r, f"evicted {r['blocks']} block(s), {format_size(r['bytes'])}")
    return 0


def cmd_flush(args: argparse.Namespace) -> int:
    """Exit status 0 when everything is durable (or written, under ssd.sync never), 1 otherwise."""
    t0 = time.perf_counter()
    with client(args) as c:
        r = c.flush_durable(args.timeout)
    took = time.perf_counter() - t0
    says = {"durable": "on disk and synced", "unsynced": "written, not synced (ssd.sync is never)",
            "timeout": f"not all on disk by the deadline: {r['pending']} still on their way",
            "failed": f"{r['failed']} could not be written (see the daemon's log)",
            "no_ssd_tier": "this daemon has no SSD tier (set ssd.dir): nothing can be made durable"}
    out(args, {**r, "seconds": took}, f"{r['durability']}: {r['blocks']} block(s) {says.get(r['durability'], '')} "
                                       f"in {took:.2f} s")
    return 0 if r["durability"] in ("durable", "unsynced") else 1


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
    text = table_of(["file", "record", "reason"], [[b["file"], b["record"], b["reason"]] for b in data["bad"]])
    summary = (f"{data['records']} record(s) checked, {len(bad)} bad"
               + (", quarantined" if args.fix and bad else ("; run with --fix to quarantine them" if bad else "")))
    out(args, data, f"{text}\n\n{summary}" if bad else summary)
    return 1 if bad and not args.fix else 0
