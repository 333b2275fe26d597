"""The remote tier as the daemon uses it (see the package docstring for the store itself).

Placement (`remote.placement`): *write-back* — a block evicted from the host pool is staged (copied into registered
staging memory, `remote.staging_bytes`; beyond it the block is dropped and counted) and put in the background lane;
*write-through* — a committed block is put from its host slot in the store lane (kvstore.movers.publish), no copy
at all. Without an SSD tier the remote tier is the first lower tier and takes the evictions (write-back by
default); beside an SSD tier the SSD takes them and the remote tier is written through (host → SSD, and → remote).

`RemoteTier` is the `LowerTier` and `SharedTier` the daemon holds, a facade over its parts, in the SSD tier's
shape (each module's docstring says what its part owns, and why):

- `wire`: what the parts share — the configuration, the network path, the client, one lock for the whole tier (the
  books, the staging and the link's state are guarded together), the registered memory (staging, the trailer
  pad, host slots' segments), the counters, a transfer's wait within remote.timeout_s;
- `link`: connecting to the store, staying linked, whether it answers now (`up`), the endpoint report;
- `books`: what the store is known to hold, without asking it (`has`), and the existence query (`probe`);
- `writeback`: staging evicted blocks (`stage`, `fill`) and the writer thread that puts them;
- `puts`: write-through (`announce`, `write`) and the put in pieces every put goes through;
- `reads`: the verified prefix into host slots (`read`, `read_async`), misses and quarantine;
- `admin`: deletes, namespaces, the stats row, the stop.

`open_tier` builds it from the configuration, with the placement it resolves and the transfer engine's endpoint.
"""
from __future__ import annotations

import logging
import os
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

from kvstore.tiers import StagingBuffer, TierContext, TierUnavailable, TierWrite
from kvstore.tiers.remote import address
from kvstore.tiers.remote.admin import Admin
from kvstore.tiers.remote.arena import Arena
from kvstore.tiers.remote.books import Books
from kvstore.tiers.remote.client import MooncakeClient
from kvstore.tiers.remote.config import RemoteConfig
from kvstore.tiers.remote.link import Link
from kvstore.tiers.remote.puts import Puts
from kvstore.tiers.remote.reads import Reads
from kvstore.tiers.remote.wire import Wire
from kvstore.tiers.remote.writeback import Staged, WriteBack
from kvstore.traffic import Lane, Path

log = logging.getLogger("kvstore")


class RemoteTier:
    name = "remote"

    def __init__(self, cfg: RemoteConfig, path: Path, client: MooncakeClient, write_back: bool,
                 placement: str = "write_back") -> None:
        self.cfg = cfg
        self.placement = placement
        self.write_through = placement in ("write_through", "both")
        self.path = path
        self.client = client
        self.write_back = write_back
        self.wire = Wire(self.name, cfg, path, client, Arena(cfg.staging_bytes) if write_back else None)
        self.link = Link(self.wire)
        self.books = Books(self.wire, self.link)
        self.link.on_tick = self.books.retry_removals
        self.puts = Puts(self.wire, self.link, self.books)
        self.writeback = WriteBack(self.wire, self.link, self.books, self.puts)
        self.reads = Reads(self.wire, self.link, self.books)
        self.admin = Admin(self.wire, self.link, self.books, self.writeback, placement, write_back)
        # what the daemon, the tests and the stats read of the tier: the parts' own objects
        self.lock = self.wire.lock
        self.cond = self.wire.cond
        self.staging = self.wire.staging
        self.pad = self.wire.pad
        self.counters: Counter[str] = self.wire.counters
        self.seconds = self.wire.seconds
        self.staged: dict[bytes, Staged] = self.books.staged

    @property
    def up(self) -> bool:
        """The store answers now: a put would be taken (while down, lookups and reads are misses at once)."""
        return self.link.up

    def start(self) -> "RemoteTier":
        self.link.thread.start()
        if self.write_back:
            self.writeback.thread.start()
        return self

    # ----- the books -----
    def has(self, bid: bytes) -> bool:
        return self.books.has(bid)

    def probe(self, bids: Sequence[bytes]) -> int:
        return self.books.probe(bids)

    def probe_each(self, bids: Sequence[bytes]) -> list[bool]:
        return self.books.probe_each(bids)

    # ----- write-back -----
    def stage(self, bid: bytes, nbytes: int, crc: int | None = None) -> StagingBuffer | bool:
        return self.writeback.stage(bid, nbytes, crc)

    def fill(self, bid: bytes, buf: StagingBuffer, data: memoryview) -> None:
        self.writeback.fill(bid, buf, data)

    # ----- write-through -----
    def announce(self, bids: list[bytes]) -> None:
        self.puts.announce(bids)

    def write(self, items: Sequence[TierWrite], lane: Lane) -> int:
        return self.puts.write(items, lane)

    # ----- reads -----
    def read(self, bids: Sequence[bytes], outs: Sequence[memoryview], lane: Lane,
             on_ready: Callable[[int], None] | None = None, crcs: list[int | None] | None = None) -> int:
        return self.reads.read(bids, outs, lane, on_ready, crcs)

    def read_async(self, bid: bytes, out: memoryview, lane: Lane,
                   on_done: Callable[[Future[Any]], None]) -> Future[Any] | None:
        return self.reads.read_async(bid, out, lane, on_done)

    # ----- deletes and the operator -----
    def delete(self, bid: bytes) -> bool:
        return self.admin.delete(bid)

    def delete_many(self, bids: Sequence[bytes]) -> list[bool]:
        return self.admin.delete_many(bids)

    def resize(self, capacity: int) -> dict[str, Any]:
        return self.admin.resize(capacity)

    def namespaces(self) -> dict[bytes, int]:
        return self.admin.namespaces()

    def stats(self) -> dict[str, Any]:
        return self.admin.stats()

    def close(self) -> None:
        self.admin.close()


