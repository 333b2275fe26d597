"""The ops that find and read blocks: `lookup` (the longest prefix any tier holds; with `mask`, which keys any tier
holds), `acquire` (pins, promoting
what a lower tier holds), `release`, `renew`, `prefetch`, and `fork` (an agent's fork of a context). See
kvstore.daemon.ops for what every op may and may not do."""
from __future__ import annotations

import time
from collections import Counter
from typing import Any

from kvstore.daemon.reply import Reply
from kvstore.daemon.state import State
from kvstore.daemon.stream import Stream
from kvstore.daemon.tenants import Conn, tenant_of
from kvstore.index import Holdings, NamespaceEntry
from kvstore.movers.prefetch import LaneFull
from kvstore.protocol import HASH_BYTES, Code, ProtocolError, split_keys
from kvstore.testpoints import fault_point
from kvstore.traffic import Lane, parse_lane
from kvstore.workflows import Touch

WAIT_S = 5.0                # a prefetch with `wait` re-checks at least this often


def op_lookup(st: State, h: Conn, m: dict[str, Any]) -> dict[str, Any]:
    """The longest prefix held by any tier, and how much of it is in the host pool. With `residual` (a pair, ForkKV:
    `ns` the base namespace, `residual` an adapter's), the residual namespace's prefix of the same keys too, in the
    same reply: a residual longer than its base is a partial hit (recompute the base only)."""
    ns = st.index.namespace(m["ns"], h)
    if m.get("mask"):
        if "residual" in m:
            raise ProtocolError(Code.BAD_REQUEST, "lookup: 'mask' and 'residual' do not go together")
        touch_of(st, h, m)
        return {"held": _held(st, ns, m["keys"])}
    residual = _residual_of(st, h, m, ns)
    touch_of(st, h, m, ns)                            # a lookup is activity; it changes no block's standing
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


def _held(st: State, ns: NamespaceEntry, blob: bytes) -> bytes:
    """Which keys of `blob` any tier holds, one byte each (1: held), whether or not the keys before them are: the
    question a hybrid model asks of its sliding-window and state groups, whose restorable prefix ends are those
    where the few blocks that group needs are held, not where a chain runs unbroken (kvstore.connectors.groups).
    The keys no local tier holds are asked of the remote store in one query, without the state lock. Pins
    nothing and counts no hit: the prefix the engine gets is counted by its full-attention group's lookup."""
    keys = split_keys(blob)
    held = bytearray(len(keys))
    missing: list[int] = []
    for i, block_hash in enumerate(keys):
        if st.index.holds(ns, block_hash) or (st.lower and st.lower.holder(ns.block_id(block_hash)) is not None):
            held[i] = 1
        else:
            missing.append(i)
    if st.remote is not None and missing:
        bids = [ns.block_id(keys[i]) for i in missing]
        st.lock.release()
        try:
            found = st.remote.probe_each(bids)
        finally:
            st.lock.acquire()
        for i, there in zip(missing, found):
            held[i] = 1 if there else 0
    return bytes(held)


def _prefix(st: State, ns: NamespaceEntry, blob: bytes) -> tuple[int, int]:
    """(the prefix of `blob` any tier holds, the part of it in the host pool); the part no local tier holds is
    asked of the remote store (one batched query, without the state lock). Every key asked counts toward the
    hit-rate ceiling (st.looked_up: distinct keys against keys looked up)."""
    asked = len(blob) // HASH_BYTES
    st.looked_up.add_keys(blob, int.from_bytes(ns.prefix, "little"))
    st.index.asked(ns, blob)
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
    ns.lookups += 1
    ns.hits += n
    ns.misses += asked - n
    return n, host


def touch_of(st: State, h: Conn, m: dict[str, Any], ns: NamespaceEntry | None = None) -> Touch | None:
    """The request's hint context (its `wf` and `agent` fields) for the index's policy; None without one. With
    `ns`, the request's keys become the workflow's chain: its call's (kvstore.workflows.rereads: does the call
    extend an earlier call's whole chain?) and the predictive prefetch's."""
    touch = st.hints.touch(tenant_of(st.config, h), m) if "wf" in m else None
    if touch is not None and ns is not None:
        st.workflows.chain(touch, m["keys"])
        if st.predictive is not None:
            st.predictive.saw(ns, touch, m["keys"])
    return touch


def op_acquire(st: State, h: Conn, m: dict[str, Any]) -> dict[str, Any] | Reply:
    """Pin the longest present prefix; blocks that only a lower tier holds are promoted into host slots first, and a
    block already being promoted (by a prefetch or another get) is waited for, never read twice. With `stream`,
    the blocks are reported in partial replies as they land; the last reply carries the rest (or is the one that
    pinned the last block asked); with `pieces` too, the next block's verified start while the rest of it is read
    (kvstore.daemon.stream). With `residual` (a
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
    touch = touch_of(st, h, m, ns)
    st.index.asked(ns, hashes)
    stream = Stream(st.index, st.pool, h, st.lock, m.get("_emit") if m.get("stream") else None,
                    pieces=bool(m.get("pieces")), counters=st.counters, wanted=len(hashes))
    _pin_prefix(st, h, ns, hashes, lane, touch, stream)
    fault_point("acquire_after_pin")
    if st.predictive is not None:
        st.predictive.acquired(ns, hashes, stream.gids)
    if stream.ended:                    # the last blocks' reply ended the stream: the client has it all
        return Reply({}, sent=True)
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
        landing = None if not stream.pieces else \
            (lambda i, gid, nb, crc, at=before: stream.landing(at + i, gid, nb, crc))
        gids += st.promotion.promote(ns, rest, h, lane, stream.publish if stream.emit else None, touch,
                                     landing=landing)
        lower += len(gids) - before
        if len(gids) == before:
            break
    _count_acquire(st, len(hashes), len(gids), lower)


def _count_acquire(st: State, asked: int, got: int, lower: int) -> None:
    """Per tier: blocks of acquires found in the host pool, promoted from a lower tier, and missed."""
    st.counters["acquired_asked"] += asked
    st.counters["acquired_host"] += got - lower
    st.counters["acquired_lower"] += lower


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
    """Unpin; a slot whose pin the daemon dropped at its lease (server.pin_lease_s) is let go of quietly: its
    reader's copy was checked against its CRC, and the lease is what a reader learns from a failed check."""
    slots = m["slots"]
    expired = getattr(h, "expired_pins", None)
    if expired:
        slots = []
        for gid, n in Counter(m["slots"]).items():     # releases beyond its pins: of pins the daemon dropped
            spare = min(max(0, n - h.pins[gid]), expired[gid])
            if spare:
                expired[gid] -= spare
                if not expired[gid]:
                    del expired[gid]
            slots += [gid] * (n - spare)
    st.index.release(slots, h)
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
