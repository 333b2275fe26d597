"""The operator's ops: stats (and the snapshot Prometheus serves), list, resize and evict. Like every op they run
under the state lock; a lower tier's resize, which may wait for a write in flight, runs without it. `list` of a
namespace's keys and `evict` walk in chunks (at most CHUNK_BLOCKS blocks and CHUNK_SLOTS slots each) and let go of
the lock between chunks, so that other clients' requests are served meanwhile (counter `admin_chunks`); the
evicted blocks' demotion copies are made there too. What a chunked op reports is what it saw: blocks stored or
removed by others meanwhile may or may not be in it.

Resize, evict and `list` of a namespace the connection did not say hello to need the admin role
(server.admin_uids, kvstore.daemon.tenants): others get `forbidden`. `list` without it shows only the connection's
own tenant's namespaces; `stats` is open to all (it shows no key)."""
from __future__ import annotations

import os
import time
from collections import Counter
from typing import TYPE_CHECKING, Any

from kvstore import __version__, workers
from kvstore.daemon import process
from kvstore.daemon.hints import unscoped
from kvstore.daemon.tenants import Conn, forbidden, tenant_of
from kvstore.index import NamespaceEntry
from kvstore.policy import Explaining, Reporting
from kvstore.protocol import HASH_BYTES, Code, ProtocolError
from kvstore.testpoints import pause_point
from kvstore.tiers import PacedTier, TenantBooks

if TYPE_CHECKING:
    from kvstore.daemon.state import State

COUNTERS = ("lookups", "hits", "hits_host", "hits_lower", "hits_remote", "misses", "acquired_asked", "acquired_host",
            "acquired_lower", "puts", "gets", "evictions", "deletes", "aborts", "demotions", "dropped",
            "promotions", "prefetched", "prefetch_skipped", "prefetch_busy", "prefetch_cancelled", "written_through",
            "write_through_skipped", "held_cap", "reservations_expired", "pins_expired", "idle_closed",
            "segment_moves", "segment_moves_inline", "segments_hollowed", "admin_chunks", "kept_own_chain",
            "not_admitted", "reserve_evictions", "published", "publish_skipped", "publish_gone", "reads_ssd",
            "reads_remote", "reads_donated", "landings",
            "blocks_compacted", "forks", "evictions_coupled")
CHUNK_BLOCKS = 256          # blocks evicted or listed per hold of the state lock
EVICT_ROOM_WAIT_S = 30.0    # an operator's eviction waits this long at most for staging room per chunk
CHUNK_SLOTS = 8192          # slots of a namespace's class looked at per hold


def op_stats(st: State, h: Conn, m: dict[str, Any]) -> dict[str, Any]:
    """Everything `kvstore stats` shows; the host pool's per-tenant rows only for the admin and for the
    connection's own tenant (other tenants' names are not another tenant's to see)."""
    s = snapshot(st)
    if not h.admin:
        host = s["tiers"][0]
        host["classes"] = [c for c in host["classes"] if c["tenant"] == h.tenant]
        s["tenants"]["rows"] = [r for r in s["tenants"]["rows"] if r["tenant"] == h.tenant]
    return s


def op_list(st: State, h: Conn, m: dict[str, Any]) -> dict[str, Any]:
    """Namespaces (all of them for an admin, else the connection's tenant's), their blocks per lower tier, and with
    `ns` up to `limit` of its keys and slots."""
    if "ns" in m and not h.admin and m["ns"] not in h.namespaces:
        raise forbidden(f"list of namespace {m['ns']}, which this connection did not say hello to,")
    tenant = None if h.admin else tenant_of(st.config, h)
    shown = [n for n in st.index.namespaces.values() if tenant is None or n.tenant == tenant]
    rows = []
    for n in shown:
        s = n.spec
        rows.append({"id": n.id, "model": s.model, "group": s.share_group, "adapter": s.adapter,
                     "tp": f"{s.tp_rank}/{s.tp_size}", "role": s.role, "digest": n.digest.hex(), "tenant": n.tenant,
                     "geometry": s.geometry.to_dict(), "slot_bytes": n.slot_bytes, "blocks": n.blocks,
                     "bytes": n.blocks * n.slot_bytes, "models": sorted(n.models), "salt": s.salt,
                     "kv_group": kv_group_of(s.salt), "lookups": n.lookups, "hits": n.hits, "misses": n.misses,
                     "got": n.got, "put": n.put})
    reply: dict[str, Any] = {"namespaces": rows, "groups": _groups(shown), **_pairs(st, shown)}
    known = {n.digest: n.id for n in shown}
    for tier in st.lower:                        # an admin sees every digest; others their tenant's registered ones
        reply[tier.name] = [{"digest": d.hex(), "ns": known.get(d), "blocks": n}
                            for d, n in tier.namespaces().items() if tenant is None or d in known]
    if "ns" in m:
        ns = st.index.namespaces.get(m["ns"])
        if ns is None:
            raise ProtocolError(Code.UNKNOWN_NAMESPACE, f"list: no namespace {m['ns']}")
        reply["keys"] = _keys(st, ns, min(m.get("limit", 100), 10000))
        if m.get("tags"):
            reply["tags"] = [_tags(st, ns, k, tenant) for k, _ in reply["keys"]]
    return reply


