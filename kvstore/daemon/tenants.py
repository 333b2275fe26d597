"""Who a connection is: its peer credentials (from the kernel, SO_PEERCRED, at accept), whether it has the admin
role, and which tenant it speaks for.

- Admin: the peer's uid is in `server.admin_uids` (by default the daemon's own uid) and, where a tenant has a
  secret, its hello carried the admin secret (`server.admin_secret`): tenants that share the daemon's uid are kept
  apart by their secrets, so the uid alone must not make one of them admin.
  Resize, evict, quotas and listing a namespace's keys that the connection did not say hello to need it: a key
  list names slots another client could then read through a mapped segment.
- Tenant: fixed at the connection's first hello. A named tenant must be configured (`tenants:`), list the peer's
  uid (if it lists any) and have the secret given (compared in constant time); else `forbidden`. With no name, the
  first tenant listing the peer's uid, else the default tenant "" for the daemon's own uid and "uid:<n>" for any
  other (refused with `tenancy.unknown: refuse`): two users that configured nothing still never share blocks. A
  tenant with a secret is never entered without it: a nameless hello from a uid it lists is refused.
- Failed hellos (`HelloGuard`): each is logged at warning with the uid; after its third, a connection's hellos with
  credentials are refused unchecked; past `server.max_failed_hellos` in a minute, so are that uid's, until the
  minute has passed (a guesser gets that many tries a minute, whatever its number of connections). A refused hello
  never closes the connection (a client that sent only well-formed requests is always answered).
"""
from __future__ import annotations

import hmac
import logging
import os
import socket
import struct
import time
from collections import Counter, defaultdict, deque
from dataclasses import dataclass, field

from kvstore.daemon.config import Config
from kvstore.index import Holdings
from kvstore.protocol import Code, ProtocolError

log = logging.getLogger("kvstore")
_CREDS = struct.Struct("3i")     # struct ucred: pid, uid, gid
HELLO_WINDOW_S = 60.0            # server.max_failed_hellos counts failures over this window, per uid
FAILED_HELLOS_PER_CONNECTION = 3  # then no credentials are checked on that connection


@dataclass(frozen=True, slots=True)
class Peer:
    pid: int
    uid: int
    gid: int

    @classmethod
    def of(cls, sock: socket.socket) -> Peer:
        pid, uid, gid = _CREDS.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CREDS.size))
        return cls(pid, uid, gid)

    def __str__(self) -> str:
        return f"pid {self.pid} (uid {self.uid})"


@dataclass(slots=True)
class Conn(Holdings):
    """A client connection's holdings, with who it is: what every op is handed."""
    peer: Peer = Peer(0, -1, -1)
    admin: bool = False
    failed_hellos: int = 0
    tenant_counted: bool = False        # counted in its tenant's connections (kvstore.daemon.access)
    pin_seen: dict[int, float] = field(default_factory=dict)    # gid -> when its pin was first seen (leases)
    expired_pins: Counter[int] = field(default_factory=Counter)  # pins dropped at their lease: releases are no-ops


def admin_secret_needed(cfg: Config) -> bool:
    """Whether the admin role needs the admin secret: where a tenant has a secret (elsewhere the uid decides, and a
    hello's admin secret, if it carries one, must still be right)."""
    return any(t.secret for t in cfg.tenants)


def is_admin(cfg: Config, peer: Peer) -> bool:
    """The admin role by uid alone (before any hello): only where no secret guards anything."""
    return peer.uid in cfg.server.admin_uids and not admin_secret_needed(cfg)


def check_admin_secret(cfg: Config, peer: Peer, secret: str) -> bool:
    """Whether a hello's `admin_secret` gives the admin role: never to a uid outside server.admin_uids (the secret
    is then not looked at); else it must be the configured one (`forbidden` if not, or if none is configured where
    one is needed)."""
    if peer.uid not in cfg.server.admin_uids:
        return False
    want = cfg.server.admin_secret
    if not want:
        if admin_secret_needed(cfg):
            raise ProtocolError(Code.FORBIDDEN, "hello: no admin secret is configured (server.admin_secret_file): "
                                                "where tenants have secrets nobody has the admin role without it")
        return True
    if not hmac.compare_digest(want.encode(), secret.encode()):
        raise ProtocolError(Code.FORBIDDEN, "hello: wrong admin secret")
    return True


