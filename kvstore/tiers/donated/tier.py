"""The donated tier: blocks kept in memory that other processes lend the daemon (SwiftCache §3.2's peer-GPU tier),
between the host pool and the tier below it (the SSD), given back on demand within a deadline.

Data flow. An evicted block is `stage`d: it books a slot in a region of its size (carving an empty region if no
slot is free; else evicting this tier's least recently used block of that size into the tier below) and returns an
opaque ticket; `fill` then copies the block in, after the daemon has left its state lock. An eviction's copy down
is made by that same `fill`, before the new block overwrites the slot (the state lock is never held across a block
copy, as in the movers). Reads copy out, through the traffic path, and check each copy against the CRC-32C the
block was stored with: its writer's, or — where the writer gave none — the CRC of the bytes `fill` copied in,
because a donor can write its memory at any time and a tier serves no byte it cannot prove. A block that fails is
a miss, dropped. Reads hand back the writer's CRC (None where it gave none), never the tier's own. A copy down
goes through a private bounce buffer, checked there: the tier below gets exactly the bytes checked.

Reclaim (`reclaim`, on the listener's thread for that donor): the region is closed to new blocks; one transfer per
block, hottest first, in the store lane, moves it down (booked below and out of these books in one step under this
tier's lock, then copied), until none is left or the deadline passes; then whatever has not started down is
dropped, the moves still queued are cancelled, the tier waits for the copies already touching the region (one
block copy each, at most: reads included), takes it out of its books, and unmaps it — a memfd region after the
reply (`reclaim_before_unmap`: the donor's pages outlive the daemon's mapping, and a munmap of a big region takes
longer than a short deadline). Each block is read from here, normally, until its own move starts; a donor that is
gone (`dead`) is never read again. The reply counts what was moved and dropped.

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
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from functools import partial
from typing import Any

from kvstore.histogram import Histogram
from kvstore.tiers import LowerTier, PacedTier, StagingBuffer, TierContext, TierWrite
from kvstore.tiers.donated.config import DonatedConfig
from kvstore.tiers.donated.listener import socket_beside
from kvstore.tiers.donated.memory import RegionMemory
from kvstore.tiers.donated.region import Block, Handoff, Region
from kvstore.traffic import Busy, Lane, Path

log = logging.getLogger("kvstore")
PENDING_WAIT_S = 5.0            # the longest a read waits for a block's fill (a copy: milliseconds)

_Placement = tuple[Region, int, "Block | None"]     # region, slot, the block evicted from it (None: it was free)


_local = threading.local()


def _bounce(nbytes: int) -> bytearray:
    """This thread's bounce buffer of `nbytes` for a copy down (kept: a fresh 2 MiB one costs 512 page faults)."""
    buf: bytearray | None = getattr(_local, "bounce", None)
    if buf is None or len(buf) != nbytes:
        buf = _local.bounce = bytearray(nbytes)
    return buf


def _ticket() -> memoryview:
    """What `stage` hands out: a token `fill` knows its booking by, not a view of donated memory (no such view
    ever leaves the tier, so none can outlive an unmap). Read-only: nothing is meant to be written into it."""
    return memoryview(bytearray(1)).toreadonly()


class _Unmap:
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