def kv_group_of(salt: str) -> str:
    """The KV group a hybrid model's namespace holds ("1:window64", "0:state", ...), as its connector labels it in
    the salt (kvstore.connectors.kv_groups); "" for a model with one group."""
    _, found, rest = salt.rpartition("|kv_group=")
    return rest.split("|", 1)[0] if found else ""


def _groups(shown: list[NamespaceEntry]) -> list[dict[str, Any]]:
    """Share groups (ICaRus): per tenant and group, the models that said hello to its namespaces and what they
    hold. `declared`: a group named in the engines' configuration (else the model is its own group)."""
    groups: dict[tuple[str, str], dict[str, Any]] = {}
    for n in shown:
        g = groups.setdefault((n.tenant, n.spec.share_group), {
            "group": n.spec.share_group, "tenant": n.tenant, "declared": bool(n.spec.group), "models": set(),
            "namespaces": 0, "blocks": 0, "bytes": 0})
        g["models"] |= n.models
        g["namespaces"] += 1
        g["blocks"] += n.blocks
        g["bytes"] += n.blocks * n.slot_bytes
    return [{**g, "models": sorted(g["models"])} for g in groups.values()]


def _pairs(st: State, shown: list[NamespaceEntry]) -> dict[str, list[dict[str, Any]]]:
    """Base/residual pairs and forks (ForkKV) among the shown namespaces. Per base namespace: its agents (residual
    namespaces paired with it), the bytes of both parts in the host pool, and what the same agents' blocks would
    take stored whole, one full block per agent (`unified_bytes`). Per fork: the context's length, the base blocks
    it inherited then and the host pool's prefix of it now, for the base and the child's residuals."""
    ids = {n.id for n in shown}
    get = st.index.namespaces.get
    pairs = []
    for bid, rids in st.index.namespaces.pairs.residuals.items():
        base = get(bid)
        agents = [r for rid in sorted(rids) if (r := get(rid)) is not None and rid in ids]
        if base is None or bid not in ids or not agents:
            continue
        pairs.append({"base": bid, "group": base.spec.share_group, "agents": [r.id for r in agents],
                      "adapters": [r.spec.adapter for r in agents], "base_blocks": base.blocks,
                      "base_bytes": base.blocks * base.slot_bytes,
                      "residual_blocks": sum(r.blocks for r in agents),
                      "residual_bytes": sum(r.blocks * r.slot_bytes for r in agents),
                      "unified_bytes": sum(r.blocks for r in agents) * base.slot_bytes})
    forks = []
    for f in st.index.namespaces.pairs.forks.values():
        base, child = get(f.base), get(f.child)
        if base is None or child is None or f.child not in ids:
            continue
        forks.append({"child": f.child, "adapter": child.spec.adapter, "parent": f.parent, "base": f.base,
                      "context_blocks": len(f.context) // HASH_BYTES, "inherited": f.inherited,
                      "base_held": st.index.host_prefix(base, f.context),
                      "residual_held": st.index.host_prefix(child, f.context), "at": f.at})
    return {"pairs": pairs, "forks": forks}


