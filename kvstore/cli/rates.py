"""What happened between two samples of the daemon — its `stats` reply and its `list` of namespaces — as rates per
second over the interval: what `kvstore top` shows and prints with `--json`. The daemon does no new work for it.

One definition per figure, shared with `kvstore stats`: a hit rate is kvstore.daemon.admin.hit_rates (the daemon's
own, which `stats` and Prometheus show since start) applied to the interval's counters; a tenant's hit rate is its
hits over its hits and misses, as `kvstore tenants` has it. Figures the daemon does not count are None, never
guessed — with one exception, marked: bytes per second are blocks per second times the namespaces' block size,
exact when every namespace has the same size (`bytes_exact`), else an estimate at their mean size weighted by the
blocks each holds. Per namespace the daemon counts only the blocks held, so a namespace's rate is the change in
its blocks (net of puts and evictions)."""
from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

from kvstore.histogram import bucket_quantile

SORTS = ("activity", "hit", "held", "evictions", "name")      # `--sort`, and the order `s` cycles through


@dataclass(frozen=True)
class Sample:
    stats: dict[str, Any]
    listing: dict[str, Any]
    at: float                               # time.monotonic() when taken


def sample(c: Any) -> Sample:
    """Two round trips: the stats op and the list of namespaces (all of them for an admin, else its tenant's)."""
    return Sample(c.stats(), c.list(), time.monotonic())


def interval(before: Sample, after: Sample) -> dict[str, Any]:
    """The figures of one interval (`kvstore top --json` prints one such object a line). A daemon that restarted
    in between (another pid) counts from zero: its first interval's rates are since its start."""
    b, a = before.stats, after.stats
    if b.get("pid") != a.get("pid"):
        b = {"counters": {}, "tenants": {"rows": []}}
    dt = max(after.at - before.at, 1e-9)
    size, exact = block_bytes(after.listing)
    spaces = namespace_rates(before.listing, after.listing, dt)
    tenants = tenant_rates(b, a, dt)
    for t in tenants:                   # its namespaces' bytes got and put (each at its own block size: exact)
        t["bytes_per_s"] = sum(n["bytes_per_s"] for n in spaces if n["tenant"] == t["tenant"])
    return {"time": time.time(), "seconds": dt, "daemon": daemon_figures(a),
            "ops": op_rates(b, a, dt, size, exact), "hit_rates": interval_hit_rates(b, a),
            "since_start": {"hit_rates": a.get("hit_rates"), "ceiling": _ceiling(a)},
            "tenants": tenants, "namespaces": spaces, "movement": movement(b, a, dt),
            "paths": traffic_rates(b, a, dt)}


def daemon_figures(s: dict[str, Any]) -> dict[str, Any]:
    """Uptime, state (ready, or an SSD tier's scan state: scanning, validating), connections, and used/capacity
    per tier."""
    tiers = {t["tier"]: {"used_bytes": t["used_bytes"], "capacity_bytes": t["capacity_bytes"]} for t in s["tiers"]}
    scans = [t["scan"] for t in s["tiers"] if t.get("scan", {}).get("state", "ready") != "ready"]
    state = {"state": "ready"} if not scans else {
        "state": scans[0]["state"], "scanned": scans[0].get("scanned"), "records": scans[0].get("records")}
    return {"version": s.get("version"), "pid": s.get("pid"), "uptime_s": s["uptime_s"], **state,
            "connections": s["connections"], "namespaces": s["namespaces"], "tiers": tiers}


def block_bytes(listing: dict[str, Any]) -> tuple[float | None, bool]:
    """The bytes of one block, and whether that is exact: every namespace has one size (else their mean, weighted
    by the blocks each holds); None without a namespace."""
    ns = listing.get("namespaces", [])
    sizes = {n["slot_bytes"] for n in ns}
    if len(sizes) <= 1:
        return (sizes.pop() if sizes else None), True
    held = sum(n["blocks"] for n in ns)
    if not held:
        return sum(sizes) / len(sizes), False
    return sum(n["slot_bytes"] * n["blocks"] for n in ns) / held, False


def _delta(b: dict[str, Any], a: dict[str, Any], key: str) -> int:
    return int(a.get(key, 0) - b.get(key, 0))


def share(part: float, whole: float) -> float | None:
    return part / whole if whole else None


