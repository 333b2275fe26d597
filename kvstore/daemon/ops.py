"""One function per op: a checked request in, reply fields out. They run under the state lock, keep books through
the index and hand byte moves to the movers; no op copies block bytes (clients do that in the shared slots).
The ops that read are in `read_ops`, those that store and remove in `write_ops`, the operator's (stats, list,
resize, evict) in `admin`; here, the session's own (ping, hello, segments), the hints', and the table of them all.

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
from typing import Any

from kvstore import __version__
from kvstore.daemon import admin, read_ops, write_ops
from kvstore.daemon.reply import Reply
from kvstore.daemon.state import State
from kvstore.daemon.tenants import Conn, check_admin_secret, resolve, tenant_of
from kvstore.index import Holdings
from kvstore.protocol import Code, ProtocolError
from kvstore.protocol.geometry import GeometryError
from kvstore.protocol.keys import NamespaceSpec

MAX_FDS_PER_REPLY = 200     # below the kernel's SCM_MAX_FD (253)


Handler = Callable[[State, Conn, dict[str, Any]], dict[str, Any] | Reply]


def op_ping(st: State, h: Holdings, m: dict[str, Any]) -> dict[str, Any]:
    return {"pong": True, "time": time.time()}


def op_hello(st: State, h: Conn, m: dict[str, Any]) -> dict[str, Any]:
    _fix_tenant(st, h, m.get("tenant"), m.get("secret"), m.get("admin_secret"))
    reply: dict[str, Any] = {"version": __version__, "pid": os.getpid(), "generation": st.pool.generation,
                             "max_keys": st.config.server.max_keys_per_request, "tenant": h.tenant,
                             "reservation_lease_s": st.config.server.reservation_lease_s, "admin": h.admin}
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


def _fix_tenant(st: State, h: Conn, name: str | None, secret: str | None, admin_secret: str | None) -> None:
    """The connection's tenant, fixed at its first hello (counted against the tenant's connection cap); a later
    hello may repeat its name, not change it. An `admin_secret` gives the admin role (kvstore.daemon.tenants).
    Credentials are checked only until they succeed, and each failure counts for the uid (HelloGuard)."""
    guard = st.access.guard
    checking = (h.tenant is None and bool(name or secret)) or (admin_secret is not None and not h.admin)
    if checking:
        guard.check(h)
    admin = False
    try:
        if admin_secret is not None and not h.admin:
            admin = check_admin_secret(st.config, h.peer, admin_secret)
        if h.tenant is None:
            tenant = resolve(st.config, h.peer, name, secret)
            st.access.enter_tenant(h, tenant)
            h.tenant = tenant
        elif name and name != h.tenant:
            raise ProtocolError(Code.FORBIDDEN, f"hello: this connection speaks for tenant {h.tenant!r} since its "
                                                f"first hello; open another connection for tenant {name[:64]!r}")
    except ProtocolError as e:
        if e.code == Code.FORBIDDEN:
            guard.failed(h, e.message)
        raise
    if admin:
        h.admin = True


def op_segments(st: State, h: Conn, m: dict[str, Any]) -> Reply:
    """Handles (memfds, sent with SCM_RIGHTS) of the segments asked for that still exist and hold the connection's
    own tenant's blocks (others are left out, as if gone), and the live ids of its tenant's segments."""
    if h.tenant is None:
        raise ProtocolError(Code.FORBIDDEN, "segments: say hello first (its tenant decides which segments are "
                                            "this connection's)")
    tenant = h.tenant
    ids = m["ids"][:MAX_FDS_PER_REPLY]
    found = [seg for i in ids if (seg := st.pool.segments.get(i)) is not None and seg.tenant == tenant]
    fds = [os.dup(s.fd) for s in found]
    info = [[s.id, s.slot_bytes, s.nslots] for s in found]
    h.segments.update(s.id for s in found)
    live = [sid for sid, seg in st.pool.segments.items() if seg.tenant == tenant]
    return Reply({"segments": info, "live": live, "generation": st.pool.generation}, fds)


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


HANDLERS: dict[str, Handler] = {
    "ping": op_ping, "hello": op_hello, "segments": op_segments, "hint": op_hint, "workflows": op_workflows,
    "lookup": read_ops.op_lookup, "acquire": read_ops.op_acquire, "release": read_ops.op_release,
    "renew": read_ops.op_renew, "prefetch": read_ops.op_prefetch, "fork": read_ops.op_fork,
    "reserve": write_ops.op_reserve, "commit": write_ops.op_commit, "abort": write_ops.op_abort,
    "delete": write_ops.op_delete, "flush": write_ops.op_flush,
    "stats": admin.op_stats, "list": admin.op_list, "resize": admin.op_resize, "tenants": admin.op_tenants,
    "tenant_quota": admin.op_tenant_quota, "evict": admin.op_evict,
}
