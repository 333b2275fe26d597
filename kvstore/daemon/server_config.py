"""The `server` section: the control socket, who may connect and with what rights, and the limits each connection
and tenant is held to (kvstore.daemon.access, kvstore.daemon.tenants); its checks, composed by
kvstore.daemon.config like every other section's."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from kvstore.protocol.paths import default_socket_path


@dataclass(slots=True)
class ServerConfig:
    socket: str = "auto"
    max_connections: int = 64
    max_frame_bytes: int = 1 << 20
    max_keys_per_request: int = 1024
    shutdown_timeout_s: float = 10.0
    send_timeout_s: float = 10.0        # a client that stops reading its replies this long is disconnected
    admin_uids: list[int] = field(default_factory=list)   # who may resize, evict, list others ("auto": our uid)
    max_held_fraction: float = 1.0      # one connection's reserved + pinned bytes, as a share of the pool
    max_reserved_fraction: float = 0.5  # one connection's reservations not committed yet, as a share of the pool
    max_namespaces_per_connection: int = 64
    reservation_lease_s: float = 60.0   # an uncommitted reservation older than this is aborted
    min_block_bytes: int = 512          # a namespace whose full block is smaller is refused
    idle_timeout_s: float = 600.0       # a connection pinning nothing that sends nothing this long is closed
    pin_lease_s: float = 300.0          # a pin held longer is dropped (its reader's late copy fails its CRC check)
    max_connections_per_uid: int = 0   # 0: max_connections // 2 (one user cannot lock the others out)
    max_connections_per_tenant: int = 0  # 0: max_connections // 2
    socket_group: str = ""              # a group (name or gid) whose members may connect: engines under own uids
    socket_mode: str = "auto"           # the socket's mode: auto = 0600, 0660 with socket_group
    admin_secret: str = ""              # where tenants have secrets, the admin role needs this too (hello)
    admin_secret_file: str = ""         # the same, read from a file (at start)
    max_failed_hellos: int = 10         # per uid per minute: then hellos with credentials are refused unchecked


def check_server(s: ServerConfig) -> list[str]:
    """Every problem with the section, one message each; resolves `socket: auto` and reads the admin secret's
    file."""
    errors: list[str] = []
    if s.socket == "auto":
        s.socket = default_socket_path()
    if not os.path.isabs(s.socket):
        errors.append(f"server.socket: must be an absolute path, got {s.socket!r}")
    if len(s.socket.encode()) > 100:
        errors.append(f"server.socket: path longer than 100 bytes (Unix socket limit): {s.socket}")
    if not 1 <= s.max_connections <= 4096:
        errors.append(f"server.max_connections: must be 1..4096, got {s.max_connections}")
    if not 4096 <= s.max_frame_bytes <= 64 << 20:
        errors.append(f"server.max_frame_bytes: must be 4KiB..64MiB, got {s.max_frame_bytes}")
    if not 1 <= s.max_keys_per_request <= 65536:
        errors.append(f"server.max_keys_per_request: must be 1..65536, got {s.max_keys_per_request}")
    if not 0.1 <= s.send_timeout_s <= 3600:
        errors.append(f"server.send_timeout_s: must be 0.1..3600 seconds, got {s.send_timeout_s}")
    if s.shutdown_timeout_s < 0:
        errors.append(f"server.shutdown_timeout_s: must not be negative, got {s.shutdown_timeout_s}")
    return errors + _check_limits(s) + _check_access(s)


def parse_socket_mode(value: Any) -> str:
    """`auto`, or an octal mode: YAML reads an unquoted 0660 as the integer 432, an environment variable gives the
    string "0660"; either way the result is the octal string."""
    if value == "auto":
        return value
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= 0o777:
        return f"0{value:o}"
    if isinstance(value, str) and value.isdigit() and set(value) <= set("01234567") and int(value, 8) <= 0o777:
        return f"0{int(value, 8):o}"
    raise ValueError(f"expected auto or an octal mode such as 0660, got {value!r}")


def socket_mode(s: ServerConfig) -> int:
    """The socket's mode bits: server.socket_mode, or 0600 (0660 where a socket_group may connect)."""
    if s.socket_mode == "auto":
        return 0o660 if s.socket_group else 0o600
    return int(s.socket_mode, 8)


def socket_gid(s: ServerConfig) -> int | None:
    """server.socket_group as a gid (None: none); ValueError naming it if no such group."""
    import grp

    if not s.socket_group:
        return None
    if s.socket_group.isdigit():
        return int(s.socket_group)
    try:
        return grp.getgrnam(s.socket_group).gr_gid
    except KeyError:
        raise ValueError(f"no group named {s.socket_group!r}") from None


def _check_access(s: ServerConfig) -> list[str]:
    """The socket's group and mode, and the admin secret (read from its file here, once)."""
    errors = []
    try:
        socket_gid(s)
    except ValueError as e:
        errors.append(f"server.socket_group: {e}")
    if socket_mode(s) & 0o007 and not s.socket_group:
        errors.append(f"server.socket_mode: {s.socket_mode} lets every local user connect; name the users' group "
                      "in server.socket_group instead (other users need a distinct uid and tenancy)")
    if s.admin_secret and s.admin_secret_file:
        errors.append("server.admin_secret and server.admin_secret_file: set one, not both")
    elif s.admin_secret_file:
        try:
            with open(s.admin_secret_file) as f:
                s.admin_secret = f.read().strip()
        except OSError as e:
            errors.append(f"server.admin_secret_file: cannot read {s.admin_secret_file}: {e.strerror}")
        else:
            if not s.admin_secret:
                errors.append(f"server.admin_secret_file: {s.admin_secret_file} is empty")
    if not 1 <= s.max_failed_hellos <= 100000:
        errors.append(f"server.max_failed_hellos: must be 1..100000, got {s.max_failed_hellos}")
    for name in ("max_connections_per_uid", "max_connections_per_tenant"):
        v = getattr(s, name)
        if not 0 <= v <= s.max_connections:
            errors.append(f"server.{name}: must be 0..server.max_connections ({s.max_connections}), got {v}")
    if not 1 <= s.pin_lease_s <= 86400:
        errors.append(f"server.pin_lease_s: must be 1..86400 seconds, got {s.pin_lease_s}")
    return errors


def _check_limits(s: ServerConfig) -> list[str]:
    errors = []
    if not 0 < s.max_held_fraction <= 1:
        errors.append(f"server.max_held_fraction: must be above 0 and at most 1, got {s.max_held_fraction}")
    if not 0 < s.max_reserved_fraction <= 1:
        errors.append(f"server.max_reserved_fraction: must be above 0 and at most 1, got {s.max_reserved_fraction}")
    if not 1 <= s.max_namespaces_per_connection <= 65536:
        errors.append(f"server.max_namespaces_per_connection: must be 1..65536, got "
                      f"{s.max_namespaces_per_connection}")
    if not 0.1 <= s.reservation_lease_s <= 86400:
        errors.append(f"server.reservation_lease_s: must be 0.1..86400 seconds, got {s.reservation_lease_s}")
    if not 1 <= s.min_block_bytes <= 1 << 30:
        errors.append(f"server.min_block_bytes: must be 1B..1GiB, got {s.min_block_bytes}")
    if not 0.1 <= s.idle_timeout_s <= 7 * 86400:
        errors.append(f"server.idle_timeout_s: must be 0.1..604800 seconds, got {s.idle_timeout_s}")
    return errors
