"""The promotion reserve: free host slots kept for promotions, refilled in the background.

An SSD-hit get into a full host pool first evicts a victim for its slot and copies the victim's bytes to the SSD
tier's staging area; only then may the record be read into that slot. Measured (bench_ssd_tier, 2 MiB blocks,
this 2-core VM) that copy alone took 0.2-0.9 ms of a ~3 ms get, on the get's critical path. So after each
promotion of a block size, a background thread evicts by the pool's own policy (the same victims an allocation
would take, handed to the eviction sink like any eviction, their copies made outside the state lock) until
`ssd.promote_reserve` slots of that size are free again: the next promotion (or put) takes a free slot and waits
for no copy. The cost is that many fewer blocks of a size that has promoted in the host pool; 0 turns it off.
Nothing is evicted while a new segment of that size still fits in the pool (its room is free anyway), nor a
pinned block. `reserve_evictions` in `kvstore stats` counts the blocks evicted for the reserve.
"""
from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable
from threading import Lock

from kvstore.index import Index, NamespaceEntry
from kvstore.tiers.host import HostPool
from kvstore.workers import Worker

SlotKey = tuple[str, int]          # (tenant, slot bytes): one class of host slots


class Reserve:
    def __init__(self, index: Index, pool: HostPool, lock: Lock, counters: Counter[str], slots: int,
                 defer: Callable[[], None], copy_evicted: Callable[[], None]) -> None:
        self.index = index
        self.pool = pool
        self.lock = lock                      # the daemon's state lock
        self.counters = counters
        self.slots = slots                    # free slots kept per class that has promoted (0: off)
        self.defer = defer                    # this thread's evictions are copied after the state lock ...
        self.copy_evicted = copy_evicted      # ... by this, which also lets go of their slots
        self._want: dict[SlotKey, NamespaceEntry] = {}
        self._cond = threading.Condition()
        self._worker: Worker | None = None

    def kick(self, ns: NamespaceEntry) -> None:
        """(Any thread, the state lock held or not.) A promotion of `ns`'s block size took a slot: refill."""
        if self.slots <= 0:
            return
        with self._cond:
            self._want[ns.slot_key] = ns
            if self._worker is None:
                self._worker = Worker("kvstore-reserve", self._run).start()
            self._cond.notify()

    def _run(self) -> None:
        self.defer()
        while True:
            with self._cond:
                while not self._want:
                    self._cond.wait()
                wanted = list(self._want.values())
                self._want.clear()
            for ns in wanted:
                with self.lock:
                    self.counters["reserve_evictions"] += self._refill_locked(ns)
                self.copy_evicted()

    def _refill_locked(self, ns: NamespaceEntry) -> int:
        """(Under the state lock.) Evict victims of `ns`'s class until `slots` of its slots are free (counting
        those whose copies are still to be made); the number evicted."""
        if self.pool.fits(ns.slot_bytes):
            return 0                          # a new segment fits: an allocation takes no victim
        cls = self.pool.classes.get(ns.slot_key)
        free = 0 if cls is None else sum(len(seg.free) for seg in cls.with_free.values())
        n = 0
        while free + n < self.slots:
            victim = self.index.policy.victim(ns.cls)
            if victim is None or not self.index.evict_block(victim):
                break
            n += 1
        return n
