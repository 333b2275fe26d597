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
- Deletes are durable before they return (unless the sync policy is never), and a resize that shrinks the cap cuts
  the files down to it, synced (removal.py).
- `open` books what each record file's map (recmap.py) names before it returns, so every block on disk is a hit
  from the first request, then validates those records' headers in the background; a file without a trusted map
  has every header scanned while the daemon already serves (a block not scanned yet is a miss), and its map
  rebuilt. Files that are not ours (foreign names, temporaries, symlinks) are skipped. `wait=True` (tools, tests)
  returns only when the scan is done (scan.py).

This module keeps the books, under `lock`: `index` (namespace digest + block hash → (payload bytes, record, seq));
`policy` (a kvstore.policy TierPolicy: the order in which the cap evicts, per block size, or per tenant and block
size where tenants have SSD quotas: `eviction_class`); `files` (payload bytes → ClassFile, whose free records are
booked there too); bytes used and blocks per namespace, kept as the index changes; `owners` and `quotas`
(owners.py: whose each digest is, on disk, and each tenant's bytes and quota; `class_records` per tenant and block
size); `counters`. The `*_locked` methods are the books' primitives for the other parts; they expect `lock` held.
`SsdStore` is also what tools, tests and the tier call: its operations are those of its parts, each handed the
store at construction — `writer` (writes.py), `reader` (reads.py), `scanner` (scan.py), `zeroing` (zeroing.py),
`room` (room.py: eviction and punching at the cap, under SSD quotas too) and `removal` (removal.py: durable
deletes, and the cut of a resize).

A record that leaves the books otherwise than by a delete (superseded by a newer copy, quarantined) is zeroed before
its space is reused, so no block comes back after a crash, and no key comes back with an older copy's bytes.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from collections import Counter
from collections.abc import Callable, Collection, Sequence
from concurrent.futures import Future
from typing import Any

from kvstore.policy import make_tier_policy
from kvstore.tiers.ssd.config import SYNC_POLICIES
from kvstore.tiers.ssd.files import ClassFile, StoreLocked, choose_io, lock_directory, open_class_file
from kvstore.tiers.ssd.owners import Owners, SsdQuotas
from kvstore.tiers.ssd.reads import Reader
from kvstore.tiers.ssd.recmap import ENTRY_BYTES, FILE_HEADER
from kvstore.tiers.ssd.removal import Removal
from kvstore.tiers.ssd.room import Room
from kvstore.tiers.ssd.scan import RestartScan, Scan
from kvstore.tiers.ssd.writes import Item, Writer
from kvstore.tiers.ssd.zeroing import Zeroing, run_unlocked
from kvstore.traffic import Lane, Path
from kvstore.workflows import Workflows

__all__ = ["SYNC_POLICIES", "ClassFile", "SsdStore", "StoreLocked"]
log = logging.getLogger("kvstore")
Out = memoryview | bytearray


class SsdStore:
    """The books (this module), with the parts that move bytes: `writer` (writes.py), `reader` (reads.py),
    `scanner` (scan.py), `zeroing` (zeroing.py), `room` (room.py) and `removal` (removal.py), over the record files
    (files.py)."""

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
        self.class_records: Counter[tuple[str, int]] = Counter()   # records per (tenant, payload bytes)
        self.writer = Writer(self, sync, pwritev)
        self.reader = Reader(self, preadv)
        self.scanner = RestartScan(self)
        self.zeroing = Zeroing(self, pwritev)       # records out of the books, wiped before they are reused
        self.evicted: set[bytes] = set()            # keys evicted for the write batch in flight (their records
        #                                             are wiped by its payload writes, not by zeroing)
        self.room = Room(self)                      # eviction and punching at the cap
        self.removal = Removal(self)                # deletes and resize
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
        """Free records of files over the cap are punched and booked as holes (room.py): at open, and when a full
        scan ends."""
        self.room.punch_forgotten_holes()

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
                 crcs: list[int | None] | None = None,
                 on_piece: Callable[[int, int, int | None], None] | None = None) -> int:
        """Read blocks into `outs`, all in flight at once; returns the length of the prefix read and verified.
        The first miss or bad record ends the prefix (a bad one is quarantined): never a partial hit past it.
        `on_ready(n)` is called as the verified prefix grows, so a caller can hand out the first blocks while
        later ones are still on the disk; `crcs` receives each verified block's CRC-32; `on_piece(i, nbytes, crc)`
        the verified start of block i while its read is in flight (reads.py)."""
        return self.reader.get_many(ns, hashes, outs, lane, on_ready, crcs, on_piece)

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
        scan (a copy not scanned yet is wiped too). Blocks on disk calls, never under the store's lock
        (removal.py)."""
        return self.removal.delete_many(keys, lane)

    def resize(self, capacity: int) -> int:
        """Set the cap. Shrinking below the files' allocated bytes cuts records from the ends of the largest files
        (those holding blocks are evicted) and truncates them: the files never stay over the cap. Returns the
        evictions. Waits for a write batch in flight and a zeroing flush (neither may touch a record being cut); the
        files are cut and synced outside the store's lock. Refused while the restart scan runs (removal.py)."""
        return self.removal.resize(capacity)

    # ----- accounting -----
    def by_namespace(self) -> dict[bytes, int]:
        """Blocks per namespace digest (kept up to date: `stats` is polled, the index may hold millions)."""
        with self.lock:
            return {d: n for d, n in self.per_ns.items() if n}

    def file_bytes(self) -> int:
        return sum(cf.size() for cf in self.files.values())

    def allocated_bytes(self) -> int:
        """The record files' bytes on the disk (their sizes less their holes): what the capacity bounds."""
        return sum(cf.allocated() for cf in self.files.values())

    def map_bytes(self) -> int:
        """The record maps' size on disk (outside the capacity: 128 bytes a record, 1/64 of the smallest)."""
        return sum(cf.nrecords * ENTRY_BYTES + FILE_HEADER for cf in self.files.values())

    def used_bytes(self) -> int:
        return self.used

    def scan_status(self) -> dict[str, Any]:
        s = self.scan
        return {"state": s.state, "records": s.total, "scanned": s.done, "from_maps": s.from_maps,
                "seconds": s.seconds if s.state == "ready" else time.monotonic() - s.started}

    # ----- the books' primitives, for the parts (writes.py, reads.py, scan.py, room.py, removal.py) -----
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
        self.policy.added(key, self.eviction_class(tenant, cf.payload))
        self.used += cf.record
        self.per_ns[key[:16]] += 1
        self.quotas.used[tenant] += cf.record
        self.class_records[(tenant, cf.payload)] += 1

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
        self.class_records[(tenant, cf.payload)] -= 1
        return where

    def eviction_class(self, tenant: str, payload: int) -> int:
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

    # ----- room at the cap (room.py), for writes.py -----
    def evict_locked(self, cf: ClassFile, writer: str = "",
                     grow: Callable[[ClassFile], int | None] | None = None) -> int | None:
        """Make room at the cap for a record of tenant `writer` (room.py): the record taken, out of the books; None
        if there is none to take."""
        return self.room.evict_locked(cf, writer, grow)

    def punch_free_locked(self, cf: ClassFile) -> bool:
        """Room for one record of `cf` within the cap, made from other block sizes' free records (room.py)."""
        return self.room.punch_free_locked(cf)

    def no_room_reason_locked(self, cf: ClassFile, tenant: str) -> str:
        """Why a write found no record: what an operator reads in the log, and what to do (room.py)."""
        return self.room.no_room_reason_locked(cf, tenant)


def _nobody(digest: bytes) -> str | None:
    return None
