"""Room at the SSD store's cap: which record a write takes when the files may not grow, and whose.

The capacity bounds the record files' bytes on the disk (their sizes less their holes, `store.allocated_bytes`).
A write that finds no free record and no room to grow its file (writes.py) comes here:
- `punch_free_locked`: other block sizes' unused (free) records are punched out of their files (files.punch), so
  that free space serves whoever writes (a file never shrinks but by resize: without this, records freed by deletes
  in one size could never serve another);
- `evict_locked`: the policy's victim among the records of this block size is handed to the writer (which zeroes
  its header). Under SSD quotas (owners.py) the victim is of the tenant the quotas choose, and a writer within its
  quota that finds no borrower's record of this size has borrowers' records of other sizes evicted and punched
  out first (`_punch_borrowed_locked`), then takes the room by growing its file;
- `no_room_reason_locked`: why a write found no record, for the log.
`punch_forgotten_holes` (at open, and when a full scan ends) punches the free records of files over the cap, whose
holes a restart cannot tell from free records.

Everything here works on the store's books (store.py) under its `lock`, which is let go for each punch (a disk
call); the eviction classes are the store's (`eviction_class`, `class_records`).
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any

from kvstore.testpoints import crash_point
from kvstore.tiers.ssd.files import ClassFile, punch
from kvstore.tiers.ssd.zeroing import run_unlocked

if TYPE_CHECKING:
    from kvstore.tiers.ssd.store import SsdStore

log = logging.getLogger("kvstore")


class Room:
    """Making room at the cap, on the store's books (see the module docstring)."""

    def __init__(self, store: SsdStore) -> None:
        self.store = store

    def punch_forgotten_holes(self) -> None:
        """Files over the cap at start held holes (records punched out for another block size's file: the holes
        are not on record, and a restart books them as free records). Reusing one would take disk space beyond
        the cap, so every free record booked now is punched (a no-op for a hole, its space back for any other:
        it holds nothing) and booked as a hole: the books count what the disk holds again. Run at open, and again
        when a full scan ends (a file without a trusted map books its free records as the scan finds them: until
        it ends, a write may fill one that is a hole, and the disk go over the cap by those holes)."""
        s = self.store
        with s.lock:
            if s.file_bytes() <= s.capacity:
                return
            taken = [(cf, cf.free) for cf in s.files.values()]
            for cf in s.files.values():
                cf.free = []
        punched = [(cf, [r for r in recs if self._punch(cf, r) is None]) for cf, recs in taken]
        with s.lock:
            for (cf, recs), (_, holes) in zip(taken, punched):
                cf.holes.extend(holes)
                gone = set(holes)
                cf.free.extend(r for r in recs if r not in gone)
        log.info("ssd: %s: the record files hold holes (another block size took their space); %d free records "
                 "punched so that the tier stays within ssd.capacity", s.dir, sum(len(h) for _, h in punched))

    def evict_locked(self, cf: ClassFile, writer: str = "",
                     grow: Callable[[ClassFile], int | None] | None = None) -> int | None:
        """Make room at the cap for a record of tenant `writer`: the policy's victim among the records of this
        block size (of the tenant whose quota allows it: owners.py) is handed to the writer, which zeroes its
        header. Under SSD quotas, a writer within its quota that finds no borrower's record of this size has
        borrowers' records of other sizes punched out first (`_punch_borrowed_locked`), then takes the room with
        `grow` (the writer's free-record path). None if there is no record to take."""
        s = self.store
        victim_tenant = writer
        if s.split:
            t = s.quotas.victim_tenant(writer, cf.record, lambda: self._holders(cf.payload),
                                       self._age(lambda tenant: (tenant, cf.payload)))
            if grow is not None and t in (None, writer) and s.quotas.within(writer, cf.record) \
                    and self._punch_borrowed_locked(cf, writer):
                return grow(cf)
            if t is None:
                s.quotas.counters["quota_blocked"] += 1
                return None
            victim_tenant = t
        key = s.policy.victim(s.eviction_class(victim_tenant, cf.payload))
        if key is None:
            return None
        s.quotas.evicted(s.owners.tenant(key[:16]), writer, cf.record)
        _, rec, _ = s.drop_locked(key)
        s.evicted.add(key)
        crash_point("mid_eviction")
        s.counters["evictions"] += 1
        return rec

    def _punch_borrowed_locked(self, cf: ClassFile, writer: str) -> bool:
        """Room for one record of `cf` within the cap, made by evicting borrowers' records of other block sizes
        (owners.py's rule: the least recently used first, none below its quota) and punching them out of their
        files (files.punch): a block size's file never shrinks, so a tenant's quota would otherwise hold only
        within the sizes it already has. False, punching nothing, when the borrowers could not give enough
        (`SsdQuotas.giveable`); False, too, when a punch is refused or the LRU order gave less than that bound
        (what was punched stays punched: room for the next write)."""
        s = self.store

        def record(payload: int) -> int:
            return s.files[payload].record

        need = cf.record - (s.capacity - s.allocated_bytes())
        if need > 0 and s.quotas.giveable(writer, s.class_records, cf.payload, record) < need:
            return False                                  # they cannot make the room: punch no one's for nothing
        while s.capacity - s.allocated_bytes() < cf.record:
            pick = s.quotas.borrower(writer, s.class_records, exclude=cf.payload, record=record,
                                     age=self._age(lambda c: c))
            if pick is None:
                return False
            tenant, payload = pick
            key = s.policy.victim(s.eviction_class(tenant, payload))
            if key is None:
                return False
            other = s.files[payload]
            s.quotas.evicted(tenant, writer, other.record)
            _, rec, _ = s.drop_locked(key)
            s.counters["evictions"] += 1
            refused = run_unlocked(s.lock, partial(self._punch, other, rec))
            if refused is not None:
                log.warning("ssd: %s; the evicted record is reused in its own file instead", refused)
                s.zero_later_locked(other, rec)
                return False
            other.holes.append(rec)
            s.counters["punched"] += 1
        return True

    def punch_free_locked(self, cf: ClassFile) -> bool:
        """Room for one record of `cf` within the cap, made from the unused (free) records of other block sizes'
        files, punched out (a file never shrinks but by resize: without this, records freed by deletes in one
        size could never serve another). False if they do not make enough."""
        s = self.store
        while s.capacity - s.allocated_bytes() < cf.record:
            other = next((f for f in s.files.values() if f is not cf and f.free), None)
            if other is None:
                return False
            rec = other.free.pop(0)                  # the end of the list the writer takes last
            refused = run_unlocked(s.lock, partial(self._punch, other, rec))
            if refused is not None:
                other.free.append(rec)
                return False
            other.holes.append(rec)
            s.counters["punched"] += 1
        return True

    @staticmethod
    def _punch(cf: ClassFile, rec: int) -> OSError | None:
        """(Without the lock.) The record's space back to the disk, and its map entry cleared."""
        refused = punch(cf, rec)
        if refused is None and cf.map is not None:
            cf.map.clear([rec])
        return refused

    def no_room_reason_locked(self, cf: ClassFile, tenant: str) -> str:
        """Why a write found no record: what an operator reads in the log, and what to do."""
        if not self.store.split:
            return "the tier is at its capacity and holds no block of this size to evict; grow ssd.capacity"
        q = self.store.quotas
        return (f"the tier is full and every tenant holding blocks of this size is at or below its SSD quota (tenant "
                f"{tenant!r} uses {q.used[tenant]} of {q.quota(tenant)} bytes); raise its quota (kvstore tenants set "
                "NAME --ssd SIZE) or grow ssd.capacity")

    def _age(self, cls_of: Callable[[Any], tuple[str, int]]) -> Callable[[Any], int | None] | None:
        """When a candidate's victim was last used, where the policy keeps a clock (LRU); None otherwise."""
        s = self.store
        oldest = getattr(s.policy, "oldest_tick", None)
        if oldest is None:
            return None
        return lambda c: oldest(s.eviction_class(*cls_of(c)))

    def _holders(self, payload: int) -> list[str]:
        return [t for (t, p), n in self.store.class_records.items() if n > 0 and p == payload]
