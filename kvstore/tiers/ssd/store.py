"""The SSD tier's record store: Full Blocks in preallocated files on local disk, found again after a restart.

- One file per block size (`blocks-<payload bytes>.kvs`), made of fixed-size records (ssd_format); files grow in
  steps up to the tier's capacity, which they never exceed. The directory is 0700, the files 0600, and a lock file
  makes one daemon its only owner.
- Every disk access is a transfer on the traffic manager's `ssd` path, in the caller's lane: a read an engine
  waits on (critical) overtakes demotion writes and the restart scan (background), and several transfers are in
  flight at once. The store's books (`lock`) are held only for dictionary updates, never across I/O.
- `put_many` writes payloads, syncs (policy always | batch | never), writes headers, syncs: a record is durable
  when it returns (with always or batch). A key deleted while its write is in flight is not published.
- Reads check every header field against the key asked and the payload's checksum against its bytes: a record that
  fails is a miss, quarantined (its header zeroed, its space reused) and counted by reason. No wrong byte is served.
- `open` starts a scan of every record header that rebuilds the index and the accounting while the daemon already
  serves (a block not scanned yet is a miss); files that are not ours (foreign names, temporaries, symlinks) are
  skipped. `wait=True` (tools, tests) returns only when the scan is done.
"""
from __future__ import annotations

import errno
import fcntl
import logging
import mmap
import os
import queue
import re
import stat
import threading
import time
import zlib
from collections import Counter
from collections.abc import Callable, Collection, Sequence
from concurrent.futures import CancelledError, Future
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import numpy as np

from kvstore.daemon.crash import crash_point
from kvstore.tiers.ssd.record import ALIGN, HEADER_BYTES, BadRecord, Header, check_payload, padded, parse_header
from kvstore.traffic import Busy, Lane, Path
from kvstore.traffic.path import PIECE_BYTES

log = logging.getLogger("kvstore")
FILE_RE = re.compile(r"^blocks-(\d+)\.kvs$")
SYNC_POLICIES = ("always", "batch", "never")
GROW_RECORDS = 64
SCAN_CHUNK = 256          # records whose headers one scan transfer reads
SCAN_IN_FLIGHT = 8        # scan transfers queued at once (the scan never fills the background lane)
ZERO = bytes(HEADER_BYTES)


class StoreLocked(RuntimeError):
    pass


@dataclass(eq=False)
class ClassFile:
    payload: int
    path: str
    fd: int
    direct: bool
    nrecords: int = 0
    free: list[int] = field(default_factory=list)
    spare: queue.SimpleQueue[mmap.mmap] = field(default_factory=queue.SimpleQueue)   # record buffers for I/O

    def take(self) -> mmap.mmap:
        try:
            return self.spare.get_nowait()
        except queue.Empty:
            return _aligned(self.record)

    @property
    def record(self) -> int:
        return HEADER_BYTES + padded(self.payload)


@dataclass
class Scan:
    """Progress of the restart scan, as `stats` and the log show it."""
    state: str = "idle"         # idle → scanning → ready
    total: int = 0              # records to scan
    done: int = 0
    started: float = 0.0
    seconds: float = 0.0


def _aligned(n: int) -> mmap.mmap:
    return mmap.mmap(-1, max(n, mmap.PAGESIZE))