def op_rates(b: dict[str, Any], a: dict[str, Any], dt: float, size: float | None,
             exact: bool) -> dict[str, Any]:
    """Lookups (calls and blocks asked), gets and puts (blocks, bytes) per second."""
    cb, ca = b.get("counters", {}), a["counters"]
    looked = _delta(cb, ca, "hits") + _delta(cb, ca, "misses")
    gets, puts = _delta(cb, ca, "gets"), _delta(cb, ca, "puts")
    return {"lookups_per_s": _delta(cb, ca, "lookups") / dt, "lookup_blocks_per_s": looked / dt,
            "get_blocks_per_s": gets / dt, "put_blocks_per_s": puts / dt,
            "get_bytes_per_s": None if size is None else gets * size / dt,
            "put_bytes_per_s": None if size is None else puts * size / dt, "bytes_exact": exact}


def interval_hit_rates(b: dict[str, Any], a: dict[str, Any]) -> dict[str, dict[str, float | None]]:
    """The daemon's hit rates per op (lookup, acquire) and tier (host, lower, miss), of this interval alone."""
    from kvstore.daemon.admin import hit_rates

    cb, ca = b.get("counters", {}), a["counters"]
    return hit_rates(Counter({k: _delta(cb, ca, k) for k in ca}))


def _ceiling(s: dict[str, Any]) -> float | None:
    return ((s.get("workflows") or {}).get("ceiling") or {}).get("hit_rate")


def tenant_rates(b: dict[str, Any], a: dict[str, Any], dt: float) -> list[dict[str, Any]]:
    """Per tenant: blocks looked up per second and their hit rate this interval (and since start), bytes held in
    the host pool and on SSD, evictions per second from each."""
    old = {r["tenant"]: r for r in (b.get("tenants") or {}).get("rows", [])}
    rows = []
    for r in (a.get("tenants") or {}).get("rows", []):
        o = old.get(r["tenant"], {})
        hits, looked = _delta(o, r, "hits"), _delta(o, r, "hits") + _delta(o, r, "misses")
        rows.append({"tenant": r["tenant"], "lookup_blocks_per_s": looked / dt, "hit_rate": share(hits, looked),
                     "hit_rate_since_start": r.get("hit_rate"), "held_bytes": r["used_bytes"],
                     "quota_bytes": r.get("quota_bytes"), "ssd_held_bytes": r.get("ssd_used_bytes"),
                     "evictions_per_s": _delta(o, r, "evictions") / dt,
                     "ssd_evictions_per_s": _delta(o, r, "ssd_evictions") / dt if "ssd_evictions" in r else None})
    return rows


def namespace_rates(b: dict[str, Any], a: dict[str, Any], dt: float) -> list[dict[str, Any]]:
    """Per namespace (model, share group): lookups per second and the hit rate of the blocks they asked for this
    interval, bytes per second got and put (its own block size: exact), blocks and bytes held, blocks on SSD, and
    the change in its host blocks per second. A namespace the daemon forgot and registered again starts afresh."""
    old = {(n["id"], n["digest"]): n for n in b.get("namespaces", [])}
    on_ssd = {r["digest"]: r["blocks"] for r in a.get("ssd", [])}
    rows = []
    for n in a.get("namespaces", []):
        o = old.get((n["id"], n["digest"]), {})
        hits, looked = _delta(o, n, "hits"), _delta(o, n, "hits") + _delta(o, n, "misses")
        moved = _delta(o, n, "got") + _delta(o, n, "put")
        rows.append({"id": n["id"], "tenant": n.get("tenant", ""), "model": n["model"], "group": n["group"],
                     "kv_group": n.get("kv_group", ""), "blocks": n["blocks"], "held_bytes": n["bytes"],
                     "block_bytes": n["slot_bytes"], "ssd_blocks": on_ssd.get(n["digest"]) if "ssd" in a else None,
                     "blocks_per_s": (_delta(o, n, "blocks") if o else 0) / dt,
                     "lookups_per_s": _delta(o, n, "lookups") / dt, "hit_rate": share(hits, looked),
                     "bytes_per_s": moved * n["slot_bytes"] / dt})
    return rows


def movement(b: dict[str, Any], a: dict[str, Any], dt: float) -> dict[str, Any]:
    """Blocks moved between tiers per second; the predictive prefetch, the write-through and the remote tier where
    the daemon has them (else None)."""
    cb, ca = b.get("counters", {}), a["counters"]
    out: dict[str, Any] = {f"{k}_per_s": _delta(cb, ca, k) / dt for k in (
        "evictions", "demotions", "promotions", "dropped", "prefetched", "written_through", "published")}
    pb, pa = ((s.get("workflows") or {}).get("prefetch") for s in (b, a))
    out["prefetch"] = None if pa is None else {"landed_per_s": _delta(pb or {}, pa, "landed") / dt,
                                               "used_per_s": _delta(pb or {}, pa, "used") / dt,
                                               "precision": pa.get("precision")}
    out["write_through"] = _write_through(b.get("write_through") or {}, a.get("write_through"))
    out["remote"] = _remote(b, a, dt)
    return out


