"""Who a connection is: its peer credentials (from the kernel, SO_PEERCRED, at accept), whether it has the admin
role, and which tenant it speaks for.

- Admin: the peer's uid is in `server.admin_uids` (by default the daemon's own uid). Resize, evict, and listing a
  namespace's keys that the connection did not say hello to need it: a key list names slots another client could
  then read through a mapped segment.
- Tenant: fixed at the connection's first hello. A named tenant must be configured (`tenants:`), list the peer's
  uid (if it lists any) and have the secret given (compared in constant time); else `forbidden`. With no name, the
  first tenant listing the peer's uid, else the default tenant "" for the daemon's own uid and "uid:<n>" for any
  other (refused with `tenancy.unknown: refuse`): two users that configured nothing still never share blocks.
"""
from __future__ import annotations

import hmac
import os
import socket
import struct
from dataclasses import dataclass

from kvstore.daemon.config import Config
from kvstore.index import Holdings
from kvstore.protocol import Code, ProtocolError

_CREDS = struct.Struct("3i")     # struct ucred: pid, uid, gid


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


def is_admin(cfg: Config, peer: Peer) -> bool:
    return peer.uid in cfg.server.admin_uids


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
