"""The donated tier: blocks kept in memory that other processes lend the daemon (SwiftCache §3.2's peer-GPU tier),
between the host pool and the tier below it (the SSD), given back on demand within a deadline.

`DonatedTier` is what the daemon, the listener and the tests hold: a `LowerTier` (and a `PacedTier`) whose methods
are those of its parts, all sharing one set of books and one lock:
- `books` (`Books`): which region each donor lent, which block is in which slot (least recently used first), the
  bookings, the announced writes, the counters; and the tier's one lock, with the locking rules every part keeps;
- `staging` (`Staging`): demotion — `stage` books a slot (evicting a block of the same size if it must), `fill`
  copies the block in after the daemon has left its state lock and publishes it; `write` for write-through;
- `down` (`Down`): blocks handed to the tier below — passed down when there is no room here, evicted for a
  newcomer, moved by a reclaim — each copied through a bounce buffer and checked on the way;
- `reads` (`Reader`): `read` and `read_async`, every copy checked against the CRC-32C the block was stored with (a
  donor can write its memory at any time): a block that fails is a miss, dropped;
- `reclaim` (`Reclaimer`): a donor taking a region back — its blocks moved down hottest first until the deadline,
  the rest dropped, the reply once nothing touches the region, the unmap (for a memfd) after it.
The listener (`listen`: the donors' socket, kvstore.tiers.donated.listener) adds regions and reclaims them.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

from kvstore.tiers import LowerTier, StagingBuffer, TierContext, TierWrite
from kvstore.tiers.donated.books import Books
from kvstore.tiers.donated.config import DonatedConfig
from kvstore.tiers.donated.down import Down
from kvstore.tiers.donated.listener import socket_beside
from kvstore.tiers.donated.memory import RegionMemory
from kvstore.tiers.donated.reads import Reader
from kvstore.tiers.donated.reclaim import Reclaimer
from kvstore.tiers.donated.staging import Staging
from kvstore.traffic import Lane, Path


class DonatedTier:
    name = "donated"

    def __init__(self, path: Path, below: LowerTier | None = None) -> None:
        """`path`: the traffic path its copies take; `below`: where evicted and reclaimed blocks go (None: they
        are dropped)."""
        self.path = path
        self.below = below
        self.books = Books()
        self.lock = self.books.lock             # the books' lock (kvstore.tiers.donated.books), shared by all parts
        self.regions = self.books.regions
        self.blocks = self.books.blocks
        self.counters = self.books.counters
        self.reclaim_seconds = self.books.reclaim_seconds
        self.listener: Any = None               # the DonateListener, where `listen` started one
        self.down = Down(self.books, below)
        self.staging = Staging(self.books, self.down)
        self.reads = Reader(self.books, path)
        self.reclaimer = Reclaimer(self.books, self.down, path)

    def listen(self, socket_path: str, **options: Any) -> DonatedTier:
        """Start taking donations at `socket_path` (kvstore.tiers.donated.listener.DonateListener's options)."""
        from kvstore.tiers.donated.listener import DonateListener
        self.listener = DonateListener(self, socket_path, **options).start()
        return self

    # ----- regions -----
    def add_region(self, name: str, mem: RegionMemory, owner: int) -> int:
        """A donor's region, usable from now on; its id."""
        return self.books.add_region(name, mem, owner)

    def donated_bytes(self) -> int:
        return self.books.donated_bytes()

    def reclaim(self, rid: int, deadline_s: float, dead: bool = False) -> dict[str, Any]:
        """Give region `rid` back: move its blocks down until `deadline_s` has passed, drop the rest, unmap it.
        `dead`: its donor is gone (its memory may be too): nothing is read from it, everything is dropped. Returns
        the reply: migrated, dropped, seconds, deadline_passed, unmapped. KeyError if it is not here (or is being
        reclaimed already)."""
        return self.reclaimer.reclaim(rid, deadline_s, dead)

    def reclaim_before_unmap(self, rid: int, deadline_s: float,
                             dead: bool = False) -> tuple[dict[str, Any], Callable[[], bool]]:
        """`reclaim` up to the moment nothing touches the region any more — the donor's answer — and its unmap,
        left to the caller to run after that answer where the memory outlives the daemon's mapping (a memfd: the
        donor's own mapping keeps its pages). Unmapping 256 MiB takes 18–40 ms, more than a short deadline: the
        donor should not wait for it. The region is gone from the books first, so no read, fill or move can
        reach it after the answer. Memory that may not outlive the mapping (CUDA) is closed here, before the
        answer; the unmap returned then only says how that went. The reply's `unmapped`: True where the unmap
        follows the answer (False only where it was made here and the mapping had to be left)."""
        return self.reclaimer.reclaim_before_unmap(rid, deadline_s, dead)

    # ----- demotion -----
    def stage(self, bid: bytes, nbytes: int, crc: int | None = None) -> StagingBuffer | bool:
        """Book a slot for an evicted block (present for `has` and reads from now on; reads wait for its fill):
        a ticket for `fill`; True if the tier holds it already; False (dropped, counted) when no region has room
        for its size and no block of its size can be evicted (with a tier below: that tier's answer instead)."""
        return self.staging.stage(bid, nbytes, crc)

    def wait_room(self, nbytes: int, timeout: float) -> int:
        """(An operator's eviction, without the state lock.) The tier below's staging room, waited for: blocks this
        tier has no room for go there (see SsdTier.wait_room)."""
        return self.down.wait_room(nbytes, timeout)

    def fill(self, bid: bytes, buf: StagingBuffer, data: memoryview) -> None:
        """(Without the state lock.) Copy an evicted block into the slot `stage` booked (first moving the slot's
        previous block down, if one was evicted for it) and publish it, unless it was deleted meanwhile or its
        bytes fail its writer's CRC (the host slot was written after commit). A buffer the tier below gave (`stage`
        passed the block down) is that tier's to fill."""
        self.staging.fill(bid, buf, data)

    # ----- write-through -----
    def announce(self, bids: list[bytes]) -> None:
        self.staging.announce(bids)

    def write(self, items: Sequence[TierWrite], lane: Lane) -> int:
        """Store announced blocks (a copy each, like a demotion); a block deleted since `announce`, or whose
        bytes fail its writer's CRC, is not stored. (Memory lent for a while is no place for durability: the
        daemon has no reason to write through to it, but the interface is whole.)"""
        return self.staging.write(items)

    # ----- reads -----
    def has(self, bid: bytes) -> bool:
        return self.books.has(bid)

    def read(self, bids: Sequence[bytes], outs: Sequence[memoryview], lane: Lane = Lane.CRITICAL,
             on_ready: Callable[[int], None] | None = None, crcs: list[int | None] | None = None) -> int:
        """Copy the longest prefix of `bids` held here and verified into `outs` (one transfer on the path);
        its length. `on_ready(n)` reports the prefix as it grows; `crcs` receives each block's writer's CRC."""
        return self.reads.read(bids, outs, lane, on_ready, crcs)

    def read_async(self, bid: bytes, out: memoryview, lane: Lane,
                   on_done: Callable[[Future[Any]], None]) -> Future[Any] | None:
        """One block's verified read as a transfer in `lane`; None if not held. Its result: the writer's CRC-32C
        (None if none), or False if the block is gone or failed its check. Busy if the lane is full."""
        return self.reads.read_async(bid, out, lane, on_done)

    # ----- the books -----
    def delete(self, bid: bytes) -> bool:
        return self.delete_many([bid])[0]

    def delete_many(self, bids: Sequence[bytes]) -> list[bool]:
        """Forget blocks (per block: whether it was here). One on its way down (booked below, copy not done) is
        deleted below too, whatever order the caller deletes the tiers in."""
        found, below = self.books.delete_many(bids)
        self.down.delete(below)
        return found

    def resize(self, capacity: int) -> dict[str, Any]:
        raise ValueError("the donated tier's capacity is what donors lend it (donate and reclaim), not a setting")

    def namespaces(self) -> dict[bytes, int]:
        return self.books.namespaces()

    def locate(self, bid: bytes) -> tuple[int, int] | None:
        """(Tests, debugging.) The region id and byte offset of a block held here."""
        return self.books.locate(bid)

    def stats(self) -> dict[str, Any]:
        return self.books.stats(self._donors)

    def _donors(self) -> int:
        return self.listener.donors() if self.listener is not None else 0

    def close(self) -> None:
        """Stop taking donations and give every region back at once (blocks dropped: the tier below closes
        first, LowerTiers closing in reverse order)."""
        with self.lock:
            self.books.closed = True
            self.lock.notify_all()              # a reclaim waiting for its moves stops moving
        if self.listener is not None:
            self.listener.close()               # its donors' regions are reclaimed as their connections end
        for rid in list(self.regions):
            try:
                self.reclaim(rid, 0.0, dead=True)
            except KeyError:
                pass


def open_tier(cfg: DonatedConfig, ctx: TierContext) -> DonatedTier | None:
    """The donated tier its section asks for (None when off), listening for donors (on `donated.socket`, else
    donate.sock beside the daemon's socket); `ctx.below`: the tier it moves blocks down to (the SSD tier, opened
    first). Copies take the traffic manager's "mem" path for shared memory, "gpu" for CUDA memory: a link of their
    own, never the SSD's (whose arbiter and measured bandwidth are the disk's: promotion ranks holders by it)."""
    if not cfg.enabled:
        return None
    traffic = ctx.traffic
    if cfg.kind == "memfd":
        path = traffic.path("mem", cfg.in_flight, nominal_bps=10e9)
    else:
        path = traffic.path("gpu", cfg.in_flight, nominal_bps=20e9)
    sock = cfg.socket or socket_beside(ctx.socket)
    return DonatedTier(path, ctx.below).listen(sock, kind=cfg.kind, max_donors=cfg.max_donors,
                                           max_bytes=cfg.max_bytes, max_deadline_s=cfg.max_deadline_ms / 1000)
