"""Write-through: blocks that engines store are also written to the first lower tier at once, in the store lane, so
they survive a daemon restart and their later eviction costs no write (DualPath persists each full block as soon as
it fills). Off by default (`ssd.write_through`): it spends write bandwidth on blocks that may never be evicted.

No copy: the tier's write reads straight from the committed slot, pinned only while its batch is written (BATCH
blocks at a time), so write-through never holds the pool's room: a block queued but not written yet can be evicted
like any other, and then goes down the write-back way (demotion's staged copy), which the write-through skips. The
queue is bounded (`ssd.staging_bytes` of blocks): beyond it a block is skipped (counted) and goes down on eviction.
A block deleted meanwhile is not published (the tier drops a write whose block was deleted after `announce`).
"""
from __future__ import annotations

import logging
from collections import Counter, deque
from threading import Condition

from kvstore.daemon.crash import fault_point
from kvstore.index import Holdings, Index, NamespaceEntry
from kvstore.tiers import LowerTier
from kvstore.tiers.host import HostPool
from kvstore.traffic import Lane
from kvstore.workers import Worker

log = logging.getLogger("kvstore")
BATCH = 32


class WriteThrough:
    def __init__(self, index: Index, pool: HostPool, tier: LowerTier, changed: Condition, counters: Counter[str],
                 max_bytes: int) -> None:
        self.index = index
        self.pool = pool
        self.tier = tier
        self.changed = changed                  # on the state lock: notified when there is work
        self.counters = counters
        self.max_bytes = max_bytes
        self.holder = Holdings()
        self.queue: deque[tuple[bytes, int, int, NamespaceEntry, bytes]] = deque()   # block id, gid, size, ns, hash
        self.queued_bytes = 0
        self.writing = 0                        # blocks of the batch being written
        self._stop = False
        self._worker = Worker("kvstore-writethrough", self._run).start()   # restarted if it ever raises

    def committed(self, ns: NamespaceEntry, hashes: list[bytes]) -> None:
        """(Under the state lock.) Queue the writes of blocks just committed (nothing pinned yet)."""
        for h in hashes:
            gid = self.index.slot(ns, h)
            if gid is None or self.tier.has(ns.block_id(h)):
                continue                            # gone already, or held by the tier already (stored again)
            if self.queued_bytes + ns.slot_bytes > self.max_bytes:
                self.counters["write_through_skipped"] += 1
                continue
            self.queued_bytes += ns.slot_bytes
            self.queue.append((ns.block_id(h), gid, ns.slot_bytes, ns, h))
        self.changed.notify_all()

    def _run(self) -> None:
        while True:
            with self.changed:
                while not self.queue and not self._stop:
                    self.changed.wait()
                if not self.queue:
                    return
                fault_point("write_through_loop")
                batch = [self.queue.popleft() for _ in range(min(BATCH, len(self.queue)))]
                self.queued_bytes -= sum(n for _, _, n, _, _ in batch)
                # Still in its slot (not deleted, nor evicted: then demotion took it down) and not in the tier yet;
                # once per block (a block deleted and stored again into the same slot is queued twice).
                live = list({b[0]: b for b in batch
                             if self.index.slot(b[3], b[4]) == b[1] and not self.tier.has(b[0])}.values())
                for _, _, _, ns, h in live:
                    self.index.pin(ns, h, self.holder)          # held for this write only
                views = [self.pool.view(gid) for _, gid, _, _, _ in live]
                self.writing = len(live)
                crcs = self.index.crcs_of([gid for _, gid, _, _, _ in live])   # the writers': checked by the tier
                self.tier.announce([bid for bid, _, _, _, _ in live])    # a delete from now on cancels the write
            try:
                stored = self.tier.write([(b[0], v, crc) for b, v, crc in zip(live, views, crcs)], Lane.STORE)
            except Exception:
                log.exception("%s: a write-through batch of %d blocks failed; they stay in the host pool",
                              self.tier.name, len(batch))
                stored = 0
            finally:
                for v in views:
                    v.release()
            with self.changed:
                self.counters["written_through"] += stored
                self.index.release([gid for _, gid, _, _, _ in live], self.holder)
                self.writing = 0

    def stats(self) -> dict[str, int]:
        """(Under the state lock.) Blocks waiting for their write, and blocks being written (pinned)."""
        return {"queued": len(self.queue), "writing": self.writing, "restarts": self._worker.restarts}

    def close(self) -> None:
        """Write what is queued (a graceful stop keeps it), then stop."""
        with self.changed:
            self._stop = True
            self.changed.notify_all()
        self._worker.join(timeout=60)
