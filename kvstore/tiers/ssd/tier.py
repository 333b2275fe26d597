"""The SSD tier as the daemon uses it: blocks evicted from the host pool are demoted here, and come back to the
host pool (promoted) when a client acquires or prefetches them.

Demotion never makes eviction wait for the disk: the evicted block's bytes are copied into a bounded staging area
(memory outside the host pool, `ssd.staging_bytes`) and the slot is free at once; a background thread writes staged
blocks to the record store in batches, in the background lane. A block staged or stored is present for lookups.
When staging is full an evicted block is dropped, and counted. Reads take staged bytes first, then the store; the
store's reads verify every record, so a bad one ends the prefix there. A block keeps its writer's CRC-32C all the
way down: staged with it, checked against it before its record is written (and the record keeps it), and checked
again when a staged copy is promoted; a block whose bytes no longer match is a miss, never served.

The copy into staging need not happen under the daemon's state lock: `stage` books the block (present for
lookups from then on) and hands out its buffer, and the evicting thread, once it has left the state lock, has
`fill` copy the slot into it and publish it; readers of a block still being copied wait for it, and the writer
skips it until then.

Write-through hooks (kvstore.movers.durability): a block waiting for its write-through is `want`ed; should it be
evicted before that write, its staged copy is flagged urgent, and the writer takes urgent blocks first, in the store
lane, never behind background demotions. `when_written` flags staged blocks urgent the same way and calls back once
each has left staging (written and synced, or dropped, or deleted): `on_disk` then says which.

Blocks are addressed by block id (kvstore.tiers): the namespace digest + the block hash (32 bytes), stable across
restarts, unlike namespace ids. This is a `LowerTier`; `open_tier` builds it from the configuration.
Thread safety: `lock` guards the staging area and is held only for dict updates and copies; the store keeps its
own books; all disk I/O is a transfer on the traffic manager's SSD path. Callers never hold the daemon's state lock
across a read.
"""
from __future__ import annotations

import logging
import mmap
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

import numpy as np

from kvstore.checksum import crc32c
from kvstore.testpoints import fault_point
from kvstore.tiers import StagingBuffer, TierContext, TierUnavailable, TierWrite
from kvstore.tiers.ssd.config import SsdConfig
from kvstore.tiers.ssd.owners import SsdQuotas
from kvstore.tiers.ssd.store import SsdStore, StoreLocked
from kvstore.traffic import Lane, Path
from kvstore.workers import Worker
from kvstore.workflows import Workflows

log = logging.getLogger("kvstore")
WRITE_BATCH = 32
PENDING_WAIT_S = 5.0          # the longest a read waits for a block's staging copy to complete
BUSY_RETRY_S = 0.05           # a demotion batch the lane refused (its queue full) is tried again after this
MIN_CAPACITY = 1 << 20


class Pending:
    """A staged block whose bytes are still being copied into `buf` (by the thread that evicted it)."""
    __slots__ = ("buf",)

    def __init__(self, buf: bytearray | mmap.mmap) -> None:
        self.buf = buf

    def __len__(self) -> int:
        return len(self.buf)


