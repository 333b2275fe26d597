"""The loop both queue movers run — write-through (kvstore.movers.writethrough: into the durable tier) and publish
(kvstore.movers.publish: into the remote store): blocks written straight from their host slots into a lower tier,
a batch at a time, the daemon's state lock held only to take a batch and to settle it.

One round: under the state lock, wait until the mover has work it can do now (`_ready`; `_poll_s` bounds the wait
where readiness does not come with a notify, e.g. a tier's link), or stop (`_finished`: one mover drains its queue
first, the other does not); take a batch whose slots are pinned for the write (`_take`: entries and their block ids
and slots); announce the ids to the tier (a delete from then on cancels their write) and let the mover act on the
announced batch (`_announced`). Without the lock, write the batch from the slots (`write_slots`: no copy). Under
the lock again, settle it (`_settle`: unpin, count, requeue or report). A round raising is logged and the loop
restarted by its Worker (kvstore.workers)."""
from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, Generic, TypeVar

from kvstore.testpoints import pause_point
from kvstore.tiers import LowerTier
from kvstore.traffic import Lane
from kvstore.workers import Worker

log = logging.getLogger("kvstore")
E = TypeVar("E")


def write_slots(tier: LowerTier, bids: list[bytes], views: list[memoryview], crcs: list[int | None], lane: Lane,
                what: str) -> int:
    """(Without the state lock.) Write a batch of announced blocks straight from their pinned host slots; how many
    the tier stored (0, logged, if its write raised: the blocks stay in the host pool). The views are released."""
    try:
        return tier.write(list(zip(bids, views, crcs)), lane) if bids else 0
    except Exception:
        log.exception("%s: %s batch of %d blocks failed; they stay in the host pool", tier.name, what, len(bids))
        return 0
    finally:
        for v in views:
            v.release()


class SlotWriter(ABC, Generic[E]):
    """The round above; a mover sets `index`, `pool`, `tier`, `changed` (the state lock's condition) and `_stop`,
    implements the hooks, and calls `start(name)` last in its constructor."""
    what = "a write"                # names the batch in a failure's log line
    lane = Lane.STORE
    index: Any
    pool: Any
    tier: Any
    changed: Any
    _stop: bool
    writing: int
    _worker: Worker

    def start(self, name: str) -> None:
        self.writing = 0                                    # blocks of the batch being written
        self._worker = Worker(name, self._run).start()      # restarted if it ever raises

    def _run(self) -> None:
        while True:
            with self.changed:
                while not self._stop and not self._ready():
                    self.changed.wait(self._poll_s())
                if self._finished():
                    return
                batch, bids, gids = self._take()
                views = [self.pool.view(gid) for gid in gids]
                crcs = self.index.crcs_of(gids)             # the writers': checked by the tier
                self.tier.announce(bids)                    # a delete from now on cancels the write
                self.writing = len(bids)
                self._announced(batch)
            pause_point("slot_write")
            stored = write_slots(self.tier, bids, views, crcs, self.lane, self.what)
            with self.changed:
                self.writing = 0
                self._settle(batch, stored)

    # ----- the hooks (each called under the state lock) -----
    @abstractmethod
    def _ready(self) -> bool:
        """There is work that can be done now."""

    def _poll_s(self) -> float | None:
        """How long to wait for readiness before looking again (None: until notified)."""
        return None

    def _finished(self) -> bool:
        """The loop ends (`_stop` set, and what must be written first is)."""
        return self._stop

    @abstractmethod
    def _take(self) -> tuple[Sequence[E], list[bytes], list[int]]:
        """The next batch: its entries, their block ids and their slots (pinned for the write)."""

    def _announced(self, batch: Sequence[E]) -> None:
        """The batch's ids are announced to the tier."""

    @abstractmethod
    def _settle(self, batch: Sequence[E], stored: int) -> None:
        """The batch's write is over (`stored` of it taken by the tier): let go of its pins, count, follow up."""
