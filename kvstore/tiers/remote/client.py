"""The remote tier's hands on Mooncake Store: the few calls the tier makes, each returning plain values and raising
`StoreDown` where the store could not answer — so that the tier's logic never sees Mooncake's return-code
conventions and the tier can be read without its manual.

Why these calls: `batch_put_from_multi_buffers` and `batch_get_into_multi_buffers` move each value as a list of
(address, length) parts in one batch, which is how a block travels with its trailer (kvstore.tiers.remote.trailer)
without a bounce copy: the block's part is its host slot (or its staging buffer), the trailer's part a small
registered pad. Every address passed must lie in memory registered with `register` (the transfer engine reads
and writes it directly); the tier registers each host-pool segment the first time it moves one of its slots.

Mooncake is imported only here, and only when a daemon is configured with a remote tier: the core daemon runs
without the `kvstore[mooncake]` extra.
"""
from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit

from kvstore.tiers import TierUnavailable
from kvstore.tiers.remote import address
from kvstore.tiers.remote.config import RemoteConfig

log = logging.getLogger("kvstore")
Part = tuple[int, int]      # (address, length) in registered memory
RPC_FAILED = -900           # Mooncake: the master did not answer (seen at once for queries, after ~4 s for moves)
NOT_FOUND = -704            # Mooncake: OBJECT_NOT_FOUND
TRANSFER_FAILED = -800      # Mooncake: the bytes did not arrive (a node gone: ~10 s until the master drops it)
INVALID = -600              # Mooncake: invalid parameters (for a get: the value's length is not the block's)


class StoreDown(RuntimeError):
    """The store did not answer (master unreachable, a transfer failed at the transport): a miss, not an error of
    the block's."""


def store_key(bid: bytes) -> str:
    """A block's key in the store: its id (namespace digest + block hash) in hex, so daemons of every node that share
    a namespace find each other's blocks, and nothing of another namespace."""
    return "kvs1/" + bid.hex()


def metadata_address(cfg: RemoteConfig) -> str:
    """The transfer engine's metadata server: as configured, else the master's own HTTP one on its default port."""
    if cfg.metadata:
        return cfg.metadata
    host = cfg.master.rpartition(":")[0]
    return f"http://{host}:8080/metadata"