def _tags(st: State, ns: NamespaceEntry, block_hash: bytes, tenant: str | None) -> dict[str, Any] | None:
    """A listed block's standing and tags under the workflow policy (None under LRU, or gone since the listing):
    the workflows by their own ids — of the connection's tenant only; the admin sees every tenant's, as
    "tenant/id" where tenants are configured — and those of them done with it (`done`: the block's class is
    measured dead for them, kvstore.workflows.rereads)."""
    policy = st.index.policy
    got = policy.describe(ns.key(block_hash)) if isinstance(policy, Explaining) else None
    if got is None:
        return None
    mine = [(w, unscoped(w)) for w in got["workflows"] if tenant is None or unscoped(w)[0] == tenant]
    label = {w: f"{t}/{name}" if tenant is None and t else name for w, (t, name) in mine}
    return {"standing": got["standing"], "touched": got["touched"],
            "workflows": {label[w]: got["agents"].get(w, []) for w, _ in mine},
            "done": [label[w] for w in got.get("done", ()) if w in label]}


def _keys(st: State, ns: NamespaceEntry, limit: int) -> list[list[Any]]:
    """Up to `limit` of the namespace's keys and slots, a chunk at a time."""
    walk = st.index.walk(ns)
    keys: list[list[Any]] = []
    if limit <= 0:
        return keys
    while True:
        keys += ([k, gid] for k, gid in st.index.keys_some(walk, CHUNK_SLOTS, min(CHUNK_BLOCKS, limit - len(keys))))
        if walk.done or len(keys) >= limit:
            return keys
        _between_chunks(st)
        if st.index.namespaces.get(ns.id) is not ns:
            return keys                         # forgotten meanwhile: no block of it is left


def op_resize(st: State, h: Conn, m: dict[str, Any]) -> dict[str, Any]:
    if not h.admin:
        raise forbidden("resize")
    name = m.get("tier", "host")
    if name != "host":
        return _resize_lower(st, name, m["bytes"])
    seg = st.pool.segment_bytes
    if m["bytes"] < seg:
        raise ProtocolError(Code.BAD_REQUEST, f"resize: {m['bytes']} bytes is below one segment ({seg} bytes)")
    quotas = st.index.quotas.total()
    if m["bytes"] < quotas:
        raise ProtocolError(Code.BAD_REQUEST, f"resize: the tenants' host quotas total {quotas} bytes, above "
                                              f"{m['bytes']}: lower them first (kvstore tenants set NAME --host N)")
    r = st.index.resize(m["bytes"])
    return {"capacity": r.capacity, "released_segments": r.released_segments, "evicted": r.evicted,
            "draining_bytes": r.draining_bytes, "mapped_bytes": st.pool.mapped_bytes, "seconds": r.seconds}


def _resize_lower(st: State, name: str, nbytes: int) -> dict[str, Any]:
    tier = st.lower.named(name)
    if tier is None:
        names = ", ".join(["host", *(t.name for t in st.lower)])
        if name == "ssd":
            raise ProtocolError(Code.BAD_REQUEST, "resize: this daemon has no SSD tier (set ssd.dir)")
        raise ProtocolError(Code.BAD_REQUEST, f"resize: unknown tier {name[:32]!r}; tiers: {names}")
    t0 = time.perf_counter()
    st.lock.release()                       # may wait for a write batch in flight: not under the state lock
    try:
        r = tier.resize(nbytes)
    except ValueError as e:
        raise ProtocolError(Code.BAD_REQUEST, f"resize: {e}") from None
    except RuntimeError as e:
        raise ProtocolError(Code.BUSY, f"resize: {e}") from None
    finally:
        st.lock.acquire()
    return {"tier": name, "released_segments": 0, "draining_bytes": 0, "seconds": time.perf_counter() - t0, **r}


def op_tenants(st: State, h: Conn, m: dict[str, Any]) -> dict[str, Any]:
    """Per tenant: quota, used, borrowed, lent, hit rate, evictions, reclaims (kvstore.index.quotas) and its eviction
    policy: every tenant's row for the admin, the connection's own otherwise."""
    q = st.index.quotas
    rows = _tenant_rows(st)
    if not h.admin:
        mine = tenant_of(st.config, h)
        rows = [r for r in q.rows([mine]) if r["tenant"] == mine]
        for r in rows:
            r.update(_ssd_rows(st, [mine]).get(mine, {}))
    chosen = {t.name: t.policy for t in st.config.tenants if t.policy}
    for r in rows:
        r["policy"] = chosen.get(r["tenant"], st.config.pool.eviction)
    tier = _ssd_tier(st)
    return {"tenants": rows, "capacity_bytes": st.pool.capacity, "mapped_bytes": st.pool.mapped_bytes,
            "charged_bytes": st.pool.charged_bytes,
            "fragmentation": q.fragmentation(), **q.stats(),
            "ssd_quotas": bool(tier is not None and tier.quotas_on)}