class DonatedTier:
    name = "donated"

    def __init__(self, path: Path, below: LowerTier | None = None) -> None:
        """`path`: the traffic path its copies take; `below`: where evicted and reclaimed blocks go (None: they
        are dropped)."""
        self.path = path
        self.below = below
        self.lock = threading.Condition()       # reentrant: `write` stages under it
        self.regions: dict[int, Region] = {}
        self.blocks: OrderedDict[bytes, Block] = OrderedDict()    # least recently used first
        self.counters: Counter[str] = Counter()
        self.reclaim_seconds = Histogram()
        self.listener: Any = None               # the DonateListener, where `listen` started one
        self._ns: Counter[bytes] = Counter()
        self._bookings: dict[int, Block] = {}   # id(ticket) -> the block booked, from `stage` to `fill`
        self._moving: Counter[bytes] = Counter()    # staged below, copy not done: a delete reaches below too
        self._announced: Counter[bytes] = Counter()
        self._killed: set[bytes] = set()
        self._next_region = 1
        self._closed = False

    def listen(self, socket_path: str, **options: Any) -> DonatedTier:
        """Start taking donations at `socket_path` (kvstore.tiers.donated.listener.DonateListener's options)."""
        from kvstore.tiers.donated.listener import DonateListener
        self.listener = DonateListener(self, socket_path, **options).start()
        return self

    # ----- regions -----
    def add_region(self, name: str, mem: RegionMemory, owner: int) -> int:
        """A donor's region, usable from now on; its id."""
        with self.lock:
            if self._closed:
                mem.close()
                raise RuntimeError("the donated tier is closed")
            rid = self._next_region
            self._next_region += 1
            self.regions[rid] = Region(rid, name, mem, owner)
            self.counters["donations"] += 1
        log.info("donated: region %d (%s, %s, %d bytes) from donor %d", rid, name, mem.kind, mem.size, owner)
        return rid

    def donated_bytes(self) -> int:
        with self.lock:
            return sum(r.size for r in self.regions.values())

    def reclaim(self, rid: int, deadline_s: float, dead: bool = False) -> dict[str, Any]:
        """Give region `rid` back: move its blocks down until `deadline_s` has passed, drop the rest, unmap it.
        `dead`: its donor is gone (its memory may be too): nothing is read from it, everything is dropped. Returns
        the reply: migrated, dropped, seconds, deadline_passed, unmapped. KeyError if it is not here (or is being
        reclaimed already)."""
        reply, unmap = self.reclaim_before_unmap(rid, deadline_s, dead)
        return {**reply, "unmapped": unmap()}

    def reclaim_before_unmap(self, rid: int, deadline_s: float,
                             dead: bool = False) -> tuple[dict[str, Any], Callable[[], bool]]:
        """`reclaim` up to the moment nothing touches the region any more — the donor's answer — and its unmap,
        left to the caller to run after that answer where the memory outlives the daemon's mapping (a memfd: the
        donor's own mapping keeps its pages). Unmapping 256 MiB takes 18–40 ms, more than a short deadline: the
        donor should not wait for it. The region is gone from the books first, so no read, fill or move can
        reach it after the answer. Memory that may not outlive the mapping (CUDA) is closed here, before the
        answer; the unmap returned then only says how that went. The reply's `unmapped`: True where the unmap
        follows the answer (False only where it was made here and the mapping had to be left)."""
        t0 = time.monotonic()
        deadline = t0 + max(deadline_s, 0.0)
        region = self._close_region(rid, dead)
        moves: dict[bytes, bool] = {}           # block -> moved down (True) or dropped on the way (False)
        flights = [] if dead else self._move_all(region, deadline, moves)
        late = time.monotonic() >= deadline
        with self.lock:
            dropped = self._drop_rest(region)   # still here: never started down
            region.gone = True                  # no copy starts from now on ...
            while region.users:                 # ... and those running end (one block copy each)
                self.lock.wait()
        self._end_flights(rid, flights)
        migrated = sum(moves.values())
        dropped += len(moves) - migrated
        unmap = self._unmapper(region)
        seconds = time.monotonic() - t0
        with self.lock:                         # listed until here (stats never show it gone, uncounted); out of
            del self.regions[rid]               # the books before the answer, its unmap possibly after
            self.reclaim_seconds.observe(seconds)
            self.counters["reclaims"] += 1
            self.counters["migrated"] += migrated
            self.counters["reclaim_dropped"] += dropped
        log.info("donated: region %d given back%s in %.3f s: %d blocks moved down, %d dropped", rid,
                 " (its donor is gone)" if dead else "", seconds, migrated, dropped)
        return {"region": rid, "migrated": migrated, "dropped": dropped, "seconds": seconds,
                "deadline_passed": late and dropped > 0, "unmapped": unmap.deferred or unmap()}, unmap

    def _close_region(self, rid: int, dead: bool) -> Region:
        """(The start of a reclaim.) The region, closed to new blocks; KeyError if absent or closing already."""
        with self.lock:
            region = self.regions.get(rid)
            if region is None or region.closing:
                raise KeyError(rid)
            region.closing, region.dead = True, dead
            return region

    def _unmapper(self, region: Region) -> _Unmap:
        """(The region gone, no copy touching it.) Its unmap, made now unless its memory outlives the mapping."""
        unmap = _Unmap(region, deferred=region.mem.outlives_mapping)
        if not unmap.deferred:
            unmap()
        return unmap

    def _move_all(self, region: Region, deadline: float, moves: dict[bytes, bool]) -> list[Future[Any]]:
        """Submit a move down for each of the region's blocks, hottest first (a block booked and not filled yet
        once it is filled), and wait until none is left or the deadline. Each block stays readable here until
        its own move starts. Returns the transfers submitted."""
        flights: list[Future[Any]] = []
        submitted: set[bytes] = set()
        while True:
            with self.lock:
                left = deadline - time.monotonic()
                if left <= 0 or self._closed:    # closing: the daemon stops, nothing is moved any more
                    break
                batch = [b for b in reversed(self.blocks.values())
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
                        if self.blocks.get(blk.bid) is blk:
                            self._drop(blk)
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
        region = blk.region
        with self.lock:
            if region.gone or region.dead or self.blocks.get(blk.bid) is not blk:
                return None
            buf = self._stage_below(blk)
            self._forget(blk)
            region.release(blk.slot)            # a closing region books nothing: the bytes stay until the unmap
            if isinstance(buf, bool):
                moves[blk.bid] = buf
                self.lock.notify_all()
                return buf
            self._moving[blk.bid] += 1
            region.users += 1
        ok = False
        try:
            ok = self._copy_below(blk.bid, buf, region, blk.offset, blk.nbytes, blk.check)
        finally:
            with self.lock:
                moves[blk.bid] = ok
                region.users -= 1
                self.lock.notify_all()
            self._settle_move(blk.bid, ok)
        return ok

    def _copy_below(self, bid: bytes, buf: StagingBuffer, region: Region, offset: int, nbytes: int,
                    check: int) -> bool:
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
                        self.counters["crc_mismatch"] += 1
                    return False
                with view.toreadonly() as checked:
                    self.below.fill(bid, buf, checked)
        except Exception:
            log.exception("donated: copying a block down to %s failed; it is dropped", self.below.name)
            return False
        return True

    def _settle_move(self, bid: bytes, ok: bool) -> None:
        """A copy down is over: a failed one is cancelled below (its booking there would never be filled)."""
        if not ok and self.below is not None:
            try:
                self.below.delete_many([bid])
            except Exception:
                log.exception("donated: cancelling a block's booking in %s failed", self.below.name)
        with self.lock:
            self._moving[bid] -= 1
            if self._moving[bid] <= 0:
                del self._moving[bid]

    def _drop_rest(self, region: Region) -> int:
        """(Under `lock`.) Forget the region's blocks; how many. A booked one keeps its slot until its fill, which
        finds the region gone and copies nothing."""
        n = 0
        for blk in list(region.owners):
            if blk is not None and self.blocks.get(blk.bid) is blk:
                self._drop(blk)
                n += 1
        return n

    # ----- demotion -----
    def stage(self, bid: bytes, nbytes: int, crc: int | None = None) -> StagingBuffer | bool:
        """Book a slot for an evicted block (present for `has` and reads from now on; reads wait for its fill):
        a ticket for `fill`; True if the tier holds it already; False (dropped, counted) when no region has room
        for its size and no block of its size can be evicted."""
        with self.lock:
            if bid in self.blocks:
                self.blocks.move_to_end(bid)
                self.counters["rewrites_saved"] += 1
                return True
            place = self._place(nbytes)
            if place is None and self.below is not None:
                self.counters["passed_down"] += 1      # no donated room (or no donor): straight to the tier below
                return self.below.stage(bid, nbytes, crc)
            if place is None:
                self.counters["dropped"] += 1
                return False
            region, slot, victim = place
            ticket = _ticket()
            blk = Block(bid, region, slot, nbytes, crc, ticket=ticket)
            if victim is None:
                region.take(slot, blk)
            else:
                blk.handoff = self._evict(victim)
                region.owners[slot] = blk
            self.blocks[bid] = blk
            self._ns[bid[:16]] += 1
            self._bookings[id(ticket)] = blk
            self.counters["staged"] += 1
            return ticket

    def _place(self, nbytes: int) -> _Placement | None:
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

    def _evict(self, victim: Block) -> Handoff | None:
        """(Under `lock`.) Take a block out for its slot's new tenant: booked below (its bytes copied there by
        the new block's `fill`, first), or dropped."""
        self._forget(victim)
        buf = self._stage_below(victim)
        if isinstance(buf, bool):
            self.counters["evicted_down" if buf else "dropped"] += 1
            return None
        self._moving[victim.bid] += 1
        self.counters["evicted_down"] += 1
        return Handoff(victim.bid, buf, victim.nbytes, victim.check)

    def _stage_below(self, blk: Block) -> StagingBuffer | bool:
        """(Under `lock`: a delete cannot slip between this and the block leaving these books.)"""
        if self.below is None:
            return False
        try:
            return self.below.stage(blk.bid, blk.nbytes, blk.crc)
        except Exception:
            log.exception("donated: %s refused a block", self.below.name)
            return False

    def wait_room(self, nbytes: int, timeout: float) -> int:
        """(An operator's eviction, without the state lock.) The tier below's staging room, waited for: blocks this
        tier has no room for go there (see SsdTier.wait_room)."""
        below = self.below
        return below.wait_room(nbytes, timeout) if isinstance(below, PacedTier) else nbytes

    def fill(self, bid: bytes, buf: StagingBuffer, data: memoryview) -> None:
        """(Without the state lock.) Copy an evicted block into the slot `stage` booked (first moving the slot's
        previous block down, if one was evicted for it) and publish it, unless it was deleted meanwhile or its
        bytes fail its writer's CRC (the host slot was written after commit). A buffer the tier below gave (`stage`
        passed the block down) is that tier's to fill."""
        if isinstance(buf, memoryview) and buf.readonly:     # our ticket (`_ticket`); the tier below's are writable
            self._fill(buf, data)
        elif self.below is not None:
            self.below.fill(bid, buf, data)

    def _fill(self, buf: StagingBuffer, data: memoryview) -> bool:
        with self.lock:
            blk = self._bookings.pop(id(buf), None)
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
                moved = usable and self._copy_below(handoff.bid, handoff.buf, region, blk.offset, handoff.nbytes,
                                                    handoff.check)
                self._settle_move(handoff.bid, moved)
            if usable and len(data) == blk.nbytes:
                got = region.mem.write(blk.offset, data)
        finally:
            with self.lock:
                if usable:
                    region.users -= 1
                published = self._publish(blk, got)
                self.lock.notify_all()
        return published

    def _publish(self, blk: Block, got: int | None) -> bool:
        """(Under `lock`.) A fill is over: the block is readable, or it is gone and its slot free."""
        blk.ticket = None
        current = self.blocks.get(blk.bid) is blk and not blk.region.gone
        if current and got is not None and (blk.crc is None or got == blk.crc):
            blk.check, blk.ready = got, True
            return True
        if current:
            self._forget(blk)
            self.counters["fill_crc_mismatch" if got is not None else "fill_failed"] += 1
        if not blk.region.gone:
            blk.region.release(blk.slot)
        return False

    # ----- write-through -----
    def announce(self, bids: list[bytes]) -> None:
        with self.lock:
            self._announced.update(bids)

    def write(self, items: Sequence[TierWrite], lane: Lane) -> int:
        """Store announced blocks (a copy each, like a demotion); a block deleted since `announce`, or whose
        bytes fail its writer's CRC, is not stored. (Memory lent for a while is no place for durability: the
        daemon has no reason to write through to it, but the interface is whole.)"""
        stored = 0
        for bid, data, crc in items:
            with self.lock:
                killed = bid in self._killed
                self._announced[bid] -= 1
                if self._announced[bid] <= 0:
                    del self._announced[bid]
                    self._killed.discard(bid)
                buf = False if killed else self.stage(bid, len(data), crc)
            if buf is True:
                stored += 1
            elif buf is not False:
                with memoryview(data) as view:
                    stored += self._fill(buf, view)
        return stored

    # ----- reads -----
    def has(self, bid: bytes) -> bool:
        return bid in self.blocks

    def read(self, bids: Sequence[bytes], outs: Sequence[memoryview], lane: Lane = Lane.CRITICAL,
             on_ready: Callable[[int], None] | None = None, crcs: list[int | None] | None = None) -> int:
        """Copy the longest prefix of `bids` held here and verified into `outs` (one transfer on the path);
        its length. `on_ready(n)` reports the prefix as it grows; `crcs` receives each block's writer's CRC."""
        if not bids:
            return 0
        nbytes = sum(len(outs[i]) for i in range(len(bids)))
        return int(self.path.run(lane, nbytes, partial(self._read_prefix, bids, outs, on_ready, crcs)).result())

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
        """One block's verified read as a transfer in `lane`; None if not held. Its result: the writer's CRC-32C
        (None if none), or False if the block is gone or failed its check. Busy if the lane is full."""
        if bid not in self.blocks:
            return None
        return self.path.submit(lane, len(out), partial(self._read_one, bid, out), tag=bid, on_done=on_done)

    def _read_one(self, bid: bytes, out: memoryview) -> int | None | bool:
        """The block's bytes into `out`, checked: its writer's CRC (None if none), or False (a miss)."""
        with self.lock:
            blk = self._pin(bid, len(out))
            self.counters["reads" if blk is not None else "read_misses"] += 1
        if blk is None:
            return False
        got = None
        try:
            got = blk.region.mem.read(blk.offset, out)
        except Exception:
            log.exception("donated: reading region %d failed; a miss", blk.region.id)
            with self.lock:
                self.counters["read_errors"] += 1
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
        deadline = time.monotonic() + PENDING_WAIT_S
        while True:
            blk = self.blocks.get(bid)
            if blk is None or blk.nbytes != nbytes or blk.region.dead or blk.region.gone:
                return None
            if blk.ready:
                break
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            self.lock.wait(min(left, 0.1))
        blk.region.pin(blk.slot)
        self.blocks.move_to_end(bid)
        return blk

    def _corrupt(self, blk: Block) -> None:
        """A copy failed its check (the donor wrote the slot, or the copy failed): a miss, and the block is gone."""
        with self.lock:
            self.counters["crc_mismatch"] += 1
            if self.blocks.get(blk.bid) is blk:
                self._drop(blk)
        log.warning("donated: a block in region %d does not match its CRC-32C (its donor wrote over it?): served "
                    "as a miss and dropped", blk.region.id)

    # ----- the books -----
    def _forget(self, blk: Block) -> None:
        """(Under `lock`.) The block leaves the books (its slot is the caller's business)."""
        del self.blocks[blk.bid]
        self._ns[blk.bid[:16]] -= 1
        if self._ns[blk.bid[:16]] <= 0:
            del self._ns[blk.bid[:16]]

    def _drop(self, blk: Block) -> None:
        """(Under `lock`.) Forget a block and free its slot — unless a fill is still to come: that fill frees it."""
        self._forget(blk)
        if blk.ready and not blk.region.gone:
            blk.region.release(blk.slot)

    def delete(self, bid: bytes) -> bool:
        return self.delete_many([bid])[0]

    def delete_many(self, bids: Sequence[bytes]) -> list[bool]:
        """Forget blocks (per block: whether it was here). One on its way down (booked below, copy not done) is
        deleted below too, whatever order the caller deletes the tiers in."""
        found, below = [], []
        with self.lock:
            for bid in bids:
                blk = self.blocks.get(bid)
                if blk is not None:
                    self._drop(blk)
                found.append(blk is not None)
                if bid in self._moving:
                    below.append(bid)
                if bid in self._announced:
                    self._killed.add(bid)
        if below and self.below is not None:
            self.below.delete_many(below)
        return found

    def resize(self, capacity: int) -> dict[str, Any]:
        raise ValueError("the donated tier's capacity is what donors lend it (donate and reclaim), not a setting")

    def namespaces(self) -> dict[bytes, int]:
        with self.lock:
            return dict(self._ns)

    def locate(self, bid: bytes) -> tuple[int, int] | None:
        """(Tests, debugging.) The region id and byte offset of a block held here."""
        with self.lock:
            blk = self.blocks.get(bid)
            return None if blk is None else (blk.region.id, blk.offset)

    def stats(self) -> dict[str, Any]:
        with self.lock:
            regions = list(self.regions.values())
            donated = sum(r.size for r in regions)
            used = sum(r.used * r.slot_bytes for r in regions)
            return {"tier": "donated", "capacity_bytes": donated, "mapped_bytes": donated, "used_bytes": used,
                    "resident_bytes": donated, "blocks": len(self.blocks), "segments": len(regions),
                    "regions": [r.describe() for r in regions],
                    "donors": self.listener.donors() if self.listener is not None else 0,
                    "counters": dict(self.counters),
                    "migrated": self.counters["migrated"],
                    "dropped": self.counters["dropped"] + self.counters["reclaim_dropped"],
                    "reclaim_seconds": self.reclaim_seconds.to_dict(),
                    "namespaces": {d.hex(): n for d, n in self._ns.items()}}

    def close(self) -> None:
        """Stop taking donations and give every region back at once (blocks dropped: the tier below closes
        first, LowerTiers closing in reverse order)."""
        with self.lock:
            self._closed = True
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
