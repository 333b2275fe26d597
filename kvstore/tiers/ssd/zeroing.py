"""Header zeroing: how a record that left the books (deleted, superseded, quarantined, cut by a write that was
cancelled) is wiped on disk before its space is used again, so that its block never comes back after a restart.

- `add_locked` (under the store's lock, with the record already out of the index) queues the record; it is not
  free until its zeroed header is written and synced, so no write can land in it meanwhile.
- `flush` (a path worker, or any thread outside the store's lock) takes everything queued, writes each zero header
  (4 KiB, aligned, no lock held), fdatasyncs each file touched (unless the sync policy is never), then frees the
  records. Flushes run one at a time (`mutex`), so when a flush returns, every record queued before it started is
  zeroed and synced: a flush is a barrier. Concurrent deletes share one flush's writes and syncs (group commit):
  the first takes the queue, the others find it empty or short and sync only what is left.
- `barrier(lane)`: a delete waits here, as a transfer in its lane (in this thread when the lane is full or the
  path closed), before it is reported. `soon_locked` queues a background flush for records nobody waits for (bad
  ones found by reads or by the scan); the next barrier, or `close`, takes them if the background lane is full.
- A record cut off by a resize while queued is dropped, never written past the end of its file (resize holds
  `mutex` while it cuts). A zero header that cannot be written or synced leaves its record out of the free list
  (counted as zero_errors in the tier's counters, logged): it is never reused while it may still hold a block,
  and the delete that waited is reported all the same (the disk is failing; the log says which file).
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kvstore.tiers.ssd import diskio
from kvstore.tiers.ssd.files import ZERO_BUF, ClassFile
from kvstore.tiers.ssd.record import HEADER_BYTES
from kvstore.traffic import Busy, Lane

if TYPE_CHECKING:
    from kvstore.tiers.ssd.store import SsdStore

log = logging.getLogger("kvstore")


class Zeroing:
    def __init__(self, store: SsdStore, pwritev: Callable[..., int]) -> None:
        self.store = store
        self._pwritev = pwritev
        self.mutex = threading.Lock()                   # one flush at a time; resize holds it while cutting
        self.queued: list[tuple[ClassFile, int]] = []    # under store.lock
        self._soon = False                               # a background flush is queued (under store.lock)
        self.closed = False                              # (under mutex) the files are being closed

    def add_locked(self, cf: ClassFile, rec: int) -> None:
        """(Under store.lock.) Queue a record that left the books; it is freed once its header is zeroed."""
        self.queued.append((cf, rec))

    def soon_locked(self) -> None:
        """(Under store.lock.) Have a background transfer flush the queue, unless one is queued already."""
        if self._soon or not self.queued:
            return
        try:
            self.store.path.submit(Lane.BACKGROUND, HEADER_BYTES, self._background)
            self._soon = True
        except (Busy, RuntimeError):
            pass                        # the next barrier or close takes them

    def _background(self) -> None:
        with self.store.lock:
            self._soon = False
        self.flush()

    def barrier(self, lane: Lane) -> None:
        """Return once every record queued so far is zeroed on disk and synced (unless the policy is never)."""
        try:
            job = self.store.path.submit(lane, HEADER_BYTES, self.flush)
        except (Busy, RuntimeError):
            self.flush()
            return
        job.result()

    def flush(self) -> None:
        """Zero the queued headers, sync their files, free the records; see the module docstring."""
        with self.mutex:
            self._flush()

    def close(self) -> None:
        """Flush what is queued; a flush after this does nothing (the files' descriptors are about to close)."""
        with self.mutex:
            self._flush()
            self.closed = True

    def _flush(self) -> None:
        """(Under mutex.)"""
        s = self.store
        if self.closed:
            return
        with s.lock:
            todo = [(cf, rec) for cf, rec in self.queued if rec < cf.nrecords]    # not cut by a resize
            self.queued = []
        if not todo:
            return
        done = [(cf, rec) for cf, rec in todo if self._zero(cf, rec)]
        synced = self._sync({cf for cf, _ in done})
        self._clear_entries([(cf, rec) for cf, rec in done if cf in synced])
        with s.lock:
            for cf, rec in done:
                if cf in synced and rec < cf.nrecords:
                    cf.free.append(rec)

    def _zero(self, cf: ClassFile, rec: int) -> bool:
        try:
            self._pwritev(cf.fd, [ZERO_BUF], rec * cf.record)
            return True
        except OSError as e:
            self._failed(cf, f"zeroing the header of record {rec}", e)
            return False

    def _clear_entries(self, done: list[tuple[ClassFile, int]]) -> None:
        """Zero the map entries of records whose zeroed headers are synced (the header first: an entry never
        goes before its header, recmap.py). Durable with the map's next sync; until then the entry is a miss."""
        for cf, rec in done:
            if cf.map is None:
                continue
            try:
                cf.map.clear([rec])
            except OSError as e:
                self._failed(cf, f"clearing the map entry of record {rec}", e)

    def _sync(self, cfs: set[ClassFile]) -> set[ClassFile]:
        """The files synced (all of them under policy never, which syncs nothing)."""
        if self.store.sync == "never":
            return cfs
        synced = set()
        for cf in cfs:
            try:
                diskio.fdatasync(cf.fd)
                synced.add(cf)
            except OSError as e:
                self._failed(cf, "syncing zeroed headers", e)
        return synced

    def _failed(self, cf: ClassFile, what: str, e: OSError) -> None:
        with self.store.lock:
            self.store.counters["zero_errors"] += 1
        log.error("ssd: %s of %s failed (%s): the record stays unused until the next start", what, cf.path, e)


def run_unlocked(lock: Any, fn: Callable[[], Any]) -> Any:
    """Call `fn` with `lock` (held by this thread) released, and take it again: for the rare disk call (creating
    or growing a file) that a caller holding the store's books must make."""
    lock.release()
    try:
        return fn()
    finally:
        lock.acquire()
