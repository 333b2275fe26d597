"""A donor taking its memory back: the reclaim of one region, within the donor's deadline.

Reclaim (`reclaim`, on the listener's thread for that donor): the region is closed to new blocks; one transfer per
block, hottest first, in the store lane, moves it down (booked below and out of these books in one step under this
tier's lock, then copied), until none is left or the deadline passes; then whatever has not started down is
dropped, the moves still queued are cancelled, the tier waits for the copies already touching the region (one
block copy each, at most: reads included), takes it out of its books, and unmaps it — a memfd region after the
reply (`reclaim_before_unmap`: the donor's pages outlive the daemon's mapping, and a munmap of a big region takes
longer than a short deadline). Each block is read from here, normally, until its own move starts; a donor that is
gone (`dead`) is never read again. The reply counts what was moved and dropped.
"""
from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from functools import partial
from typing import Any

from kvstore.tiers.donated.books import Books
from kvstore.tiers.donated.down import Down
from kvstore.tiers.donated.region import Block, Region
from kvstore.traffic import Busy, Lane, Path

log = logging.getLogger("kvstore")


class Unmap:
    """A reclaimed region's unmap, made once (the first call; later ones say how it went): nothing touches the
    region any more when it is made (gone, no copy in flight, out of the books)."""

    def __init__(self, region: Region, deferred: bool) -> None:
        self.region = region
        self.deferred = deferred                # made after the donor's answer
        self._done: bool | None = None

    def __call__(self) -> bool:
        if self._done is None:
            self._done = self.region.mem.close()
            if not self._done:
                log.warning("donated: region %d: its mapping is left (a view of it is still held)", self.region.id)
        return self._done


class Reclaimer:
    """`reclaim` and `reclaim_before_unmap` (DonatedTier's): the moves down run on the tier's traffic path."""

    def __init__(self, books: Books, down: Down, path: Path) -> None:
        self.books = books
        self.down = down
        self.path = path
        self.lock = books.lock

    def reclaim(self, rid: int, deadline_s: float, dead: bool = False) -> dict[str, Any]:
        reply, unmap = self.reclaim_before_unmap(rid, deadline_s, dead)
        return {**reply, "unmapped": unmap()}

    def reclaim_before_unmap(self, rid: int, deadline_s: float, dead: bool = False) -> tuple[dict[str, Any], Unmap]:
        t0 = time.monotonic()
        deadline = t0 + max(deadline_s, 0.0)
        region = self._close_region(rid, dead)
        moves: dict[bytes, bool] = {}           # block -> moved down (True) or dropped on the way (False)
        flights = [] if dead else self._move_all(region, deadline, moves)
        late = time.monotonic() >= deadline
        with self.lock:
            dropped = self.books.drop_rest(region)   # still here: never started down
            region.gone = True                  # no copy starts from now on ...
            while region.users:                 # ... and those running end (one block copy each)
                self.lock.wait()
        self._end_flights(rid, flights)
        migrated = sum(moves.values())
        dropped += len(moves) - migrated
        unmap = self._unmapper(region)
        seconds = time.monotonic() - t0
        books = self.books
        with self.lock:                         # listed until here (stats never show it gone, uncounted); out of
            del books.regions[rid]              # the books before the answer, its unmap possibly after
            books.reclaim_seconds.observe(seconds)
            books.counters["reclaims"] += 1
            books.counters["migrated"] += migrated
            books.counters["reclaim_dropped"] += dropped
        log.info("donated: region %d given back%s in %.3f s: %d blocks moved down, %d dropped", rid,
                 " (its donor is gone)" if dead else "", seconds, migrated, dropped)
        return {"region": rid, "migrated": migrated, "dropped": dropped, "seconds": seconds,
                "deadline_passed": late and dropped > 0, "unmapped": unmap.deferred or unmap()}, unmap

    def _close_region(self, rid: int, dead: bool) -> Region:
        """(The start of a reclaim.) The region, closed to new blocks; KeyError if absent or closing already."""
        with self.lock:
            region = self.books.regions.get(rid)
            if region is None or region.closing:
                raise KeyError(rid)
            region.closing, region.dead = True, dead
            return region

    def _unmapper(self, region: Region) -> Unmap:
        """(The region gone, no copy touching it.) Its unmap, made now unless its memory outlives the mapping."""
        unmap = Unmap(region, deferred=region.mem.outlives_mapping)
        if not unmap.deferred:
            unmap()
        return unmap

    def _move_all(self, region: Region, deadline: float, moves: dict[bytes, bool]) -> list[Future[Any]]:
        """Submit a move down for each of the region's blocks, hottest first (a block booked and not filled yet
        once it is filled), and wait until none is left or the deadline. Each block stays readable here until
        its own move starts. Returns the transfers submitted."""
        books = self.books
        flights: list[Future[Any]] = []
        submitted: set[bytes] = set()
        while True:
            with self.lock:
                left = deadline - time.monotonic()
                if left <= 0 or books.closed:    # closing: the daemon stops, nothing is moved any more
                    break
                batch = [b for b in reversed(books.blocks.values())
                         if b.region is region and b.ready and b.bid not in submitted]
                if not batch:
                    if region.used == 0:
                        break
                    self.lock.wait(left)         # moves under way, or fills on their way
                    continue
            for blk in batch:
                submitted.add(blk.bid)
                try:
                    flights.append(self.path.submit(Lane.STORE, blk.nbytes, partial(self._move_one, blk, moves),
                                                    tag=("donated", region.id)))
                except (Busy, RuntimeError):     # the lane is full (or the path closed): this one is dropped
                    with self.lock:
                        if books.blocks.get(blk.bid) is blk:
                            books.drop(blk)
                            moves[blk.bid] = False
        return flights

    def _end_flights(self, rid: int, flights: list[Future[Any]]) -> None:
        """(The region is gone.) Moves still queued are cancelled (their blocks were dropped with the rest);
        those that left the queue find the region gone and do nothing, and are waited for: the reply is the
        whole story, and nothing of the region is touched after it."""
        self.path.cancel(("donated", rid))
        for f in flights:
            if not f.cancelled():
                f.exception()

    def _move_one(self, blk: Block, moves: dict[bytes, bool]) -> bool | None:
        """(A path worker.) Move one block of a closing region down: booked below and out of these books in one
        step under the lock (a delete cannot slip between), then copied. None if it left meanwhile, or its region
        is gone (the deadline passed first: it was dropped with the rest)."""
        books = self.books
        region = blk.region
        with self.lock:
            if region.gone or region.dead or books.blocks.get(blk.bid) is not blk:
                return None
            buf = self.down.book(blk)
            books.forget(blk)
            region.release(blk.slot)            # a closing region books nothing: the bytes stay until the unmap
            if isinstance(buf, bool):
                moves[blk.bid] = buf
                self.lock.notify_all()
                return buf
            books.moving[blk.bid] += 1
            region.users += 1
        ok = False
        try:
            ok = self.down.copy(blk.bid, buf, region, blk.offset, blk.nbytes, blk.check)
        finally:
            with self.lock:
                moves[blk.bid] = ok
                region.users -= 1
                self.lock.notify_all()
            self.down.settle(blk.bid, ok)
        return ok
