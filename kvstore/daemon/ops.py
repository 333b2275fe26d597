"""One function per op: a checked request in, reply fields out. They run under the state lock, keep books through
the index and hand byte moves to the movers; no op copies block bytes (clients do that in the shared slots).
The operator's ops (stats, list, resize, evict) are in `admin`.

Each op gets the connection (`Conn`: its holdings, peer and role). `hello` fixes the connection's tenant
(kvstore.daemon.tenants) and refuses geometries below server.min_block_bytes; `segments` hands out only the
connection's own tenant's segments; `reserve` gives each reservation a lease (server.reservation_lease_s). A durable
`commit` and `flush` wait for the disk without the state lock (kvstore.movers.durability). `hint` and the hint
context of lookup, acquire, reserve and commit (`wf`, `agent`) are kept by kvstore.daemon.hints, per tenant; the
context reaches the index as a `Touch`, for the eviction policy; the keys of a lookup, acquire or reserve naming a
workflow are that workflow's chain for the predictive prefetch (kvstore.movers.predictive), which a `call` hint
with `next` starts at once and which learns from acquires which of its blocks were used. A `lookup` or `acquire`
naming a `residual` namespace answers a ForkKV pair (base and residual) in one reply, and `fork` books an agent's
fork of a context (kvstore.index.sharing)."""
from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvstore import __version__
from kvstore.daemon import admin
from kvstore.daemon.state import State
from kvstore.daemon.stream import Stream
from kvstore.daemon.tenants import Conn, resolve, tenant_of
from kvstore.index import Holdings, NamespaceEntry
from kvstore.movers.durability import NO_SSD_TIER, Ticket
from kvstore.movers.prefetch import LaneFull
from kvstore.protocol import HASH_BYTES, Code, ProtocolError, split_keys
from kvstore.protocol.geometry import GeometryError
from kvstore.protocol.keys import NamespaceSpec
from kvstore.traffic import Lane, parse_lane
from kvstore.workflows import Touch

MAX_FDS_PER_REPLY = 200     # below the kernel's SCM_MAX_FD (253)
WAIT_S = 5.0                # a prefetch with `wait` re-checks at least this often


@dataclass
class Reply:
    fields: dict[str, Any]
    fds: list[int] = field(default_factory=list)   # duplicated under the lock; the sender closes them
    close: bool = False


Handler = Callable[[State, Conn, dict[str, Any]], dict[str, Any] | Reply]


def op_ping(st: State, h: Holdings, m: dict[str, Any]) -> dict[str, Any]:
    return {"pong": True, "time": time.time()}


def op_hello(st: State, h: Conn, m: dict[str, Any]) -> dict[str, Any]:
    _fix_tenant(st, h, m.get("tenant"), m.get("secret"))
    reply: dict[str, Any] = {"version": __version__, "pid": os.getpid(), "generation": st.pool.generation,
                             "max_keys": st.config.server.max_keys_per_request, "tenant": h.tenant,
                             "reservation_lease_s": st.config.server.reservation_lease_s}
    if "namespace" in m:
        try:
            spec = NamespaceSpec.from_dict(m["namespace"])
        except GeometryError as e:
            raise ProtocolError(Code.WRONG_GEOMETRY, f"hello: {e}") from None
        except (TypeError, ValueError) as e:
            raise ProtocolError(Code.BAD_REQUEST, f"hello: {e}") from None
        g = spec.geometry
        least = st.config.server.min_block_bytes
        if g.full_bytes < least:      # tiny blocks: free lists of millions of slots built under the state lock
            raise ProtocolError(Code.WRONG_GEOMETRY, f"hello: geometry's full block is {g.full_bytes} bytes, below "
                                                     f"server.min_block_bytes ({least} bytes)")
        ns = st.index.register(spec, h)
        reply.update(ns=ns.id, digest=ns.digest.hex(), slot_bytes=g.full_bytes, layer_bytes=g.layer_bytes)
    return reply


def _fix_tenant(st: State, h: Conn, name: str | None, secret: str | None) -> None:
    """The connection's tenant, fixed at its first hello; a later hello may repeat its name, not change it."""
    if h.tenant is None:
        h.tenant = resolve(st.config, h.peer, name, secret)
    elif name and name != h.tenant:
        raise ProtocolError(Code.FORBIDDEN, f"hello: this connection speaks for tenant {h.tenant!r} since its first "
                                            f"hello; open another connection for tenant {name[:64]!r}")


