"""The restart scan: the store's books rebuilt from the record headers on disk, while the daemon already serves.

- `start` opens every record file of the directory (files.py: foreign names, temporaries and symlinks are skipped
  and counted as skipped_files; a torn tail is cut and counted as bad.torn_tail), then reads every header of the
  records the files held at that moment, in chunks of SCAN_CHUNK, as background transfers on the store's path, at
  most SCAN_IN_FLIGHT queued at once (the scan never fills the background lane; a read an engine waits on
  overtakes it). `wait=True` (tools, tests) returns when the scan is done.
- Each header found is booked under the store's lock: an empty record is free; a bad one (torn, foreign, corrupt,
  of another length) is quarantined; of two copies of a key the newest (highest sequence number) wins and the other
  is quarantined as superseded; a key deleted during the scan is quarantined as deleted wherever the scan finds
  it (the delete waits for the scan, `wait`, so that this zeroing is durable before it is reported).
- Requests are served meanwhile: a block not scanned yet is a miss. Writes made during the scan take records the
  scan has already read or has grown the files by, and outrank every copy it may still find (their sequence
  numbers come from the clock), so the scan never undoes them.
- `progress(done, total)` is called as the scan passes each tenth (once, however many it passes at once) and at
  the end. A chunk whose read fails is logged, its records stay unused until the next start, and the scan goes
  on. `stop` (the store closing, or its path closed under the scan) ends it early in state "stopped", with the
  books holding what was scanned so far. Nothing on disk changes except the quarantined headers (zeroed).
"""
from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import CancelledError, Future
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

from kvstore.tiers.ssd.files import LOCK_NAME, ClassFile, aligned, cut_torn_tail, record_file_payload
from kvstore.tiers.ssd.record import HEADER_BYTES, BadRecord, parse_header
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
    state: str = "idle"         # idle → scanning → ready (or stopped)
    total: int = 0              # records to scan
    done: int = 0
    started: float = 0.0
    seconds: float = 0.0


class RestartScan:
    def __init__(self, store: SsdStore) -> None:
        self.store = store
        self.progress = Scan()
        self.closing = False
        self.deleted: set[bytes] = set()            # keys deleted before the scan found them (under store.lock)
        self._thread: threading.Thread | None = None

    def start(self, progress: Progress | None, wait: bool) -> None:
        """Open the directory's record files and scan their headers in a thread; with `wait`, until done."""
        self._open_files()
        ends = {cf: cf.nrecords for cf in self.store.files.values()}    # records grown from now on are not read
        self.progress = Scan("scanning", sum(ends.values()), 0, time.monotonic())
        self._thread = threading.Thread(target=self._run, args=(ends, progress), name="kvstore-scan", daemon=True)
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
        if self.progress.state == "scanning":
            self.deleted.add(key)

    # ----- the files -----
    def _open_files(self) -> None:
        s = self.store
        for name in sorted(os.listdir(s.dir)):
            if name == LOCK_NAME:
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

    # ----- the scan thread -----
    def _run(self, ends: dict[ClassFile, int], report: Progress | None) -> None:
        """Queue the chunks a few at a time, then wait for the last ones and mark the scan finished."""
        slots = threading.Semaphore(SCAN_IN_FLIGHT)
        pending: list[Future[Any]] = []
        scan = self.progress
        step, reported = max(1, scan.total // 10), 0
        for cf, start, end in _chunks(ends):
            job = self._submit(cf, start, end, slots)
            if job is None:
                break
            pending = self._reap(pending, wait=False) + [job]
            if report and scan.done // step != reported // step:
                reported = scan.done
                report(scan.done, scan.total)
        self._reap(pending, wait=True)
        with self.store.lock:
            scan.state = "stopped" if self.closing else "ready"
            scan.seconds = time.monotonic() - scan.started
            self.deleted.clear()
        if report:
            report(scan.done, scan.total)

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

    def _submit(self, cf: ClassFile, start: int, end: int, slots: threading.Semaphore) -> Future[Any] | None:
        """Queue one chunk as a background transfer once a slot is free; None when the scan must stop."""
        while not slots.acquire(timeout=0.1):
            if self.closing:
                return None
        while not self.closing:
            try:
                return self.store.path.submit(Lane.BACKGROUND, (end - start) * HEADER_BYTES,
                                              partial(self._scan_chunk, cf, start, end),
                                              on_done=lambda f: slots.release())
            except Busy:
                time.sleep(0.01)
            except RuntimeError:             # the path closed under us
                self.closing = True
        return None

    def _scan_chunk(self, cf: ClassFile, start: int, end: int) -> None:
        """(A path worker.) Read the headers of records start .. end-1, then book them all under the lock."""
        raws = []
        with aligned(HEADER_BYTES) as buf:
            for rec in range(start, end):
                n = os.preadv(cf.fd, [buf], rec * cf.record)
                raws.append(buf[:n])
        with self.store.lock:
            for i, raw in enumerate(raws):
                self._book_header_locked(cf, start + i, raw)
            self.progress.done += len(raws)

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


def _chunks(ends: dict[ClassFile, int]) -> Iterator[tuple[ClassFile, int, int]]:
    """(file, first record, end) of each chunk, file by file."""
    for cf, nrecords in ends.items():
        for start in range(0, nrecords, SCAN_CHUNK):
            yield cf, start, min(start + SCAN_CHUNK, nrecords)
