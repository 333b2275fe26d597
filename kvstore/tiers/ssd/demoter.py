"""The SSD tier's writes into its record store: the demotion writer thread, and the write batches it shares with
write-through.

A background thread (`kvstore-demote`, a supervised kvstore.workers.Worker: restarted if it ever raises) writes
staged blocks (kvstore.tiers.ssd.staging) to the record store in batches of up to WRITE_BATCH: urgent blocks first
(a write-through or a durability wait is behind them), in the store lane; else any staged blocks, in the
background lane. Blocks still being copied in are left for later. A written block leaves staging (its buffer kept
as a spare), its watchers are told, and an operator's eviction waiting for staging room wakes. A batch the lane
refused (its queue full) stays staged and is tried again after BUSY_RETRY_S (counted as busy_retries); a batch that
fails is dropped, and logged. `close` writes what is staged before the thread ends.

Write-through (`announce`, then `write`) goes through the same batches: `announce` books the keys of a batch
before their bytes are taken, and a delete from then on cancels them (`cancel_locked`: the batch publishes nothing
of them) and waits for the batch to end (`wait_out`), so a kill -9 after the delete's reply can never find the
block's record written and synced. The books of the batches in flight are under the tier's lock (the staging
area's).
"""
from __future__ import annotations

import logging
import mmap
from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvstore.testpoints import fault_point
from kvstore.tiers import TierWrite
from kvstore.tiers.ssd.staging import Pending, Staging, tell_watchers
from kvstore.traffic import Lane
from kvstore.workers import Worker

if TYPE_CHECKING:
    from kvstore.tiers.ssd.store import SsdStore

log = logging.getLogger("kvstore")
WRITE_BATCH = 32
BUSY_RETRY_S = 0.05           # a demotion batch the lane refused (its queue full) is tried again after this


class Demoter:
    """The writer thread and the write batches in flight (see the module docstring)."""

    def __init__(self, staging: Staging, store: SsdStore) -> None:
        self.staging = staging
        self.store = store
        self.lock = staging.lock
        self.busy_retries = 0                          # demotion batches the lane refused, kept staged to retry
        self.stop = False
        self.inflight: Counter[bytes] = Counter()     # keys in a write batch now (demotion or write-through)
        self.killed: set[bytes] = set()                # ... deleted meanwhile: the batch must not publish them
        self.worker = Worker("kvstore-demote", self._run)      # restarted if it ever raises
        self.served = ""                               # the tenant whose background batch went last

    def start(self) -> None:
        self.worker.start()

    def close(self) -> None:
        """Write what is staged, then let the thread end."""
        with self.lock:
            self.stop = True
            self.lock.notify()
        self.worker.join()

    # ----- the writer thread -----
    def _run(self) -> None:
        area = self.staging
        while True:
            with self.lock:
                while True:
                    batch, lane = self._next_batch()
                    if batch or (self.stop and not area.blocks):
                        break
                    self.lock.wait()
                if not batch:
                    return
                fault_point("demote_loop")
                self._begin([k for k, _ in batch])
                items = [(k, v, area.crcs.get(k)) for k, v in batch]
            busy: set[bytes] = set()
            try:
                self.write(items, lane, busy)
            except Exception:
                log.exception("ssd: a demotion batch of %d blocks failed; they are dropped", len(batch))
            with self.lock:
                for k, v in batch:
                    if k in busy and area.blocks.get(k) is v and not self.stop:
                        continue                           # the lane was full: staged still, written next time
                    if area.blocks.get(k) is v:            # not deleted or staged again meanwhile
                        area.forget_locked(k)
                        area.keep_spare_locked(v)          # no one else holds it: reuse it, faulted in already
                gone = area.unstaged_locked([k for k, _ in batch])
                self.lock.notify_all()                     # an operator's eviction waiting for staging room
                if busy:
                    self.busy_retries += 1
                    self.lock.wait(BUSY_RETRY_S)           # the lane drains meanwhile
            tell_watchers(gone)

    def _next_batch(self) -> tuple[list[tuple[bytes, bytes | bytearray | mmap.mmap]], Lane]:
        """(Under `lock`.) The next demotion batch: urgent blocks first (a write-through or a durability wait is
        behind them; their tenants take turns upstream, kvstore.movers.fair), in the store lane; else staged blocks
        of one tenant, in the background lane, the tenants in turn (the next after the last served, by name), each
        tenant's in the order staged. Blocks still being copied in are left for later."""
        area = self.staging
        blocks = area.blocks
        urgent = [(k, v) for k in area.urgent
                  if (v := blocks.get(k)) is not None and not isinstance(v, Pending)][:WRITE_BATCH]
        if urgent:
            return urgent, Lane.STORE
        ready: dict[str, list[tuple[bytes, bytes | bytearray | mmap.mmap]]] = {}
        for k, v in blocks.items():
            if not isinstance(v, Pending):
                mine = ready.setdefault(area.tenants.get(k, ""), [])
                if len(mine) < WRITE_BATCH:
                    mine.append((k, v))
        if not ready:
            return [], Lane.BACKGROUND
        turn = sorted(ready)
        self.served = next((t for t in turn if t > self.served), turn[0])
        return ready[self.served], Lane.BACKGROUND

    # ----- write batches (demotion and write-through) -----
    def announce(self, keys: list[bytes]) -> None:
        """Announce the keys of a write batch before their bytes are taken (a delete from then on cancels them)."""
        with self.lock:
            self._begin(keys)

    def _begin(self, keys: list[bytes]) -> None:
        self.inflight.update(keys)

    def write(self, items: Sequence[TierWrite], lane: Lane, busy: set[bytes] | None = None) -> int:
        """Write announced blocks (block id, bytes, writer's CRC-32C or None) to the store in `lane`; a key
        deleted since `announce`, or whose bytes fail its CRC, is not published. `busy` receives the keys not
        stored only because the lane's queue was full."""
        try:
            return self.store.put_many([(k[:16], k[16:], v, crc) for k, v, crc in items], lane,
                                       cancelled=self.killed, busy=busy)
        finally:
            with self.lock:
                for k, _, _ in items:
                    self.inflight[k] -= 1
                    if self.inflight[k] <= 0:
                        del self.inflight[k]
                        self.killed.discard(k)
                self.lock.notify_all()                  # deletes waiting for this batch

    def cancel_locked(self, key: bytes) -> None:
        """(Under `lock`.) The key was deleted: a batch writing it now publishes nothing of it."""
        if key in self.inflight:
            self.killed.add(key)

    def wait_out(self, keys: Sequence[bytes]) -> None:
        """Until no batch in flight writes any of `keys`."""
        with self.lock:
            while any(k in self.inflight for k in keys):
                self.lock.wait()