def op_segments(st: State, h: Conn, m: dict[str, Any]) -> Reply:
    """Handles (memfds, sent with SCM_RIGHTS) of the segments asked for that still exist and hold the connection's
    own tenant's blocks (others are left out, as if gone), and the live ids of its tenant's segments."""
    tenant = tenant_of(st.config, h)
    ids = m["ids"][:MAX_FDS_PER_REPLY]
    found = [seg for i in ids if (seg := st.pool.segments.get(i)) is not None and seg.tenant == tenant]
    fds = [os.dup(s.fd) for s in found]
    info = [[s.id, s.slot_bytes, s.nslots] for s in found]
    h.segments.update(s.id for s in found)
    live = [sid for sid, seg in st.pool.segments.items() if seg.tenant == tenant]
    return Reply({"segments": info, "live": live, "generation": st.pool.generation}, fds)


def op_lookup(st: State, h: Conn, m: dict[str, Any]) -> dict[str, Any]:
    """The longest prefix held by any tier, and how much of it is in the host pool. With `residual` (a pair, ForkKV:
    `ns` the base namespace, `residual` an adapter's), the residual namespace's prefix of the same keys too, in the
    same reply: a residual longer than its base is a partial hit (recompute the base only)."""
    ns = st.index.namespace(m["ns"], h)
    residual = _residual_of(st, h, m, ns)
    _touch(st, h, m, ns)                            # a lookup is activity; it changes no block's standing
    n, host = _prefix(st, ns, m["keys"])
    reply: dict[str, Any] = {"n": n, "host": host}
    if residual is not None:
        rn, rhost = _prefix(st, residual, m["keys"])
        reply["residual"] = {"n": rn, "host": rhost}
    return reply


def _residual_of(st: State, h: Conn, m: dict[str, Any], base: NamespaceEntry) -> NamespaceEntry | None:
    """The request's residual namespace (field `residual`), paired with its base `ns`; None without one."""
    if "residual" not in m:
        return None
    residual = st.index.namespace(m["residual"], h)
    st.index.namespaces.pairs.pair(base, residual)
    return residual


def _prefix(st: State, ns: NamespaceEntry, blob: bytes) -> tuple[int, int]:
    """(the prefix of `blob` any tier holds, the part of it in the host pool); the part no local tier holds is
    asked of the remote store (one batched query, without the state lock). Every key asked counts toward the
    hit-rate ceiling (st.looked_up: distinct keys against keys looked up)."""
    asked = len(blob) // HASH_BYTES
    st.looked_up.add_keys(blob, int.from_bytes(ns.prefix, "little"))
    n = host = st.index.host_prefix(ns, blob)
    remote = 0                                      # blocks of the prefix only the remote store holds
    if st.lower and host < asked:                   # the rest of the prefix may be below: block by block
        for block_hash in split_keys(blob[host * HASH_BYTES:]):
            if st.index.holds(ns, block_hash):
                n += 1
                continue
            holder = st.lower.holder(ns.block_id(block_hash))
            if holder is None:
                break
            n += 1
            remote += holder is st.remote
    if st.remote is not None and n < asked:         # one question to the store for the rest, without the lock
        rest = [ns.block_id(bh) for bh in split_keys(blob[n * HASH_BYTES:])]
        st.lock.release()
        try:
            asked_store = st.remote.probe(rest)
        finally:
            st.lock.acquire()
        n += asked_store
        remote += asked_store
    st.counters["hits_remote"] += remote
    st.counters["lookups"] += 1
    st.counters["hits"] += n
    st.counters["hits_host"] += host
    st.counters["hits_lower"] += n - host
    st.counters["misses"] += asked - n
    figures = st.index.quotas.of(ns.tenant)
    figures.hits += n
    figures.misses += asked - n
    return n, host


def _touch(st: State, h: Conn, m: dict[str, Any], ns: NamespaceEntry | None = None,
           forward: bool = True) -> Touch | None:
    """The request's hint context (its `wf` and `agent` fields) for the index's policy; None without one. With
    `ns`, the request's keys become the workflow's chain (the predictive prefetch; `forward`: see its `saw`)."""
    touch = st.hints.touch(tenant_of(st.config, h), m) if "wf" in m else None
    if touch is not None and ns is not None and st.predictive is not None:
        st.predictive.saw(ns, touch, m["keys"], forward)
    return touch


def op_reserve(st: State, h: Conn, m: dict[str, Any]) -> dict[str, Any]:
    ns = st.index.namespace(m["ns"], h)
    lease_until = time.monotonic() + st.config.server.reservation_lease_s
    touch = _touch(st, h, m, ns, forward=False)     # a put's batches come tail first
    gids, status = st.index.reserve(ns, split_keys(m["keys"]), h, lease_until, touch=touch)
    return {"slots": gids, "status": [int(s) for s in status], "generation": st.pool.generation}