def _tenant_rows(st: State) -> list[dict[str, Any]]:
    """Every tenant's host row with its SSD figures (where the daemon has an SSD tier)."""
    names = [t.name for t in st.config.tenants]
    ssd = _ssd_rows(st, names)
    rows = st.index.quotas.rows(names + list(ssd))
    for r in rows:
        r.update(ssd.get(r["tenant"], {}))
    return rows


def _ssd_tier(st: State) -> TenantBooks | None:
    """The lower tier that keeps tenants' books (the SSD's), or None."""
    return next((t for t in st.lower if isinstance(t, TenantBooks)), None)


def _ssd_rows(st: State, tenants: list[str]) -> dict[str, dict[str, int]]:
    tier = _ssd_tier(st)
    return tier.tenant_rows(tenants) if tier is not None else {}


def op_tenant_quota(st: State, h: Conn, m: dict[str, Any]) -> dict[str, Any]:
    """Change a tenant's host quota, SSD quota or both online: O(1), nothing moves now
    (kvstore.index.quotas.Quotas.set, kvstore.tiers.ssd.owners.SsdQuotas.set)."""
    if not h.admin:
        raise forbidden("tenants set")
    name = m["tenant"]
    known = {t.name for t in st.config.tenants} | {c.tenant for c in st.pool.classes.values()} | set(
        st.index.quotas.quotas)
    if name not in known and name != "" and not name.startswith("uid:"):
        raise ProtocolError(Code.BAD_REQUEST, f"tenants set: no tenant {name[:64]!r}; tenants: "
                                              f"{', '.join(sorted(repr(t) for t in known)) or 'none'}")
    if m.get("host") is None and m.get("ssd") is None:
        raise ProtocolError(Code.BAD_REQUEST, "tenants set: give host, ssd or both (bytes)")
    tier = _ssd_tier(st)
    if m.get("ssd") is not None and tier is None:
        raise ProtocolError(Code.BAD_REQUEST, "tenants set: this daemon has no SSD tier (set ssd.dir)")
    reply: dict[str, Any] = {"tenant": name}
    try:
        if m.get("ssd") is not None and tier is not None:
            reply["ssd_before"] = tier.set_quota(name, m["ssd"])
            reply["ssd"] = m["ssd"]
        if m.get("host") is not None:
            reply["host_before"] = st.index.quotas.quota(name)
            try:
                st.index.quotas.set(name, m["host"])
            except ValueError:
                if "ssd" in reply and tier is not None:   # all or nothing: the SSD quota goes back as it was
                    tier.set_quota(name, reply["ssd_before"])
                raise
            reply["host"] = m["host"]
    except ValueError as e:
        raise ProtocolError(Code.BAD_REQUEST, f"tenants set: {e}") from None
    reply["used_bytes"] = st.index.quotas.held(name)
    return reply


def op_evict(st: State, h: Conn, m: dict[str, Any]) -> dict[str, Any]:
    if not h.admin:
        raise forbidden("evict")
    if not m.get("all") and not m.get("bytes"):
        raise ProtocolError(Code.BAD_REQUEST, "evict: give 'bytes' (how much to free) or 'all': true")
    if "ns" in m and st.index.namespaces.get(m["ns"]) is None:
        raise ProtocolError(Code.UNKNOWN_NAMESPACE, f"evict: no namespace {m['ns']}")
    plan = st.index.evict_plan(m.get("ns"), m.get("bytes", 0), bool(m.get("all")))
    while not st.index.evict_some(plan, _staging_room(st)):
        _between_chunks(st)
    return {"blocks": plan.blocks, "bytes": plan.freed}


