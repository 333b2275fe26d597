"""Demotion into donated memory: `stage` books an evicted block's slot, `fill` copies the block in and publishes it,
and `write` (write-through) does both for announced blocks.

An evicted block is `stage`d: it books a slot in a region of its size (carving an empty region if no slot is free;
else evicting this tier's least recently used block of that size into the tier below) and returns an opaque
ticket; `fill` then copies the block in, after the daemon has left its state lock. An eviction's copy down is made
by that same `fill`, before the new block overwrites the slot (the state lock is never held across a block copy,
as in the movers). A block with no room here and none of its size to evict goes straight to the tier below
(kvstore.tiers.donated.down): `stage` returns that tier's buffer, and `fill` hands the bytes to it.

A booked block is present for `has` and reads from `stage` on (reads wait for its fill); `fill` publishes it once
its bytes are in and match its writer's CRC-32C, or takes it out of the books and frees its slot (deleted
meanwhile, its region reclaimed, or its bytes no longer its writer's: the host slot was written after commit).
The CRC of the bytes the fill copied in is what reads check the block against from then on.
"""
from __future__ import annotations

from collections.abc import Sequence

from kvstore.tiers import StagingBuffer, TierWrite
from kvstore.tiers.donated.books import Books
from kvstore.tiers.donated.down import Down
from kvstore.tiers.donated.region import Block


def _ticket() -> memoryview:
    """What `stage` hands out: a token `fill` knows its booking by, not a view of donated memory (no such view
    ever leaves the tier, so none can outlive an unmap). Read-only: nothing is meant to be written into it."""
    return memoryview(bytearray(1)).toreadonly()


class Staging:
    """`stage`, `fill`, `announce` and `write` (DonatedTier's, which says who calls them and when)."""

    def __init__(self, books: Books, down: Down) -> None:
        self.books = books
        self.down = down
        self.lock = books.lock

    def stage(self, bid: bytes, nbytes: int, crc: int | None = None) -> StagingBuffer | bool:
        books = self.books
        with self.lock:
            if bid in books.blocks:
                books.blocks.move_to_end(bid)
                books.counters["rewrites_saved"] += 1
                return True
            place = books.place(nbytes)
            if place is None:
                return self.down.pass_down(bid, nbytes, crc)
            region, slot, victim = place
            ticket = _ticket()
            blk = Block(bid, region, slot, nbytes, crc, ticket=ticket)
            if victim is None:
                region.take(slot, blk)
            else:
                blk.handoff = self.down.evict(victim)
                region.owners[slot] = blk
            books.book(blk)
            return ticket

    def fill(self, bid: bytes, buf: StagingBuffer, data: memoryview) -> None:
        if isinstance(buf, memoryview) and buf.readonly:     # our ticket (`_ticket`); the tier below's are writable
            self.fill_booked(buf, data)
        else:
            self.down.fill(bid, buf, data)

    def fill_booked(self, buf: StagingBuffer, data: memoryview) -> bool:
        """Fill the block booked under ticket `buf` (its slot's evicted block copied down first); published?"""
        with self.lock:
            blk = self.books.take_booking(buf)
            if blk is None:
                return False
            region = blk.region
            usable = not (region.gone or region.dead)
            if usable:
                region.users += 1
            handoff, blk.handoff = blk.handoff, None
        got = None
        try:
            if handoff is not None:
                moved = usable and self.down.copy(handoff.bid, handoff.buf, region, blk.offset, handoff.nbytes,
                                                  handoff.check)
                self.down.settle(handoff.bid, moved)
            if usable and len(data) == blk.nbytes:
                got = region.mem.write(blk.offset, data)
        finally:
            with self.lock:
                if usable:
                    region.users -= 1
                published = self.books.publish(blk, got)
                self.lock.notify_all()
        return published

    # ----- write-through -----
    def announce(self, bids: list[bytes]) -> None:
        self.books.announce(bids)

    def write(self, items: Sequence[TierWrite]) -> int:
        stored = 0
        for bid, data, crc in items:
            with self.lock:
                killed = self.books.unannounce(bid)
                buf = False if killed else self.stage(bid, len(data), crc)
            if buf is True:
                stored += 1
            elif buf is not False:
                with memoryview(data) as view:
                    if isinstance(buf, memoryview) and buf.readonly:       # booked here
                        stored += self.fill_booked(buf, view)
                    else:                               # no room here: the tier below's buffer, filled there
                        self.down.fill(bid, buf, view)
                        stored += 1
        return stored
