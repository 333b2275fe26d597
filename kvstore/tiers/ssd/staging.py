"""The SSD tier's staging area: evicted blocks waiting in memory for their SSD write, and the write-through hooks
that make some of them urgent.

Demotion never makes eviction wait for the disk: the evicted block's bytes are copied into a bounded staging area
(memory outside the host pool, `ssd.staging_bytes`) and the slot is free at once; the demotion writer
(kvstore.tiers.ssd.demoter) writes staged blocks to the record store. A block staged or stored is present for
lookups. When staging is full an evicted block is dropped, and counted. A staged block keeps its writer's CRC-32C
(`crcs`): it is checked against it before its record is written (and the record keeps it), and again when a
staged copy is promoted (`intact`); a copy whose bytes no longer match is a miss, never served.

Tenants (issue 29): one named tenant stages at most TENANT_SHARE of `ssd.staging_bytes` (past it its evicted
blocks are dropped, counted per tenant in `dropped_share`), so that a neighbour's flood of evictions leaves room
for another tenant's; and the writer takes background batches tenant by tenant in turn (kvstore.tiers.ssd.demoter),
so that a tenant's few staged blocks wait one batch of each other tenant's, not its whole backlog. The default
tenant "" (a daemon without tenants) is not bounded: it has no neighbour.

The copy into staging need not happen under the daemon's state lock: `stage` books the block (present for
lookups from then on) and hands out its buffer, and the evicting thread, once it has left the state lock, has
`fill` copy the slot into it and publish it; readers of a block still being copied wait for it (`staged_locked`),
and the writer skips it until then. Buffers written to disk are kept as spares for the next staged copies.

Write-through hooks (kvstore.movers.durability): a block waiting for its write-through is `want`ed; should it be
evicted before that write, its staged copy is flagged urgent, and the writer takes urgent blocks first, in the store
lane, never behind background demotions. `when_written` flags staged blocks urgent the same way and calls back once
each has left staging (written and synced, or dropped, or deleted): the tier's `on_disk` then says which. Watchers
are called outside the lock (`tell_watchers`): they take their own.

`lock` (a condition, reentrant) guards everything here, and the demotion writer's books of the batches in flight;
it is the tier's one lock, held only for dict updates and copies (never across a disk call), and the store's lock
is only ever taken inside it, never the other way.
"""
from __future__ import annotations

import logging
import mmap
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from kvstore.checksum import crc32c
from kvstore.tiers import StagingBuffer
from kvstore.tiers.ssd.config import SsdConfig

if TYPE_CHECKING:
    from kvstore.tiers.ssd.store import SsdStore

log = logging.getLogger("kvstore")
TENANT_SHARE = 0.5            # of ssd.staging_bytes one named tenant may fill (as the write-through's queue)
PENDING_WAIT_S = 5.0          # the longest a read waits for a block's staging copy to complete
Watchers = list[tuple[bytes, list[Callable[[bytes], None]]]]   # keys that left staging, and who waits for them


class Pending:
    """A staged block whose bytes are still being copied into `buf` (by the thread that evicted it)."""
    __slots__ = ("buf",)

    def __init__(self, buf: bytearray | mmap.mmap) -> None:
        self.buf = buf

    def __len__(self) -> int:
        return len(self.buf)


