"""One function per op: validated request in, reply fields out. They run under the state lock and only keep books;
no op copies block bytes (clients do that in the shared slots)."""
from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from threading import Condition, Lock
from typing import Any

from kvstore import __version__
from kvstore.daemon.config import Config
from kvstore.protocol.geometry import GeometryError
from kvstore.index.books import Holdings, Index, NamespaceEntry
from kvstore.protocol.keys import NamespaceSpec
from kvstore.daemon.metrics import OpMetrics
from kvstore.tiers.host import HostPool
from kvstore.movers.prefetch import Prefetcher
from kvstore.protocol import Code, ProtocolError, split_keys
from kvstore.traffic import Lane, parse_lane
from kvstore.traffic.manager import TrafficManager
from kvstore.movers.writethrough import WriteThrough

log = logging.getLogger("kvstore")
MAX_FDS_PER_REPLY = 200     # below the kernel's SCM_MAX_FD (253)
PROMOTION_WAIT_S = 5.0      # a get or a waiting prefetch re-checks at least this often


@dataclass
class State:
    """Everything the ops share; guarded by `lock`."""
    config: Config
    pool: HostPool
    index: Index
    metrics: OpMetrics = field(default_factory=OpMetrics)
    lock: Lock = field(default_factory=Lock)
    connections: int = 0
    started: float = field(default_factory=time.time)
    prefetcher: Prefetcher | None = None
    traffic: TrafficManager | None = None
    write_through: WriteThrough | None = None
    changed: Condition = field(init=False)     # on `lock`: notified when a promotion or prefetch finishes

    def __post_init__(self) -> None:
        self.changed = Condition(self.lock)


@dataclass
class Reply:
    fields: dict[str, Any]
    fds: list[int] = field(default_factory=list)   # duplicated under the lock; the sender closes them
    close: bool = False


Handler = Callable[[State, Holdings, dict[str, Any]], dict[str, Any] | Reply]


def op_ping(st: State, h: Holdings, m: dict[str, Any]) -> dict[str, Any]:
    return {"pong": True, "time": time.time()}


def op_hello(st: State, h: Holdings, m: dict[str, Any]) -> dict[str, Any]:
    reply: dict[str, Any] = {"version": __version__, "pid": os.getpid(), "generation": st.pool.generation,
                             "max_keys": st.config.server.max_keys_per_request}
    if "namespace" in m:
        try:
            spec = NamespaceSpec.from_dict(m["namespace"])
        except GeometryError as e:
            raise ProtocolError(Code.WRONG_GEOMETRY, f"hello: {e}") from None
        except (TypeError, ValueError) as e:
            raise ProtocolError(Code.BAD_REQUEST, f"hello: {e}") from None
        ns = st.index.register(spec, h)
        g = spec.geometry
        reply.update(ns=ns.id, digest=ns.digest.hex(), slot_bytes=g.full_bytes, layer_bytes=g.layer_bytes)
    return reply


def op_segments(st: State, h: Holdings, m: dict[str, Any]) -> Reply:
    """Handles (memfds, sent with SCM_RIGHTS) of the segments asked for that still exist, and the live ids."""
    ids = m["ids"][:MAX_FDS_PER_REPLY]
    found = [st.pool.segments[i] for i in ids if i in st.pool.segments]
    fds = [os.dup(s.fd) for s in found]
    info = [[s.id, s.slot_bytes, s.nslots] for s in found]
    h.segments.update(s.id for s in found)
    return Reply({"segments": info, "live": list(st.pool.segments), "generation": st.pool.generation}, fds)


def op_lookup(st: State, h: Holdings, m: dict[str, Any]) -> dict[str, Any]:
    ns = st.index.namespace(m["ns"], h)
    n, host = st.index.lookup(ns, m["keys"])
    return {"n": n, "host": host}          # flat: the rest of the prefix is on SSD


def op_reserve(st: State, h: Holdings, m: dict[str, Any]) -> dict[str, Any]:
    ns = st.index.namespace(m["ns"], h)
    gids, status = st.index.reserve(ns, split_keys(m["keys"]), h)
    return {"slots": gids, "status": status, "generation": st.pool.generation}


def op_commit(st: State, h: Holdings, m: dict[str, Any]) -> dict[str, Any]:
    ns = st.index.namespace(m["ns"], h)
    keys = split_keys(m["keys"])
    n = st.index.commit(ns, keys, h, m.get("crcs"))
    if st.write_through is not None:
        st.write_through.committed(ns, keys)
    return {"n": n}