def op_commit(st: State, h: Conn, m: dict[str, Any]) -> dict[str, Any]:
    """Publish reserved blocks. With `durable`, they go to the write-through path at once (first in line) and the
    reply waits until they are on disk and synced, or until the deadline (`timeout_ms`, else
    ssd.durable_timeout_s; at most ssd.durable_timeout_max_s): see `_wait_durable` for the answers."""
    ns = st.index.namespace(m["ns"], h)
    hashes = split_keys(m["keys"])
    n = st.index.commit(ns, hashes, h, m.get("crcs"), touch=_touch(st, h, m))
    if st.publisher is not None:
        st.publisher.committed(ns, hashes)
    if not m.get("durable"):
        if st.write_through is not None:
            st.write_through.committed(ns, hashes)
        return {"n": n}
    if st.write_through is None:
        return {"n": n, "durability": NO_SSD_TIER, "blocks": n, "pending": n, "failed": 0}
    ticket = st.write_through.committed(ns, hashes, durable=True)
    assert ticket is not None
    return {"n": n, **_wait_durable(st, ticket, m)}


def op_flush(st: State, h: Conn, m: dict[str, Any]) -> dict[str, Any]:
    """Wait until blocks stored before this request are on disk and synced (same deadline and answers as a
    durable commit): with `ns` and `keys`, those blocks (pinned until written); with `ns` alone, that namespace's
    blocks; without either, every block of the connection's tenant. Those on their way already are waited for, the
    host pool's that the lower tier lacks are queued first in line (write_through or not), and those being demoted
    are flagged urgent."""
    if "keys" in m and "ns" not in m:
        raise ProtocolError(Code.BAD_REQUEST, "flush: field 'keys' needs field 'ns' (the namespace of the keys)")
    ns = st.index.namespace(m["ns"], h) if "ns" in m else None
    if st.write_through is None:
        return {"durability": NO_SSD_TIER, "blocks": 0, "pending": 0, "failed": 0}
    if ns is not None and "keys" in m:
        ticket = st.write_through.flush_blocks(ns, split_keys(m["keys"]))
    else:
        tenant = tenant_of(st.config, h)
        ticket = _flush_namespaces(st, [n for n in st.index.namespaces.values()
                                        if n.tenant == tenant and (ns is None or n is ns)])
    return _wait_durable(st, ticket, m)


def _flush_namespaces(st: State, namespaces: list[NamespaceEntry]) -> Ticket:
    """Queue every block of these namespaces for the disk: their host-pool blocks a chunk at a time along each
    namespace's walk (kvstore.index.sweep), letting go of the state lock between chunks, then their staged ones
    (so a block evicted during the walk is caught there)."""
    wt = st.write_through
    assert wt is not None
    ticket = wt.flush_namespaces(namespaces)
    for ns in namespaces:
        cursor = st.index.walk(ns)
        while not cursor.done:
            chunk = st.index.keys_some(cursor, admin.CHUNK_SLOTS, admin.CHUNK_BLOCKS)
            wt.flush_more(ns, [bh for bh, _ in chunk], ticket)
            st.lock.release()                  # other clients' requests run between chunks
            st.lock.acquire()
    wt.flush_staged(namespaces, ticket)
    return ticket


def _wait_durable(st: State, ticket: Ticket, m: dict[str, Any]) -> dict[str, Any]:
    """Wait, without the state lock, for the ticket's blocks to reach the disk; the answer (`durability`):
    durable (all on disk and synced, or deleted meanwhile), unsynced (written, but ssd.sync is never), timeout
    (stored, not all on disk yet: `pending`), failed (`failed` of them could not be written; counted in the
    stats), and how many blocks the request covered (`blocks`)."""
    cfg = st.config.ssd
    timeout = min(m["timeout_ms"] / 1000 if "timeout_ms" in m else cfg.durable_timeout_s, cfg.durable_timeout_max_s)
    assert st.write_through is not None
    st.lock.release()
    try:
        return st.write_through.wait(ticket, timeout)
    finally:
        st.lock.acquire()


def op_abort(st: State, h: Holdings, m: dict[str, Any]) -> dict[str, Any]:
    ns = st.index.namespace(m["ns"], h)
    return {"n": st.index.abort(ns, split_keys(m["keys"]), h)}


