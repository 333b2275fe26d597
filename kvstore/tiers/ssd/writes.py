"""The SSD store's writes: placing records at the cap, writing them, making them durable, publishing them.

`Writer.put_many` runs one batch at a time (`batch`; resize waits for it) and guarantees:
- Placement never takes the files past the store's capacity (the bytes allocated on the disk): a record comes from
  the file's free records, else one of its holes allocated again, else the file grows by up to GROW_RECORDS
  (really allocated, files.allocate, with the store's lock let go; where the cap leaves no room, other block
  sizes' free records are punched out first: free space serves whoever writes, store.punch_free_locked), else the
  store evicts a record of that block size (its policy's victim, of the tenant the SSD quotas choose; under quotas
  a tenant within its own may first have a borrower's record of another size punched out for room:
  store.evict_locked); with none of these the block is not stored (counted as full). A file system that refuses
  to grow is counted as disk_full and the tier stays at its size, evicting within it.
- Each payload is written as a transfer in the caller's lane, after zeroing the record's old header in the same
  write (a crash leaves an empty record, never an old header over new bytes). A payload that can be moved as it is
  (aligned_for_io) is written in pieces of PIECE_BYTES with a checkpoint between pieces, so that a lower-lane write
  yields the device to critical reads; any other payload goes through an aligned buffer in one write.
- Then, each a transfer in the caller's lane: a sync of the files (policy always or batch), the headers (crash
  point after_payload before them, mid_header halfway through), a sync again. Under policy never nothing is synced.
- A record is published (in the store's books) only once its header is written and synced: durable when
  put_many returns, unless the policy is never. A key deleted while its write was in flight, or found in
  `cancelled` at publication, is not published: its record is zeroed and freed.
- A failed payload write leaves that record free again (write_errors); a failed sync or header write publishes
  nothing from the batch. Either way the old copy of a key, if any, stays as it was.
- A block that comes with its writer's CRC-32C is checked against it before it is written: one that no longer
  matches (its slot was altered after commit) is not stored (crc_mismatch), and the record keeps the writer's CRC,
  so a reader checks the bytes against what the writer committed, not against what the disk was handed.
"""
from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Collection, Sequence
from concurrent.futures import Future
from functools import partial
from typing import TYPE_CHECKING, Any

from kvstore.testpoints import crash_point
from kvstore.tiers.ssd import diskio
from kvstore.tiers.ssd.files import ZERO_BUF, ClassFile, add_records, aligned, aligned_for_io, allocate, refill
from kvstore.tiers.ssd.recmap import entry_of
from kvstore.tiers.ssd.record import HEADER_BYTES, Header, padded, running_crcs
from kvstore.tiers.ssd.zeroing import run_unlocked
from kvstore.traffic import Busy, Lane
from kvstore.traffic.path import PIECE_BYTES

if TYPE_CHECKING:
    from kvstore.tiers.ssd.store import SsdStore

log = logging.getLogger("kvstore")
GROW_RECORDS = 64
ZERO = bytes(HEADER_BYTES)
Item = tuple[bytes, bytes, Any] | tuple[bytes, bytes, Any, int | None]   # ns, hash, payload[, the writer's CRC]
Placed = tuple[ClassFile, int, bytes, int, Any, int | None]   # file, record, key, seq, payload, the writer's CRC
Written = tuple[ClassFile, int, Header]                  # file, record, the header to write
Writing = tuple[ClassFile, int, bytes, int, Future[Any], bool]  # file, record, key, seq, its write, writer's CRC


class CrcMismatch(Exception):
    """A block's bytes no longer match the CRC its writer committed it with."""


