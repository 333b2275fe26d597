"""The donated tier's books, and the one lock every part of the tier shares: which region each donor lent, which
block is in which region slot (least recently used first), the bookings between `stage` and `fill`, the blocks on
their way down, the announced writes, and the counters `stats` shows. The parts (staging, reads, reclaim, down)
read and change them only under `lock`; the region and block records themselves are kvstore.tiers.donated.region.

Locking. `lock` (a Condition) guards all the books (regions, blocks, slots, counters) and is held for book updates
only, never across a copy. The daemon calls `stage`, `has`, `delete_many` under its state lock (state lock, then
this lock, then the lower tier's lock: `stage` below is called under this one, and nothing takes them the other
way), and `fill`, `read`, `read_async` without it; reclaims run on listener threads without the state lock. A copy
of region memory is only made between `region.users += 1` and `-= 1`, taken under the lock while the region is not
gone; the unmap waits for `users` to reach 0 after marking the region gone: no copy ever touches unmapped memory.
A slot is overwritten only by the fill of the block booked into it, and never while a reader has it pinned.
"""
from __future__ import annotations

import logging
import threading
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

from kvstore.histogram import Histogram
from kvstore.tiers import StagingBuffer
from kvstore.tiers.donated.memory import RegionMemory
from kvstore.tiers.donated.region import Block, Region

log = logging.getLogger("kvstore")

Placement = tuple[Region, int, "Block | None"]     # region, slot, the block evicted from it (None: it was free)


