"""The donated tier's way down: blocks it hands to the tier below it (the SSD), or drops where there is none.

A block goes down three ways: `stage` finds no donated room for it and no block of its size to evict, and passes
it straight to the tier below (`pass_down`: the tier below's staging buffer is what `stage` returns); a block is
evicted from its slot for a newcomer (`evict`: booked below now, its bytes copied down by the newcomer's `fill`
before they are overwritten); a reclaim moves a closing region's blocks down (kvstore.tiers.donated.reclaim). A
block is booked below (`book`) under the tier's lock, in the same step as it leaves these books, so a delete cannot
slip between; until its copy is over it is counted in `Books.moving`, and a delete reaches the tier below too.

A copy down goes through a private bounce buffer, checked there: the tier below gets exactly the bytes checked. A
copy that fails (its check, or the copy) is cancelled below, its booking there never to be filled.
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

from kvstore.tiers import LowerTier, PacedTier, StagingBuffer
from kvstore.tiers.donated.books import Books
from kvstore.tiers.donated.region import Block, Handoff, Region

log = logging.getLogger("kvstore")

_local = threading.local()


def _bounce(nbytes: int) -> bytearray:
    """This thread's bounce buffer of `nbytes` for a copy down (kept: a fresh 2 MiB one costs 512 page faults)."""
    buf: bytearray | None = getattr(_local, "bounce", None)
    if buf is None or len(buf) != nbytes:
        buf = _local.bounce = bytearray(nbytes)
    return buf


class Down:
    """The tier below (`below`; None: blocks that would go down are dropped), as this tier hands blocks to it."""

    def __init__(self, books: Books, below: LowerTier | None) -> None:
        self.books = books
        self.below = below
        self.lock = books.lock

    def pass_down(self, bid: bytes, nbytes: int, crc: int | None) -> StagingBuffer | bool:
        """(Under `lock`, from `stage`.) A block with no donated room for it: the tier below's answer to its
        `stage`, or False (dropped, counted) where there is none."""
        if self.below is not None:
            self.books.counters["passed_down"] += 1    # no donated room (or no donor): straight to the tier below
            return self.below.stage(bid, nbytes, crc)
        self.books.counters["dropped"] += 1
        return False

    def book(self, blk: Block) -> StagingBuffer | bool:
        """(Under `lock`: a delete cannot slip between this and the block leaving these books.)"""
        if self.below is None:
            return False
        try:
            return self.below.stage(blk.bid, blk.nbytes, blk.crc)
        except Exception:
            log.exception("donated: %s refused a block", self.below.name)
            return False

    def evict(self, victim: Block) -> Handoff | None:
        """(Under `lock`.) Take a block out for its slot's new tenant: booked below (its bytes copied there by
        the new block's `fill`, first), or dropped."""
        self.books.forget(victim)
        buf = self.book(victim)
        if isinstance(buf, bool):
            self.books.counters["evicted_down" if buf else "dropped"] += 1
            return None
        self.books.moving[victim.bid] += 1
        self.books.counters["evicted_down"] += 1
        return Handoff(victim.bid, buf, victim.nbytes, victim.check)

    def copy(self, bid: bytes, buf: StagingBuffer, region: Region, offset: int, nbytes: int, check: int) -> bool:
        """(Counted in `region.users`.) Copy a block out of the region into a private bounce buffer, check it
        against the CRC it was stored with, and `fill` the tier below from that: the bytes handed down are the
        bytes checked, whatever the donor writes meanwhile (the tier below could check a block with its writer's
        CRC itself, but not one without). False if the check or the copy failed: the caller cancels it below."""
        assert self.below is not None
        bounce = _bounce(nbytes)
        try:
            with memoryview(bounce) as view:
                if region.mem.read(offset, view) != check:
                    with self.lock:
                        self.books.counters["crc_mismatch"] += 1
                    return False
                with view.toreadonly() as checked:
                    self.below.fill(bid, buf, checked)
        except Exception:
            log.exception("donated: copying a block down to %s failed; it is dropped", self.below.name)
            return False
        return True

    def settle(self, bid: bytes, ok: bool) -> None:
        """A copy down is over: a failed one is cancelled below (its booking there would never be filled)."""
        if not ok and self.below is not None:
            try:
                self.below.delete_many([bid])
            except Exception:
                log.exception("donated: cancelling a block's booking in %s failed", self.below.name)
        self.books.moved(bid)

    def fill(self, bid: bytes, buf: StagingBuffer, data: memoryview) -> None:
        """(Without the state lock.) A block `pass_down` gave the tier below: that tier's buffer, its to fill."""
        if self.below is not None:
            self.below.fill(bid, buf, data)

    def delete(self, bids: Sequence[bytes]) -> None:
        """(Without this tier's lock.) Blocks deleted while on their way down are deleted below too."""
        if bids and self.below is not None:
            self.below.delete_many(bids)

    def wait_room(self, nbytes: int, timeout: float) -> int:
        """The tier below's staging room, waited for (see SsdTier.wait_room); `nbytes` where it is not paced."""
        below = self.below
        return below.wait_room(nbytes, timeout) if isinstance(below, PacedTier) else nbytes
