"""The SSD tier's record store: Full Blocks in preallocated files on local disk, found again after a restart.

- One file per block size (`blocks-<payload bytes>.kvs`), made of fixed-size records (ssd_format); files grow in
  steps up to the tier's capacity, which they never exceed. The directory is 0700, the files 0600, and a lock file
  makes one daemon its only owner.
- `put_many` writes payloads, syncs (policy always | batch | never), writes headers, syncs: a record is durable
  when it returns (with always or batch). Records are read back with O_DIRECT where the file system allows it.
- `get` checks every header field against the key asked and the payload's checksum against its bytes: a record that
  fails is a miss, quarantined (its header zeroed, its space reused) and counted by reason. No wrong byte is served.
- `open` scans the headers of every record to rebuild the index and the accounting; files that are not ours
  (foreign names, temporaries, symlinks) are skipped.

This is the store alone; demotion from the host pool, promotion and prefetch through the traffic lanes come next.
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
import zlib
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from kvstore.crash import crash_point
from kvstore.tiers.ssd_format import HEADER_BYTES, BadRecord, Header, check_payload, padded, parse_header

log = logging.getLogger("kvstore")
FILE_RE = re.compile(r"^blocks-(\d+)\.kvs$")
SYNC_POLICIES = ("always", "batch", "never")
GROW_RECORDS = 64
SCAN_CHUNK = 256          # records whose headers one scan task reads
SCAN_THREADS = 16


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
    buf: mmap.mmap = field(default_factory=lambda: _aligned(0))   # one record, aligned for O_DIRECT
    spare: queue.SimpleQueue[mmap.mmap] = field(default_factory=queue.SimpleQueue)   # for the I/O threads

    def take(self) -> mmap.mmap:
        try:
            return self.spare.get_nowait()
        except queue.Empty:
            return _aligned(self.record)

    @property
    def record(self) -> int:
        return HEADER_BYTES + padded(self.payload)


def _aligned(n: int) -> mmap.mmap:
    return mmap.mmap(-1, max(n, mmap.PAGESIZE))


class SsdStore:
    def __init__(self, directory: str, capacity: int, sync: str = "batch", io_depth: int = 4) -> None:
        if sync not in SYNC_POLICIES:
            raise ValueError(f"ssd sync policy must be one of {', '.join(SYNC_POLICIES)}, got {sync!r}")
        self.dir = directory
        self.capacity = capacity
        self.sync = sync
        self.files: dict[int, ClassFile] = {}
        self.index: dict[bytes, tuple[int, int, int]] = {}    # ns + hash → (payload bytes, record, seq)
        self.counters: Counter[str] = Counter()
        self.seq = 0
        self._lock_fd = -1
        # I/O and CRC-32 release the GIL: a few threads keep the disk and the checksum busy at once
        self._io = ThreadPoolExecutor(io_depth, thread_name_prefix="kvstore-ssd")

    # ----- opening -----
    def open(self, progress: Callable[[int, int], None] | None = None) -> "SsdStore":
        _private_dir(self.dir)
        self._lock_fd = os.open(os.path.join(self.dir, "LOCK"), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock_fd)
            raise StoreLocked(f"another kvstore daemon owns {self.dir} (its LOCK file is held); give each daemon "
                              f"its own ssd directory") from None
        names = sorted(os.listdir(self.dir))
        for i, name in enumerate(names):
            self._open_file(name)
            if progress:
                progress(i + 1, len(names))
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
        self._scan(cf)

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
            cf.buf = _aligned(cf.record)
        return cf

    def _scan(self, cf: ClassFile) -> None:
        """Rebuild the index from every record header; the newest copy of a key wins. Headers are read by many
        threads at once (a 4 KiB O_DIRECT read waits on the device, not the CPU), parsed here in record order."""
        chunks = range(0, cf.nrecords, SCAN_CHUNK)
        with ThreadPoolExecutor(SCAN_THREADS, thread_name_prefix="kvstore-scan") as pool:
            for start, headers in zip(chunks, pool.map(lambda s: _read_headers(cf, s), chunks)):
                for i, raw in enumerate(headers):
                    self._index_header(cf, start + i, raw)

    def _index_header(self, cf: ClassFile, rec: int, raw: bytes) -> None:
        try:
            h = parse_header(raw)
        except BadRecord as e:
            self._quarantine(cf, rec, e.reason)
            return
        if h is None or h.length != cf.payload:
            if h is not None:
                self._quarantine(cf, rec, "wrong_length")
            else:
                cf.free.append(rec)
            return
        key = h.ns + h.hash
        old = self.index.get(key)
        if old is not None and old[2] > h.seq:
            self._quarantine(cf, rec, "superseded")
            return
        if old is not None:
            self._quarantine(self.files[old[0]], old[1], "superseded")
        self.index[key] = (cf.payload, rec, h.seq)
        self.seq = max(self.seq, h.seq)

    # ----- writes -----
    def put_many(self, items: Sequence[tuple[bytes, bytes, bytes | memoryview]]) -> int:
        """Store (namespace digest, block hash, payload) records; returns how many were stored (the rest found
        no room). Durable on return unless the sync policy is never."""
        jobs = []
        for ns, h, payload in items:
            cf = self._class_file(len(payload))
            rec = self._free_record(cf)
            if rec is None and self._evict_one(cf):
                rec = self._free_record(cf)
            if rec is None:
                self.counters["full"] += 1
                continue
            self.seq += 1
            jobs.append((cf, rec, ns, h, self.seq, self._io.submit(self._write_payload, cf, rec, payload)))
        placed = [(cf, rec, Header(ns, h, cf.payload, job.result(), seq)) for cf, rec, ns, h, seq, job in jobs]
        self._sync({cf for cf, _, _ in placed}, "always", "batch")
        crash_point("after_payload")
        for i, (cf, rec, header) in enumerate(placed):
            self._write(cf, rec * cf.record, header.pack())
            if i == len(placed) // 2:
                crash_point("mid_header")
        self._sync({cf for cf, _, _ in placed}, "always", "batch")
        for cf, rec, header in placed:
            key = header.ns + header.hash
            old = self.index.get(key)
            if old is not None:
                self._release(self.files[old[0]], old[1])
            self.index[key] = (cf.payload, rec, header.seq)
        self.counters["writes"] += len(placed)
        return len(placed)

    def _write_payload(self, cf: ClassFile, rec: int, payload: bytes | memoryview) -> int:
        """(An I/O thread.) Write one payload; returns its CRC-32."""
        buf = cf.take()
        try:
            n = padded(len(payload))
            buf[:len(payload)] = payload
            crc = zlib.crc32(buf[:len(payload)])
            with memoryview(buf) as mv, mv[:n] as part:
                os.pwritev(cf.fd, [part], rec * cf.record + HEADER_BYTES)
            return crc
        finally:
            cf.spare.put(buf)

    def _write(self, cf: ClassFile, offset: int, data: bytes | memoryview) -> None:
        """Write through the class's aligned buffer (O_DIRECT needs aligned memory, offsets and lengths)."""
        n = padded(len(data))
        cf.buf[:len(data)] = data
        cf.buf[len(data):n] = bytes(n - len(data))
        with memoryview(cf.buf) as mv, mv[:n] as part:
            os.pwritev(cf.fd, [part], offset)

    def _sync(self, cfs: set[ClassFile], *policies: str) -> None:
        if self.sync in policies:
            for cf in cfs:
                os.fdatasync(cf.fd)

    def _evict_one(self, cf: ClassFile) -> bool:
        """Make room at the cap: drop the least recently used record of this block size (the index is kept in
        use order: reads move a key to its end)."""
        for key, (payload, rec, _) in self.index.items():
            if payload == cf.payload:
                del self.index[key]
                crash_point("mid_eviction")
                self._release(cf, rec)
                self.counters["evictions"] += 1
                return True
        return False

    def _free_record(self, cf: ClassFile) -> int | None:
        if not cf.free:
            grow = min(GROW_RECORDS, (self.capacity - self.file_bytes()) // cf.record)
            if grow <= 0:
                return None
            os.ftruncate(cf.fd, (cf.nrecords + grow) * cf.record)
            cf.free.extend(range(cf.nrecords + grow - 1, cf.nrecords - 1, -1))
            cf.nrecords += grow
        return cf.free.pop()

    # ----- reads -----
    def get(self, ns: bytes, h: bytes, out: memoryview | bytearray) -> bool:
        """Read the block into `out` (len = payload bytes); False on a miss, with bad records quarantined."""
        return self.get_many(ns, [h], [out]) == 1

    def get_many(self, ns: bytes, hashes: Sequence[bytes], outs: Sequence[memoryview | bytearray]) -> int:
        """Read blocks into `outs`, several in flight; returns the length of the prefix read and verified. The
        first miss or bad record ends the prefix (a bad one is quarantined): never a partial hit past it."""
        jobs = []
        for h, out in zip(hashes, outs):
            where = self.index.get(ns + h)
            if where is None or where[0] != len(out):
                self.counters["misses" if where is None else "wrong_geometry"] += 1
                break
            cf = self.files[where[0]]
            jobs.append((h, cf, where[1], self._io.submit(self._read_payload, cf, where[1], ns, h, out)))
        n = 0
        for h, cf, rec, job in jobs:
            try:
                job.result()
            except BadRecord as e:
                if self.index.get(ns + h, (0, -1))[1] == rec:
                    del self.index[ns + h]
                    self._quarantine(cf, rec, e.reason)
                break
            n += 1
            self.index[ns + h] = self.index.pop(ns + h)      # most recently used
        for _, _, _, job in jobs[n:]:
            job.exception()                 # let every read finish before the caller reuses its buffers
        self.counters["hits"] += n
        return n

    def _read_payload(self, cf: ClassFile, rec: int, ns: bytes, h: bytes, out: memoryview | bytearray) -> None:
        """(An I/O thread.) Read one record, check it against the key and its checksum, copy the payload out."""
        buf = cf.take()
        try:
            with memoryview(buf) as mv:
                n = os.preadv(cf.fd, [mv], rec * cf.record)
                header = parse_header(bytes(mv[:min(n, HEADER_BYTES)]))
                if header is None or header.ns != ns or header.hash != h or header.length != len(out):
                    raise BadRecord("key_mismatch", "the record holds another block")
                with mv[HEADER_BYTES:n] as payload:
                    check_payload(header, payload)
                    out[:] = payload[:header.length]
        finally:
            cf.spare.put(buf)

    def delete(self, ns: bytes, h: bytes) -> bool:
        where = self.index.pop(ns + h, None)
        if where is not None:
            self._release(self.files[where[0]], where[1])
        return where is not None

    def _release(self, cf: ClassFile, rec: int) -> None:
        self._write(cf, rec * cf.record, bytes(HEADER_BYTES))
        cf.free.append(rec)

    def _quarantine(self, cf: ClassFile, rec: int, reason: str) -> None:
        """A bad record is never read again: its header is zeroed and its space reused."""
        self.counters[f"bad.{reason}"] += 1
        log.warning("ssd: record %d of %s is bad (%s): quarantined, served as a miss", rec, cf.path, reason)
        self._release(cf, rec)

    def verify(self, fix: bool = False) -> list[tuple[str, int, str]]:
        """Read every indexed record whole and check it: (file, record, reason) of each bad one. With `fix`, bad
        records are quarantined; without, nothing on disk changes."""
        bad = []
        for key, (payload, rec, _) in list(self.index.items()):
            cf = self.files[payload]
            with memoryview(cf.buf) as mv:
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
                del self.index[key]
                self._quarantine(cf, rec, bad[-1][2])
        return bad

    def resize(self, capacity: int) -> int:
        """Set the cap. Shrinking below the files' size cuts records from the ends of the largest files (those
        holding blocks are evicted) and truncates them: the files never stay over the cap. Returns the evictions."""
        self.capacity = capacity
        evicted = 0
        while self.file_bytes() > capacity:
            cf = max(self.files.values(), key=lambda f: f.nrecords * f.record)
            over = self.file_bytes() - capacity
            cut = min(cf.nrecords, -(-over // cf.record))
            tail = set(range(cf.nrecords - cut, cf.nrecords))
            for key, (payload, rec, _) in list(self.index.items()):
                if payload == cf.payload and rec in tail:
                    del self.index[key]
                    evicted += 1
            cf.free = [r for r in cf.free if r not in tail]
            cf.nrecords -= cut
            os.ftruncate(cf.fd, cf.nrecords * cf.record)
        self.counters["evictions"] += evicted
        return evicted

    def by_namespace(self) -> dict[bytes, int]:
        """Blocks per namespace digest."""
        out: Counter[bytes] = Counter()
        for key in self.index:
            out[key[:16]] += 1
        return dict(out)

    # ----- accounting -----
    def file_bytes(self) -> int:
        return sum(cf.nrecords * cf.record for cf in self.files.values())

    def used_bytes(self) -> int:
        return sum(self.files[p].record for p, _, _ in self.index.values())

    def close(self) -> None:
        self._io.shutdown(wait=True)
        for cf in self.files.values():
            os.close(cf.fd)
            cf.buf.close()
        self.files.clear()
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1


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


def _read_headers(cf: ClassFile, start: int) -> list[bytes]:
    """(A scan thread.) The raw headers of records start .. start+SCAN_CHUNK-1."""
    buf = _aligned(HEADER_BYTES)
    try:
        out = []
        for rec in range(start, min(start + SCAN_CHUNK, cf.nrecords)):
            n = os.preadv(cf.fd, [buf], rec * cf.record)
            out.append(buf[:n])
        return out
    finally:
        buf.close()
