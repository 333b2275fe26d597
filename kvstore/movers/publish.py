"""Publishing: committed blocks are also put in the remote tier at once, in the store lane, so that the daemons of
other nodes find them while this node still holds them (remote.placement write_through or both; beside an SSD tier
this is how blocks reach the store, the SSD taking the evictions).

No copy: the tier puts straight from the committed slot (the pool's segments are registered with the store's
transfer engine), pinned only while its batch is on the wire. The queue is bounded (remote.staging_bytes of
blocks): beyond it a block is skipped and counted (publish_skipped) — it stays on this node, and goes down by
demotion where the remote tier takes evictions. A block evicted or deleted before its turn is skipped too.

While the store does not answer, the queue waits (within the same bound) instead of handing the tier puts it would
skip: blocks committed while the master is down are published when it answers again, those still in their host
slot then (the others stay on this node: local only, counted `publish_gone` / `publish_skipped`).
"""
from __future__ import annotations

from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass
from threading import Condition

from kvstore.index import Holdings, Index, NamespaceEntry
from kvstore.movers.slots import SlotWriter
from kvstore.tiers import SharedTier
from kvstore.tiers.host import HostPool

BATCH = 32
DOWN_POLL_S = 0.25      # while the store is down, how often the queue looks whether it answers again
TRIES = 8               # puts of a block the store refused (a master just restarted places nothing for a while:
                        # until the nodes' segments are mounted again), the waits between them doubling to 4 s
REFUSED_WAIT_MAX_S = 4.0


@dataclass(slots=True)
class Queued:
    ns: NamespaceEntry
    hash: bytes
    gid: int                # the slot at commit: a block no longer there is not published
    tries: int = 0          # batches of it the store did not take


class Publisher(SlotWriter[Queued]):
    what = "a publishing"

    def __init__(self, index: Index, pool: HostPool, tier: SharedTier, changed: Condition, counters: Counter[str],
                 max_bytes: int) -> None:
        self.index = index
        self.pool = pool
        self.tier = tier
        self.changed = changed                  # on the state lock: notified when there is work
        self.counters = counters
        self.max_bytes = max_bytes
        self.holder = Holdings()
        self.queue: deque[Queued] = deque()
        self.queued_bytes = 0
        self._stop = False
        self.start("kvstore-publish")

    def committed(self, ns: NamespaceEntry, hashes: list[bytes]) -> None:
        """(Under the state lock.) Queue the blocks just committed."""
        for h in hashes:
            gid = self.index.slot(ns, h)
            if gid is not None:
                self._enqueue(Queued(ns, h, gid))
        self.changed.notify_all()

    def _enqueue(self, q: Queued, first: bool = False) -> None:
        if self.queued_bytes + q.ns.slot_bytes > self.max_bytes:
            self.counters["publish_skipped"] += 1
            return
        if first:
            self.queue.appendleft(q)
        else:
            self.queue.append(q)
        self.queued_bytes += q.ns.slot_bytes

    # ----- the writer (kvstore.movers.slots: the loop) -----
    def _ready(self) -> bool:
        return bool(self.queue) and self.tier.up

    def _poll_s(self) -> float | None:
        return DOWN_POLL_S if self.queue else None        # the tier's link is not our lock's: no notify comes

    def _take(self) -> tuple[list[Queued], list[bytes], list[int]]:
        live = self._pull()
        return live, [q.ns.block_id(q.hash) for q in live], [q.gid for q in live]

    def _settle(self, batch: Sequence[Queued], stored: int) -> None:
        self.counters["published"] += stored
        if batch:
            self.index.release([q.gid for q in batch], self.holder)
        if stored < len(batch) and self._again(list(batch)):   # refused: give the store time before the next
            tries = max(q.tries for q in batch)                  # batch, more each time (about 16 s in all)
            self.changed.wait(min(DOWN_POLL_S * 2 ** max(tries - 1, 0), REFUSED_WAIT_MAX_S))

    def _again(self, batch: list[Queued]) -> bool:
        """(Under the state lock.) A batch the store did not wholly take — it went down under it, or refused it (a
        master just restarted places nothing until the nodes' segments are mounted again; a full store evicts
        after refusing): in line again, first if the store is down, at most TRIES times a block (a block the store
        took stays out; when it went down, all go back: it answers that as stored). Whether any went back."""
        down = not self.tier.up
        back = False
        for q in reversed(batch):
            if not down and self.tier.has(q.ns.block_id(q.hash)):
                continue                                  # this one the store took
            q.tries += 0 if down else 1
            if q.tries >= TRIES:
                self.counters["publish_refused"] += 1
                continue
            self._enqueue(q, first=down)
            back = True
        return back

    def _pull(self) -> list[Queued]:
        """(Under the state lock.) Up to BATCH queued blocks still in their slot, pinned for their put."""
        out: list[Queued] = []
        while self.queue and len(out) < BATCH:
            q = self.queue.popleft()
            self.queued_bytes -= q.ns.slot_bytes
            if self.index.slot(q.ns, q.hash) == q.gid and self.index.pin(q.ns, q.hash, self.holder) == q.gid:
                out.append(q)
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
