"""The client's operator calls: the daemon's books and knobs as one request each — ping, stats, list, resize,
tenants and their quotas, evict, and a tenant-wide durable flush. The `kvstore` CLI and operators use them; an
engine's data path never does. A layer of `Client` (kvstore.client.connection) on the wire alone: each is one
`call`, whose refusal raises KVStoreError; what the admin alone may do (another tenant's books, quotas, evict) the
daemon decides, not the client.
"""
from __future__ import annotations

from typing import Any

from kvstore.client.wire import Wire


class AdminCalls(Wire):
    """The daemon's books and knobs, one round trip each."""

    def ping(self) -> dict[str, Any]:
        return self.call("ping")

    def stats(self) -> dict[str, Any]:
        return self.call("stats")

    def list(self, ns: int | None = None, limit: int = 100, tags: bool = False) -> dict[str, Any]:
        """Namespaces; with `ns`, up to `limit` of its blocks, and with `tags` each one's standing and the workflows
        that touched it (under pool.eviction: workflow; None per block otherwise)."""
        if ns is None:
            return self.call("list")
        return self.call("list", ns=ns, limit=limit, **({"tags": True} if tags else {}))

    def resize(self, nbytes: int, tier: str = "host") -> dict[str, Any]:
        return self.call("resize", bytes=nbytes, tier=tier)

    def tenants(self) -> dict[str, Any]:
        """Per tenant: quota, used, borrowed, lent, hit rate, evictions, reclaims (every tenant for the admin, your
        own otherwise), and the pool's capacity and charged bytes."""
        return self.call("tenants")

    def set_quota(self, tenant: str, host: int | None = None, ssd: int | None = None) -> dict[str, Any]:
        """Change a tenant's guaranteed host bytes, SSD bytes or both online (admin)."""
        fields = {k: v for k, v in (("host", host), ("ssd", ssd)) if v is not None}
        return self.call("tenant_quota", tenant=tenant, **fields)

    def evict(self, nbytes: int = 0, everything: bool = False, ns: int | None = None) -> dict[str, Any]:
        fields: dict[str, Any] = {"all": everything} if everything else {"bytes": nbytes}
        if ns is not None:
            fields["ns"] = ns
        return self.call("evict", **fields)

    def flush_durable(self, timeout_s: float | None = None) -> dict[str, Any]:
        """Wait until every block of this connection's tenant stored before now is on disk and synced in the
        daemon's SSD tier (blocks only in the host pool are written first in line), or until the deadline (the
        daemon's ssd.durable_timeout_s if None). The daemon's answer: {durability, blocks, pending, failed}
        (kvstore.client.blocks). Not `flush`, which reads the replies of pipelined requests."""
        if timeout_s is not None and self.timeout is not None and not 0 <= timeout_s < self.timeout:
            raise ValueError(f"timeout_s ({timeout_s} s) must be 0 or more and below the socket timeout "
                             f"({self.timeout} s)")
        return self.call("flush", **({} if timeout_s is None else {"timeout_ms": int(timeout_s * 1000)}))
