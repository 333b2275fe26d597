"""What the daemon keeps across connections to hold tenants apart (issue 29): connections per user and per tenant
(each capped below `server.max_connections`, so that one user or tenant cannot lock the others out), the bytes
held and reserved per tenant and per user other than the daemon's own (`HoldGroup`s: the per-connection shares of
the pool apply to their sums, so that opening more connections, or speaking as more tenants, gains nothing), and the
failed hellos (`HelloGuard`). Under the state lock.
"""
from __future__ import annotations

import os
from collections import Counter

from kvstore.daemon.server_config import ServerConfig
from kvstore.daemon.tenants import Conn, HelloGuard, Peer
from kvstore.index import HoldGroup
from kvstore.protocol import Code, ProtocolError


def connection_cap(configured: int, total: int) -> int:
    """A per-user or per-tenant cap: as configured, or (0) three quarters of server.max_connections, so that a
    quarter is always left to the others."""
    return configured or max(1, total - total // 4)


class Access:
    def __init__(self, cfg: ServerConfig) -> None:
        self.guard = HelloGuard(cfg.max_failed_hellos)
        self.uid_cap = connection_cap(cfg.max_connections_per_uid, cfg.max_connections)
        self.tenant_cap = connection_cap(cfg.max_connections_per_tenant, cfg.max_connections)
        self.per_uid: Counter[int] = Counter()
        self.per_tenant: Counter[str] = Counter()
        self._groups: dict[str, HoldGroup] = {}

    def group(self, name: str) -> HoldGroup:
        g = self._groups.get(name)
        if g is None:
            g = self._groups[name] = HoldGroup(name)
        return g

    def uid_full(self, peer: Peer) -> str | None:
        """Why a new connection of this user is refused (its cap), or None."""
        if self.per_uid[peer.uid] >= self.uid_cap:
            return (f"uid {peer.uid} holds {self.per_uid[peer.uid]} connections, the most one user may "
                    f"(server.max_connections_per_uid); close some or try again later")
        return None

    def connected(self, h: Conn) -> None:
        """Count a new connection for its user; its holdings count in the user's sums too, except for the daemon's
        own user: its tenants are told apart by their secrets and capped each (a cap on their sum would take
        quotas away), and that user can read the daemon's memory anyway."""
        self.per_uid[h.peer.uid] += 1
        if h.peer.uid != os.getuid():
            h.join(self.group(f"uid:{h.peer.uid}"))

    def enter_tenant(self, h: Conn, tenant: str) -> None:
        """Count the connection in its tenant (its hello fixed it) and its holdings in the tenant's sums; refused
        with too_many_connections past the tenant's cap."""
        if self.per_tenant[tenant] >= self.tenant_cap:
            raise ProtocolError(Code.TOO_MANY_CONNECTIONS, f"hello: tenant {tenant!r} holds "
                                                           f"{self.per_tenant[tenant]} connections, the most one "
                                                           "tenant may (server.max_connections_per_tenant)")
        self.per_tenant[tenant] += 1
        h.tenant_counted = True
        h.join(self.group(f"tenant:{tenant}"))

    def disconnected(self, h: Conn) -> None:
        """(After the index let go of its holdings, so its groups' sums are back.)"""
        _leave(self.per_uid, h.peer.uid)
        if h.tenant is not None and h.tenant_counted:
            _leave(self.per_tenant, h.tenant)


def _leave(counter: Counter, key: object) -> None:  # type: ignore[type-arg]
    if counter[key] > 0:
        counter[key] -= 1
        if not counter[key]:
            del counter[key]
