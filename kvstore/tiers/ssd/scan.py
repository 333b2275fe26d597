"""What a restart knows of the disk: the store's books loaded from the record maps (recmap.py) before the daemon
serves, or, where a map cannot be trusted, rebuilt from every record header while the daemon already serves.

- `start` opens every record file of the directory with its map (files.py: foreign names, temporaries and symlinks
  are skipped and counted as skipped_files; a torn tail is cut and counted as bad.torn_tail).
- **A file with a complete map** is booked from it at once, before `start` returns: every block its map names is a
  hit from the moment the daemon serves; the records it names nothing in are free. Of two entries for one key the
  newest (highest sequence number) wins, the other is quarantined. Each booked record is *unverified* until its
  header has been read: a background pass (state "validating") reads them and quarantines any whose header does
  not name the same key and copy (bad.stale_map); a read before that checks the header anyway, like every read.
- **A file without a trusted map** has its map emptied and marked building, then every header of the records the
  file held at that moment is read (state "scanning"). Each header found is booked under the store's lock: an
  empty record is free; a bad one (torn, foreign, corrupt, of another length) is quarantined; of two copies of a
  key the newest wins and the other is quarantined as superseded; a key deleted during the scan is quarantined as
  deleted wherever the scan finds it (a delete waits for such a scan, `wait`, so that this zeroing is durable
  before it is reported). A block not scanned yet is a miss. Writes made during the scan take records the scan has
  already read or has grown the files by, and outrank every copy it may still find (their sequence numbers come
  from the clock), so the scan never undoes them. At its end, with writes and zeroing held back for a moment, the
  entries of the records it found are written into the map, synced, and the map marked complete.
- Both read headers in chunks of SCAN_CHUNK, as background transfers on the store's path, at most SCAN_IN_FLIGHT
  queued at once (never filling the background lane; a read an engine waits on overtakes them). `wait=True`
  (tools, tests) returns when they are done.
- `progress(done, total)` is called as the scan passes each tenth (once, however many it passes at once) and at
  the end. A chunk whose read fails is logged, its records stay unused (or unverified) until the next start, and the
  scan goes on. `stop` (the store closing, or its path closed under the scan) ends it early in state "stopped", with
  the books holding what was found so far (a map being built stays marked building). Nothing on disk changes except
  the quarantined headers (zeroed) and the maps.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import CancelledError, Future
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

from kvstore.tiers.ssd.files import LOCK_NAME, ClassFile, aligned, cut_torn_tail, is_map_name, record_file_payload
from kvstore.tiers.ssd.owners import FILE as OWNERS_FILE
from kvstore.tiers.ssd.recmap import BUILDING, COMPLETE, ENTRY_BYTES, HEADER_FIELDS
from kvstore.tiers.ssd.record import HEADER_BYTES, BadRecord, Header, parse_header
from kvstore.traffic import Busy, Lane

if TYPE_CHECKING:
    from kvstore.tiers.ssd.store import SsdStore

log = logging.getLogger("kvstore")
SCAN_CHUNK = 256          # records whose headers one scan transfer reads
SCAN_IN_FLIGHT = 8        # scan transfers queued at once (the scan never fills the background lane)
Progress = Callable[[int, int], None]


@dataclass
class Scan:
    """Progress of the restart scan, as `stats` and the log show it."""
    state: str = "idle"         # idle → scanning (some file has no trusted map) or validating → ready (or stopped)
    total: int = 0              # records to scan or validate
    done: int = 0
    started: float = 0.0
    seconds: float = 0.0
    from_maps: int = 0          # blocks booked from the maps at start (hits from the first request)


class RestartScan:
    def __init__(self, store: SsdStore) -> None:
        self.store = store
        self.progress = Scan()
        self.closing = False
        self.deleted: set[bytes] = set()            # keys deleted before the scan found them (under store.lock)
        self.found: dict[tuple[ClassFile, int], bytes] = {}   # (file, record) → its header's fields, booked by
        #                                                        a full scan: the entries of the map it rebuilds
        self.damaged: dict[ClassFile, set[int]] = {}   # records whose map entry is damaged, header not read yet
        self.unread: set[ClassFile] = set()             # files a full scan could not read whole: map not completed
        self._thread: threading.Thread | None = None

    def start(self, progress: Progress | None, wait: bool) -> None:
        """Open the directory's record files; book those with a complete map from it, and start the thread that
        scans the others' headers and validates the maps' entries; with `wait`, until it is done."""
        started = time.monotonic()
        self._open_files()
        scan, check = {}, {}
        for cf in list(self.store.files.values()):
            assert cf.map is not None
            if cf.map.complete():
                check[cf] = cf.nrecords
            else:
                cf.map.reset(BUILDING)
                scan[cf] = cf.nrecords            # records grown from now on are not read
        from_maps = sum(self._load_map(cf) for cf in check)
        state = "scanning" if scan else "validating"
        self.progress = Scan(state, sum(scan.values()) + sum(check.values()), 0, started, from_maps=from_maps)
        if from_maps or scan:
            log.info("ssd: %s: %d blocks known from the record maps; %s", self.store.dir, from_maps,
                     f"{len(scan)} file(s) without a trusted map are scanned" if scan else "validating them")
        self._thread = threading.Thread(target=self._run, args=(scan, check, progress), name="kvstore-scan",
                                        daemon=True)
        self._thread.start()
        if wait:
            self._thread.join()

    def stop(self) -> None:
        """Submit nothing more, and return once the chunks already queued have finished."""
        self.closing = True
        if self._thread is not None and self._thread.is_alive():
            self._thread.join()

    def wait(self) -> None:
        """Return once the scan has ended (at once when none runs): every copy it found is booked or queued for
        zeroing."""
        t = self._thread
        if t is not None and t.is_alive() and t is not threading.current_thread():
            t.join()

    def note_deleted_locked(self, key: bytes) -> None:
        """(Under store.lock.) A key not in the books was deleted: while scanning, a copy found later is stale."""
        if self.unsure_locked():
            self.deleted.add(key)

    def unsure_locked(self) -> bool:
        """(Under store.lock.) Whether a copy of some key may still be found on disk that the books do not hold:
        during a full scan, or while damaged map entries are unread. A delete then waits for the scan."""
        return self.progress.state == "scanning" or (self.progress.state == "validating" and bool(self.damaged))

    # ----- the files -----
    def _open_files(self) -> None:
        s = self.store
        for name in sorted(os.listdir(s.dir)):
            if name in (LOCK_NAME, OWNERS_FILE, OWNERS_FILE + ".tmp") or is_map_name(name):
                continue
            payload = record_file_payload(s.dir, name)
            path = os.path.join(s.dir, name)
            if payload is None:
                s.counters["skipped_files"] += 1
                log.info("ssd: skipped %s (not a kvstore record file)", path)
                continue
            with s.lock:
                cf = s.class_file(payload, path)
            torn = cut_torn_tail(cf)
            if torn:     # a torn tail or appended garbage: cut back to whole records
                s.counters["bad.torn_tail"] += 1
                log.warning("ssd: %s ends with %d bytes that are not a whole record: cut", path, torn)

    # ----- the maps -----
    def _load_map(self, cf: ClassFile) -> int:
        """Book the blocks a complete map names (newest copy of a key wins), unverified; the records it names
        nothing in are free. Returns the blocks booked."""
        s = self.store
        assert cf.map is not None
        entries, damaged = cf.map.load(cf.nrecords)    # oldest first
        named = set(damaged)                            # neither free nor booked until their headers are read
        with s.lock:
            if damaged:
                self.damaged[cf] = set(damaged)
                log.warning("ssd: %d entries of %s are damaged: their records are checked before any is reused",
                            len(damaged), cf.map.path)
            for rec, key, seq in entries:
                old = s.index.get(key)
                if old is not None:                     # an older copy whose zeroing a crash cut short
                    s.drop_locked(key)
                    s.quarantine_locked(s.files[old[0]], old[1], "superseded")
                s.add_locked(key, cf, rec, seq)
                cf.unverified[rec] = key
                named.add(rec)
            if entries:
                s.saw_seq_locked(entries[-1][2])
            cf.free = [r for r in range(cf.nrecords - 1, -1, -1) if r not in named]
            return len(cf.unverified)

    def _complete_maps(self, files: list[ClassFile]) -> None:
        """After a full scan: write the entries of the records it found that are still booked there, sync, and mark
        the maps complete. Writes and zeroing wait meanwhile, so no record changes hands under an entry."""
        s = self.store
        with s.writer.batch, s.zeroing.mutex:
            with s.lock:
                todo: dict[ClassFile, list[tuple[int, bytes]]] = {cf: [] for cf in files}
                for (cf, rec), entry in self.found.items():
                    h = parse_header(entry)
                    if h is not None and s.index.get(h.ns + h.hash) == (cf.payload, rec, h.seq):
                        todo[cf].append((rec, entry))
                self.found = {}
            for cf, entries in todo.items():
                if cf.map is None or s.files.get(cf.payload) is not cf or cf in self.unread:
                    continue                    # (a file not read whole: a complete map would lose what it missed)
                try:
                    cf.map.put(entries)
                    cf.map.mark(COMPLETE)
                except OSError as e:
                    log.error("ssd: could not complete the record map %s (%s): the next start scans %s again",
                              cf.map.path, e, cf.path)

    # ----- the scan thread -----
    def _run(self, scan: dict[ClassFile, int], check: dict[ClassFile, int], report: Progress | None) -> None:
        """Queue the chunks a few at a time (full scans first: their blocks are misses until read), then wait for
        the last ones, complete the maps rebuilt, and mark the scan finished."""
        slots = threading.Semaphore(SCAN_IN_FLIGHT)
        pending: list[Future[Any]] = []
        progress = self.progress
        step, reported = max(1, progress.total // 10), 0
        chunks = [(self._scan_chunk, c) for c in _chunks(scan)] + [(self._check_chunk, c) for c in _chunks(check)]
        for fn, (cf, start, end) in chunks:
            job = self._submit(fn, cf, start, end, slots)
            if job is None:
                break
            pending = self._reap(pending, wait=False) + [job]
            if report and progress.done // step != reported // step:
                reported = progress.done
                report(progress.done, progress.total)
        self._reap(pending, wait=True)
        if scan and not self.closing:
            self._complete_maps(list(scan))
            self.store.punch_forgotten_holes()     # their free records are all booked now
        with self.store.lock:
            progress.state = "stopped" if self.closing else "ready"
            progress.seconds = time.monotonic() - progress.started
            self.deleted.clear()
            self.damaged.clear()          # (stopped early: their records stay unused until the next start)
            self.found = {}
        if report:
            report(progress.done, progress.total)

    def _reap(self, pending: list[Future[Any]], wait: bool) -> list[Future[Any]]:
        """The chunks still running (all finished, with `wait`); a failed one is logged."""
        left = []
        for f in pending:
            if not wait and not f.done():
                left.append(f)
                continue
            try:
                f.result()
            except (CancelledError, OSError) as e:
                log.error("ssd: scan of %s: a chunk of records could not be read (%s); they stay unused until the "
                          "next start", self.store.dir, e)
        return left

    def _submit(self, fn: Callable[[ClassFile, int, int], None], cf: ClassFile, start: int, end: int,
                slots: threading.Semaphore) -> Future[Any] | None:
        """Queue one chunk as a background transfer once a slot is free; None when the scan must stop."""
        while not slots.acquire(timeout=0.1):
            if self.closing:
                return None
        while not self.closing:
            try:
                return self.store.path.submit(Lane.BACKGROUND, (end - start) * HEADER_BYTES,
                                              partial(fn, cf, start, end),
                                              on_done=lambda f: slots.release())
            except Busy:
                time.sleep(0.01)
            except RuntimeError:             # the path closed under us
                self.closing = True
        return None

    def _scan_chunk(self, cf: ClassFile, start: int, end: int) -> None:
        """(A path worker.) Read the headers of records start .. end-1, then book them all under the lock. A chunk
        that cannot be read leaves its file's map incomplete: the next start scans that file again."""
        try:
            raws = _read_headers(cf, range(start, end))
        except OSError:
            with self.store.lock:
                self.unread.add(cf)
            raise
        with self.store.lock:
            for rec, raw in raws:
                self._book_header_locked(cf, rec, raw)
            self.progress.done += end - start

    def _check_chunk(self, cf: ClassFile, start: int, end: int) -> None:
        """(A path worker.) Read the headers of the unverified records among start .. end-1 and check each against
        the map's entry it was booked from: the same key and copy, or the record is quarantined. A record that left
        the books while its header was read (deleted, evicted, rewritten) is not judged: it is no longer ours."""
        s = self.store
        with s.lock:
            damaged = self.damaged.get(cf, set())
            recs = [r for r in range(start, end) if r in cf.unverified or r in damaged]
        raws = _read_headers(cf, recs)
        repaired = []
        with s.lock:
            for rec, raw in raws:
                if rec in damaged:
                    damaged.discard(rec)
                    if self._adopt_locked(cf, rec, raw):
                        repaired.append((rec, bytes(raw[:HEADER_FIELDS]).ljust(ENTRY_BYTES, b"\0")))
                    continue
                key = cf.unverified.get(rec)
                if key is None:
                    continue
                reason = _mismatch(raw, key, s.index[key][2], cf.payload)
                if reason is None:
                    del cf.unverified[rec]
                else:
                    s.drop_locked(key)
                    s.quarantine_locked(cf, rec, reason)
            self.progress.done += end - start
            if not damaged:
                self.damaged.pop(cf, None)
        if repaired and cf.map is not None:
            cf.map.put(repaired)              # synced with the next batch; until then the header is read again

    def _adopt_locked(self, cf: ClassFile, rec: int, raw: bytes) -> bool:
        """(Under store.lock.) A record whose map entry is damaged: book the block its header names (a torn or
        rotten entry must not lose a durable block), unless the header is not whole, the key was deleted since the
        start, or a newer copy is booked; else wipe it. Whether it was booked (its entry is then rewritten)."""
        s = self.store
        try:
            h = parse_header(raw)
        except BadRecord:
            h = None
        key = None if h is None else h.ns + h.hash
        old = None if key is None else s.index.get(key)
        if h is None or key is None or h.length != cf.payload or key in self.deleted or (old and old[2] >= h.seq):
            s.quarantine_locked(cf, rec, "damaged_map")
            return False
        if old is not None:
            s.drop_locked(key)
            s.quarantine_locked(s.files[old[0]], old[1], "superseded")
        s.add_locked(key, cf, rec, h.seq)
        s.saw_seq_locked(h.seq)
        s.counters["map_repaired"] += 1
        return True

    def _book_header_locked(self, cf: ClassFile, rec: int, raw: bytes) -> None:
        """(Under store.lock.) Book one record from its header: free, quarantined, or the key's newest copy."""
        s = self.store
        try:
            h = parse_header(raw)
        except BadRecord as e:
            s.quarantine_locked(cf, rec, e.reason)
            return
        if h is None:
            cf.free.append(rec)
            return
        key = h.ns + h.hash
        old = s.index.get(key)
        if h.length != cf.payload:
            s.quarantine_locked(cf, rec, "wrong_length")
        elif key in self.deleted:
            s.quarantine_locked(cf, rec, "deleted")
        elif old is not None and old[2] > h.seq:
            s.quarantine_locked(cf, rec, "superseded")
        else:
            if old is not None:
                s.drop_locked(key)
                s.quarantine_locked(s.files[old[0]], old[1], "superseded")
            s.add_locked(key, cf, rec, h.seq)
            s.saw_seq_locked(h.seq)
            self.found[(cf, rec)] = bytes(raw[:HEADER_FIELDS]).ljust(ENTRY_BYTES, b"\0")


def _read_headers(cf: ClassFile, recs: Iterable[int]) -> list[tuple[int, bytes]]:
    """(A path worker.) (record, its header's bytes) for each record."""
    raws = []
    with aligned(HEADER_BYTES) as buf:
        for rec in recs:
            n = os.preadv(cf.fd, [buf], rec * cf.record)
            raws.append((rec, bytes(buf[:n])))
    return raws


def _mismatch(raw: bytes, key: bytes, seq: int, payload: int) -> str | None:
    """Why a header does not confirm the map's entry (key, sequence number) of a record; None if it does."""
    try:
        h: Header | None = parse_header(raw)
    except BadRecord as e:
        return e.reason
    if h is None or h.ns + h.hash != key or h.seq != seq or h.length != payload:
        return "stale_map"
    return None


def _chunks(ends: dict[ClassFile, int]) -> Iterator[tuple[ClassFile, int, int]]:
    """(file, first record, end) of each chunk, file by file."""
    for cf, nrecords in ends.items():
        for start in range(0, nrecords, SCAN_CHUNK):
            yield cf, start, min(start + SCAN_CHUNK, nrecords)
