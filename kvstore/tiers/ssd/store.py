"""The SSD tier's record store: Full Blocks in preallocated files on local disk, found again after a restart.

- One file per block size (`blocks-<payload bytes>.kvs`), made of fixed-size records (record.py); files grow in
  steps up to the tier's capacity, which they never exceed. The directory is 0700, the files 0600, and a lock file
  makes one daemon its only owner (files.py).
- Every disk access is a transfer on the traffic manager's `ssd` path, in the caller's lane: a read an engine
  waits on (critical) overtakes demotion writes and the restart scan (background), and several transfers are in
  flight at once. The store's books (`lock`) are never held across a disk call: not a record's read or write, not
  a header's zeroing (zeroing.py), and not the rare file calls of the books either (creating a block size's file,
  growing one, cutting one at a resize), which let go of the lock for the call. `stats` never waits for a disk.
- `put_many` writes payloads, syncs (policy always | batch | never), writes headers, syncs: a record is durable
  when it returns (with always or batch). A key deleted while its write is in flight is not published (writes.py).
- Reads check every header field against the key asked and the payload's checksum against its bytes: a record that
  fails is a miss, quarantined (its header zeroed, its space reused) and counted by reason. No wrong byte is served
  (reads.py).
- `open` books what each record file's map (recmap.py) names before it returns, so every block on disk is a hit
  from the first request, then validates those records' headers in the background; a file without a trusted map
  has every header scanned while the daemon already serves (a block not scanned yet is a miss), and its map
  rebuilt. Files that are not ours (foreign names, temporaries, symlinks) are skipped. `wait=True` (tools, tests)
  returns only when the scan is done (scan.py).

This module keeps the books, under `lock`: `index` (namespace digest + block hash → (payload bytes, record, seq));
`policy` (a kvstore.policy TierPolicy: the order in which the cap evicts, per block size, or per tenant and block
size where tenants have SSD quotas); `files` (payload bytes → ClassFile, whose free records are booked there too);
bytes used and blocks per namespace, kept as the index changes; `owners` and `quotas` (owners.py: whose each
digest is, on disk, and each tenant's bytes and quota); `counters`. The `*_locked` methods are the books'
primitives for the other parts; they expect `lock` held.

Deletes are durable before they return: the record leaves the books at once and `delete` returns only once its
header is zeroed on disk and synced (zeroing.py; concurrent deletes share the writes and syncs), after any write of
the key in flight has finished (it publishes nothing) and, during a full restart scan (no trusted map), after the
scan (a copy it had not reached yet is zeroed too); with a map every copy is in the books from the start. Under
sync policy never nothing is durable, deletes included: they return at once.
A record that leaves the books otherwise (superseded by a newer copy, quarantined) is zeroed before its space is
reused, so no block comes back after a crash, and no key comes back with an older copy's bytes.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from collections import Counter
from collections.abc import Callable, Collection, Sequence
from concurrent.futures import Future
from functools import partial
from typing import Any

from kvstore.policy import make_tier_policy
from kvstore.testpoints import crash_point
from kvstore.tiers.ssd import diskio
from kvstore.tiers.ssd.config import SYNC_POLICIES
from kvstore.tiers.ssd.files import ClassFile, StoreLocked, choose_io, lock_directory, open_class_file, punch
from kvstore.tiers.ssd.owners import Owners, SsdQuotas
from kvstore.tiers.ssd.reads import Reader
from kvstore.tiers.ssd.recmap import ENTRY_BYTES, FILE_HEADER
from kvstore.tiers.ssd.scan import RestartScan, Scan
from kvstore.tiers.ssd.writes import Item, Writer
from kvstore.tiers.ssd.zeroing import Zeroing, run_unlocked
from kvstore.traffic import Lane, Path
from kvstore.workflows import Workflows

__all__ = ["SYNC_POLICIES", "ClassFile", "SsdStore", "StoreLocked"]
log = logging.getLogger("kvstore")
Out = memoryview | bytearray


class SsdStore:
    """The books (this module), with the parts that move bytes: `writer` (writes.py), `reader` (reads.py) and
    `scanner` (scan.py), over the record files (files.py)."""

    def __init__(self, directory: str, capacity: int, sync: str = "batch", path: Path | None = None,
                 io: str = "threads", eviction: str = "lru", workflows: Workflows | None = None,
                 quotas: SsdQuotas | None = None) -> None:
        if sync not in SYNC_POLICIES:
            raise ValueError(f"ssd sync policy must be one of {', '.join(SYNC_POLICIES)}, got {sync!r}")
        # Record payloads move by os.preadv/pwritev from the path's worker threads, or through an io_uring per
        # worker (uring.py) when asked for and the probe finds it sound; either way one transfer a worker.
        self.io, preadv, pwritev = choose_io(io)
        self.dir = directory
        self.capacity = capacity
        self.path = path if path is not None else Path("ssd", workers=4)   # standalone: tools and tests
        self._own_path = path is None
        self.lock = threading.Lock()         # the books below; never held across a record's I/O
        self.files: dict[int, ClassFile] = {}
        self.index: dict[bytes, tuple[int, int, int]] = {}    # ns + hash → (payload bytes, record, seq)
        self.policy = make_tier_policy(eviction, workflows)  # which record the cap takes next, per block size
        self.counters: Counter[str] = Counter()
        self.used = 0                        # bytes of the records in the index
        self.per_ns: Counter[bytes] = Counter()    # blocks per namespace digest, kept as the index changes
        self.owners = Owners(directory, synced=sync != "never")     # digest → tenant, kept on disk
        self.quotas = quotas if quotas is not None else SsdQuotas()
        self.split = quotas is not None and quotas.total() > 0      # eviction classes per (tenant, block size)
        self.tenant_of: Callable[[bytes], str | None] = _nobody    # the daemon's: a registered digest's tenant
        self._classes: dict[tuple[str, int], int] = {}            # (tenant, payload bytes) → policy class
        self._class_records: Counter[tuple[str, int]] = Counter()  # records per (tenant, payload bytes)
        self.writer = Writer(self, sync, pwritev)
        self.reader = Reader(self, preadv)
        self.scanner = RestartScan(self)
        self.zeroing = Zeroing(self, pwritev)       # records out of the books, wiped before they are reused
        self.evicted: set[bytes] = set()            # keys evicted for the write batch in flight (their records
        #                                             are wiped by its payload writes, not by zeroing)
        self._seq = 0
        self._lock_fd = -1

    @property
    def sync(self) -> str:
        """The sync policy: always | batch | never (SYNC_POLICIES)."""
        return self.writer.sync

    @property
    def scan(self) -> Scan:
        """Progress of the restart scan."""
        return self.scanner.progress

    # ----- opening and closing -----
    def open(self, progress: Callable[[int, int], None] | None = None, wait: bool = True) -> "SsdStore":
        """Own the directory (StoreLocked if another daemon does) and start the restart scan."""
        self._lock_fd = lock_directory(self.dir)
        self.owners.open()
        self.scanner.start(progress, wait)
        self.punch_forgotten_holes()
        return self

    def punch_forgotten_holes(self) -> None:
        """Files over the cap at start held holes (records punched out for another block size's file: the holes
        are not on record, and a restart books them as free records). Reusing one would take disk space beyond
        the cap, so every free record booked now is punched (a no-op for a hole, its space back for any other:
        it holds nothing) and booked as a hole: the books count what the disk holds again. Run at open, and again
        when a full scan ends (a file without a trusted map books its free records as the scan finds them: until
        it ends, a write may fill one that is a hole, and the disk go over the cap by those holes)."""
        with self.lock:
            if self.file_bytes() <= self.capacity:
                return
            taken = [(cf, cf.free) for cf in self.files.values()]
            for cf in self.files.values():
                cf.free = []
        punched = [(cf, [r for r in recs if self._punch(cf, r) is None]) for cf, recs in taken]
        with self.lock:
            for (cf, recs), (_, holes) in zip(taken, punched):
                cf.holes.extend(holes)
                gone = set(holes)
                cf.free.extend(r for r in recs if r not in gone)
        log.info("ssd: %s: the record files hold holes (another block size took their space); %d free records "
                 "punched so that the tier stays within ssd.capacity", self.dir, sum(len(h) for _, h in punched))

    def close(self) -> None:
        self.scanner.stop()              # a scan in progress stops submitting and finishes what it queued
        self.zeroing.close()             # what was queued is wiped: nothing left out of the books comes back
        if self._own_path:
            self.path.close()
        for cf in self.files.values():
            if cf.map is not None:
                try:
                    cf.map.sync()        # entries zeroed lazily since the last batch
                except OSError as e:
                    log.error("ssd: syncing the record map %s failed (%s)", cf.map.path, e)
                cf.map.close()
            os.close(cf.fd)
        self.files.clear()
        complete = self.scan.state == "ready"          # else the books may lack records the scan did not reach
        self.owners.close(live=[d for d, n in self.per_ns.items() if n] if complete else self.owners.known)
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1

    # ----- writes and reads (writes.py, reads.py) -----
    def put_many(self, items: Sequence[Item], lane: Lane = Lane.BACKGROUND, cancelled: Collection[bytes] = (),
                 busy: set[bytes] | None = None) -> int:
        """Store (namespace digest, block hash, payload) records; returns how many were stored (the rest found
        no room, or were deleted while being written). Durable on return unless the sync policy is never. A key
        that appears in `cancelled` by the time its record is published (deleted upstream) is not published.
        `busy` receives the keys not stored only because the lane's queue was full (worth trying again)."""
        return self.writer.put_many(items, lane, cancelled, busy)

    def has(self, key: bytes) -> bool:
        return key in self.index

    def get(self, ns: bytes, h: bytes, out: Out, lane: Lane = Lane.CRITICAL) -> bool:
        """Read the block into `out` (len = payload bytes); False on a miss, with bad records quarantined."""
        return self.get_many(ns, [h], [out], lane) == 1

    def get_many(self, ns: bytes, hashes: Sequence[bytes], outs: Sequence[Out],
                 lane: Lane = Lane.CRITICAL, on_ready: Callable[[int], None] | None = None,
                 crcs: list[int | None] | None = None) -> int:
        """Read blocks into `outs`, all in flight at once; returns the length of the prefix read and verified.
        The first miss or bad record ends the prefix (a bad one is quarantined): never a partial hit past it.
        `on_ready(n)` is called as the verified prefix grows, so a caller can hand out the first blocks while
        later ones are still on the disk; `crcs` receives each verified block's CRC-32."""
        return self.reader.get_many(ns, hashes, outs, lane, on_ready, crcs)

    def read_async(self, key: bytes, out: Out, lane: Lane,
                   on_done: Callable[[Future[Any]], None] | None = None) -> Future[Any] | None:
        """Submit a verified read of one block into `out`; None (counted) when the store does not hold it with
        that size. The future's result is the block's CRC-32, or False for a bad record (quarantined); Busy if the
        lane is full."""
        return self.reader.read_async(key, out, lane, on_done)

    def read_into(self, key: bytes, cf: ClassFile, rec: int, out: Out) -> int | bool | None:
        """(A path worker.) Read one record, check it against the key and its checksum, and put the payload in
        `out`: straight into it when it is aligned for O_DIRECT (a host slot of a whole number of pages), else
        through an aligned buffer. On a failed check `out` holds garbage, and the caller does not publish it."""
        return self.reader.read_into(key, cf, rec, out)

    def verify(self, fix: bool = False) -> list[tuple[str, int, str]]:
        """Read every indexed record whole and check it: (file, record, reason) of each bad one. With `fix`, bad
        records are quarantined; without, nothing on disk changes. An offline tool: reads in this thread."""
        return self.reader.verify(fix)

    # ----- deletes and resize -----
    def delete(self, ns: bytes, h: bytes, lane: Lane = Lane.STORE) -> bool:
        """Forget the block; True if the store held it or was writing it. Durable on return: see delete_many."""
        return self.delete_many([ns + h], lane)[0]

    def delete_many(self, keys: Sequence[bytes], lane: Lane = Lane.STORE) -> list[bool]:
        """Forget blocks (namespace digest + block hash each); for each, whether the store held it or was writing
        it. Durable on return (unless the sync policy is never: then nothing is): every header is zeroed on disk
        and synced, in `lane` and in one flush, after the write batch in flight (if it writes one of them, or
        reuses the record of one it evicted: that write publishes nothing) and, during the restart scan, after the
        scan (a copy not scanned yet is wiped too). Blocks on disk calls, never under the store's lock."""
        found = []
        with self.lock:
            wait_batch = False
            for key in keys:
                writing = self.writer.cancel_locked(key)
                wait_batch = wait_batch or writing or key in self.evicted
                where = self.index.get(key)
                if where is not None:
                    self.drop_locked(key)
                    self.zeroing.add_locked(self.files[where[0]], where[1])
                found.append(where is not None or writing)
            scanning = self.scanner.unsure_locked()
            if scanning:
                for key in keys:
                    self.scanner.note_deleted_locked(key)     # an older copy the scan finds later is stale
            if self.sync == "never":
                self.zeroing.soon_locked()
                return found
        if wait_batch:
            with self.writer.batch:        # that batch ends: its records are queued for zeroing, or overwritten
                pass
        if scanning:
            self.scanner.wait()            # the scan has queued every copy it found
        self.zeroing.barrier(lane)
        return found

    def resize(self, capacity: int) -> int:
        """Set the cap. Shrinking below the files' allocated bytes cuts records from the ends of the largest files
        (those holding blocks are evicted) and truncates them: the files never stay over the cap. Returns the
        evictions. Waits for a write batch in flight and a zeroing flush (neither may touch a record being cut); the
        files are cut and synced outside the store's lock. Refused while the restart scan runs."""
        with self.writer.batch, self.zeroing.mutex:
            with self.lock:
                if self.scan.state == "scanning":
                    raise RuntimeError(f"the SSD tier is still scanning ({self.scan.done} of {self.scan.total} "
                                       "records); resize it when the scan is done")
                self.capacity = capacity
                evicted = 0
                cut: set[ClassFile] = set()
                while self.allocated_bytes() > capacity:
                    evicted += self._cut_largest_locked(capacity, cut)
                self.counters["evictions"] += evicted
                sizes = [(cf, cf.size()) for cf in cut]
            for cf, size in sizes:
                diskio.ftruncate(cf.fd, size)
                if self.sync != "never":
                    diskio.fsync(cf.fd)          # the cut survives a power cut: the files stay under the cap
                if cf.map is not None:
                    cf.map.cut(cf.nrecords)
            return evicted

    def _cut_largest_locked(self, capacity: int, cut: set[ClassFile]) -> int:
        """Cut the largest file's books by what the files are over `capacity` (at most all of it), adding it to
        `cut` (the caller truncates it); the evictions."""
        cf = max(self.files.values(), key=lambda f: f.size())
        n = min(cf.nrecords, -(-(self.allocated_bytes() - capacity) // cf.record))
        first = cf.nrecords - n
        victims = [key for key in cf.keys[first:] if key is not None]     # the cut records only, not the index
        for key in victims:
            self.drop_locked(key)
        del cf.keys[first:]
        cf.free = [r for r in cf.free if r < first]
        cf.holes = [r for r in cf.holes if r < first]
        cf.nrecords = first
        cut.add(cf)
        return len(victims)

    # ----- accounting -----
    def by_namespace(self) -> dict[bytes, int]:
        """Blocks per namespace digest (kept up to date: `stats` is polled, the index may hold millions)."""
        with self.lock:
            return {d: n for d, n in self.per_ns.items() if n}

    def file_bytes(self) -> int:
        return sum(cf.size() for cf in self.files.values())

    def map_bytes(self) -> int:
        """The record maps' size on disk (outside the capacity: 128 bytes a record, 1/64 of the smallest)."""
        return sum(cf.nrecords * ENTRY_BYTES + FILE_HEADER for cf in self.files.values())

    def used_bytes(self) -> int:
        return self.used

    def scan_status(self) -> dict[str, Any]:
        s = self.scan
        return {"state": s.state, "records": s.total, "scanned": s.done, "from_maps": s.from_maps,
                "seconds": s.seconds if s.state == "ready" else time.monotonic() - s.started}

    # ----- the books' primitives, for scan.py, writes.py and reads.py -----
    def class_file(self, payload: int, path: str | None = None) -> ClassFile:
        """(Under the lock.) The record file for `payload`-byte blocks, opened (created empty, and the directory
        synced) on first use, with the lock let go for the disk calls. Only one thread opens files at a time: the
        writer's batch, or the scan before the daemon serves."""
        cf = self.files.get(payload)
        if cf is None:
            opened = run_unlocked(self.lock, lambda: open_class_file(self.dir, payload, path))
            cf = self.files.setdefault(payload, opened)
            if cf is not opened:
                os.close(opened.fd)
        return cf

    def add_locked(self, key: bytes, cf: ClassFile, rec: int, seq: int) -> None:
        """Book `key` in record `rec` of `cf`, as the most recently used."""
        self.index[key] = (cf.payload, rec, seq)
        if rec >= len(cf.keys):
            cf.keys.extend([None] * (rec + 1 - len(cf.keys)))
        cf.keys[rec] = key
        tenant = self.owners.tenant(key[:16])
        self.policy.added(key, self._class(tenant, cf.payload))
        self.used += cf.record
        self.per_ns[key[:16]] += 1
        self.quotas.used[tenant] += cf.record
        self._class_records[(tenant, cf.payload)] += 1

    def drop_locked(self, key: bytes) -> tuple[int, int, int]:
        """Take `key` out of the books; its record is the caller's to free or zero."""
        where = self.index.pop(key)
        self.policy.removed(key)
        cf = self.files[where[0]]
        cf.unverified.pop(where[1], None)
        cf.keys[where[1]] = None
        self.used -= cf.record
        self.per_ns[key[:16]] -= 1
        tenant = self.owners.tenant(key[:16])
        self.quotas.used[tenant] -= cf.record
        self._class_records[(tenant, cf.payload)] -= 1
        return where

    def _class(self, tenant: str, payload: int) -> int:
        """The policy's eviction class of a tenant's records of one size: the size itself without SSD quotas (one
        order per block size, shared by every tenant), else one per (tenant, size)."""
        if not self.split:
            return payload
        cls = self._classes.get((tenant, payload))
        if cls is None:
            cls = self._classes[(tenant, payload)] = len(self._classes)
        return cls

    def owner_locked(self, digest: bytes) -> str:
        """The tenant of a digest about to be written, learnt from the daemon (and kept on disk) if new. A digest
        with records already booked as the default tenant's (written before its owner was known: a directory from
        before owners.kvo, or one whose file was lost) stays so: its records' books are not moved."""
        if digest not in self.owners.known and not self.per_ns[digest]:
            self.owners.learn(digest, self.tenant_of(digest))
        return self.owners.tenant(digest)

    def refresh(self, key: bytes) -> None:
        """A block the tier holds was stored again (demoted again, or written through again): it is refreshed in
        the eviction order, as a read refreshes it (issue 14 part 5)."""
        with self.lock:
            self.touch_locked(key)

    def touch_locked(self, key: bytes) -> None:
        """Make `key` the most recently used, if it is still booked."""
        if key in self.index:
            self.policy.accessed(key)

    def next_seq_locked(self) -> int:
        """A sequence number for a new write. Sequence numbers only order copies of one key; writes made during
        the scan must outrank any copy the scan has not reached yet, hence the clock."""
        self._seq = max(self._seq + 1, time.time_ns())
        return self._seq

    def saw_seq_locked(self, seq: int) -> None:
        """A copy with sequence number `seq` was found on disk: new writes outrank it."""
        self._seq = max(self._seq, seq)

    def evict_locked(self, cf: ClassFile, writer: str = "",
                     grow: Callable[[ClassFile], int | None] | None = None) -> int | None:
        """Make room at the cap for a record of tenant `writer`: the policy's victim among the records of this
        block size (of the tenant whose quota allows it: owners.py) is handed to the writer, which zeroes its
        header. Under SSD quotas, a writer within its quota that finds no borrower's record of this size has
        borrowers' records of other sizes punched out first (`_punch_borrowed_locked`), then takes the room with
        `grow` (the writer's free-record path). None if there is no record to take."""
        victim_tenant = writer
        if self.split:
            t = self.quotas.victim_tenant(writer, cf.record, lambda: self._holders(cf.payload),
                                          self._age(lambda tenant: (tenant, cf.payload)))
            if grow is not None and t in (None, writer) and self.quotas.within(writer, cf.record) \
                    and self._punch_borrowed_locked(cf, writer):
                return grow(cf)
            if t is None:
                self.quotas.counters["quota_blocked"] += 1
                return None
            victim_tenant = t
        key = self.policy.victim(self._class(victim_tenant, cf.payload))
        if key is None:
            return None
        self.quotas.evicted(self.owners.tenant(key[:16]), writer, cf.record)
        _, rec, _ = self.drop_locked(key)
        self.evicted.add(key)
        crash_point("mid_eviction")
        self.counters["evictions"] += 1
        return rec

    def _punch_borrowed_locked(self, cf: ClassFile, writer: str) -> bool:
        """Room for one record of `cf` within the cap, made by evicting borrowers' records of other block sizes
        (owners.py's rule: the least recently used first, none below its quota) and punching them out of their
        files (files.punch): a block size's file never shrinks, so a tenant's quota would otherwise hold only
        within the sizes it already has. False when no borrower is left to give (what was punched stays punched:
        room for the next write)."""
        while self.capacity - self.allocated_bytes() < cf.record:
            pick = self.quotas.borrower(writer, self._class_records, exclude=cf.payload,
                                        record=lambda p: self.files[p].record, age=self._age(lambda c: c))
            if pick is None:
                return False
            tenant, payload = pick
            key = self.policy.victim(self._class(tenant, payload))
            if key is None:
                return False
            other = self.files[payload]
            self.quotas.evicted(tenant, writer, other.record)
            _, rec, _ = self.drop_locked(key)
            self.counters["evictions"] += 1
            refused = run_unlocked(self.lock, partial(self._punch, other, rec))
            if refused is not None:
                log.warning("ssd: %s; the evicted record is reused in its own file instead", refused)
                self.zero_later_locked(other, rec)
                return False
            other.holes.append(rec)
            self.counters["punched"] += 1
        return True

    def punch_free_locked(self, cf: ClassFile) -> bool:
        """Room for one record of `cf` within the cap, made from the unused (free) records of other block sizes'
        files, punched out (a file never shrinks but by resize: without this, records freed by deletes in one
        size could never serve another). False if they do not make enough."""
        while self.capacity - self.allocated_bytes() < cf.record:
            other = next((f for f in self.files.values() if f is not cf and f.free), None)
            if other is None:
                return False
            rec = other.free.pop(0)                  # the end of the list the writer takes last
            refused = run_unlocked(self.lock, partial(self._punch, other, rec))
            if refused is not None:
                other.free.append(rec)
                return False
            other.holes.append(rec)
            self.counters["punched"] += 1
        return True

    @staticmethod
    def _punch(cf: ClassFile, rec: int) -> OSError | None:
        """(Without the lock.) The record's space back to the disk, and its map entry cleared."""
        refused = punch(cf, rec)
        if refused is None and cf.map is not None:
            cf.map.clear([rec])
        return refused

    def allocated_bytes(self) -> int:
        """The record files' bytes on the disk (their sizes less their holes): what the capacity bounds."""
        return sum(cf.allocated() for cf in self.files.values())

    def no_room_reason_locked(self, cf: ClassFile, tenant: str) -> str:
        """Why a write found no record: what an operator reads in the log, and what to do."""
        if not self.split:
            return "the tier is at its capacity and holds no block of this size to evict; grow ssd.capacity"
        q = self.quotas
        return (f"the tier is full and every tenant holding blocks of this size is at or below its SSD quota (tenant "
                f"{tenant!r} uses {q.used[tenant]} of {q.quota(tenant)} bytes); raise its quota (kvstore tenants set "
                "NAME --ssd SIZE) or grow ssd.capacity")

    def _age(self, cls_of: Callable[[Any], tuple[str, int]]) -> Callable[[Any], int | None] | None:
        """When a candidate's victim was last used, where the policy keeps a clock (LRU); None otherwise."""
        oldest = getattr(self.policy, "oldest_tick", None)
        if oldest is None:
            return None
        return lambda c: oldest(self._class(*cls_of(c)))

    def _holders(self, payload: int) -> list[str]:
        return [t for (t, p), n in self._class_records.items() if n > 0 and p == payload]

    def quarantine_locked(self, cf: ClassFile, rec: int, reason: str) -> None:
        """A bad record (already out of the index) is never read again: its header is zeroed (in the background)
        before its space is reused; counted as bad.<reason>."""
        self.counters[f"bad.{reason}"] += 1
        if reason != "deleted":
            log.warning("ssd: record %d of %s is bad (%s): quarantined, served as a miss", rec, cf.path, reason)
        self.zero_later_locked(cf, rec)

    def zero_later_locked(self, cf: ClassFile, rec: int) -> None:
        """A record out of the index is zeroed by a background transfer (or the next delete's flush), then
        freed (zeroing.py)."""
        self.zeroing.add_locked(cf, rec)
        self.zeroing.soon_locked()


def _nobody(digest: bytes) -> str | None:
    return None