class SsdStore:
    def __init__(self, directory: str, capacity: int, sync: str = "batch", path: Path | None = None,
                 io: str = "threads") -> None:
        if sync not in SYNC_POLICIES:
            raise ValueError(f"ssd sync policy must be one of {', '.join(SYNC_POLICIES)}, got {sync!r}")
        # Record payloads move by os.preadv/pwritev from the path's worker threads, or through an io_uring per
        # worker (tiers/uring) when asked for and the probe finds it sound; either way one transfer a worker.
        self.io = "threads"
        self._preadv: Callable[..., int] = os.preadv
        self._pwritev: Callable[..., int] = os.pwritev
        if io in ("auto", "io_uring"):
            from kvstore.tiers.ssd import uring

            if uring.available():
                self.io, self._preadv, self._pwritev = "io_uring", uring.preadv, uring.pwritev
            (log.info if self.io == "io_uring" or io == "auto" else log.warning)("ssd: %s", uring.REASON)
        self.dir = directory
        self.capacity = capacity
        self.sync = sync
        self.path = path if path is not None else Path("ssd", workers=4)   # standalone: tools and tests
        self._own_path = path is None
        self.lock = threading.Lock()         # the books below; never held across I/O
        self.files: dict[int, ClassFile] = {}
        self.index: dict[bytes, tuple[int, int, int]] = {}    # ns + hash → (payload bytes, record, seq); LRU order
        self.counters: Counter[str] = Counter()
        self.used = 0                        # bytes of the records in the index
        self.per_ns: Counter[bytes] = Counter()    # blocks per namespace digest, kept as the index changes
        self.scan = Scan()
        self._seq = 0
        self._writing: dict[bytes, int] = {}        # key → seq of its write in flight; a delete removes it
        self._deleted_in_scan: set[bytes] = set()   # deleted before the scan found them
        self._batch = threading.Lock()              # one put_many at a time; resize waits for it
        self._scan_thread: threading.Thread | None = None
        self._closing = False
        self._zeroing = 0                           # header zeroings queued; close waits for them
        self._lock_fd = -1

    # ----- opening -----
    def open(self, progress: Callable[[int, int], None] | None = None, wait: bool = True) -> "SsdStore":
        _private_dir(self.dir)
        self._lock_fd = os.open(os.path.join(self.dir, "LOCK"), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock_fd)
            raise StoreLocked(f"another kvstore daemon owns {self.dir} (its LOCK file is held); give each daemon "
                              f"its own ssd directory") from None
        for name in sorted(os.listdir(self.dir)):
            self._open_file(name)
        self.scan = Scan("scanning", sum(cf.nrecords for cf in self.files.values()), 0, time.monotonic())
        self._scan_thread = threading.Thread(target=self._scan_all, args=(progress,), name="kvstore-scan",
                                             daemon=True)
        self._scan_thread.start()
        if wait:
            self._scan_thread.join()
        return self

    def _open_file(self, name: str) -> None:
        m = FILE_RE.match(name)
        path = os.path.join(self.dir, name)
        if name == "LOCK":
            return
        if not m or not stat.S_ISREG(os.lstat(path).st_mode):
            self.counters["skipped_files"] += 1
            log.info("ssd: skipped %s (not a kvstore record file)", path)
            return
        cf = self._class_file(int(m.group(1)), path)
        size = os.fstat(cf.fd).st_size
        cf.nrecords = size // cf.record
        if size % cf.record:     # a torn tail or appended garbage: cut back to whole records
            self.counters["bad.torn_tail"] += 1
            log.warning("ssd: %s ends with %d bytes that are not a whole record: cut", path, size % cf.record)
            os.ftruncate(cf.fd, cf.nrecords * cf.record)

    def _class_file(self, payload: int, path: str | None = None) -> ClassFile:
        cf = self.files.get(payload)
        if cf is None:
            path = path or os.path.join(self.dir, f"blocks-{payload}.kvs")
            flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
            try:
                fd, direct = os.open(path, flags | os.O_DIRECT, 0o600), True
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                fd, direct = os.open(path, flags, 0o600), False   # tmpfs and friends: no O_DIRECT
            cf = self.files[payload] = ClassFile(payload, path, fd, direct)
        return cf

    def _scan_all(self, progress: Callable[[int, int], None] | None) -> None:
        """(The scan thread.) Read every record header in chunks, as background transfers a few at a time, and
        index them; the newest copy of a key wins. Requests are served meanwhile."""
        slots = threading.Semaphore(SCAN_IN_FLIGHT)
        pending: list[Future[Any]] = []
        step = max(1, self.scan.total // 10)
        for cf in list(self.files.values()):
            for start in range(0, cf.nrecords, SCAN_CHUNK):
                while not slots.acquire(timeout=0.1):
                    if self._closing:
                        break
                while not self._closing:
                    try:
                        pending.append(self.path.submit(
                            Lane.BACKGROUND, min(SCAN_CHUNK, cf.nrecords - start) * HEADER_BYTES,
                            partial(self._scan_chunk, cf, start),
                            on_done=lambda f: slots.release()))
                        break
                    except Busy:
                        time.sleep(0.01)
                    except RuntimeError:             # the path closed under us
                        self._closing = True
                before = self.scan.done
                pending = [f for f in pending if not f.done()]
                if progress and (self.scan.done // step) != (before // step):
                    progress(self.scan.done, self.scan.total)
        for f in pending:
            try:
                f.result()
            except (CancelledError, OSError) as e:
                log.error("ssd: scan of %s stopped: %s", self.dir, e)
        with self.lock:
            self.scan.state = "stopped" if self._closing else "ready"
            self.scan.seconds = time.monotonic() - self.scan.started
            self._deleted_in_scan.clear()
        if progress:
            progress(self.scan.done, self.scan.total)

    def _scan_chunk(self, cf: ClassFile, start: int) -> None:
        """(A path worker.) Read and index the headers of records start .. start+SCAN_CHUNK-1."""
        raws = []
        with _aligned(HEADER_BYTES) as buf:
            for rec in range(start, min(start + SCAN_CHUNK, cf.nrecords)):
                n = os.preadv(cf.fd, [buf], rec * cf.record)
                raws.append(buf[:n])
        with self.lock:
            for i, raw in enumerate(raws):
                self._index_header(cf, start + i, raw)
            self.scan.done += len(raws)

    def _index_header(self, cf: ClassFile, rec: int, raw: bytes) -> None:
        try:
            h = parse_header(raw)
        except BadRecord as e:
            self._quarantine_locked(cf, rec, e.reason)
            return
        if h is None or h.length != cf.payload:
            if h is not None:
                self._quarantine_locked(cf, rec, "wrong_length")
            else:
                cf.free.append(rec)
            return
        key = h.ns + h.hash
        if key in self._deleted_in_scan:
            self._quarantine_locked(cf, rec, "deleted")
            return
        old = self.index.get(key)
        if old is not None and old[2] > h.seq:
            self._quarantine_locked(cf, rec, "superseded")
            return
        if old is not None:
            self._drop(key)
            self._quarantine_locked(self.files[old[0]], old[1], "superseded")
        self._add(key, cf, rec, h.seq)
        self._seq = max(self._seq, h.seq)

    def _next_seq(self) -> int:
        """Sequence numbers only order copies of one key; writes made during the scan must outrank any copy the
        scan has not reached yet, hence the clock."""
        self._seq = max(self._seq + 1, time.time_ns())
        return self._seq

    # ----- writes -----
    def put_many(self, items: Sequence[tuple[bytes, bytes, Any]],
                 lane: Lane = Lane.BACKGROUND, cancelled: Collection[bytes] = ()) -> int:
        """Store (namespace digest, block hash, payload) records; returns how many were stored (the rest found
        no room, or were deleted while being written). Durable on return unless the sync policy is never. A key
        that appears in `cancelled` by the time its record is published (deleted upstream) is not published."""
        with self._batch:
            placed = self._place(items)
            headers: list[tuple[ClassFile, int, Header]] = []
            try:
                writes = []
                for cf, rec, key, seq, payload in placed:
                    try:
                        writes.append((cf, rec, key, seq, self.path.submit(
                            lane, cf.record, partial(self._write_payload, cf, rec, payload))))
                    except Busy as e:
                        self._unplace(cf, rec, key, str(e))
                for cf, rec, key, seq, job in writes:
                    try:
                        headers.append((cf, rec, Header(key[:16], key[16:], cf.payload, job.result(), seq)))
                    except OSError as e:
                        self._unplace(cf, rec, key, f"write_error: {e}")
                if not headers:
                    return 0
                cfs = {cf for cf, _, _ in headers}
                self.path.submit(lane, 0, lambda: self._sync(cfs, "always", "batch")).result()
                crash_point("after_payload")
                self.path.submit(lane, len(headers) * HEADER_BYTES, lambda: self._write_headers(headers)).result()
                self.path.submit(lane, 0, lambda: self._sync(cfs, "always", "batch")).result()
            except (OSError, Busy, RuntimeError) as e:      # a failed sync or header write: nothing is published
                for cf, rec, header in headers:
                    self._unplace(cf, rec, header.ns + header.hash, f"batch failed: {e}")
                return 0
            return self._publish(headers, cancelled)

    def _place(self, items: Sequence[tuple[bytes, bytes, Any]]) -> list[tuple[Any, ...]]:
        placed = []
        with self.lock:
            for ns, h, payload in items:
                cf = self._class_file(len(payload))
                rec = self._free_record(cf)
                if rec is None:
                    rec = self._evict_one(cf)
                if rec is None:
                    self.counters["full"] += 1
                    continue
                seq = self._writing[ns + h] = self._next_seq()
                placed.append((cf, rec, ns + h, seq, payload))
        return placed

    def _unplace(self, cf: ClassFile, rec: int, key: bytes, why: str) -> None:
        log.error("ssd: writing a record to %s failed (%s); the block is not stored", cf.path, why)
        with self.lock:
            self.counters["write_errors"] += 1
            self._writing.pop(key, None)
            cf.free.append(rec)

    def _publish(self, headers: list[tuple[ClassFile, int, Header]], cancelled: Collection[bytes]) -> int:
        stored = 0
        with self.lock:
            for cf, rec, header in headers:
                key = header.ns + header.hash
                if self._writing.get(key) != header.seq or key in cancelled:   # deleted while being written
                    self._writing.pop(key, None)
                    self._zero_later(cf, rec)
                    continue
                del self._writing[key]
                old = self.index.get(key)
                if old is not None:
                    self._drop(key)
                    self.files[old[0]].free.append(old[1])
                self._add(key, cf, rec, header.seq)
                stored += 1
            self.counters["writes"] += stored
        return stored

    def _write_payload(self, cf: ClassFile, rec: int, payload: Any) -> int:
        """(A path worker.) Write one payload; returns its CRC-32. The record's old header (an evicted block's,
        or a stale copy's) is zeroed first, in the same sync: a crash can leave an empty record, never an old
        header over new bytes."""
        if _aligned_for_io(payload):       # a host slot or an aligned staged copy: written from where it is
            self._write_in_pieces(cf, rec, payload)
            return zlib.crc32(payload)
        buf = cf.take()
        try:
            end = HEADER_BYTES + padded(len(payload))
            buf[:HEADER_BYTES] = ZERO
            buf[HEADER_BYTES:HEADER_BYTES + len(payload)] = payload
            with memoryview(buf) as mv, mv[:end] as part, mv[HEADER_BYTES:HEADER_BYTES + len(payload)] as body:
                crc = zlib.crc32(body)
                self._pwritev(cf.fd, [part], rec * cf.record)       # zero header + payload: one write
            return crc
        finally:
            cf.spare.put(buf)

    def _write_in_pieces(self, cf: ClassFile, rec: int, payload: Any) -> None:
        """(A path worker.) The zeroed header and the payload, piece by piece (PIECE_BYTES): between pieces a
        lower-lane write yields the device to critical reads (Path.checkpoint)."""
        at = rec * cf.record
        with memoryview(payload) as mv:
            for i in range(0, len(mv), PIECE_BYTES):
                if i:
                    self.path.checkpoint()
                with mv[i:i + PIECE_BYTES] as part:
                    if i == 0:
                        self._pwritev(cf.fd, [ZERO_BUF, part], at)
                    else:
                        self._pwritev(cf.fd, [part], at + HEADER_BYTES + i)

    def _read_in_pieces(self, cf: ClassFile, rec: int, head: memoryview, out: Any) -> int:
        """(A path worker.) Header and payload straight into `out`, piece by piece, yielding to critical reads
        between pieces when this is a lower-lane read; returns the bytes read (short at the end of the file)."""
        at = rec * cf.record
        n = 0
        with memoryview(out) as o:
            for i in range(0, len(o), PIECE_BYTES):
                if i:
                    self.path.checkpoint()
                with o[i:i + PIECE_BYTES] as part:
                    bufs = [head, part] if i == 0 else [part]
                    want = sum(len(b) for b in bufs)
                    got = self._preadv(cf.fd, bufs, at + (0 if i == 0 else HEADER_BYTES + i))
                n += got
                if got < want:
                    break
        return n

    def _write_headers(self, headers: list[tuple[ClassFile, int, Header]]) -> None:
        """(A path worker.) Each header through one aligned buffer (O_DIRECT needs aligned memory and offsets)."""
        with _aligned(HEADER_BYTES) as buf:
            for i, (cf, rec, header) in enumerate(headers):
                buf[:] = header.pack()
                os.pwritev(cf.fd, [buf], rec * cf.record)
                if i == len(headers) // 2:
                    crash_point("mid_header")

    def _sync(self, cfs: set[ClassFile], *policies: str) -> None:
        if self.sync in policies:
            self.path.checkpoint()          # a flush of the device's cache would stall a critical read
            for cf in cfs:
                os.fdatasync(cf.fd)

    def _evict_one(self, cf: ClassFile) -> int | None:
        """(Under the lock.) Make room at the cap: the least recently used record of this block size (the index
        is kept in use order: reads move a key to its end) is handed to the writer, which zeroes its header."""
        for key, (payload, rec, _) in self.index.items():
            if payload == cf.payload:
                self._drop(key)
                crash_point("mid_eviction")
                self.counters["evictions"] += 1
                return rec
        return None

    def _free_record(self, cf: ClassFile) -> int | None:
        if not cf.free:
            grow = min(GROW_RECORDS, (self.capacity - self.file_bytes()) // cf.record)
            if grow <= 0 or not self._grow(cf, grow):
                return None
            cf.free.extend(range(cf.nrecords + grow - 1, cf.nrecords - 1, -1))
            cf.nrecords += grow
        return cf.free.pop()

    def _grow(self, cf: ClassFile, records: int) -> bool:
        """(Under the lock.) Allocate `records` more records at the end of the file: really allocated
        (posix_fallocate, not a sparse ftruncate), so writes into them are plain overwrites and a full disk shows
        here, as a clean "no room", never as a failed write later. False when the file system refuses."""
        start, n = cf.nrecords * cf.record, records * cf.record
        try:
            os.posix_fallocate(cf.fd, start, n)
            return True
        except OSError as e:
            if e.errno in (errno.EOPNOTSUPP, errno.EINVAL):     # no fallocate here: a sparse file will do
                os.ftruncate(cf.fd, start + n)
                return True
            if e.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
                raise
            try:
                os.ftruncate(cf.fd, start)                    # nothing half-allocated stays past our records
            except OSError:
                pass
            self.counters["disk_full"] += 1
            if self.counters["disk_full"] == 1 or self.counters["disk_full"] % 1000 == 0:
                log.error("ssd: the file system refused %d more bytes for %s (%s): the tier stays at %d bytes, "
                          "evicting within them; free space there or lower ssd.capacity", n, cf.path,
                          os.strerror(e.errno), self.file_bytes())
            return False

    def _drop(self, key: bytes) -> tuple[int, int, int]:
        where = self.index.pop(key)
        self.used -= self.files[where[0]].record
        self.per_ns[key[:16]] -= 1
        return where

    def _add(self, key: bytes, cf: ClassFile, rec: int, seq: int) -> None:
        self.index[key] = (cf.payload, rec, seq)
        self.used += cf.record
        self.per_ns[key[:16]] += 1

    # ----- reads -----
    def has(self, key: bytes) -> bool:
        return key in self.index

    def get(self, ns: bytes, h: bytes, out: memoryview | bytearray, lane: Lane = Lane.CRITICAL) -> bool:
        """Read the block into `out` (len = payload bytes); False on a miss, with bad records quarantined."""
        return self.get_many(ns, [h], [out], lane) == 1

    def get_many(self, ns: bytes, hashes: Sequence[bytes], outs: Sequence[memoryview | bytearray],
                 lane: Lane = Lane.CRITICAL, on_ready: Callable[[int], None] | None = None,
                 crcs: list[int | None] | None = None) -> int:
        """Read blocks into `outs`, all in flight at once; returns the length of the prefix read and verified.
        The first miss or bad record ends the prefix (a bad one is quarantined): never a partial hit past it.
        `on_ready(n)` is called as the verified prefix grows, so a caller can hand out the first blocks while
        later ones are still on the disk; `crcs` receives each verified block's CRC-32."""
        jobs = []
        for h, out in zip(hashes, outs):
            job = self.read_async(ns + h, out, lane)
            if job is None:
                break
            jobs.append(job)
        n = 0
        try:
            while n < len(jobs):
                if not _ok(jobs[n], crcs):
                    break
                n += 1
                while n < len(jobs) and jobs[n].done() and _ok(jobs[n], crcs):
                    n += 1                                      # hand out what has landed, in one go
                if on_ready is not None:
                    on_ready(n)
        finally:
            for job in jobs[n:]:
                if not job.cancel():
                    _ok(job, None)      # let every read finish before the caller reuses its buffers
        with self.lock:                 # the head of the prefix the most recent: the disk cap takes tails first
            for h in reversed(hashes[:n]):
                if ns + h in self.index:
                    self.index[ns + h] = self.index.pop(ns + h)
        return n

    def read_async(self, key: bytes, out: memoryview | bytearray, lane: Lane,
                   on_done: Callable[[Future[Any]], None] | None = None) -> Future[Any] | None:
        """Submit a verified read of one block into `out`; None (counted) when the store does not hold it with
        that size. The future's result is the block's CRC-32, or False for a bad record (quarantined); Busy if the
        lane is full."""
        with self.lock:
            where = self.index.get(key)
            if where is None or where[0] != len(out):
                self.counters["misses" if where is None else "wrong_geometry"] += 1
                return None
            cf = self.files[where[0]]
        return self.path.submit(lane, cf.record, lambda: self.read_into(key, cf, where[1], out), tag=key,
                                on_done=on_done)

    def read_into(self, key: bytes, cf: ClassFile, rec: int, out: memoryview | bytearray) -> int | bool:
        """(A path worker.) Read one record, check it against the key and its checksum, and put the payload in
        `out`: straight into it when it is aligned for O_DIRECT (a host slot of a whole number of pages), else
        through an aligned buffer. On a failed check `out` holds garbage, and the caller does not publish it."""
        buf = cf.take()
        try:
            with memoryview(buf) as mv:
                direct = _aligned_for_io(out)
                if direct:
                    with mv[:HEADER_BYTES] as head:
                        n = self._read_in_pieces(cf, rec, head, out)
                    got = n - HEADER_BYTES
                else:
                    n = self._preadv(cf.fd, [mv], rec * cf.record)
                header = parse_header(bytes(mv[:min(n, HEADER_BYTES)]))
                if header is None or header.ns + header.hash != key or header.length != len(out):
                    raise BadRecord("key_mismatch", "the record holds another block")
                if direct:
                    with memoryview(out) as o, o[:max(got, 0)] as payload:
                        check_payload(header, payload)
                else:
                    with mv[HEADER_BYTES:n] as payload:
                        check_payload(header, payload)
                        out[:] = payload[:header.length]
        except BadRecord as e:
            with self.lock:
                if self.index.get(key, (0, -1))[1] == rec:    # not evicted or rewritten while we read
                    self._drop(key)
                    self._quarantine_locked(cf, rec, e.reason)
            return False
        finally:
            cf.spare.put(buf)
        with self.lock:
            if key in self.index:
                self.index[key] = self.index.pop(key)          # most recently used
            self.counters["hits"] += 1
        return header.crc                 # verified: the host slot may carry it on

    # ----- deletes and bad records -----
    def delete(self, ns: bytes, h: bytes) -> bool:
        """Forget the block; its header is zeroed (a background transfer) before its record is reused, so a
        deleted block never comes back after a restart. A write in flight for it is not published."""
        key = ns + h
        with self.lock:
            writing = self._writing.pop(key, None) is not None
            where = self.index.get(key)
            if where is not None:
                self._drop(key)
                self._zero_later(self.files[where[0]], where[1])
            elif self.scan.state == "scanning":
                self._deleted_in_scan.add(key)
        return where is not None or writing

    def _zero_later(self, cf: ClassFile, rec: int) -> None:
        """(Under the lock.) Zero a record's header in the background, then free the record."""
        def zero() -> None:
            with self.lock:
                if rec < cf.nrecords:                           # not cut by a shrink meanwhile
                    os.pwritev(cf.fd, [ZERO_BUF], rec * cf.record)
                    cf.free.append(rec)

        def zeroed(f: Future[Any]) -> None:
            with self.lock:
                self._zeroing -= 1
        try:
            self.path.submit(Lane.BACKGROUND, HEADER_BYTES, zero, on_done=zeroed)
            self._zeroing += 1
        except (Busy, RuntimeError):
            if rec < cf.nrecords:
                os.pwritev(cf.fd, [ZERO_BUF], rec * cf.record)
                cf.free.append(rec)

    def _quarantine_locked(self, cf: ClassFile, rec: int, reason: str) -> None:
        """A bad record is never read again: its header is zeroed and its space reused."""
        self.counters[f"bad.{reason}"] += 1
        if reason != "deleted":
            log.warning("ssd: record %d of %s is bad (%s): quarantined, served as a miss", rec, cf.path, reason)
        self._zero_later(cf, rec)

    def verify(self, fix: bool = False) -> list[tuple[str, int, str]]:
        """Read every indexed record whole and check it: (file, record, reason) of each bad one. With `fix`, bad
        records are quarantined; without, nothing on disk changes. An offline tool: reads in this thread."""
        bad = []
        for key, (payload, rec, _) in list(self.index.items()):
            cf = self.files[payload]
            with _aligned(cf.record) as buf, memoryview(buf) as mv:
                n = os.preadv(cf.fd, [mv], rec * cf.record)
                try:
                    header = parse_header(bytes(mv[:min(n, HEADER_BYTES)]))
                    if header is None or header.ns + header.hash != key:
                        raise BadRecord("key_mismatch", "the record holds another block")
                    with mv[HEADER_BYTES:n] as body:
                        check_payload(header, body)
                except BadRecord as e:
                    bad.append((cf.path, rec, e.reason))
            if fix and bad and bad[-1][:2] == (cf.path, rec):
                with self.lock:
                    self._drop(key)
                    self._quarantine_locked(cf, rec, bad[-1][2])
        return bad

    def resize(self, capacity: int) -> int:
        """Set the cap. Shrinking below the files' size cuts records from the ends of the largest files (those
        holding blocks are evicted) and truncates them: the files never stay over the cap. Returns the evictions.
        Waits for a write batch in flight; refused while the restart scan runs."""
        with self._batch, self.lock:
            if self.scan.state == "scanning":
                raise RuntimeError(f"the SSD tier is still scanning ({self.scan.done} of {self.scan.total} "
                                   "records); resize it when the scan is done")
            self.capacity = capacity
            evicted = 0
            while self.file_bytes() > capacity:
                cf = max(self.files.values(), key=lambda f: f.nrecords * f.record)
                over = self.file_bytes() - capacity
                cut = min(cf.nrecords, -(-over // cf.record))
                first = cf.nrecords - cut
                for key, (payload, rec, _) in list(self.index.items()):
                    if payload == cf.payload and rec >= first:
                        self._drop(key)
                        evicted += 1
                cf.free = [r for r in cf.free if r < first]
                cf.nrecords = first
                os.ftruncate(cf.fd, cf.nrecords * cf.record)
            self.counters["evictions"] += evicted
            return evicted

    # ----- accounting -----
    def by_namespace(self) -> dict[bytes, int]:
        """Blocks per namespace digest (kept up to date: `stats` is polled, the index may hold millions)."""
        with self.lock:
            return {d: n for d, n in self.per_ns.items() if n}

    def file_bytes(self) -> int:
        return sum(cf.nrecords * cf.record for cf in self.files.values())

    def used_bytes(self) -> int:
        return self.used

    def scan_status(self) -> dict[str, Any]:
        s = self.scan
        return {"state": s.state, "records": s.total, "scanned": s.done,
                "seconds": s.seconds if s.state == "ready" else time.monotonic() - s.started}

    def close(self) -> None:
        self._closing = True             # a scan in progress stops submitting and finishes what it queued
        if self._scan_thread is not None and self._scan_thread.is_alive():
            self._scan_thread.join()
        deadline = time.monotonic() + 10
        while self._zeroing and time.monotonic() < deadline:     # deleted blocks stay deleted after a restart
            time.sleep(0.005)
        if self._own_path:
            self.path.close()
        for cf in self.files.values():
            os.close(cf.fd)
        self.files.clear()
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1


ZERO_BUF = _aligned(HEADER_BYTES)          # all zeros, aligned: the header of a deleted or bad record


def _aligned_for_io(buf: Any) -> bool:
    """Whether O_DIRECT can move `buf` as it is: its address and length on 4 KiB boundaries."""
    if len(buf) % ALIGN:
        return False
    try:
        return int(np.frombuffer(buf, np.uint8).ctypes.data) % ALIGN == 0
    except (TypeError, ValueError):
        return False


def _ok(job: Future[Any], crcs: list[int | None] | None) -> bool:
    """A read's outcome: True for a verified block, whose CRC-32 (None if unknown) goes to `crcs`; a bad, failed or
    cancelled read is a miss."""
    try:
        r = job.result()
        if r is False:
            return False
        if crcs is not None:
            crcs.append(None if r is None or r is True else int(r))
        return True
    except (CancelledError, OSError) as e:
        if isinstance(e, OSError):
            log.error("ssd: read failed: %s", e)
        return False


def _private_dir(path: str) -> None:
    """Create the directory 0700, or check that it is ours, private, and not a symlink."""
    os.makedirs(path, mode=0o700, exist_ok=True)
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise NotADirectoryError(f"ssd directory {path} is a symlink or not a directory; refusing to follow it")
    if st.st_uid != os.getuid():
        raise PermissionError(f"ssd directory {path} belongs to uid {st.st_uid}, not to us")
    if stat.S_IMODE(st.st_mode) & 0o077:
        os.chmod(path, 0o700)