def op_acquire(st: State, h: Conn, m: dict[str, Any]) -> dict[str, Any]:
    """Pin the longest present prefix; blocks that only a lower tier holds are promoted into host slots first, and a
    block already being promoted (by a prefetch or another get) is waited for, never read twice. With `stream`,
    the blocks are reported in partial replies as they land; the last reply carries the rest. With `residual` (a
    pair), the residual namespace's prefix of the same keys is pinned too and answered beside (`residual`)."""
    ns = st.index.namespace(m["ns"], h)
    residual = _residual_of(st, h, m, ns)
    if residual is not None and m.get("stream"):
        raise ProtocolError(Code.BAD_REQUEST, "acquire: a pair (field 'residual') is not streamed; acquire the "
                                              "residual on its own, or the pair without 'stream'")
    hashes = split_keys(m["keys"])
    try:
        lane = parse_lane(m.get("lane", "critical"))
    except ValueError as e:
        raise ProtocolError(Code.BAD_REQUEST, f"acquire: {e}") from None
    touch = _touch(st, h, m, ns)
    stream = Stream(st.index, st.pool, h, st.lock, m.get("_emit") if m.get("stream") else None)
    _pin_prefix(st, h, ns, hashes, lane, touch, stream)
    if st.predictive is not None:
        st.predictive.acquired(ns, hashes, stream.gids)
    part = stream.rest()
    reply = {"slots": part, "crcs": st.index.crcs_of(part), "generation": st.pool.generation}
    if residual is not None:
        rs = Stream(st.index, st.pool, h, st.lock, None)
        _pin_prefix(st, h, residual, hashes, lane, touch, rs)
        rpart = rs.rest()
        reply["residual"] = {"slots": rpart, "crcs": st.index.crcs_of(rpart)}
        reply["generation"] = st.pool.generation
    return reply


def _pin_prefix(st: State, h: Conn, ns: NamespaceEntry, hashes: list[bytes], lane: Lane, touch: Touch | None,
                stream: Stream) -> None:
    """Pin the longest prefix of `hashes` any tier holds into `stream.gids`, promoting from below."""
    gids = stream.gids
    lower = 0                                           # blocks of the prefix promoted by this request
    while len(gids) < len(hashes):
        rest = hashes[len(gids):]
        more = st.index.acquire(ns, rest, h, touch)
        if st.index.at_cap(h, ns.slot_bytes):
            gids += more
            break                                       # the prefix within server.max_held_fraction
        if more:
            gids += more
            continue
        if not st.lower:
            break
        if stream.unsent():
            stream.flush()                              # the lock was released: look at the host pool again
            continue
        if st.promotion.in_flight(ns, rest[0]):
            if not st.promotion.wait(ns, rest[0]):
                break                                   # still in flight: the prefix so far
            continue
        before = len(gids)
        gids += st.promotion.promote(ns, rest, h, lane, stream.publish if stream.emit else None, touch)
        lower += len(gids) - before
        if len(gids) == before:
            break
    _count_acquire(st, len(hashes), len(gids), lower)


def _count_acquire(st: State, asked: int, got: int, lower: int) -> None:
    """Per tier: blocks of acquires found in the host pool, promoted from a lower tier, and missed."""
    st.counters["acquired_asked"] += asked
    st.counters["acquired_host"] += got - lower
    st.counters["acquired_lower"] += lower


def op_hint(st: State, h: Conn, m: dict[str, Any]) -> dict[str, Any]:
    """Advice about a workflow or chat session (kvstore.daemon.hints): answered ok even when ignored. A call naming
    the agents expected `next` starts the workflow's predictive prefetch before the reply."""
    reply = st.hints.apply(tenant_of(st.config, h), m)
    if st.predictive is not None and m.get("next"):
        st.predictive.run_now()
    return reply


def op_workflows(st: State, h: Conn, m: dict[str, Any]) -> dict[str, Any]:
    """Active workflows, the most recently active first: the connection's tenant's (every tenant's for the
    admin)."""
    tenant = None if h.admin else tenant_of(st.config, h)
    return {"workflows": st.hints.rows(tenant, min(m.get("limit", 100), 10000))}