def op_abort(st: State, h: Holdings, m: dict[str, Any]) -> dict[str, Any]:
    ns = st.index.namespace(m["ns"], h)
    return {"n": st.index.abort(ns, split_keys(m["keys"]), h)}


class Stream:
    """A streaming acquire's partial replies: blocks are sent as they land, in key order, so the client can start
    copying the first ones while later ones are still on the SSD. Without `emit`, nothing is sent early."""

    def __init__(self, st: State, h: Holdings, emit: Callable[[dict[str, Any], list[int]], None] | None) -> None:
        self.st = st
        self.holder = h
        self.emit = emit
        self.gids: list[int] = []
        self.sent = 0

    def unsent(self) -> bool:
        return self.emit is not None and len(self.gids) > self.sent

    def flush(self) -> None:
        """(Under the state lock.) Send the blocks not sent yet, with the lock released meanwhile. A client gone
        mid-stream only stops the sending: the promotion finishes, and the session drops its pins."""
        if not self.unsent():
            return
        part = self.gids[self.sent:]
        self.sent = len(self.gids)
        fields: dict[str, Any] = {"slots": part, "crcs": self.st.index.crcs_of(part)}
        # handles of segments this connection has not seen ride along: the client cannot ask mid-stream
        new = [self.st.pool.segments[sid] for sid in sorted({g >> 32 for g in part} - self.holder.segments)]
        fds = [os.dup(seg.fd) for seg in new]
        fields["segments"] = [[seg.id, seg.slot_bytes, seg.nslots] for seg in new]
        self.holder.segments.update(seg.id for seg in new)
        self.st.lock.release()
        try:
            assert self.emit is not None
            self.emit(fields, fds)
        except OSError as e:
            log.debug("streaming acquire: the client went away (%s); not sending more", e)
            self.emit = None
        finally:
            self.st.lock.acquire()

    def rest(self) -> list[int]:
        return self.gids[self.sent:]


def op_acquire(st: State, h: Holdings, m: dict[str, Any]) -> dict[str, Any]:
    """Pin the longest present prefix; blocks that only the SSD tier holds are promoted into host slots first, and a
    block already being promoted (by a prefetch or another get) is waited for, never read twice. With `stream`,
    the blocks are reported in partial replies as they land; the last reply carries the rest."""
    ns = st.index.namespace(m["ns"], h)
    keys = split_keys(m["keys"])
    try:
        lane = parse_lane(m.get("lane", "critical"))
    except ValueError as e:
        raise ProtocolError(Code.BAD_REQUEST, f"acquire: {e}") from None
    stream = Stream(st, h, m.get("_emit") if m.get("stream") else None)
    gids = stream.gids
    while len(gids) < len(keys):
        rest = keys[len(gids):]
        more = st.index.acquire(ns, rest, h)
        if more:
            gids += more
            continue
        if st.index.ssd is None:
            break
        if stream.unsent():
            stream.flush()                              # the lock was released: look at the host pool again
            continue
        if ns.prefix + rest[0] in st.index.promoting:
            if not _wait_promoted(st, ns.prefix + rest[0]):
                break                                   # still in flight: the prefix so far
            continue
        if not _promote(st, ns, rest, h, lane, stream):
            break
    part = stream.rest()
    return {"slots": part, "crcs": st.index.crcs_of(part), "generation": st.pool.generation}


def _wait_promoted(st: State, key: bytes) -> bool:
    if st.prefetcher is not None:
        st.prefetcher.escalate(key)                     # a queued prefetch of it becomes critical
    deadline = time.monotonic() + PROMOTION_WAIT_S
    while key in st.index.promoting:
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        st.changed.wait(left)
    return True


