"""The client library: talks to the local daemon over its Unix socket and maps the host pool's segments, so a
block moves with one copy between the caller's buffer and a shared slot. Sync; `kvstore.client.aio` wraps it for
asyncio.

    with Client() as c:
        ns = c.namespace(NamespaceSpec("llama-8b", Geometry(layers=32, tokens=16, kv_heads=8, head_dim=128)))
        ns.put(hashes, blocks)           # reserve → copy → commit, in batches
        n = ns.lookup(hashes)            # longest stored prefix
        ns.get(hashes[:n], outs)         # acquire → copy → release

Layer by layer: `ns.reserve(hashes)` gives a Reservation whose `write_layer(i, srcs)` fills layer i of every
block (engines save as each layer finishes) and `commit()` publishes the Full Blocks; `ns.acquire(hashes)` gives a
Lease whose `read_layer(i, dsts)` loads layer i of the prefix, and `release()` unpins it.

A Client is not thread-safe: use one per thread (they are cheap), or the asyncio flavour.

`Client` is built in layers, each a module of its own, all of them one object (no hop between them on a hot path):
  kvstore.client.wire      `Wire`: the socket, framing, request and reply, pipelining (`send`, `flush`), timeouts,
                           fd passing, and connecting again after the daemon closed the connection (`REPLAYABLE`
                           requests are sent again; `NoDaemon` when none listens); `KVStoreError` is its refusal.
  kvstore.client.segments  `SegmentMaps`: the daemon's memfd segments mapped by fd, kept across a reconnect only
                           where the daemon hands back the same memory.
  kvstore.client.admin     `AdminCalls`: the operator's calls (stats, list, resize, tenants, quotas, evict, flush).
  here                     `Client`: the namespaces said hello to (and again after a reconnect), pairs and forks,
                           hints, the copier, and closing it all. A namespace's blocks move in kvstore.client.blocks.

Tenants: `Client(tenant=..., secret=...)` (else KVSTORE_TENANT / KVSTORE_TENANT_SECRET, else none) names the
tenant the connection speaks for; the daemon checks it at the first hello (sent at connect when a tenant is named)
and refuses with `forbidden` a tenant that is not configured, not allowed to this user, or a wrong secret.

Hints (kvstore.client.hints): `Client.workflow(wid, type)` and `Client.session(sid)` give handles whose methods tell
the daemon that a workflow begins, an agent of it runs, it ends (never raising for a hint the daemon does not take);
their `context(agent)` goes with a namespace's lookup, get, put, acquire and reserve (`context=`).
"""
from __future__ import annotations

import builtins
import os
import weakref
from collections.abc import Sequence
from typing import Any

from kvstore.client.admin import AdminCalls
from kvstore.client.blocks import Namespace
from kvstore.client.copier import Copier
from kvstore.client.hints import SessionHandle, WorkflowHandle
from kvstore.client.pairs import ForkView, Pair
from kvstore.client.segments import SegmentMaps
from kvstore.client.wire import MAX_FDS, NS_FIELDS, QUIET_S, RECV_BYTES, REPLAYABLE, KVStoreError, NoDaemon
from kvstore.protocol.keys import NamespaceSpec, pack_keys

# what this module named before its layers moved out: still importable from here
__all__ = ["MAX_FDS", "NS_FIELDS", "QUIET_S", "RECV_BYTES", "REPLAYABLE", "Client", "KVStoreError", "NoDaemon"]


class Client(AdminCalls, SegmentMaps):
    def __init__(self, path: str | None = None, copy_threads: int = 1, timeout: float | None = 30.0,
                 tenant: str | None = None, secret: str | None = None, admin_secret: str | None = None) -> None:
        super().__init__(path, timeout, tenant, secret, admin_secret)   # connected (NoDaemon if none listens)
        self._spaces: weakref.WeakSet[Namespace] = weakref.WeakSet()   # said hello to: again after a reconnect
        self.copier = Copier(copy_threads)
        self.max_keys = 1024
        self.lease_s = 60.0                   # the daemon's reservation lease (hello says): renew() before it ends
        if self.tenant or self.admin_secret:
            try:
                self.call("hello", **self._credentials())    # refused here, not at the first namespace
            except BaseException:
                self.close()
                raise

    # ----- namespaces -----
    def namespace(self, spec: NamespaceSpec) -> Namespace:
        reply = self.call("hello", namespace=spec.to_dict(), client=f"pid {os.getpid()}", **self._credentials())
        self.max_keys = reply["max_keys"]
        self.lease_s = reply.get("reservation_lease_s", self.lease_s)
        self.daemon_pid = reply["pid"]
        ns = Namespace(self, reply["ns"], spec)
        self._spaces.add(ns)
        return ns

    def _rejoin(self, pid: int) -> dict[int, int]:
        """After a reconnect (kvstore.client.wire): the segments kept or dropped first, then hello again to every
        namespace; a Namespace's id follows."""
        super()._rejoin(pid)
        renamed = {}
        for ns in list(self._spaces):
            new = self.call("hello", namespace=ns.spec.to_dict(), client=f"pid {os.getpid()}",
                            **self._credentials())["ns"]
            renamed[ns.id], ns.id = new, new
        return renamed

    def pair(self, base: NamespaceSpec, residual: NamespaceSpec) -> Pair:
        """A base namespace and one adapter's residual namespace (ForkKV), each said hello to; the daemon checks
        at the pair's first request that they are one model's base (role base) and residual (role residual)."""
        return Pair(self.namespace(base), self.namespace(residual))

    def fork(self, base: Namespace, child: Namespace, hashes: Sequence[bytes],
             parent: Namespace | None = None) -> ForkView:
        """Agent `child` (its residual namespace) forks the context `hashes` over `base`, from `parent`'s residual
        namespace if named: it inherits the base blocks by reference (nothing is copied) and writes only its
        residuals. The answer says what the child must still compute (kvstore.client.pairs.ForkView)."""
        extra = {} if parent is None else {"parent": parent.id}
        r = self.call("fork", ns=base.id, residual=child.id, keys=pack_keys(hashes), **extra)
        return ForkView(r["base"], r["host"], r["residual"], r["parent"])

    def renew(self) -> int:
        """Extend every reservation this connection holds open by a whole lease from now (a writer whose copies
        outlast `lease_s`, e.g. a forward pass saving layer by layer on a slow machine). Returns how many."""
        return int(self.call("renew")["n"])

    # ----- hints -----
    def hint(self, kind: str, **fields: Any) -> dict[str, Any]:
        """The raw hint op (kvstore.daemon.hints): raises KVStoreError on a malformed hint; a meaningless one is
        answered with `ignored`. The handles below never raise."""
        return self.call("hint", kind=kind, **fields)

    def workflow(self, wid: str, type: str | None = None) -> WorkflowHandle:
        """A handle on workflow `wid` (of type `type`, e.g. its family: what the predictor learns per); sends
        nothing until one of its methods is called."""
        return WorkflowHandle(self, wid, type)

    def session(self, sid: str) -> SessionHandle:
        """A handle on chat session `sid` (a workflow whose every turn reuses its whole history)."""
        return SessionHandle(self, sid)

    def workflows(self, limit: int = 100) -> builtins.list[dict[str, Any]]:
        """Active workflows of this client's tenant (every tenant's for the admin), the most recent first."""
        rows: builtins.list[dict[str, Any]] = self.call("workflows", limit=limit)["workflows"]
        return rows

    def close(self) -> None:
        self._closed = True
        for sid in list(self._segments):
            self._unmap(sid)
        self.copier.close()
        self.sock.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