def op_prefetch(st: State, h: Holdings, m: dict[str, Any]) -> dict[str, Any]:
    """Promote lower-tier blocks (the SSD's, the remote store's) ahead of their get, into free host space only;
    `wait` replies when they are done."""
    ns = st.index.namespace(m["ns"], h)
    if st.prefetcher is None:
        raise ProtocolError(Code.BAD_REQUEST, "prefetch: this daemon has no lower tier (set ssd.dir or "
                                              "remote.master)")
    hashes = split_keys(m["keys"])
    if st.remote is not None:                       # what the store holds of them, asked without the lock
        bids = [ns.block_id(bh) for bh in hashes]
        st.lock.release()
        try:
            st.remote.probe(bids)
        finally:
            st.lock.acquire()
    try:
        ticket = st.prefetcher.submit(ns, hashes)   # refused at once if the prefetch lane is full
    except LaneFull as e:
        raise ProtocolError(Code.BUSY, str(e)) from None
    while m.get("wait") and ticket.pending:
        st.changed.wait(timeout=WAIT_S)
    return {"queued": ticket.queued, "done": ticket.done, "skipped": ticket.skipped}


def op_renew(st: State, h: Holdings, m: dict[str, Any]) -> dict[str, Any]:
    """Extend the connection's open reservations by a whole lease (server.reservation_lease_s) from now: a writer
    whose copies outlast the lease (a slow forward pass saving layer by layer) keeps its slots."""
    lease = st.config.server.reservation_lease_s
    return {"n": st.index.renew(h, time.monotonic() + lease), "lease_s": lease}


def op_release(st: State, h: Holdings, m: dict[str, Any]) -> dict[str, Any]:
    st.index.release(m["slots"], h)
    return {"n": len(m["slots"])}


def op_fork(st: State, h: Conn, m: dict[str, Any]) -> dict[str, Any]:
    """A new agent forks a context (ForkKV §5.2): `ns` the base namespace, `residual` the child's own residual
    namespace, `parent` the residual namespace it forks from (optional), `keys` the context. The child inherits the
    base blocks by reference — they are keyed by tokens, so nothing is copied — and will write only its residuals.
    Answers the inherited base prefix (`base`, `host`), the child's residual prefix (`residual`) and the parent's
    (`parent`, or None): what the child must compute is its residuals past `residual` and the base past `base`."""
    base = st.index.namespace(m["ns"], h)
    child = st.index.namespace(m["residual"], h)
    parent = st.index.namespace(m["parent"], h) if "parent" in m else None
    if parent is not None and parent is child:
        raise ProtocolError(Code.BAD_REQUEST, "fork: 'parent' and 'residual' name the same namespace; a child "
                                              "forks with its own residual namespace (its adapter)")
    pairs = st.index.namespaces.pairs
    pairs.check(base, child)
    if parent is not None:
        pairs.check(base, parent)
    blob = m["keys"]
    n, host = _prefix(st, base, blob)
    rn, _ = _prefix(st, child, blob)
    pn = _prefix(st, parent, blob)[0] if parent is not None else None
    pairs.fork(base, child, parent, blob, n)
    st.counters["forks"] += 1
    return {"base": n, "host": host, "residual": rn, "parent": pn}


def op_delete(st: State, h: Holdings, m: dict[str, Any]) -> dict[str, Any]:
    """Delete from every tier: a pinned host block goes at its last release, a queued prefetch is dropped unread,
    a promotion in flight is never published, a write in flight is not published. The lower tiers' deletes (which
    may wait for a durable disk write) run without the state lock; meanwhile no promotion of these keys starts."""
    ns = st.index.namespace(m["ns"], h)
    hashes = split_keys(m["keys"])
    if st.prefetcher is not None:
        st.prefetcher.cancel(ns, hashes)
    in_host = st.index.delete(ns, hashes)
    if st.write_through is not None:
        st.write_through.forget(ns, hashes)          # waiters for their durability: nothing to persist
    below = [False] * len(hashes)
    if st.lower:
        keys = [ns.key(b) for b in hashes]
        ids = [ns.block_id(b) for b in hashes]
        st.index.begin_delete(keys)
        st.lock.release()
        try:
            below = st.lower.delete_many(ids)            # one durable flush for the request's keys
        finally:
            st.lock.acquire()
            st.index.end_delete(keys)
    n = sum(a or b for a, b in zip(in_host, below))
    st.counters["deletes"] += n
    return {"n": n}


HANDLERS: dict[str, Handler] = {
    "ping": op_ping, "hello": op_hello, "segments": op_segments, "lookup": op_lookup, "reserve": op_reserve,
    "commit": op_commit, "abort": op_abort, "acquire": op_acquire, "release": op_release, "delete": op_delete,
    "renew": op_renew, "fork": op_fork,
    "prefetch": op_prefetch, "stats": admin.op_stats, "list": admin.op_list, "resize": admin.op_resize,
    "tenants": admin.op_tenants, "tenant_quota": admin.op_tenant_quota,
    "evict": admin.op_evict, "flush": op_flush, "hint": op_hint, "workflows": op_workflows,
}