def _promote(st: State, ns: NamespaceEntry, keys: list[bytes], h: Holdings, lane: Lane, stream: Stream) -> list[int]:
    """Promote the leading SSD-only keys into pinned host slots; the disk reads run without the state lock, in
    `lane`, and with a streaming acquire each block is published and sent as soon as the prefix reaches it."""
    plan = st.index.plan_promotion(ns, keys, h)
    if not plan:
        return []
    views = [st.pool.view(gid) for _, gid in plan]   # the reserved slots keep their segments mapped
    ssd = st.index.ssd
    assert ssd is not None
    got: list[int] = []
    crcs: list[int | None] = []                       # each verified record's CRC-32: the slots carry them on
    done = [0, False]                                 # blocks finished early; a chunk came back short

    def on_ready(n: int) -> None:                     # the session thread, without the state lock
        with st.lock:
            if done[1]:
                return
            chunk = plan[done[0]:n]
            part = st.index.finish_promotion(ns, chunk, len(chunk), h, crcs=crcs[done[0]:n])
            done[0] = n
            done[1] = len(part) < len(chunk)         # deleted meanwhile: the prefix ends there
            got.extend(part)
            stream.gids.extend(part)
            st.changed.notify_all()
            stream.flush()

    st.lock.release()                                 # the disk read runs without the state lock
    try:
        st.index.run_deferred(st.lock, done=False)    # slots taken by eviction: their old bytes staged first
        n = ssd.read([ns.digest + key for key, _ in plan], views, lane, on_ready if stream.emit else None, crcs)
    except OSError as e:
        log.error("ssd: promotion read failed (%s); serving the host prefix only", e)
        n = 0
    finally:
        for v in views:
            v.release()
        st.lock.acquire()
    if done[0] < len(plan):
        part = st.index.finish_promotion(ns, plan[done[0]:], 0 if done[1] else max(n - done[0], 0), h,
                                         crcs=crcs[done[0]:])
        got.extend(part)
        stream.gids.extend(part)
    st.changed.notify_all()
    return got


def op_prefetch(st: State, h: Holdings, m: dict[str, Any]) -> dict[str, Any]:
    """Promote SSD blocks ahead of their get, into free host space only; `wait` replies when they are done."""
    ns = st.index.namespace(m["ns"], h)
    if st.prefetcher is None:
        raise ProtocolError(Code.BAD_REQUEST, "prefetch: this daemon has no SSD tier (set ssd.dir)")
    ticket = st.prefetcher.submit(ns, split_keys(m["keys"]))   # busy at once if the prefetch lane is full
    while m.get("wait") and ticket.pending:
        st.changed.wait(timeout=PROMOTION_WAIT_S)
    return {"queued": ticket.queued, "done": ticket.done, "skipped": ticket.skipped}


def op_release(st: State, h: Holdings, m: dict[str, Any]) -> dict[str, Any]:
    st.index.release(m["slots"], h)
    return {"n": len(m["slots"])}


def op_delete(st: State, h: Holdings, m: dict[str, Any]) -> dict[str, Any]:
    ns = st.index.namespace(m["ns"], h)
    keys = split_keys(m["keys"])
    if st.prefetcher is not None:
        st.prefetcher.cancel(ns, keys)              # a queued prefetch of a deleted block is dropped unread
    return {"n": st.index.delete(ns, keys)}


def op_stats(st: State, h: Holdings, m: dict[str, Any]) -> dict[str, Any]:
    return snapshot(st)


def op_list(st: State, h: Holdings, m: dict[str, Any]) -> dict[str, Any]:
    rows = []
    for n in st.index.namespaces.values():
        s = n.spec
        rows.append({"id": n.id, "model": s.model, "group": s.share_group, "adapter": s.adapter,
                     "tp": f"{s.tp_rank}/{s.tp_size}", "role": s.role, "digest": n.digest.hex(),
                     "geometry": s.geometry.to_dict(), "slot_bytes": n.slot_bytes, "blocks": n.blocks,
                     "bytes": n.blocks * n.slot_bytes})
    reply: dict[str, Any] = {"namespaces": rows}
    if st.index.ssd is not None:
        known = {n.digest.hex(): n.id for n in st.index.namespaces.values()}
        reply["ssd"] = [{"digest": d, "ns": known.get(d), "blocks": n}
                        for d, n in st.index.ssd.stats()["namespaces"].items()]
    if "ns" in m:
        ns = st.index.namespaces.get(m["ns"])
        if ns is None:
            raise ProtocolError(Code.UNKNOWN_NAMESPACE, f"list: no namespace {m['ns']}")
        limit = min(m.get("limit", 100), 10000)
        reply["keys"] = [[k, gid] for k, gid in st.index.keys_of(ns, limit)]
    return reply