def _staging_room(st: State) -> int:
    """(Under the state lock, which it may let go of.) How many blocks the next chunk of an operator's eviction
    may evict: CHUNK_BLOCKS, or as many as the first lower tier can stage now after waiting (without the lock) for
    its writes to make room. Evicting 1 GiB at once into 256 MiB of SSD staging dropped three blocks in four."""
    first = st.lower.first if st.lower else None
    slot = max((c.slot_bytes for c in st.pool.classes.values()), default=0)
    if not isinstance(first, PacedTier) or not slot:
        return CHUNK_BLOCKS
    st.lock.release()
    try:
        room = first.wait_room(CHUNK_BLOCKS * slot, EVICT_ROOM_WAIT_S)
    finally:
        st.lock.acquire()
    return max(1, min(CHUNK_BLOCKS, room // slot))


def _between_chunks(st: State) -> None:
    """(Called under the state lock, which it lets go of and takes again.) Other requests run now; the demotion
    copies of the blocks the last chunk evicted are made meanwhile, and their slots let go of."""
    st.counters["admin_chunks"] += 1
    st.lock.release()
    try:
        st.copy_deferred(done=False)
        time.sleep(0)                       # a thread waiting for the lock takes it now, not after the next chunk
        pause_point("between_chunks")
    finally:
        st.lock.acquire()


def snapshot(st: State) -> dict[str, Any]:
    """(Under the state lock.) Everything `kvstore stats` shows, and Prometheus serves."""
    pool, idx = st.pool, st.index
    classes = [{"slot_bytes": c.slot_bytes, "tenant": c.tenant, "segments": len(c.segments),
                "slots": sum(s.nslots for s in c.segments.values()),
                "free": sum(len(s.free) for s in c.segments.values())} for c in pool.classes.values()]
    host = {"tier": "host", "capacity_bytes": pool.capacity, "mapped_bytes": pool.mapped_bytes,
            "used_bytes": pool.used_bytes, "resident_bytes": pool.resident_bytes(), "blocks": len(idx.table),
            "reaping_bytes": pool.reaping_bytes, "retiring_bytes": pool.retiring_bytes,
            "punched_bytes": pool.punched_bytes, "charged_bytes": pool.charged_bytes,
            "segments": len(pool.segments), "segment_bytes": pool.segment_bytes, "classes": classes,
            "eviction": {"policy": idx.policy.name,
                         **(idx.policy.report() if isinstance(idx.policy, Reporting) else {})}}
    counters = {k: st.counters[k] for k in COUNTERS}
    counters["refused_connections"] = st.metrics.refused_connections
    counters["accept_errors"] = st.metrics.accept_errors
    return {"version": __version__, "pid": os.getpid(), "uptime_s": time.time() - st.started,
            "socket": st.config.server.socket, "counters": counters, "tiers": [host, *st.lower.stats()],
            "traffic": st.traffic.stats(), "errors": dict(st.metrics.errors), "connections": st.connections,
            "latency": {op: hist.to_dict() for op, hist in st.metrics.latency.items()}, "process": process.state(),
            "workers": workers.stats(), "write_through": st.write_through.stats() if st.write_through else None,
            "publish": st.publisher.stats() if st.publisher else None,
            "hit_rates": hit_rates(st.counters), "workflows": workflow_stats(st),
            "tenants": {"rows": _tenant_rows(st), **idx.quotas.stats()},
            **idx.stats()}


def hit_rates(c: Counter[str]) -> dict[str, dict[str, float | None]]:
    """Of the blocks lookups and acquires asked for: the shares found in the host pool, in a lower tier, and
    missed (None before any)."""
    looked, acquired = c["hits"] + c["misses"], c["acquired_asked"]
    got = c["acquired_host"] + c["acquired_lower"]
    return {"lookup": _shares(looked, c["hits_host"], c["hits_lower"], c["misses"]),
            "acquire": _shares(acquired, c["acquired_host"], c["acquired_lower"], acquired - got)}


def _shares(total: int, host: int, lower: int, miss: int) -> dict[str, float | None]:
    if not total:
        return {"host": None, "lower": None, "miss": None}
    return {"host": host / total, "lower": lower / total, "miss": miss / total}


def workflow_stats(st: State) -> dict[str, Any]:
    """The hints' books (kvstore.daemon.hints), the predictor's accuracy, the policy's retired and active blocks
    where it keeps them, and the hit-rate ceiling: 1 − distinct keys looked up / keys looked up."""
    out = st.hints.stats()
    hll = st.looked_up
    out["ceiling"] = {"looked_up": hll.added, "distinct": round(hll.distinct()), "hit_rate": hll.ceiling()}
    blocks = st.index.policy.counts() if isinstance(st.index.policy, Explaining) else {}
    if blocks:
        out["blocks"] = {"retired": blocks.get("retired", 0), "active": blocks.get("active", 0)}
    return out
