"""Records taken out of the SSD store on purpose: deletes, and the cut of a resize.

Deletes are durable before they return: the record leaves the books at once and `delete` returns only once its
header is zeroed on disk and synced (zeroing.py; concurrent deletes share the writes and syncs), after any write of
the key in flight has finished (it publishes nothing) and, during a full restart scan (no trusted map), after the
scan (a copy it had not reached yet is zeroed too); with a map every copy is in the books from the start. Under
sync policy never nothing is durable, deletes included: they return at once.

A resize that shrinks the cap below the files' allocated bytes cuts records from the ends of the largest files
(those holding blocks are evicted) and truncates them, syncing the cut (unless the policy is never): the files never
stay over the cap, not even after a power cut. It waits for a write batch in flight and a zeroing flush (neither may
touch a record being cut), cuts the books under the store's lock and the files outside it, and is refused while the
restart scan runs.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvstore.tiers.ssd import diskio
from kvstore.tiers.ssd.files import ClassFile
from kvstore.traffic import Lane

if TYPE_CHECKING:
    from kvstore.tiers.ssd.store import SsdStore


class Removal:
    """`delete_many` and `resize`, on the store's books (see the module docstring)."""

    def __init__(self, store: SsdStore) -> None:
        self.store = store

    def delete_many(self, keys: Sequence[bytes], lane: Lane) -> list[bool]:
        """Forget blocks; for each, whether the store held it or was writing it. Durable on return (see the
        module docstring), in `lane` and in one flush. Blocks on disk calls, never under the store's lock."""
        s = self.store
        found = []
        with s.lock:
            wait_batch = False
            for key in keys:
                writing = s.writer.cancel_locked(key)
                wait_batch = wait_batch or writing or key in s.evicted
                where = s.index.get(key)
                if where is not None:
                    s.drop_locked(key)
                    s.zeroing.add_locked(s.files[where[0]], where[1])
                found.append(where is not None or writing)
            scanning = s.scanner.unsure_locked()
            if scanning:
                for key in keys:
                    s.scanner.note_deleted_locked(key)     # an older copy the scan finds later is stale
            if s.sync == "never":
                s.zeroing.soon_locked()
                return found
        if wait_batch:
            with s.writer.batch:           # that batch ends: its records are queued for zeroing, or overwritten
                pass
        if scanning:
            s.scanner.wait()               # the scan has queued every copy it found
        s.zeroing.barrier(lane)
        return found

    def resize(self, capacity: int) -> int:
        """Set the cap, cutting the files down to it (see the module docstring); the evictions."""
        s = self.store
        with s.writer.batch, s.zeroing.mutex:
            with s.lock:
                if s.scan.state == "scanning":
                    raise RuntimeError(f"the SSD tier is still scanning ({s.scan.done} of {s.scan.total} "
                                       "records); resize it when the scan is done")
                s.capacity = capacity
                evicted = 0
                cut: set[ClassFile] = set()
                while s.allocated_bytes() > capacity:
                    evicted += self._cut_largest_locked(capacity, cut)
                s.counters["evictions"] += evicted
                sizes = [(cf, cf.size()) for cf in cut]
            for cf, size in sizes:
                diskio.ftruncate(cf.fd, size)
                if s.sync != "never":
                    diskio.fsync(cf.fd)          # the cut survives a power cut: the files stay under the cap
                if cf.map is not None:
                    cf.map.cut(cf.nrecords)
            return evicted

    def _cut_largest_locked(self, capacity: int, cut: set[ClassFile]) -> int:
        """Cut the largest file's books by what the files are over `capacity` (at most all of it), adding it to
        `cut` (the caller truncates it); the evictions."""
        s = self.store
        cf = max(s.files.values(), key=lambda f: f.size())
        n = min(cf.nrecords, -(-(s.allocated_bytes() - capacity) // cf.record))
        first = cf.nrecords - n
        victims = [key for key in cf.keys[first:] if key is not None]     # the cut records only, not the index
        for key in victims:
            s.drop_locked(key)
        del cf.keys[first:]
        cf.free = [r for r in cf.free if r < first]
        cf.holes = [r for r in cf.holes if r < first]
        cf.nrecords = first
        cut.add(cf)
        return len(victims)