class Staging:
    """The staging area's books and the write-through hooks (see the module docstring), under `lock`."""

    def __init__(self, cfg: SsdConfig, store: SsdStore) -> None:
        self.cfg = cfg
        self.store = store
        self.lock = threading.Condition()
        self.blocks: dict[bytes, bytes | bytearray | mmap.mmap | Pending] = {}
        self.crcs: dict[bytes, int | None] = {}         # the writer's CRC-32C of each staged block (None: none)
        self.nbytes = 0
        self.tenants: dict[bytes, str] = {}              # staged key → its tenant ("" none named)
        self.tenant_bytes: Counter[str] = Counter()      # staged bytes per tenant
        self.dropped = 0
        self.dropped_share: Counter[str] = Counter()     # dropped at the tenant's share (TENANT_SHARE)
        self.rewrites_saved = 0
        self.crc_mismatch = 0                            # staged copies that failed their writer's CRC when read
        self.spare: dict[int, list[mmap.mmap]] = {}      # staging buffers written to disk, ready for reuse
        self.wanted: set[bytes] = set()                  # keys a write-through waits for: urgent if staged
        self.urgent: dict[bytes, None] = {}              # staged keys written next, in the store lane (in order)
        self.watchers: dict[bytes, list[Callable[[bytes], None]]] = {}   # called once the key leaves staging

    def _buffer(self, nbytes: int) -> bytearray | mmap.mmap:
        """(Under `lock`.) A buffer for a staged copy: page-aligned memory when the block is a whole number of
        pages, so that its SSD write goes straight from it (O_DIRECT) instead of through another copy; buffers are
        reused once written (a fresh 2 MiB mapping costs 512 page faults)."""
        if nbytes % mmap.PAGESIZE:
            return bytearray(nbytes)
        spare = self.spare.get(nbytes)
        return spare.pop() if spare else mmap.mmap(-1, nbytes)

    def keep_spare_locked(self, buf: object) -> None:
        """(Under `lock`.) A buffer no one holds any more: a mapping is kept for reuse, faulted in already."""
        if isinstance(buf, mmap.mmap):
            self.spare.setdefault(len(buf), []).append(buf)

    # ----- demotion -----
    def stage(self, key: bytes, nbytes: int, crc: int | None = None) -> StagingBuffer | bool:
        """Book an evicted block for its SSD write: the buffer that the caller has `fill` fill; True if
        the tier holds the block already (a key names its bytes: a chained hash of the tokens in one namespace,
        and a delete removes the SSD copy too), so it is not written again; False (dropped, counted) when staging
        is full. From here on the block is present for lookups and reads."""
        with self.lock:
            if key in self.blocks or self.store.has(key):
                self.rewrites_saved += 1
                if key not in self.blocks:
                    self.store.refresh(key)     # stored again: fresh in the SSD's order too (the store's lock
                    #                             is only ever taken inside this one, never the other way)
                return True
            if self.nbytes + nbytes > self.cfg.staging_bytes:
                self.dropped += 1
                return False
            tenant = self.store.tenant_of(key[:16]) or ""
            if tenant and self.tenant_bytes[tenant] + nbytes > self.cfg.staging_bytes * TENANT_SHARE:
                self.dropped += 1
                self.dropped_share[tenant] += 1
                return False
            self.nbytes += nbytes
            self.tenant_bytes[tenant] += nbytes
            self.tenants[key] = tenant
            buf = self._buffer(nbytes)
            self.blocks[key] = Pending(buf)
            self.crcs[key] = crc
            if key in self.wanted:
                self.urgent[key] = None
            return buf

    def wait_room(self, nbytes: int, timeout: float) -> int:
        """(Without the daemon's state lock.) Wait until `nbytes` of staging (at most all of it) are free, or
        `timeout`; the free bytes. An operator's eviction (`kvstore evict --all`) moves blocks down in chunks that
        fit, instead of evicting faster than the disk writes and dropping what staging cannot hold."""
        deadline = time.monotonic() + timeout
        want = min(nbytes, self.cfg.staging_bytes)
        with self.lock:
            while self.cfg.staging_bytes - self.nbytes < want:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self.lock.wait(left)
            return self.cfg.staging_bytes - self.nbytes

    def fill(self, key: bytes, buf: StagingBuffer, data: memoryview) -> None:
        """(Without the daemon's state lock.) Copy the evicted block's bytes into the buffer `stage` gave
        (numpy, without the GIL), then publish it: readers may take it, the writer may write it (unless it was
        deleted meanwhile: then the buffer goes back to the spares)."""
        np.copyto(np.frombuffer(buf, np.uint8), np.frombuffer(data, np.uint8))
        with self.lock:
            entry = self.blocks.get(key)
            if isinstance(entry, Pending) and entry.buf is buf:
                self.blocks[key] = buf
            else:
                self.keep_spare_locked(buf)
            self.lock.notify_all()

    # ----- reads of staged copies -----
    def staged_locked(self, key: bytes) -> bytes | bytearray | mmap.mmap | None:
        """(Under `lock`.) The staged bytes of `key`, waiting out a copy in progress; None if not staged."""
        entry = self.blocks.get(key)
        deadline = time.monotonic() + PENDING_WAIT_S
        while isinstance(entry, Pending):
            if time.monotonic() > deadline:              # never expected: a copy takes milliseconds
                log.warning("ssd: the staging copy of a block took over %.0f s; served as a miss", PENDING_WAIT_S)
                return None
            self.lock.wait(0.1)
            entry = self.blocks.get(key)
        return entry

    def intact(self, key: bytes, out: memoryview, crc: int | None) -> bool:
        """A staged block's copy matches its writer's CRC-32C (True without one: the reader cannot verify it, and
        the slot will not claim it can). A copy that fails was altered before it was demoted: dropped, a miss."""
        if crc is None or crc32c(out) == crc:
            return True
        with self.lock:
            self.crc_mismatch += 1
            if self.crcs.get(key) == crc and not isinstance(self.blocks.get(key), Pending):
                self.forget_locked(key)
            gone = self.unstaged_locked([key])
        tell_watchers(gone)
        log.warning("ssd: a staged block does not match its writer's CRC-32C (its slot was written after commit): "
                    "served as a miss and dropped")
        return False

    def drop_locked(self, key: bytes) -> bool:
        """(Under `lock`.) Forget a staged copy (deleted): whether there was one. Its buffer is not reused: the
        writer may be writing from it."""
        return self.forget_locked(key) is not None

    def forget_locked(self, key: bytes) -> bytes | bytearray | mmap.mmap | Pending | None:
        """(Under `lock`.) Take a block out of staging (written, dropped or deleted): its entry, or None."""
        self.crcs.pop(key, None)
        staged = self.blocks.pop(key, None)
        if staged is not None:
            self.nbytes -= len(staged)
            tenant = self.tenants.pop(key, "")
            self.tenant_bytes[tenant] -= len(staged)
            if not self.tenant_bytes[tenant]:
                del self.tenant_bytes[tenant]
        return staged

    # ----- write-through hooks -----
    def want(self, keys: Sequence[bytes]) -> None:
        """These blocks wait for their write-through: should one be staged (evicted first), it is urgent."""
        with self.lock:
            self.wanted.update(keys)
            self.flag_locked(keys)

    def unwant(self, keys: Sequence[bytes]) -> None:
        """The write-throughs of these blocks are over (written, or no longer to be written)."""
        with self.lock:
            self.wanted.difference_update(keys)

    def when_written(self, keys: Sequence[bytes], done: Callable[[bytes], None]) -> None:
        """Call `done(key)` for each of `keys` once it is not staged any more (written and synced, dropped or
        deleted: `on_disk` says which); staged ones are flagged urgent. Keys not staged are reported at once, by
        this thread; the others by the thread that writes or drops them, outside the tier's lock."""
        now = []
        with self.lock:
            for k in keys:
                if k in self.blocks:
                    self.watchers.setdefault(k, []).append(done)
                else:
                    now.append(k)
            self.flag_locked(keys)
        for k in now:
            done(k)

    def staged_keys(self, digests: set[bytes]) -> list[bytes]:
        """Staged blocks of these namespaces (by digest): what a flush waits for besides the host pool's."""
        with self.lock:
            return [k for k in self.blocks if k[:16] in digests]

    def flag_locked(self, keys: Sequence[bytes]) -> None:
        flagged = False
        for k in keys:
            if k in self.blocks and k not in self.urgent:
                self.urgent[k] = None
                flagged = True
        if flagged:
            self.lock.notify_all()

    def unstaged_locked(self, keys: Sequence[bytes]) -> Watchers:
        """(Under `lock`.) Keys that may have left staging: no longer urgent; their watchers, to call after the
        lock is let go."""
        gone = []
        for k in keys:
            if k in self.blocks:
                continue
            self.urgent.pop(k, None)
            if k in self.watchers:
                gone.append((k, self.watchers.pop(k)))
        return gone


def tell_watchers(gone: Watchers) -> None:
    """Tell the watchers of keys that left staging (outside the tier's lock: they take their own)."""
    for key, watchers in gone:
        for done in watchers:
            done(key)
