"""The ops that store and remove blocks: `reserve`, `commit` (durable ones wait for the disk without the state
lock), `flush`, `abort`, `delete` (from every tier). See kvstore.daemon.ops for what every op may and may not do."""
from __future__ import annotations

import time
from typing import Any

from kvstore.daemon import admin
from kvstore.daemon.read_ops import touch_of
from kvstore.daemon.state import State
from kvstore.daemon.tenants import Conn, tenant_of
from kvstore.index import Holdings, NamespaceEntry
from kvstore.movers.durability import NO_SSD_TIER, Ticket
from kvstore.protocol import Code, ProtocolError, split_keys


def op_reserve(st: State, h: Conn, m: dict[str, Any]) -> dict[str, Any]:
    """Slots for a chain's blocks, head first (kvstore.index.stores); `after`: the chain's blocks this put stored
    just before them, never evicted for them; `more`: this connection's next reserve goes on with the chain."""
    ns = st.index.namespace(m["ns"], h)
    lease_until = time.monotonic() + st.config.server.reservation_lease_s
    touch = touch_of(st, h, m, ns)
    after = split_keys(m["after"]) if "after" in m else None
    gids, status = st.index.reserve(ns, split_keys(m["keys"]), h, lease_until, touch=touch, after=after,
                                    more=m.get("more", False))
    reply = {"slots": gids, "status": [int(s) for s in status], "generation": st.pool.generation}
    if st.index.stopped:
        reply["stopped"] = st.index.stopped         # why the rest of the chain got no slot (Stores.reserve)
    return reply


def op_commit(st: State, h: Conn, m: dict[str, Any]) -> dict[str, Any]:
    """Publish reserved blocks. With `durable`, they go to the write-through path at once (first in line) and the
    reply waits until they are on disk and synced, or until the deadline (`timeout_ms`, else
    ssd.durable_timeout_s; at most ssd.durable_timeout_max_s): see `_wait_durable` for the answers."""
    ns = st.index.namespace(m["ns"], h)
    hashes = split_keys(m["keys"])
    n = st.index.commit(ns, hashes, h, m.get("crcs"), touch=touch_of(st, h, m))
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
        reply = st.write_through.wait(ticket, timeout)
    finally:
        st.lock.acquire()
    if timeout > 0 and reply["pending"]:          # the waiter gives up: what only it waited for leaves the queue
        st.write_through.abandon(ticket)
    return reply


def op_abort(st: State, h: Holdings, m: dict[str, Any]) -> dict[str, Any]:
    ns = st.index.namespace(m["ns"], h)
    return {"n": st.index.abort(ns, split_keys(m["keys"]), h)}


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