class MooncakeClient:
    """One `MooncakeDistributedStore`, set up with this node's segment. Thread-safe as Mooncake's client is; the
    lock only guards (re)connection and registration."""

    def __init__(self, cfg: RemoteConfig, advertised: str = "127.0.0.1", listen: str | None = None) -> None:
        """`advertised`: the address the other nodes are told (remote.hostname's, as MC_TCP_BIND_ADDRESS);
        `listen`: the address the transfer engine's ports bind, None: every address
        (kvstore.tiers.remote.address)."""
        try:
            from mooncake.store import MooncakeDistributedStore, ReplicateConfig
        except ImportError as e:
            raise TierUnavailable(f"remote: Mooncake Store's client is not installed ({e}); install the extra: "
                                  f"pip install 'kvstore[mooncake]' (and Debian's libibverbs1)") from None
        self.cfg = cfg
        self._factory = MooncakeDistributedStore
        self._replicate = ReplicateConfig()
        self._replicate.replica_num = cfg.replicas
        self._lock = threading.Lock()
        self._store: Any = None
        self._regions: dict[int, int] = {}      # registered address → length
        self.advertised = advertised
        self.listen = listen
        self.endpoint: dict[str, Any] = {}      # what the other nodes are told, and where the ports listen

    # ----- connection -----
    @property
    def connected(self) -> bool:
        return self._store is not None

    def reachable(self, timeout: float = 1.0) -> str | None:
        """None if the master's RPC port and the HTTP metadata server accept a TCP connection; else which does not.
        Why ask first: Mooncake's setup() holds the GIL until it gives up (~90 s against a port nobody listens
        on), which would freeze the whole daemon."""
        where = [("master", self.cfg.master)]
        meta = urlsplit(metadata_address(self.cfg))
        if meta.scheme == "http" and meta.hostname:
            where.append(("metadata server", f"{meta.hostname}:{meta.port or 80}"))
        for what, addr in where:
            host, _, port = addr.rpartition(":")
            try:
                socket.create_connection((host.strip("[]"), int(port)), timeout=timeout).close()
            except (OSError, ValueError) as e:
                return f"the {what} at {addr} does not answer ({e})"
        return None

    def connect(self) -> None:
        """Set up a client with this node's segment; StoreDown if the master or the metadata server refuses. Once
        set up, a client links again by itself when a restarted master answers (its segment mounted again):
        it is set up once per daemon."""
        with self._lock:
            self._connect_locked()

    def _connect_locked(self) -> None:
        store = self._factory()
        c = self.cfg
        with address.armed(self.listen):          # the engine's listening ports bind here (its setup binds them)
            rc = store.setup(c.hostname, metadata_address(c), c.segment_bytes, c.buffer_bytes, c.protocol,
                             c.device, c.master)
        if rc != 0:
            raise StoreDown(f"setting up Mooncake Store's client failed (code {rc}); is mooncake_master "
                            f"running at {c.master} with its metadata server at {metadata_address(c)}?")
        self._store = store
        try:
            self.endpoint = address.describe(str(store.get_hostname()), metadata_address(c))
        except Exception as e:                          # a binding without get_hostname: nothing to show
            log.debug("remote: could not read this node's transfer endpoint: %s", e)
        for addr, size in self._regions.items():      # memory named before the client existed
            store.register_buffer(addr, size)

    def healthy(self) -> bool:
        """Whether the master answers now (one small RPC)."""
        try:
            return int(self._call("is_exist", store_key(b"\0" * 32))) >= 0
        except StoreDown:
            return False

    def _call(self, name: str, *args: Any) -> Any:
        store = self._store
        if store is None:
            raise StoreDown("not connected")
        try:
            return getattr(store, name)(*args)
        except Exception as e:                          # the binding raises where the transport broke
            raise StoreDown(f"{name} failed: {type(e).__name__}: {e}") from e

    # ----- memory -----
    def register(self, addr: int, size: int) -> None:
        """Let the transfer engine move bytes straight from and to [addr, addr+size). A region registered before
        that overlaps it is dropped first: its memory was unmapped (its address is in use again)."""
        with self._lock:
            if self._regions.get(addr) == size:
                return
            for old, n in list(self._regions.items()):
                if old < addr + size and addr < old + n:
                    self._unregister_locked(old)
            if self._store is not None:
                rc = self._store.register_buffer(addr, size)
                if rc != 0:
                    raise StoreDown(f"registering {size} bytes of memory failed (code {rc})")
            self._regions[addr] = size

    def registered(self, addr: int, size: int) -> bool:
        """Whether [addr, addr+size) lies in registered memory (a snapshot of the regions: another thread may be
        registering one)."""
        return any(old <= addr and addr + size <= old + n for old, n in tuple(self._regions.items()))

    def unregister(self, addr: int) -> None:
        with self._lock:
            self._unregister_locked(addr)

    def _unregister_locked(self, addr: int) -> None:
        self._regions.pop(addr, None)
        if self._store is not None:
            try:
                self._store.unregister_buffer(addr)
            except Exception:
                pass

    # ----- blocks -----
    def exist(self, keys: Sequence[str]) -> list[bool]:
        """Which keys the store holds now (one batched query to the master)."""
        codes = self._call("batch_is_exist", list(keys))
        if any(c < 0 for c in codes):
            raise StoreDown(f"the master did not answer an existence query (codes "
                            f"{sorted(set(c for c in codes if c < 0))})")
        return [c == 1 for c in codes]

    def put(self, keys: Sequence[str], parts: Sequence[Sequence[Part]]) -> list[int]:
        """Store each key's value, the concatenation of its parts; per key 0 (stored), or a negative code (the
        store refused it: full, or the key exists already, which for a block is as good as stored)."""
        ptrs = [[p[0] for p in ps] for ps in parts]
        sizes = [[p[1] for p in ps] for ps in parts]
        return _answered("batch_put_from_multi_buffers",
                         self._call("batch_put_from_multi_buffers", list(keys), ptrs, sizes, self._replicate))

    def get(self, keys: Sequence[str], parts: Sequence[Sequence[Part]]) -> list[int]:
        """Read each key's value into its parts; per key the bytes read, or a negative code (not there, or a
        transfer failure)."""
        ptrs = [[p[0] for p in ps] for ps in parts]
        sizes = [[p[1] for p in ps] for ps in parts]
        return _answered("batch_get_into_multi_buffers",
                         self._call("batch_get_into_multi_buffers", list(keys), ptrs, sizes))

    def remove(self, keys: Sequence[str]) -> None:
        """Remove keys from the store, also those still in their put lease (a delete is a delete)."""
        self._call("batch_remove", list(keys), True)

    def close(self) -> None:
        """Let go of the store. Nothing may call the client after this (Mooncake's client faults on any call after
        its close): the tier closes its path first. A setup still blocked in the link thread (up to ~90 s against a
        master that does not listen) is left to the process's exit."""
        if not self._lock.acquire(timeout=2.0):
            return
        try:
            store, self._store = self._store, None
            if store is not None:
                for addr in list(self._regions):
                    try:
                        store.unregister_buffer(addr)
                    except Exception:
                        pass
                try:
                    store.close()
                except Exception:
                    pass
            self._regions.clear()
        finally:
            self._lock.release()


def _answered(call: str, codes: Sequence[int]) -> list[int]:
    """Per-key codes, unless the master answered none of them (StoreDown)."""
    out = list(codes)
    if out and all(c == RPC_FAILED for c in out):
        raise StoreDown(f"the master did not answer {call} (code {RPC_FAILED})")
    return out
