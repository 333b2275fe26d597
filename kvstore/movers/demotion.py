"""Demotion: a block evicted from the host pool goes down to the first lower tier instead of being dropped.

The index hands each eviction to `Demotion` (its eviction sink) under the state lock. The tier books the block at
once (present for lookups from then on) and hands out a buffer; the copy of the slot into it (2 MiB for a typical
block) is made after the state lock is left, by the thread that evicted it: a request thread copies before it
replies (`deferring` ... `copy_deferred`), so no client writes the slot first. Until then the slot is held (pinned
by the index for us) — or, when the slot was handed to the evicting caller, written by nobody before the copy.
A retiring segment's blocks are copied the same way (their held slots keep it alive; it is released, and punched by
the pool's reaper, once the last copy is done), except when an allocation waits for that very memory under the lock
(`Eviction.copy_now`: a second move while one is still in flight). Those, and evictions outside a request, are
copied at once, under the lock.
The tier writes staged blocks to its medium on its own schedule, in the background lane, after checking them against
the writer's CRC-32C that the slot carried (booked with the block when it is staged).
"""
from __future__ import annotations

import threading
from collections import Counter

from kvstore.index import Eviction
from kvstore.testpoints import pause_point
from kvstore.tiers import LowerTier, StagingBuffer
from kvstore.tiers.host import HostPool, split_gid

_Copy = tuple[memoryview, StagingBuffer, bytes, int]    # slot view, staging buffer, block id, gid held (or 0)


class Demotion:
    def __init__(self, tier: LowerTier, pool: HostPool, counters: Counter[str]) -> None:
        self.tier = tier
        self.pool = pool
        self.counters = counters
        self._local = threading.local()      # per thread: the copies it makes once it has left the state lock

    def __call__(self, e: Eviction) -> bool:
        """(The index's eviction sink, under the state lock.) Book the block in the tier; True when its slot must
        be held until `copy_deferred` has copied it."""
        pending: list[_Copy] | None = getattr(self._local, "pending", None)
        seg, slot = self.pool.segment_of(e.gid), split_gid(e.gid)[1]
        buf = self.tier.stage(e.block_id, e.nbytes, seg.crc[slot])     # the writer's CRC goes down with it
        self.counters["dropped" if buf is False else "demotions"] += 1
        if isinstance(buf, bool):
            return False
        if pending is None or e.copy_now:
            with self.pool.view(e.gid) as data:
                self.tier.fill(e.block_id, buf, data)
            return False
        if e.draining:
            self._local.draining = True       # one of them is from a retiring segment (a test's pause point)
        pending.append((self.pool.view(e.gid), buf, e.block_id, 0 if e.handed_over else e.gid))
        return not e.handed_over

    def deferring(self) -> None:
        """Copies of blocks this thread evicts from now on wait for `copy_deferred`, which the thread calls as soon
        as it has left the state lock: the state lock is never held across a block copy."""
        if getattr(self._local, "pending", None) is None:
            self._local.pending = []

    def copy_deferred(self, done: bool = True) -> list[int]:
        """(Without the state lock.) Make this thread's deferred copies; returns the slots held for them, which
        the caller lets go of (`Index.let_go`, under the lock). With `done`, stop deferring."""
        pending: list[_Copy] | None = getattr(self._local, "pending", None)
        if done:
            self._local.pending = None
        if not pending:
            return []
        if getattr(self._local, "draining", False):
            self._local.draining = False
            pause_point("draining_copy")
        held = []
        for view, buf, block_id, gid in pending:
            with view:
                self.tier.fill(block_id, buf, view)
            if gid:
                held.append(gid)
        pending.clear()
        return held