class Writer:
    def __init__(self, store: SsdStore, sync: str, pwritev: Callable[..., int]) -> None:
        self.store = store
        self.sync = sync
        self._pwritev = pwritev
        self.batch = threading.Lock()               # one put_many at a time; resize waits for it
        self.writing: dict[bytes, int] = {}         # key → seq of its write in flight (under store.lock)

    def cancel_locked(self, key: bytes) -> bool:
        """(Under store.lock.) The key was deleted: its write in flight, if any, is not published."""
        return self.writing.pop(key, None) is not None

    def put_many(self, items: Sequence[Item], lane: Lane, cancelled: Collection[bytes],
                 busy: set[bytes] | None = None) -> int:
        """Store (namespace digest, block hash, payload[, writer's CRC-32C]) records; returns how many were
        published. `busy` receives the keys not stored because the lane's queue was full (nothing else failed)."""
        with self.batch:
            try:
                return self._write_batch(items, lane, cancelled, busy if busy is not None else set())
            finally:
                with self.store.lock:
                    self.store.quotas.placing.clear()     # published (now in `used`) or not stored

    def _write_batch(self, items: Sequence[Item], lane: Lane, cancelled: Collection[bytes], busy: set[bytes]) -> int:
        """The batch: place, write the payloads, make them durable, publish (see the module docstring)."""
        placed = self._place(items)
        headers: list[Written] = []
        try:
            for cf, rec, key, seq, job, writer in self._submit_payloads(placed, lane, busy):
                try:
                    marks = job.result()
                    headers.append((cf, rec, Header(key[:16], key[16:], cf.payload, marks[-1], seq, writer,
                                                    marks=marks if len(marks) > 1 else ())))
                except CrcMismatch:
                    self._unplace(cf, rec, key, "crc_mismatch")
                except OSError as e:
                    self._unplace(cf, rec, key, f"write_error: {e}")
            if not headers:
                return 0
            self._make_durable(headers, lane)
        except (OSError, Busy, RuntimeError) as e:      # a failed sync or header write: nothing is published
            for cf, rec, header in headers:
                self._unplace(cf, rec, header.ns + header.hash, f"batch failed: {e}", isinstance(e, Busy))
                if isinstance(e, Busy):
                    busy.add(header.ns + header.hash)
            return 0
        return self._publish(headers, cancelled)

    # ----- placement -----
    def _place(self, items: Sequence[Item]) -> list[Placed]:
        """Book a record for each block (free, grown, or evicted at the cap); a block without one is skipped."""
        s = self.store
        placed = []
        with s.lock:
            for ns, h, payload, *writer_crc in items:
                cf = s.class_file(len(payload))
                tenant = s.owner_locked(ns)
                rec = self._free_record_locked(cf)
                if rec is None:
                    rec = s.evict_locked(cf, tenant, self._free_record_locked)
                if rec is None:
                    s.counters["full"] += 1
                    if s.counters["full"] == 1 or s.counters["full"] % 1000 == 0:
                        log.warning("ssd: no record for a %d-byte block of tenant %r (%d such so far): %s",
                                    cf.payload, tenant, s.counters["full"], s.no_room_reason_locked(cf, tenant))
                    continue
                s.quotas.placing[tenant] += cf.record
                seq = self.writing[ns + h] = s.next_seq_locked()
                placed.append((cf, rec, ns + h, seq, payload, writer_crc[0] if writer_crc else None))
        return placed

    def _free_record_locked(self, cf: ClassFile) -> int | None:
        """(Under store.lock.) A free record of the file, else a hole of it allocated again, else the file grown:
        within the capacity (the bytes allocated on the disk), None without room."""
        s = self.store
        if not cf.free:
            room = s.capacity - s.allocated_bytes()
            if room < cf.record and s.punch_free_locked(cf):     # other sizes' unused records: room for this one
                room = s.capacity - s.allocated_bytes()
            if cf.holes and room >= cf.record:
                return self._refill_locked(cf)
            records = min(GROW_RECORDS, room // cf.record)
            if records <= 0 or not self._grow_locked(cf, records):
                return None
        return cf.free.pop()

    def _refill_locked(self, cf: ClassFile) -> int | None:
        """(Under store.lock, let go for the allocation.) A punched record of the file, allocated again."""
        s = self.store
        rec = cf.holes.pop()                 # counted as allocated from here: the cap holds while we wait
        refused = run_unlocked(s.lock, lambda: refill(cf, rec))
        if refused is None:
            return rec
        cf.holes.append(rec)
        s.counters["disk_full"] += 1
        return None

    def _grow_locked(self, cf: ClassFile, records: int) -> bool:
        """(Under store.lock, let go for the allocation: only this batch grows files.) Grow the file; False
        (counted, logged now and then) when the file system refuses."""
        s = self.store
        start = cf.size()
        refused = run_unlocked(s.lock, lambda: allocate(cf, start, records * cf.record))
        if refused is None:
            add_records(cf, records)
            return True
        s.counters["disk_full"] += 1
        if s.counters["disk_full"] == 1 or s.counters["disk_full"] % 1000 == 0:
            log.error("ssd: the file system refused %d more bytes for %s (%s): the tier stays at %d bytes, "
                      "evicting within them; free space there or lower ssd.capacity", records * cf.record, cf.path,
                      os.strerror(refused.errno or 0), s.file_bytes())
        return False

    def _unplace(self, cf: ClassFile, rec: int, key: bytes, why: str, busy: bool = False) -> None:
        """A placed record not written after all: given back (zeroed later). `busy`: only the lane's queue was
        full, which the caller may try again (counted, not logged as a failure)."""
        if why == "crc_mismatch":
            log.warning("ssd: a block's bytes no longer match the CRC-32C its writer committed (its shared slot was "
                        "written after commit): not stored; a reader gets a miss")
        elif not busy:
            log.error("ssd: writing a record to %s failed (%s); the block is not stored", cf.path, why)
        with self.store.lock:
            self.store.counters["crc_mismatch" if why == "crc_mismatch" else "busy" if busy else "write_errors"] += 1
            self.writing.pop(key, None)
            self.store.zero_later_locked(cf, rec)   # it may still hold an evicted block's header

    def _publish(self, headers: list[Written], cancelled: Collection[bytes]) -> int:
        """Book the written records, unless deleted meanwhile (then the record is zeroed). A key's previous
        record is zeroed too, and both are durable before this returns: a crash can then never bring back a
        deleted key, nor a key with an older copy's bytes once its new record is evicted. A key placed twice in
        one batch (`writing` holds the later copy's seq) publishes its later copy; the earlier is zeroed."""
        s = self.store
        stored = 0
        wiped = 0
        with s.lock:
            for cf, rec, header in headers:
                key = header.ns + header.hash
                ours = self.writing.get(key) == header.seq
                if not ours or key in cancelled:     # deleted while being written, or placed again after this
                    if ours:
                        del self.writing[key]
                    s.zeroing.add_locked(cf, rec)
                    wiped += 1
                    continue
                del self.writing[key]
                old = s.index.get(key)
                if old is not None:
                    s.drop_locked(key)
                    s.zeroing.add_locked(s.files[old[0]], old[1])
                    wiped += 1
                s.add_locked(key, cf, rec, header.seq)
                stored += 1
            s.counters["writes"] += stored
            s.evicted.clear()                  # the victims' records hold this batch's blocks now
        if wiped:
            s.zeroing.barrier(Lane.STORE)
        return stored

    # ----- the disk -----
    def _submit_payloads(self, placed: list[Placed], lane: Lane, busy: set[bytes]) -> list[Writing]:
        """Queue every payload write in `lane`; a block whose lane is full is unplaced (and put in `busy`)."""
        writes = []
        for cf, rec, key, seq, payload, crc in placed:
            try:
                writes.append((cf, rec, key, seq, self.store.path.submit(
                    lane, cf.record, partial(self._write_payload, cf, rec, payload, crc)), crc is not None))
            except Busy as e:
                self._unplace(cf, rec, key, str(e), busy=True)
                busy.add(key)
        return writes

    def _make_durable(self, headers: list[Written], lane: Lane) -> None:
        """Write the records' map entries, sync them and the payloads, write the headers, sync again: each a
        transfer in `lane`, waited for. A header is written only once its map entry is synced (recmap.py)."""
        cfs = {cf for cf, _, _ in headers}
        path = self.store.path
        path.submit(lane, 0, lambda: self._map_then_sync(headers, cfs)).result()
        crash_point("after_payload")
        path.submit(lane, len(headers) * HEADER_BYTES, lambda: self._write_headers(headers)).result()
        path.submit(lane, 0, lambda: self._sync(cfs, "always", "batch")).result()

    def _write_payload(self, cf: ClassFile, rec: int, payload: Any, writer_crc: int | None) -> tuple[int, ...]:
        """(A path worker.) Write one payload, with the record's header zeroed; returns its marks (record.py), the
        last of which is the CRC-32C its header carries: the writer's, checked against the bytes first
        (CrcMismatch: nothing written), or, without one, the bytes' own. Bytes written from a shared slot are
        checked before the write; should they change during it, the record fails its check when read (a miss),
        since it keeps the writer's CRC."""
        if aligned_for_io(payload):       # a host slot or an aligned staged copy: written from where it is
            marks = _checked(payload, writer_crc)
            self._write_in_pieces(cf, rec, payload)
            return marks
        buf = cf.take()
        try:
            end = HEADER_BYTES + padded(len(payload))
            buf[:HEADER_BYTES] = ZERO
            buf[HEADER_BYTES:HEADER_BYTES + len(payload)] = payload
            with memoryview(buf) as mv, mv[:end] as part, mv[HEADER_BYTES:HEADER_BYTES + len(payload)] as body:
                marks = _checked(body, writer_crc)                  # our private copy: what is written
                self._pwritev(cf.fd, [part], rec * cf.record)       # zero header + payload: one write
            return marks
        finally:
            cf.spare.put(buf)

    def _write_in_pieces(self, cf: ClassFile, rec: int, payload: Any) -> None:
        """(A path worker.) The zeroed header and the payload, piece by piece (PIECE_BYTES): between pieces a
        lower-lane write yields the device to critical reads (Path.checkpoint)."""
        at = rec * cf.record
        with memoryview(payload) as mv:
            for i in range(0, len(mv), PIECE_BYTES):
                if i:
                    self.store.path.checkpoint()
                with mv[i:i + PIECE_BYTES] as part:
                    if i == 0:
                        self._pwritev(cf.fd, [ZERO_BUF, part], at)
                    else:
                        self._pwritev(cf.fd, [part], at + HEADER_BYTES + i)

    def _write_headers(self, headers: list[Written]) -> None:
        """(A path worker.) Each header through one aligned buffer (O_DIRECT needs aligned memory and offsets)."""
        with aligned(HEADER_BYTES) as buf:
            for i, (cf, rec, header) in enumerate(headers):
                buf[:] = header.pack()
                diskio.pwritev(cf.fd, [buf], rec * cf.record)
                if i == len(headers) // 2:
                    crash_point("mid_header")

    def _map_then_sync(self, headers: list[Written], cfs: set[ClassFile]) -> None:
        """(A path worker.) The records' map entries and the owners of new namespaces (owners.py), then the sync
        of payloads, entries and owners: one transfer."""
        self._write_map(headers)
        with self.store.lock:
            owners = self.store.owners.take_pending()
        self.store.owners.append(owners, synced=self.sync in ("always", "batch"))
        self._sync(cfs, "always", "batch")

    def _write_map(self, headers: list[Written]) -> None:
        """(A path worker.) Each record's map entry (buffered writes; synced with the payloads)."""
        for cf, rec, header in headers:
            assert cf.map is not None
            cf.map.put([(rec, entry_of(header))])

    def _sync(self, cfs: set[ClassFile], *policies: str) -> None:
        """(A path worker.) fdatasync the files and their maps when the sync policy is one of `policies`."""
        if self.sync in policies:
            self.store.path.checkpoint()          # a flush of the device's cache would stall a critical read
            for cf in cfs:
                diskio.fdatasync(cf.fd)
                if cf.map is not None:
                    cf.map.sync()


def _checked(payload: Any, writer_crc: int | None) -> tuple[int, ...]:
    """The payload's marks (its CRC-32C at the end of each piece, in the same pass): the last, its CRC, must be
    the writer's when there is one."""
    marks = running_crcs(payload)
    if writer_crc is not None and marks[-1] != writer_crc:
        raise CrcMismatch()
    return marks