class Books:
    """The tier's books and its lock (see the module docstring); one instance, shared by the tier's parts."""

    def __init__(self) -> None:
        self.lock = threading.Condition()       # reentrant: `write` stages under it
        self.regions: dict[int, Region] = {}
        self.blocks: OrderedDict[bytes, Block] = OrderedDict()    # least recently used first
        self.counters: Counter[str] = Counter()
        self.reclaim_seconds = Histogram()
        self.ns: Counter[bytes] = Counter()
        self.bookings: dict[int, Block] = {}   # id(ticket) -> the block booked, from `stage` to `fill`
        self.moving: Counter[bytes] = Counter()    # staged below, copy not done: a delete reaches below too
        self.announced: Counter[bytes] = Counter()
        self.killed: set[bytes] = set()
        self.next_region = 1
        self.closed = False

    # ----- regions -----
    def add_region(self, name: str, mem: RegionMemory, owner: int) -> int:
        """A donor's region, usable from now on; its id."""
        with self.lock:
            if self.closed:
                mem.close()
                raise RuntimeError("the donated tier is closed")
            rid = self.next_region
            self.next_region += 1
            self.regions[rid] = Region(rid, name, mem, owner)
            self.counters["donations"] += 1
        log.info("donated: region %d (%s, %s, %d bytes) from donor %d", rid, name, mem.kind, mem.size, owner)
        return rid

    def donated_bytes(self) -> int:
        with self.lock:
            return sum(r.size for r in self.regions.values())

    # ----- slots: booking and publication -----
    def place(self, nbytes: int) -> Placement | None:
        """(Under `lock`.) A free slot of this size; else an empty region carved for it; else the slot of the least
        recently used block of this size that no reader holds (to be evicted)."""
        regions = [r for r in self.regions.values() if r.open]
        for r in regions:
            if r.slot_bytes == nbytes and r.free:
                return r, r.free.pop(), None
        for r in regions:
            if r.carvable(nbytes):
                r.carve(nbytes)
                return r, r.free.pop(), None
        for blk in self.blocks.values():
            if blk.ready and blk.nbytes == nbytes and blk.region.open and blk.region.pins[blk.slot] == 0:
                return blk.region, blk.slot, blk
        return None

    def book(self, blk: Block) -> None:
        """(Under `lock`.) A block booked into its slot enters the books, its ticket (`blk.ticket`) with it."""
        self.blocks[blk.bid] = blk
        self.ns[blk.bid[:16]] += 1
        self.bookings[id(blk.ticket)] = blk
        self.counters["staged"] += 1

    def take_booking(self, ticket: StagingBuffer) -> Block | None:
        """(Under `lock`.) The block a ticket was handed out for, once (None: not one of ours, or taken)."""
        return self.bookings.pop(id(ticket), None)

    def publish(self, blk: Block, got: int | None) -> bool:
        """(Under `lock`.) A fill is over: the block is readable, or it is gone and its slot free."""
        blk.ticket = None
        current = self.blocks.get(blk.bid) is blk and not blk.region.gone
        if current and got is not None and (blk.crc is None or got == blk.crc):
            blk.check, blk.ready = got, True
            return True
        if current:
            self.forget(blk)
            self.counters["fill_crc_mismatch" if got is not None else "fill_failed"] += 1
        if not blk.region.gone:
            blk.region.release(blk.slot)
        return False

    # ----- leaving -----
    def forget(self, blk: Block) -> None:
        """(Under `lock`.) The block leaves the books (its slot is the caller's business)."""
        del self.blocks[blk.bid]
        self.ns[blk.bid[:16]] -= 1
        if self.ns[blk.bid[:16]] <= 0:
            del self.ns[blk.bid[:16]]

    def drop(self, blk: Block) -> None:
        """(Under `lock`.) Forget a block and free its slot — unless a fill is still to come: that fill frees it."""
        self.forget(blk)
        if blk.ready and not blk.region.gone:
            blk.region.release(blk.slot)

    def drop_rest(self, region: Region) -> int:
        """(Under `lock`.) Forget the region's blocks; how many. A booked one keeps its slot until its fill, which
        finds the region gone and copies nothing."""
        n = 0
        for blk in list(region.owners):
            if blk is not None and self.blocks.get(blk.bid) is blk:
                self.drop(blk)
                n += 1
        return n

    def delete_many(self, bids: Sequence[bytes]) -> tuple[list[bool], list[bytes]]:
        """Forget blocks: per block whether it was here, and those on their way down (booked below, copy not done),
        which the caller deletes below too. An announced one is killed: its `write` will not store it."""
        found, below = [], []
        with self.lock:
            for bid in bids:
                blk = self.blocks.get(bid)
                if blk is not None:
                    self.drop(blk)
                found.append(blk is not None)
                if bid in self.moving:
                    below.append(bid)
                if bid in self.announced:
                    self.killed.add(bid)
        return found, below

    def moved(self, bid: bytes) -> None:
        """A copy down is over (stored or cancelled below)."""
        with self.lock:
            self.moving[bid] -= 1
            if self.moving[bid] <= 0:
                del self.moving[bid]

    # ----- write-through -----
    def announce(self, bids: list[bytes]) -> None:
        with self.lock:
            self.announced.update(bids)

    def unannounce(self, bid: bytes) -> bool:
        """(Under `lock`.) An announced block's write has come: whether it was deleted since (killed)."""
        killed = bid in self.killed
        self.announced[bid] -= 1
        if self.announced[bid] <= 0:
            del self.announced[bid]
            self.killed.discard(bid)
        return killed

    # ----- the operator's view -----
    def has(self, bid: bytes) -> bool:
        return bid in self.blocks

    def namespaces(self) -> dict[bytes, int]:
        with self.lock:
            return dict(self.ns)

    def locate(self, bid: bytes) -> tuple[int, int] | None:
        """(Tests, debugging.) The region id and byte offset of a block held here."""
        with self.lock:
            blk = self.blocks.get(bid)
            return None if blk is None else (blk.region.id, blk.offset)

    def stats(self, donors: Callable[[], int]) -> dict[str, Any]:
        """`donors`: how many donors are connected (asked under the lock, as part of the same picture)."""
        with self.lock:
            regions = list(self.regions.values())
            donated = sum(r.size for r in regions)
            used = sum(r.used * r.slot_bytes for r in regions)
            return {"tier": "donated", "capacity_bytes": donated, "mapped_bytes": donated, "used_bytes": used,
                    "resident_bytes": donated, "blocks": len(self.blocks), "segments": len(regions),
                    "regions": [r.describe() for r in regions],
                    "donors": donors(),
                    "counters": dict(self.counters),
                    "migrated": self.counters["migrated"],
                    "dropped": self.counters["dropped"] + self.counters["reclaim_dropped"],
                    "reclaim_seconds": self.reclaim_seconds.to_dict(),
                    "namespaces": {d.hex(): n for d, n in self.ns.items()}}