def _write_through(wb: dict[str, Any], wa: dict[str, Any] | None) -> dict[str, Any] | None:
    """Blocks on their way to disk, the oldest one's age, and the lag commit → synced of this interval's blocks."""
    if not wa or "lag" not in wa:
        return None
    buckets = _bucket_delta(wa["lag"]["buckets"], (wb.get("lag") or {}).get("buckets"))
    return {"enabled": wa.get("enabled"), "pending": wa.get("pending", 0),
            "oldest_pending_s": wa.get("oldest_pending_s", 0.0), "synced": sum(buckets),
            "lag_p50_s": quantile(buckets, 0.5), "lag_p99_s": quantile(buckets, 0.99)}


def _remote(b: dict[str, Any], a: dict[str, Any], dt: float) -> dict[str, Any] | None:
    """Whether the remote store answers, and this node's puts and gets to it per second."""
    ra = next((t for t in a["tiers"] if t["tier"] == "remote"), None)
    if ra is None:
        return None
    rb: dict[str, Any] = next((t for t in b.get("tiers", []) if t["tier"] == "remote"), {})
    cb, ca = rb.get("counters", {}), ra.get("counters", {})
    return {"up": ra.get("up"), "puts_per_s": _delta(cb, ca, "puts") / dt, "gets_per_s": _delta(cb, ca, "gets") / dt,
            "unreachable_per_s": _delta(cb, ca, "unreachable") / dt, "staged_bytes": ra.get("staged_bytes")}


def _bucket_delta(after: list[int], before: list[int] | None) -> list[int]:
    return [x - y for x, y in zip(after, before)] if before else list(after)


def quantile(buckets: list[int], q: float) -> float | None:
    """The bucket bound holding the q-quantile; None beyond the last bound (strict JSON has no Infinity)."""
    seconds = bucket_quantile(buckets, q)
    return None if seconds == float("inf") else seconds


def traffic_rates(before: dict[str, Any], after: dict[str, Any], seconds: float) -> list[dict[str, Any]]:
    """Per path and lane, what happened between two stats snapshots: throughput, transfers per second, and the
    latency percentiles of just the transfers in between (from the histograms' bucket differences)."""
    old = {(p["path"], lane): r for p in before.get("traffic", []) for lane, r in p["lanes"].items()}
    rows = []
    for p in after.get("traffic", []):
        for lane, r in p["lanes"].items():
            o = old.get((p["path"], lane), {})
            buckets = _bucket_delta(r["latency"]["buckets"], (o.get("latency") or {}).get("buckets"))
            rows.append({"path": p["path"], "lane": lane, "bytes_per_s": _delta(o, r, "bytes") / seconds,
                         "transfers_per_s": _delta(o, r, "transfers") / seconds, "queued": r["queued"],
                         "in_flight": r["in_flight"], "p50_s": quantile(buckets, 0.5),
                         "p99_s": quantile(buckets, 0.99), "rejected": _delta(o, r, "rejected")})
    return rows


def sort_key(order: str, kind: str) -> Any:
    """The key that sorts tenant rows (`kind` "tenant") or namespace rows by `order` (one of SORTS), most first;
    `name` sorts alphabetically. A figure a row lacks sorts last."""
    def key(r: dict[str, Any]) -> Any:
        if order == "name":
            return (r["tenant"],) if kind == "tenant" else (r["model"], r["group"], r["id"])
        figure = {"activity": r["lookup_blocks_per_s"] if kind == "tenant" else
                  r.get("lookups_per_s", 0.0) + abs(r["blocks_per_s"]),
                  "hit": r.get("hit_rate"), "held": r["held_bytes"], "evictions": r.get("evictions_per_s")}[order]
        return (figure is None, -(figure or 0.0), -r["held_bytes"])
    return key


def select(frame: dict[str, Any], order: str, tenant: str | None = None, ns: str | None = None) -> dict[str, Any]:
    """The interval's tenant and namespace rows sorted by `order`, and kept to one tenant (`tenant`) or to the
    namespaces whose id, model or share group is `ns` (and their tenants)."""
    tenants, spaces = frame["tenants"], frame["namespaces"]
    if tenant is not None:
        tenants = [r for r in tenants if r["tenant"] == tenant]
        spaces = [n for n in spaces if n["tenant"] == tenant]
    if ns is not None:
        spaces = [n for n in spaces if ns in (str(n["id"]), n["model"], n["group"])]
        tenants = [r for r in tenants if r["tenant"] in {n["tenant"] for n in spaces}]
    return {**frame, "sort": order, "tenants": sorted(tenants, key=sort_key(order, "tenant")),
            "namespaces": sorted(spaces, key=sort_key(order, "namespace"))}