class HelloGuard:
    """Failed hellos per uid over the last minute (see the module docstring). Kept under the state lock."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._failures: defaultdict[int, deque[float]] = defaultdict(deque)
        self.refused = 0

    def _recent(self, uid: int, now: float) -> deque[float]:
        q = self._failures[uid]
        while q and q[0] <= now - HELLO_WINDOW_S:
            q.popleft()
        if not q:
            del self._failures[uid]
        return q

    def check(self, h: Conn, now: float | None = None) -> None:
        """Refuse, unchecked, a hello with credentials on a connection past its failures, or from a uid past its
        failures this minute."""
        peer = h.peer
        if h.failed_hellos >= FAILED_HELLOS_PER_CONNECTION:
            self.refused += 1
            raise ProtocolError(Code.FORBIDDEN, f"hello: {h.failed_hellos} failed hellos on this connection: no more "
                                                "credentials are checked on it")
        if len(self._recent(peer.uid, time.monotonic() if now is None else now)) >= self.limit:
            self.refused += 1
            raise ProtocolError(Code.FORBIDDEN, f"hello: too many failed hellos from uid {peer.uid} in the last "
                                                f"{HELLO_WINDOW_S:g} s (server.max_failed_hellos); try again later")

    def failed(self, h: Conn, why: str, now: float | None = None) -> None:
        """Count a failure of this connection and its uid; log it."""
        h.failed_hellos += 1
        q = self._failures[h.peer.uid]
        q.append(time.monotonic() if now is None else now)
        if len(q) <= self.limit:
            log.warning("failed hello from %s: %s%s", h.peer, why, " (now refusing this uid's hellos for a minute: "
                        "server.max_failed_hellos)" if len(q) == self.limit else "")
        while len(q) > self.limit:          # memory stays bounded whatever the flood
            q.popleft()


def forbidden(what: str) -> ProtocolError:
    """The refusal of an admin operation, naming the setting that grants it."""
    return ProtocolError(Code.FORBIDDEN, f"{what} needs the admin role: run it as a user listed in "
                                         "server.admin_uids (by default the daemon's own user)")


def resolve(cfg: Config, peer: Peer, name: str | None, secret: str | None) -> str:
    """The tenant a hello speaks for (see the module docstring); ProtocolError(FORBIDDEN) if it may not."""
    if name:
        t = next((t for t in cfg.tenants if t.name == name), None)
        if t is None:
            raise ProtocolError(Code.FORBIDDEN, f"hello: tenant {name[:64]!r} is not configured (tenants: in the "
                                                "daemon's configuration)")
        if t.uids and peer.uid not in t.uids:
            raise ProtocolError(Code.FORBIDDEN, f"hello: uid {peer.uid} may not speak as tenant {name!r} (its uids "
                                                "in the daemon's tenants: configuration)")
        if t.secret and not hmac.compare_digest(t.secret.encode(), (secret or "").encode()):
            raise ProtocolError(Code.FORBIDDEN, f"hello: wrong secret for tenant {name!r}")
        return t.name
    mine = next((t for t in cfg.tenants if peer.uid in t.uids), None)
    if mine is not None:
        if mine.secret:
            raise ProtocolError(Code.FORBIDDEN, f"hello: uid {peer.uid} belongs to tenant {mine.name!r}, which has a "
                                                "secret: name the tenant with its secret (KVSTORE_TENANT, "
                                                "KVSTORE_TENANT_SECRET)")
        return mine.name
    if peer.uid == os.getuid():
        return ""
    if cfg.tenancy.unknown == "refuse":
        raise ProtocolError(Code.FORBIDDEN, f"hello: uid {peer.uid} belongs to no tenant and this daemon refuses "
                                            "unknown tenants (tenancy.unknown: refuse); name a tenant with its "
                                            "secret, or ask for one in the daemon's tenants: configuration")
    return f"uid:{peer.uid}"


def tenant_of(cfg: Config, h: Conn) -> str:
    """The connection's tenant; before any hello, the one a hello without a name would get (not fixed by this)."""
    return h.tenant if h.tenant is not None else resolve(cfg, h.peer, None, None)
