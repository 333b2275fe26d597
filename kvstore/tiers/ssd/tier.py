"""The SSD tier as the daemon uses it: blocks evicted from the host pool are demoted here, and come back to the
host pool (promoted) when a client acquires or prefetches them.

`SsdTier` is what the daemon, the movers and the tests hold: a `LowerTier` (and a `DurableTier`, `TenantBooks` and
`PacedTier`) whose methods are those of its parts, all sharing one lock (`lock`, the staging area's):
- `staging` (`Staging`, kvstore.tiers.ssd.staging): the bounded staging area evicted blocks are copied into
  (`stage`, `fill`, `wait_room`), and the write-through hooks (`want`, `unwant`, `when_written`, `staged_keys`)
  that make staged blocks urgent;
- `demoter` (`Demoter`, kvstore.tiers.ssd.demoter): the writer thread that writes staged blocks to the store, and
  the write batches it shares with write-through (`announce`, `write`), which a delete cancels;
- `store` (`SsdStore`, kvstore.tiers.ssd.store): the record store, with its own books and lock;
and this module, the facade: lookups and reads (`has`, `read`, `read_async`), deletes, resize, the tenants' books
(kvstore.tiers.ssd.owners), stats, and `open_tier`, which builds the tier from the configuration.

Reads take staged bytes first, then the store; the store's reads verify every record, so a bad one ends the prefix
there. A block keeps its writer's CRC-32C all the way down: staged with it, checked against it before its record
is written (and the record keeps it), and checked again when a staged copy is promoted; a block whose bytes no
longer match is a miss, never served.

Blocks are addressed by block id (kvstore.tiers): the namespace digest + the block hash (32 bytes), stable across
restarts, unlike namespace ids. This is a `LowerTier`; `open_tier` builds it from the configuration.
Thread safety: `lock` guards the staging area and is held only for dict updates and copies; the store keeps its
own books; all disk I/O is a transfer on the traffic manager's SSD path. Callers never hold the daemon's state lock
across a read.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

from kvstore.tiers import StagingBuffer, TierContext, TierUnavailable, TierWrite
from kvstore.tiers.ssd.config import SsdConfig
from kvstore.tiers.ssd.demoter import Demoter
from kvstore.tiers.ssd.owners import SsdQuotas
from kvstore.tiers.ssd.staging import Staging, tell_watchers
from kvstore.tiers.ssd.store import SsdStore, StoreLocked
from kvstore.traffic import Lane, Path
from kvstore.workflows import Workflows

log = logging.getLogger("kvstore")
MIN_CAPACITY = 1 << 20


class SsdTier:
    name = "ssd"
    reads_in_pieces = True              # `read` takes on_piece (kvstore.tiers.LowerTier)

    def __init__(self, cfg: SsdConfig, path: Path | None = None, workflows: Workflows | None = None,
                 quotas: SsdQuotas | None = None) -> None:
        self.cfg = cfg
        self.persist_on_stop = cfg.persist_on_stop       # (DurableTier) a graceful stop writes the host pool here
        self.store = SsdStore(cfg.dir, cfg.capacity, cfg.sync, path, cfg.io, cfg.eviction, workflows, quotas)
        self.path = self.store.path
        self.staging = Staging(cfg, self.store)
        self.lock = self.staging.lock                   # the tier's one lock, shared by its parts
        self.demoter = Demoter(self.staging, self.store)

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
        self.demoter.start()
        return self

    @property
    def rewrites_saved(self) -> int:
        """Evicted blocks not written again: the tier held them already."""
        return self.staging.rewrites_saved

    # ----- demotion (staging.py, demoter.py) -----
    def stage(self, key: bytes, nbytes: int, crc: int | None = None) -> StagingBuffer | bool:
        """Book an evicted block for its SSD write: the buffer for `fill`; True if the tier holds it already;
        False (dropped, counted) when staging is full. Present for lookups and reads from here on."""
        return self.staging.stage(key, nbytes, crc)

    def wait_room(self, nbytes: int, timeout: float) -> int:
        """(Without the daemon's state lock.) Wait until `nbytes` of staging are free, or `timeout`; the free
        bytes (an operator's eviction moves blocks down in chunks that fit)."""
        return self.staging.wait_room(nbytes, timeout)

    def fill(self, key: bytes, buf: StagingBuffer, data: memoryview) -> None:
        """(Without the daemon's state lock.) Copy the evicted block's bytes into the buffer `stage` gave and
        publish it."""
        self.staging.fill(key, buf, data)

    def announce(self, keys: list[bytes]) -> None:
        """Announce the keys of a write batch before their bytes are taken (a delete from then on cancels them)."""
        self.demoter.announce(keys)

    def write(self, items: Sequence[TierWrite], lane: Lane) -> int:
        """Write announced blocks (block id, bytes, writer's CRC-32C or None) to the store in `lane`; a key
        deleted since `announce`, or whose bytes fail its CRC, is not published."""
        return self.demoter.write(items, lane)

    # ----- write-through hooks (staging.py) -----
    def want(self, keys: Sequence[bytes]) -> None:
        """These blocks wait for their write-through: should one be staged (evicted first), it is urgent."""
        self.staging.want(keys)

    def unwant(self, keys: Sequence[bytes]) -> None:
        """The write-throughs of these blocks are over (written, or no longer to be written)."""
        self.staging.unwant(keys)

    def when_written(self, keys: Sequence[bytes], done: Callable[[bytes], None]) -> None:
        """Call `done(key)` for each of `keys` once it is not staged any more (written and synced, dropped or
        deleted: `on_disk` says which); staged ones are flagged urgent."""
        self.staging.when_written(keys, done)

    def staged_keys(self, digests: set[bytes]) -> list[bytes]:
        """Staged blocks of these namespaces (by digest): what a flush waits for besides the host pool's."""
        return self.staging.staged_keys(digests)

    def on_disk(self, key: bytes) -> bool:
        """The block's record is written (and synced, unless ssd.sync is never)."""
        return self.store.has(key)

    # ----- reads -----
    def has(self, key: bytes) -> bool:
        return key in self.staging.blocks or self.store.has(key)

    def read(self, keys: Sequence[bytes], outs: Sequence[memoryview], lane: Lane = Lane.CRITICAL,
             on_ready: Callable[[int], None] | None = None, crcs: list[int | None] | None = None,
             on_piece: Callable[[int, int, int | None], None] | None = None) -> int:
        """Copy the longest prefix of `keys` that this tier holds and verifies into `outs`; returns its length.
        `on_ready(n)` reports the prefix as it grows (streaming gets); `crcs` receives each block's writer's
        CRC-32C (None where the writer gave none); `on_piece(i, nbytes, crc)` the verified start of block i
        while its critical read is still in flight, with its writer's CRC-32C once it is whole (reads.py)."""
        area = self.staging
        n = 0
        while n < len(keys):
            with self.lock:
                staged = area.staged_locked(keys[n])
                if staged is not None:
                    outs[n][:] = staged
                    crc = area.crcs.get(keys[n])
                    end = -1
                else:
                    end = n                                     # a run on disk, of one namespace
                    while end < len(keys) and keys[end] not in area.blocks and keys[end][:16] == keys[n][:16]:
                        end += 1
            if end < 0:                                     # reported outside the lock: on_ready takes others
                if not area.intact(keys[n], outs[n], crc):
                    return n
                n += 1
                if crcs is not None:
                    crcs.append(crc)
                if on_ready is not None:
                    on_ready(n)
                continue
            report = None if on_ready is None else (lambda k, base=n: on_ready(base + k))
            pieces = None if on_piece is None else (lambda k, nb, crc, base=n: on_piece(base + k, nb, crc))
            got = self.store.get_many(keys[n][:16], [k[16:] for k in keys[n:end]], outs[n:end], lane, report,
                                      crcs, pieces)
            if got < end - n:
                return n + got
            n = end
        return n

    def read_async(self, key: bytes, out: memoryview, lane: Lane,
                   on_done: Callable[[Future[Any]], None]) -> Future[Any] | None:
        """Submit one block's read as a transfer in `lane` (a staged block is copied by the transfer too, so that
        completions always arrive on a path worker); None if the tier does not hold it. Busy if the lane is full."""
        if key not in self.staging.blocks:
            return self.store.read_async(key, out, lane, on_done)
        return self.path.submit(lane, len(out), lambda: self._read_now(key, out), tag=key, on_done=on_done)

    def _read_now(self, key: bytes, out: memoryview) -> int | bool | None:
        """(A path worker.) The block from staging or, if it was written meanwhile, from the store: its writer's
        CRC-32C (None if none); False if it is gone or fails its CRC."""
        with self.lock:
            staged = self.staging.staged_locked(key)
            if staged is not None:
                out[:] = staged
                crc = self.staging.crcs.get(key)
        if staged is not None:
            return crc if self.staging.intact(key, out, crc) else False
        where = self.store.index.get(key)
        if where is None or where[0] != len(out):
            return False
        return self.store.read_into(key, self.store.files[where[0]], where[1], out)

    # ----- deletes and resize -----
    def delete(self, key: bytes) -> bool:
        return self.delete_many([key])[0]

    def delete_many(self, keys: Sequence[bytes]) -> list[bool]:
        """Forget blocks: staged copies at once, records durably (SsdStore.delete_many: one flush for all). A
        block in a write batch now is cancelled there, and the delete waits for that batch to end (it publishes
        nothing of it), so a kill -9 after the reply can never find the block's record written and synced."""
        staged_found = []
        with self.lock:
            for key in keys:
                staged_found.append(self.staging.drop_locked(key))
                self.demoter.cancel_locked(key)
            gone = self.staging.unstaged_locked(keys)
        tell_watchers(gone)
        self.demoter.wait_out(keys)
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
        """Per tenant: SSD quota, bytes used, borrowed, evictions, evictions for another tenant's writes; its
        evicted blocks staged (bytes) and dropped at its share of staging (staging.TENANT_SHARE)."""
        area = self.staging
        with self.lock:
            staged, dropped = dict(area.tenant_bytes), dict(area.dropped_share)
        with self.store.lock:
            rows = self.store.quotas.rows([*tenants, *dropped])
        for t, r in rows.items():
            r.update(ssd_staged_bytes=staged.get(t, 0), ssd_dropped_share=dropped.get(t, 0))
        return rows

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
        area = self.staging
        with self.lock:
            staged_blocks, staged_bytes, urgent = len(area.blocks), area.nbytes, len(area.urgent)
        return {"tier": "ssd", "capacity_bytes": self.cfg.capacity, "mapped_bytes": files, "used_bytes": used,
                "resident_bytes": allocated, "hole_bytes": files - allocated, "blocks": blocks,
                "segments": len(s.files), "staged_blocks": staged_blocks,
                "staged_bytes": staged_bytes, "staged_urgent": urgent, "dropped": area.dropped,
                "busy_retries": self.demoter.busy_retries,
                "rewrites_saved": area.rewrites_saved,
                "staged_crc_mismatch": area.crc_mismatch, "writer_restarts": self.demoter.worker.restarts,
                "counters": counters, "scan": s.scan_status(), "io": s.io,
                "namespaces": {d.hex(): n for d, n in s.by_namespace().items()}}

    def close(self) -> None:
        """Write what is staged, then close the store."""
        self.demoter.close()
        self.store.close()


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
