"""Where the remote tier's bytes travel, decided by two settings and checked once linked.

- `remote.hostname` is this node's address as the other nodes reach it. Mooncake's transfer engine does not take it
  from the client's setup: it advertises MC_TCP_BIND_ADDRESS, or else the machine's first non-loopback address (and
  on a host with only loopback it retries for a minute and gives up). So the tier sets MC_TCP_BIND_ADDRESS to the
  hostname's address (`advertised`): one setting decides where the other nodes send this node's bytes, and the
  default, 127.0.0.1, keeps a single-host setup on loopback.
- `remote.bind_address` is where the engine's two listening ports (handshake and TCP data) accept connections:
  empty means the advertised address only, "0.0.0.0" or "::" every address (Mooncake's own behaviour). Mooncake
  binds both to the any-address with no setting to narrow them, so `kvstore serve` starts itself again with
  native/kvbind.c preloaded (`reexec_with_bind_guard`), and the tier arms it, in its link thread only, around the
  engine's setup (`armed`): only those binds are narrowed.

Once linked, `describe` reads what the engine really advertised (from the HTTP metadata server) and which addresses
its ports listen on (from /proc/self/net/tcp*), for the log line, `kvstore stats` and the tests.
"""
from __future__ import annotations

import ctypes
import glob
import ipaddress
import json
import logging
import os
import socket
import struct
import sys
import urllib.parse
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

log = logging.getLogger("kvstore")
ANY = ("0.0.0.0", "::")
GUARD_ENV = "KVSTORE_BIND_GUARD"          # set by the re-exec: the library is preloaded (or could not be)


def is_loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address.strip("[]"))
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped.is_loopback
    return ip.is_loopback


def is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
        return True
    except ValueError:
        return False


def advertised(hostname: str) -> str:
    """The IP address the other nodes are told to reach this node at: `hostname` itself, or its first address.
    Raises OSError where the name does not resolve."""
    if is_ip(hostname):
        return hostname
    return str(socket.getaddrinfo(hostname, None, proto=socket.IPPROTO_TCP)[0][4][0])


def listen_address(hostname_ip: str, bind_address: str) -> str | None:
    """The address the engine's ports should bind, or None for every address (nothing to narrow)."""
    want = bind_address or hostname_ip
    return None if want in ANY else want


# ----- the preloaded library -----
def library_path() -> str | None:
    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    found = sorted(glob.glob(os.path.join(here, "_kvbind*.so")))
    return found[0] if found else None


def _guard() -> Any:
    lib = ctypes.CDLL(None)
    return lib if hasattr(lib, "kvbind_arm") else None


def guard_loaded() -> bool:
    return _guard() is not None


def reexec_with_bind_guard() -> None:
    """Start this process again with native/kvbind.c preloaded (same pid, same arguments), once; returns where that
    is not needed (loaded already, or tried) or not possible (the library was not built: the caller warns)."""
    if os.environ.get(GUARD_ENV) or guard_loaded() or sys.platform != "linux":
        return
    lib = library_path()
    if lib is None:
        return
    env = dict(os.environ)
    env[GUARD_ENV] = "1"
    env["LD_PRELOAD"] = " ".join(p for p in (lib, env.get("LD_PRELOAD", "")) if p)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)


@contextmanager
def armed(address: str | None) -> Iterator[bool]:
    """The calling thread's binds to the any-address go to `address` while inside (True), where the library is
    loaded and there is an address to bind; else nothing changes (False)."""
    lib = _guard() if address else None
    if lib is None or address is None:
        yield False
        return
    if lib.kvbind_arm(address.encode()) != 0:
        raise ValueError(f"not an IP address: {address!r}")
    try:
        yield True
    finally:
        lib.kvbind_arm(None)


# ----- what the engine really does -----
def _metadata_entry(metadata: str, key: str, timeout: float = 1.0) -> dict[str, Any] | None:
    url = f"{metadata}?key={urllib.parse.quote(key, safe='')}"
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            data = json.loads(r.read())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def describe(segment: str, metadata: str) -> dict[str, Any]:
    """This node's transfer endpoint as the other nodes see it (the metadata server's entries for its segment, HTTP
    metadata only) and the addresses its ports listen on here."""
    out: dict[str, Any] = {"segment": segment, "advertised": "", "ports": [], "listening": []}
    if not metadata.startswith("http://"):
        return out
    rpc = _metadata_entry(metadata, f"mooncake/rpc_meta/{segment}") or {}
    ram = _metadata_entry(metadata, f"mooncake/ram/{segment}") or {}
    out["advertised"] = str(rpc.get("ip_or_host_name") or ram.get("tcp_data_host") or "")
    ports = [int(p) for p in (rpc.get("rpc_port"), ram.get("tcp_data_port")) if p]
    out["ports"] = ports
    out["listening"] = sorted({f"{a}:{p}" for a, p in listeners() if p in ports})
    return out


def listeners(pid: int | str = "self") -> list[tuple[str, int]]:
    """The (address, port) of every TCP socket process `pid` listens on (Linux: /proc)."""
    return [local for state, local, _ in sockets(pid) if state == LISTEN]


LISTEN = "0A"                       # /proc/net/tcp's state of a listening socket (01: established)


def sockets(pid: int | str = "self") -> list[tuple[str, tuple[str, int], tuple[str, int]]]:
    """(state, local, remote) of every TCP socket process `pid` holds (Linux: /proc; IPv4-mapped IPv6 addresses
    shown as IPv4)."""
    inodes = set()
    fd_dir = f"/proc/{pid}/fd"
    try:
        names = os.listdir(fd_dir)
    except OSError:
        return []
    for fd in names:
        try:
            target = os.readlink(os.path.join(fd_dir, fd))
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    out = []
    for table in ("tcp", "tcp6"):
        try:
            with open(f"/proc/{pid}/net/{table}") as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            if len(fields) > 9 and fields[9] in inodes:
                out.append((fields[3], _address(fields[1]), _address(fields[2])))
    return out


def _address(hexaddr: str) -> tuple[str, int]:
    """/proc/net/tcp's "0100007F:1F90" → ("127.0.0.1", 8080); IPv6 in its four host-order words."""
    ip, port = hexaddr.split(":")
    raw = bytes.fromhex(ip)
    if len(raw) == 4:
        text = socket.inet_ntop(socket.AF_INET, struct.pack("<I", int(ip, 16)))
    else:
        words = b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4))
        text = socket.inet_ntop(socket.AF_INET6, words)
        mapped = ipaddress.IPv6Address(text).ipv4_mapped
        text = str(mapped) if mapped is not None else text
    return text, int(port, 16)


def problems(endpoint: dict[str, Any], hostname_ip: str, listen: str | None) -> list[str]:
    """What an operator must know about the endpoint the engine set up: it advertises another address than
    remote.hostname's, or its ports listen on more than `listen` (None: every address was asked for)."""
    out = []
    told = endpoint.get("advertised", "")
    if told and told != hostname_ip:
        out.append(f"Mooncake advertises {told} to the other nodes, not remote.hostname's {hostname_ip}: the "
                   f"other nodes send this node's bytes there (is MC_TCP_BIND_ADDRESS honoured by this Mooncake?)")
    if listen is not None:
        wide = [a for a in endpoint.get("listening", []) if a.rpartition(":")[0] != listen]
        if wide:
            out.append(f"the transfer engine listens on {', '.join(wide)}, not only on {listen} (the bind guard, "
                       f"native/kvbind.c, is not loaded: build kvstore with a C compiler, or firewall ports "
                       f"{', '.join(str(p) for p in endpoint.get('ports', []))})")
    return out