def op_resize(st: State, h: Holdings, m: dict[str, Any]) -> dict[str, Any]:
    tier = m.get("tier", "host")
    if tier == "ssd":
        return _resize_ssd(st, m["bytes"])
    if tier != "host":
        raise ProtocolError(Code.BAD_REQUEST, f"resize: unknown tier {tier[:32]!r}; tiers: host, ssd")
    seg = st.pool.segment_bytes
    if m["bytes"] < seg:
        raise ProtocolError(Code.BAD_REQUEST, f"resize: {m['bytes']} bytes is below one segment ({seg} bytes)")
    r = st.index.resize(m["bytes"])
    return {"capacity": r.capacity, "released_segments": r.released_segments, "evicted": r.evicted,
            "draining_bytes": r.draining_bytes, "mapped_bytes": st.pool.mapped_bytes, "seconds": r.seconds}


def _resize_ssd(st: State, nbytes: int) -> dict[str, Any]:
    ssd = st.index.ssd
    if ssd is None:
        raise ProtocolError(Code.BAD_REQUEST, "resize: this daemon has no SSD tier (set ssd.dir)")
    if nbytes < 1 << 20:
        raise ProtocolError(Code.BAD_REQUEST, f"resize: the SSD tier needs at least 1 MiB, got {nbytes} bytes")
    t0 = time.perf_counter()
    st.lock.release()                       # waits for a demotion batch in flight: not under the state lock
    try:
        evicted = ssd.resize(nbytes)
    except RuntimeError as e:
        raise ProtocolError(Code.BUSY, f"resize: {e}") from None
    finally:
        st.lock.acquire()
    return {"tier": "ssd", "capacity": nbytes, "evicted": evicted, "mapped_bytes": ssd.store.file_bytes(),
            "released_segments": 0, "draining_bytes": 0, "seconds": time.perf_counter() - t0}


def op_evict(st: State, h: Holdings, m: dict[str, Any]) -> dict[str, Any]:
    if not m.get("all") and not m.get("bytes"):
        raise ProtocolError(Code.BAD_REQUEST, "evict: give 'bytes' (how much to free) or 'all': true")
    ns: NamespaceEntry | None = None
    if "ns" in m:
        ns = st.index.namespaces.get(m["ns"])
        if ns is None:
            raise ProtocolError(Code.UNKNOWN_NAMESPACE, f"evict: no namespace {m['ns']}")
    blocks, freed = st.index.evict(ns, m.get("bytes", 0), bool(m.get("all")))
    return {"blocks": blocks, "bytes": freed}


def snapshot(st: State) -> dict[str, Any]:
    pool, idx = st.pool, st.index
    classes = [{"slot_bytes": c.slot_bytes, "segments": len(c.segments),
                "slots": sum(s.nslots for s in c.segments.values()),
                "free": sum(len(s.free) for s in c.segments.values())} for c in pool.classes.values()]
    host = {"tier": "host", "capacity_bytes": pool.capacity, "mapped_bytes": pool.mapped_bytes,
            "used_bytes": pool.used_bytes, "resident_bytes": pool.resident_bytes(), "blocks": len(idx.table),
            "reaping_bytes": pool.reaping_bytes,
            "segments": len(pool.segments), "segment_bytes": pool.segment_bytes, "classes": classes}
    counters = {k: idx.counters[k] for k in ("lookups", "hits", "misses", "puts", "gets", "evictions", "deletes",
                                             "aborts", "demotions", "dropped", "promotions", "prefetched",
                                             "prefetch_skipped", "prefetch_busy", "prefetch_cancelled",
                                             "written_through", "write_through_skipped")}
    counters["refused_connections"] = st.metrics.refused_connections
    return {"version": __version__, "pid": os.getpid(), "uptime_s": time.time() - st.started,
            "socket": st.config.server.socket, "counters": counters,
            "tiers": [host] + ([idx.ssd.stats()] if idx.ssd is not None else []),
            "traffic": st.traffic.stats() if st.traffic is not None else [],
            "errors": dict(st.metrics.errors), "connections": st.connections,
            "latency": {op: hist.to_dict() for op, hist in st.metrics.latency.items()}, **idx.stats()}


HANDLERS: dict[str, Handler] = {
    "ping": op_ping, "hello": op_hello, "segments": op_segments, "lookup": op_lookup, "reserve": op_reserve,
    "commit": op_commit, "abort": op_abort, "acquire": op_acquire, "release": op_release, "delete": op_delete,
    "stats": op_stats, "list": op_list, "resize": op_resize, "evict": op_evict, "prefetch": op_prefetch,
}