def placement(cfg: RemoteConfig, below_first: str = "") -> str:
    """write_back or write_through or both, as configured; `auto`: write-back where the remote tier is the first
    lower tier, else write-through (`below_first`, the tier opened before it, takes the evictions)."""
    if cfg.placement == "auto":
        return "write_through" if below_first else "write_back"
    return cfg.placement


def open_tier(cfg: RemoteConfig, ctx: TierContext) -> RemoteTier | None:
    if not cfg.master:
        return None
    first = ctx.opened[0] if ctx.opened else ""
    where = placement(cfg, first)
    if first and where != "write_through":
        raise TierUnavailable(f"remote.placement {where}: beside an {first.upper()} tier the {first.upper()} takes "
                              f"the host pool's evictions; set remote.placement to write_through (or auto)")
    # Mooncake's own bound on a transfer that has started (a read into host slots is never abandoned)
    os.environ.setdefault("MC_TRANSFER_TIMEOUT", str(max(1, int(round(cfg.timeout_s)))))
    # Mooncake's own log lines go to the daemon's stderr: its warnings and errors only, unless kvstore logs debug
    os.environ.setdefault("MC_LOG_LEVEL", "INFO" if log.isEnabledFor(logging.DEBUG) else "WARNING")
    advertised, listen = _endpoint_addresses(cfg)
    client = MooncakeClient(cfg, advertised, listen)
    path = ctx.traffic.path("net", cfg.in_flight, nominal_bps=1e9)
    tier = RemoteTier(cfg, path, client, write_back=where in ("write_back", "both"), placement=where).start()
    log.info("remote: Mooncake Store at %s (metadata %s, %s), %s, %d replica(s); this node is %s to the others; "
             "linking in the background", cfg.master, cfg.metadata or "the master's", cfg.protocol, where,
             cfg.replicas, advertised)
    return tier


def _endpoint_addresses(cfg: RemoteConfig) -> tuple[str, str | None]:
    """(the address the other nodes are told, the one the transfer ports bind or None for every address), with
    MC_TCP_BIND_ADDRESS set to the first: Mooncake advertises that, not the hostname its setup is given."""
    try:
        told = address.advertised(cfg.hostname)
    except OSError as e:
        raise TierUnavailable(f"remote.hostname {cfg.hostname!r} does not resolve ({e}); set it to this node's "
                              f"address as the other nodes reach it") from None
    before = os.environ.get("MC_TCP_BIND_ADDRESS")
    if before and before != told:
        log.warning("remote: MC_TCP_BIND_ADDRESS=%s in the environment is replaced by remote.hostname's %s (one "
                    "setting decides where this node's bytes travel: set remote.hostname)", before, told)
    os.environ["MC_TCP_BIND_ADDRESS"] = told
    listen = address.listen_address(told, cfg.bind_address)
    if listen is not None and not address.guard_loaded():
        log.warning("remote: the transfer engine's ports will listen on every address, not only %s: the bind "
                    "guard (native/kvbind.c) is not loaded (%s); firewall them, or set remote.bind_address: "
                    "0.0.0.0 to say that is meant", listen,
                    "not built: no C compiler at install" if address.library_path() is None else
                    "start the daemon with `kvstore serve`, which preloads it")
    return told, listen