class SsdTier:
    name = "ssd"

    def __init__(self, cfg: SsdConfig, path: Path | None = None, workflows: Workflows | None = None,
                 quotas: SsdQuotas | None = None) -> None:
        self.cfg = cfg
        self.persist_on_stop = cfg.persist_on_stop       # (DurableTier) a graceful stop writes the host pool here
        self.store = SsdStore(cfg.dir, cfg.capacity, cfg.sync, path, cfg.io, cfg.eviction, workflows, quotas)
        self.path = self.store.path
        self.staging: dict[bytes, bytes | bytearray | mmap.mmap | Pending] = {}
        self.staged_crcs: dict[bytes, int | None] = {}  # the writer's CRC-32C of each staged block (None: none)
        self.staged_bytes = 0
        self.dropped = 0
        self.counters_busy_retries = 0                 # demotion batches the lane refused, kept staged to retry
        self.rewrites_saved = 0
        self.crc_mismatch = 0                            # staged copies that failed their writer's CRC when read
        self.lock = threading.Condition()
        self._stop = False
        self._inflight: Counter[bytes] = Counter()    # keys in a write batch now (demotion or write-through)
        self._killed: set[bytes] = set()               # ... deleted meanwhile: the batch must not publish them
        self._spare: dict[int, list[mmap.mmap]] = {}     # staging buffers written to disk, ready for reuse
        self._wanted: set[bytes] = set()                 # keys a write-through waits for: urgent if staged
        self._urgent: dict[bytes, None] = {}             # staged keys written next, in the store lane (in order)
        self._watchers: dict[bytes, list[Callable[[bytes], None]]] = {}   # called once the key leaves staging
        self._writer = Worker("kvstore-demote", self._run)     # restarted if it ever raises

    def open(self, wait: bool = False) -> "SsdTier":
        """Open the store: what its record maps name is booked before this returns (hits from the first request);
        the headers are validated, or scanned where a map cannot be trusted, while the daemon serves."""
        def progress(done: int, total: int) -> None:
            ready = "" if done < total else f"; ready in {self.store.scan_status()['seconds']:.1f} s"
            log.info("ssd: %s %d of %d records in %s (%d blocks)%s", self.store.scan.state, done, total,
                     self.cfg.dir, len(self.store.index), ready)

        self.store.open(progress, wait=wait)
        scan = self.store.scan
        if scan.state == "scanning":
            log.info("ssd: %s: %d records to scan (no trusted record map); serving meanwhile, a block not scanned "
                     "yet is a miss (kvstore stats shows the progress)", self.cfg.dir, scan.total)
        elif scan.total:
            log.info("ssd: %s: %d blocks known from the record maps, served from now; validating %d records in "
                     "the background", self.cfg.dir, scan.from_maps, scan.total)
        self._writer.start()
        return self

    def _buffer(self, nbytes: int) -> bytearray | mmap.mmap:
        """(Under `lock`.) A buffer for a staged copy: page-aligned memory when the block is a whole number of
        pages, so that its SSD write goes straight from it (O_DIRECT) instead of through another copy; buffers are
        reused once written (a fresh 2 MiB mapping costs 512 page faults)."""
        if nbytes % mmap.PAGESIZE:
            return bytearray(nbytes)
        spare = self._spare.get(nbytes)
        return spare.pop() if spare else mmap.mmap(-1, nbytes)

    # ----- demotion -----
    def stage(self, key: bytes, nbytes: int, crc: int | None = None) -> StagingBuffer | bool:
        """Book an evicted block for its SSD write: the buffer that the caller has `fill` fill; True if
        the tier holds the block already (a key names its bytes: a chained hash of the tokens in one namespace,
        and a delete removes the SSD copy too), so it is not written again; False (dropped, counted) when staging
        is full. From here on the block is present for lookups and reads."""
        with self.lock:
            if key in self.staging or self.store.has(key):
                self.rewrites_saved += 1
                if key not in self.staging:
                    self.store.refresh(key)     # stored again: fresh in the SSD's order too (the store's lock
                    #                             is only ever taken inside this one, never the other way)
                return True
            if self.staged_bytes + nbytes > self.cfg.staging_bytes:
                self.dropped += 1
                return False
            self.staged_bytes += nbytes
            buf = self._buffer(nbytes)
            self.staging[key] = Pending(buf)
            self.staged_crcs[key] = crc
            if key in self._wanted:
                self._urgent[key] = None
            return buf

    def wait_room(self, nbytes: int, timeout: float) -> int:
        """(Without the daemon's state lock.) Wait until `nbytes` of staging (at most all of it) are free, or
        `timeout`; the free bytes. An operator's eviction (`kvstore evict --all`) moves blocks down in chunks that
        fit, instead of evicting faster than the disk writes and dropping what staging cannot hold."""
        deadline = time.monotonic() + timeout
        want = min(nbytes, self.cfg.staging_bytes)
        with self.lock:
            while self.cfg.staging_bytes - self.staged_bytes < want:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self.lock.wait(left)
            return self.cfg.staging_bytes - self.staged_bytes

    def fill(self, key: bytes, buf: StagingBuffer, data: memoryview) -> None:
        """(Without the daemon's state lock.) Copy the evicted block's bytes into the buffer `stage` gave
        (numpy, without the GIL), then publish it: readers may take it, the writer may write it (unless it was
        deleted meanwhile: then the buffer goes back to the spares)."""
        np.copyto(np.frombuffer(buf, np.uint8), np.frombuffer(data, np.uint8))
        with self.lock:
            entry = self.staging.get(key)
            if isinstance(entry, Pending) and entry.buf is buf:
                self.staging[key] = buf
            elif isinstance(buf, mmap.mmap):
                self._spare.setdefault(len(buf), []).append(buf)
            self.lock.notify_all()

    def _staged(self, key: bytes) -> bytes | bytearray | mmap.mmap | None:
        """(Under `lock`.) The staged bytes of `key`, waiting out a copy in progress; None if not staged."""
        entry = self.staging.get(key)
        deadline = time.monotonic() + PENDING_WAIT_S
        while isinstance(entry, Pending):
            if time.monotonic() > deadline:              # never expected: a copy takes milliseconds
                log.warning("ssd: the staging copy of a block took over %.0f s; served as a miss", PENDING_WAIT_S)
                return None
            self.lock.wait(0.1)
            entry = self.staging.get(key)
        return entry

    def _run(self) -> None:
        while True:
            with self.lock:
                while True:
                    batch, lane = self._next_batch()
                    if batch or (self._stop and not self.staging):
                        break
                    self.lock.wait()
                if not batch:
                    return
                fault_point("demote_loop")
                self._begin([k for k, _ in batch])
                items = [(k, v, self.staged_crcs.get(k)) for k, v in batch]
            busy: set[bytes] = set()
            try:
                self._write(items, lane, busy)
            except Exception:
                log.exception("ssd: a demotion batch of %d blocks failed; they are dropped", len(batch))
            with self.lock:
                for k, v in batch:
                    if k in busy and self.staging.get(k) is v and not self._stop:
                        continue                           # the lane was full: staged still, written next time
                    if self.staging.get(k) is v:           # not deleted or staged again meanwhile
                        del self.staging[k]
                        self.staged_crcs.pop(k, None)
                        self.staged_bytes -= len(v)
                        if isinstance(v, mmap.mmap):       # no one else holds it: reuse it, faulted in already
                            self._spare.setdefault(len(v), []).append(v)
                gone = self._unstaged_locked([k for k, _ in batch])
                self.lock.notify_all()                     # an operator's eviction waiting for staging room
                if busy:
                    self.counters_busy_retries += 1
                    self.lock.wait(BUSY_RETRY_S)           # the lane drains meanwhile
            _call(gone)

    def _next_batch(self) -> tuple[list[tuple[bytes, bytes | bytearray | mmap.mmap]], Lane]:
        """(Under `lock`.) The next demotion batch: urgent blocks first (a write-through or a durability wait is
        behind them), in the store lane; else any staged blocks, in the background lane. Blocks still being
        copied in are left for later."""
        urgent = [(k, v) for k in self._urgent
                  if (v := self.staging.get(k)) is not None and not isinstance(v, Pending)][:WRITE_BATCH]
        if urgent:
            return urgent, Lane.STORE
        return [(k, v) for k, v in self.staging.items() if not isinstance(v, Pending)][:WRITE_BATCH], Lane.BACKGROUND

    # ----- write-through hooks -----
    def want(self, keys: Sequence[bytes]) -> None:
        """These blocks wait for their write-through: should one be staged (evicted first), it is urgent."""
        with self.lock:
            self._wanted.update(keys)
            self._flag_locked(keys)

    def unwant(self, keys: Sequence[bytes]) -> None:
        """The write-throughs of these blocks are over (written, or no longer to be written)."""
        with self.lock:
            self._wanted.difference_update(keys)

    def when_written(self, keys: Sequence[bytes], done: Callable[[bytes], None]) -> None:
        """Call `done(key)` for each of `keys` once it is not staged any more (written and synced, dropped or
        deleted: `on_disk` says which); staged ones are flagged urgent. Keys not staged are reported at once, by
        this thread; the others by the thread that writes or drops them, outside the tier's lock."""
        now = []
        with self.lock:
            for k in keys:
                if k in self.staging:
                    self._watchers.setdefault(k, []).append(done)
                else:
                    now.append(k)
            self._flag_locked(keys)
        for k in now:
            done(k)

    def staged_keys(self, digests: set[bytes]) -> list[bytes]:
        """Staged blocks of these namespaces (by digest): what a flush waits for besides the host pool's."""
        with self.lock:
            return [k for k in self.staging if k[:16] in digests]

    def on_disk(self, key: bytes) -> bool:
        """The block's record is written (and synced, unless ssd.sync is never)."""
        return self.store.has(key)

    def _flag_locked(self, keys: Sequence[bytes]) -> None:
        flagged = False
        for k in keys:
            if k in self.staging and k not in self._urgent:
                self._urgent[k] = None
                flagged = True
        if flagged:
            self.lock.notify_all()

    def _unstaged_locked(self, keys: Sequence[bytes]) -> list[tuple[bytes, list[Callable[[bytes], None]]]]:
        """(Under `lock`.) Keys that may have left staging: no longer urgent; their watchers, to call after the
        lock is let go."""
        gone = []
        for k in keys:
            if k in self.staging:
                continue
            self._urgent.pop(k, None)
            if k in self._watchers:
                gone.append((k, self._watchers.pop(k)))
        return gone

    def announce(self, keys: list[bytes]) -> None:
        """Announce the keys of a write batch before their bytes are taken (a delete from then on cancels them)."""
        with self.lock:
            self._begin(keys)

    def _begin(self, keys: list[bytes]) -> None:
        self._inflight.update(keys)

    def write(self, items: Sequence[TierWrite], lane: Lane) -> int:
        """Write announced blocks (block id, bytes, writer's CRC-32C or None) to the store in `lane`; a key
        deleted since `announce`, or whose bytes fail its CRC, is not published."""
        return self._write(items, lane, None)

    def _write(self, items: Sequence[TierWrite], lane: Lane, busy: set[bytes] | None) -> int:
        """`write`, with `busy` receiving the keys not stored only because the lane's queue was full."""
        try:
            return self.store.put_many([(k[:16], k[16:], v, crc) for k, v, crc in items], lane,
                                       cancelled=self._killed, busy=busy)
        finally:
            with self.lock:
                for k, _, _ in items:
                    self._inflight[k] -= 1
                    if self._inflight[k] <= 0:
                        del self._inflight[k]
                        self._killed.discard(k)
                self.lock.notify_all()                  # deletes waiting for this batch

    # ----- reads -----
    def has(self, key: bytes) -> bool:
        return key in self.staging or self.store.has(key)

    def read(self, keys: Sequence[bytes], outs: Sequence[memoryview], lane: Lane = Lane.CRITICAL,
             on_ready: Callable[[int], None] | None = None, crcs: list[int | None] | None = None) -> int:
        """Copy the longest prefix of `keys` that this tier holds and verifies into `outs`; returns its length.
        `on_ready(n)` reports the prefix as it grows (streaming gets); `crcs` receives each block's writer's
        CRC-32C (None where the writer gave none)."""
        n = 0
        while n < len(keys):
            with self.lock:
                staged = self._staged(keys[n])
                if staged is not None:
                    outs[n][:] = staged
                    crc = self.staged_crcs.get(keys[n])
                    end = -1
                else:
                    end = n                                     # a run on disk, of one namespace
                    while end < len(keys) and keys[end] not in self.staging and keys[end][:16] == keys[n][:16]:
                        end += 1
            if end < 0:                                     # reported outside the lock: on_ready takes others
                if not self._intact(keys[n], outs[n], crc):
                    return n
                n += 1
                if crcs is not None:
                    crcs.append(crc)
                if on_ready is not None:
                    on_ready(n)
                continue
            report = None if on_ready is None else (lambda k, base=n: on_ready(base + k))
            got = self.store.get_many(keys[n][:16], [k[16:] for k in keys[n:end]], outs[n:end], lane, report,
                                      crcs)
            if got < end - n:
                return n + got
            n = end
        return n

    def read_async(self, key: bytes, out: memoryview, lane: Lane,
                   on_done: Callable[[Future[Any]], None]) -> Future[Any] | None:
        """Submit one block's read as a transfer in `lane` (a staged block is copied by the transfer too, so that
        completions always arrive on a path worker); None if the tier does not hold it. Busy if the lane is full."""
        if key not in self.staging:
            return self.store.read_async(key, out, lane, on_done)
        return self.path.submit(lane, len(out), lambda: self._read_now(key, out), tag=key, on_done=on_done)

    def _read_now(self, key: bytes, out: memoryview) -> int | bool | None:
        """(A path worker.) The block from staging or, if it was written meanwhile, from the store: its writer's
        CRC-32C (None if none); False if it is gone or fails its CRC."""
        with self.lock:
            staged = self._staged(key)
            if staged is not None:
                out[:] = staged
                crc = self.staged_crcs.get(key)
        if staged is not None:
            return crc if self._intact(key, out, crc) else False
        where = self.store.index.get(key)
        if where is None or where[0] != len(out):
            return False
        return self.store.read_into(key, self.store.files[where[0]], where[1], out)

    def _intact(self, key: bytes, out: memoryview, crc: int | None) -> bool:
        """A staged block's copy matches its writer's CRC-32C (True without one: the reader cannot verify it, and
        the slot will not claim it can). A copy that fails was altered before it was demoted: dropped, a miss."""
        if crc is None or crc32c(out) == crc:
            return True
        with self.lock:
            self.crc_mismatch += 1
            if self.staged_crcs.get(key) == crc and not isinstance(self.staging.get(key), Pending):
                staged = self.staging.pop(key)
                self.staged_crcs.pop(key)
                self.staged_bytes -= len(staged)
            gone = self._unstaged_locked([key])
        _call(gone)
        log.warning("ssd: a staged block does not match its writer's CRC-32C (its slot was written after commit): "
                    "served as a miss and dropped")
        return False

    def delete(self, key: bytes) -> bool:
        return self.delete_many([key])[0]

    def delete_many(self, keys: Sequence[bytes]) -> list[bool]:
        """Forget blocks: staged copies at once, records durably (SsdStore.delete_many: one flush for all). A
        block in a write batch now is cancelled there, and the delete waits for that batch to end (it publishes
        nothing of it), so a kill -9 after the reply can never find the block's record written and synced."""
        staged_found = []
        with self.lock:
            for key in keys:
                self.staged_crcs.pop(key, None)
                staged = self.staging.pop(key, None)
                if staged is not None:
                    self.staged_bytes -= len(staged)
                staged_found.append(staged is not None)
                if key in self._inflight:
                    self._killed.add(key)
            gone = self._unstaged_locked(keys)
        _call(gone)
        with self.lock:
            while any(k in self._inflight for k in keys):
                self.lock.wait()
        found = self.store.delete_many(keys)
        return [a or b for a, b in zip(found, staged_found)]

    def resize(self, capacity: int) -> dict[str, Any]:
        """Set the cap: records beyond it are evicted and the files cut (waits for a write batch in flight)."""
        if capacity < MIN_CAPACITY:
            raise ValueError(f"the SSD tier needs at least 1 MiB, got {capacity} bytes")
        quotas = self.store.quotas.total() if self.store.split else 0
        if capacity < quotas:
            raise ValueError(f"the tenants' SSD quotas total {quotas} bytes, above {capacity}: lower them first "
                             "(kvstore tenants set NAME --ssd N)")
        evicted = self.store.resize(capacity)
        self.cfg.capacity = capacity
        return {"capacity": capacity, "evicted": evicted, "mapped_bytes": self.store.file_bytes()}

    def namespaces(self) -> dict[bytes, int]:
        return self.store.by_namespace()

    # ----- tenants (owners.py) -----
    def know_tenants(self, tenant_of: Callable[[bytes], str | None]) -> None:
        """The daemon's map from a registered namespace digest to its tenant, asked when a digest is first
        written (the answer is kept in the tier's directory)."""
        self.store.tenant_of = tenant_of

    def tenant_rows(self, tenants: Sequence[str]) -> dict[str, dict[str, int]]:
        """Per tenant: SSD quota, bytes used, borrowed, evictions, evictions for another tenant's writes."""
        with self.store.lock:
            return self.store.quotas.rows(tenants)

    @property
    def quotas_on(self) -> bool:
        return self.store.split

    def set_quota(self, tenant: str, nbytes: int) -> int:
        """Change a tenant's SSD quota online (O(1)); the quota before. ValueError if quotas are off (they are
        chosen at start) or the quotas would not fit the tier."""
        if not self.store.split:
            raise ValueError("SSD quotas are off (no tenant had an ssd quota when this daemon started): set "
                             "tenants[].ssd or tenancy.default_ssd in the configuration and restart")
        with self.store.lock:
            before = self.store.quotas.quota(tenant)
            self.store.quotas.set(tenant, nbytes, self.store.capacity)
            return before

    # ----- inspection -----
    def stats(self) -> dict[str, Any]:
        s = self.store
        with s.lock:
            counters, blocks, used, files = dict(s.counters), len(s.index), s.used_bytes(), s.file_bytes()
            allocated = s.allocated_bytes()
        with self.lock:
            staged_blocks, staged_bytes, urgent = len(self.staging), self.staged_bytes, len(self._urgent)
        return {"tier": "ssd", "capacity_bytes": self.cfg.capacity, "mapped_bytes": files, "used_bytes": used,
                "resident_bytes": allocated, "hole_bytes": files - allocated, "blocks": blocks,
                "segments": len(s.files), "staged_blocks": staged_blocks,
                "staged_bytes": staged_bytes, "staged_urgent": urgent, "dropped": self.dropped,
                "busy_retries": self.counters_busy_retries,
                "rewrites_saved": self.rewrites_saved,
                "staged_crc_mismatch": self.crc_mismatch, "writer_restarts": self._writer.restarts,
                "counters": counters, "scan": s.scan_status(), "io": s.io,
                "namespaces": {d.hex(): n for d, n in s.by_namespace().items()}}

    def close(self) -> None:
        """Write what is staged, then close the store."""
        with self.lock:
            self._stop = True
            self.lock.notify()
        self._writer.join()
        self.store.close()


def _call(gone: list[tuple[bytes, list[Callable[[bytes], None]]]]) -> None:
    """Tell the watchers of keys that left staging (outside the tier's lock: they take their own)."""
    for key, watchers in gone:
        for done in watchers:
            done(key)


def open_tier(cfg: SsdConfig, ctx: TierContext) -> SsdTier | None:
    """The SSD tier `ssd.dir` asks for (None when empty), open and scanning; TierUnavailable says why not. The
    context's hint books are what `ssd.eviction: workflow` reads; its quotas["ssd"] the tenants' SSD quotas."""
    if not cfg.dir:
        return None
    path = ctx.traffic.path("ssd")
    quotas = SsdQuotas(*ctx.quotas.get("ssd", ({}, 0)))
    try:
        return SsdTier(cfg, path, ctx.workflows, quotas).open()
    except StoreLocked as e:
        raise TierUnavailable(str(e)) from None
    except OSError as e:
        raise TierUnavailable(f"cannot use ssd.dir {cfg.dir}: {e.strerror or e}") from None
