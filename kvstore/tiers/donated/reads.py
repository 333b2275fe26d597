"""The donated tier's reads: `read` (the longest verified prefix of a batch, one transfer) and `read_async` (one
block, a transfer in the caller's lane), both copying out of donated memory through the tier's traffic path.

Reads copy out, through the traffic path, and check each copy against the CRC-32C the block was stored with: its
writer's, or — where the writer gave none — the CRC of the bytes `fill` copied in, because a donor can write its
memory at any time and a tier serves no byte it cannot prove. A block that fails is a miss, dropped. Reads hand back
the writer's CRC (None where it gave none), never the tier's own.

A read pins the block's slot (no eviction overwrites it under the copy) and counts in its region's `users` (no
unmap happens under it) for one block copy, taken under the tier's lock while the region is neither gone nor its
donor dead; a block still being filled is waited for, up to PENDING_WAIT_S. Each block read is made the most
recently used.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from functools import partial
from typing import Any

from kvstore.tiers.donated.books import Books
from kvstore.tiers.donated.region import Block
from kvstore.traffic import Busy, Lane, Path

log = logging.getLogger("kvstore")
PENDING_WAIT_S = 5.0            # the longest a read waits for a block's fill (a copy: milliseconds)


class Reader:
    """`read` and `read_async` (DonatedTier's) over the tier's books, on its traffic path."""

    def __init__(self, books: Books, path: Path) -> None:
        self.books = books
        self.path = path
        self.lock = books.lock

    def read(self, bids: Sequence[bytes], outs: Sequence[memoryview], lane: Lane,
             on_ready: Callable[[int], None] | None, crcs: list[int | None] | None) -> int:
        if not bids:
            return 0
        nbytes = sum(len(outs[i]) for i in range(len(bids)))
        try:
            job = self.path.run(lane, nbytes, partial(self._read_prefix, bids, outs, on_ready, crcs))
        except Busy:                        # the lane's queue is full: nothing read now (LowerTier.read: a prefix)
            with self.lock:
                self.books.counters["read_busy"] += 1
            return 0
        return int(job.result())

    def _read_prefix(self, bids: Sequence[bytes], outs: Sequence[memoryview],
                     on_ready: Callable[[int], None] | None, crcs: list[int | None] | None) -> int:
        n = 0
        for bid, out in zip(bids, outs):
            crc = self._read_one(bid, out)
            if crc is False:
                break
            n += 1
            if crcs is not None:
                crcs.append(crc)
            if on_ready is not None:
                on_ready(n)
        return n

    def read_async(self, bid: bytes, out: memoryview, lane: Lane,
                   on_done: Callable[[Future[Any]], None]) -> Future[Any] | None:
        if bid not in self.books.blocks:
            return None
        return self.path.submit(lane, len(out), partial(self._read_one, bid, out), tag=bid, on_done=on_done)

    def _read_one(self, bid: bytes, out: memoryview) -> int | None | bool:
        """The block's bytes into `out`, checked: its writer's CRC (None if none), or False (a miss)."""
        with self.lock:
            blk = self._pin(bid, len(out))
            self.books.counters["reads" if blk is not None else "read_misses"] += 1
        if blk is None:
            return False
        got = None
        try:
            got = blk.region.mem.read(blk.offset, out)
        except Exception:
            log.exception("donated: reading region %d failed; a miss", blk.region.id)
            with self.lock:
                self.books.counters["read_errors"] += 1
        finally:
            with self.lock:
                blk.region.unpin(blk.slot)
                self.lock.notify_all()
        if got != blk.check:
            self._corrupt(blk)
            return False
        return blk.crc

    def _pin(self, bid: bytes, nbytes: int) -> Block | None:
        """(Under `lock`.) The block, its slot pinned and its region held mapped for one copy; None if it is not
        here (or not of this size, or its donor is gone). Waits out a fill in progress."""
        blocks = self.books.blocks
        deadline = time.monotonic() + PENDING_WAIT_S
        while True:
            blk = blocks.get(bid)
            if blk is None or blk.nbytes != nbytes or blk.region.dead or blk.region.gone:
                return None
            if blk.ready:
                break
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            self.lock.wait(min(left, 0.1))
        blk.region.pin(blk.slot)
        blocks.move_to_end(bid)
        return blk

    def _corrupt(self, blk: Block) -> None:
        """A copy failed its check (the donor wrote the slot, or the copy failed): a miss, and the block is gone."""
        with self.lock:
            self.books.counters["crc_mismatch"] += 1
            if self.books.blocks.get(blk.bid) is blk:
                self.books.drop(blk)
        log.warning("donated: a block in region %d does not match its CRC-32C (its donor wrote over it?): served "
                    "as a miss and dropped", blk.region.id)
