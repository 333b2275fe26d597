"""Publishing: committed blocks are also put in the remote tier at once, in the store lane, so that the daemons of
other nodes find them while this node still holds them (remote.placement write_through or both; beside an SSD tier
this is how blocks reach the store, the SSD taking the evictions).

No copy: the tier puts straight from the committed slot (the pool's segments are registered with the store's
transfer engine), pinned only while its batch is on the wire. The queue is bounded (remote.staging_bytes of
blocks): beyond it a block is skipped and counted (publish_skipped) — it stays on this node, and goes down by
demotion where the remote tier takes evictions. A block evicted or deleted before its turn is skipped too.
"""
from __future__ import annotations

from collections import Counter, deque
from threading import Condition

from kvstore.index import Holdings, Index, NamespaceEntry
from kvstore.movers.writethrough import write_slots
from kvstore.tiers import LowerTier
from kvstore.tiers.host import HostPool
from kvstore.traffic import Lane
from kvstore.workers import Worker

BATCH = 32


class Publisher:
    def __init__(self, index: Index, pool: HostPool, tier: LowerTier, changed: Condition, counters: Counter[str],
                 max_bytes: int) -> None:
        self.index = index
        self.pool = pool
        self.tier = tier
        self.changed = changed                  # on the state lock: notified when there is work
        self.counters = counters
        self.max_bytes = max_bytes
        self.holder = Holdings()
        self.queue: deque[tuple[NamespaceEntry, bytes, int]] = deque()   # (namespace, block hash, slot at commit)
        self.queued_bytes = 0
        self.writing = 0
        self._stop = False
        self._worker = Worker("kvstore-publish", self._run).start()

    def committed(self, ns: NamespaceEntry, hashes: list[bytes]) -> None:
        """(Under the state lock.) Queue the blocks just committed."""
        for h in hashes:
            gid = self.index.slot(ns, h)
            if gid is None:
                continue
            if self.queued_bytes + ns.slot_bytes > self.max_bytes:
                self.counters["publish_skipped"] += 1
                continue
            self.queue.append((ns, h, gid))
            self.queued_bytes += ns.slot_bytes
        self.changed.notify_all()

    def _run(self) -> None:
        while True:
            with self.changed:
                while not self.queue and not self._stop:
                    self.changed.wait()
                if self._stop:
                    return
                live = self._take()
                views = [self.pool.view(gid) for _, _, gid in live]
                crcs = self.index.crcs_of([gid for _, _, gid in live])
                bids = [ns.block_id(h) for ns, h, _ in live]
                self.tier.announce(bids)                   # a delete from now on cancels the put
                self.writing = len(live)
            stored = write_slots(self.tier, bids, views, crcs, Lane.STORE, "a publishing")
            with self.changed:
                self.counters["published"] += stored
                gids = [gid for _, _, gid in live]
                if gids:
                    self.index.release(gids, self.holder)
                self.writing = 0

    def _take(self) -> list[tuple[NamespaceEntry, bytes, int]]:
        """(Under the state lock.) Up to BATCH queued blocks still in their slot, pinned for their put."""
        out: list[tuple[NamespaceEntry, bytes, int]] = []
        while self.queue and len(out) < BATCH:
            ns, h, gid = self.queue.popleft()
            self.queued_bytes -= ns.slot_bytes
            if self.index.slot(ns, h) == gid and self.index.pin(ns, h, self.holder) == gid:
                out.append((ns, h, gid))
            else:
                self.counters["publish_gone"] += 1
        return out

    def stats(self) -> dict[str, object]:
        return {"queued": len(self.queue), "queued_bytes": self.queued_bytes, "writing": self.writing,
                "restarts": self._worker.restarts}

    def close(self) -> None:
        with self.changed:
            self._stop = True
            self.changed.notify_all()
