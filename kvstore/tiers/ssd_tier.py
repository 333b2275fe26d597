"""The SSD tier as the daemon uses it: blocks evicted from the host pool are demoted here, and come back to the
host pool (promoted) when a client acquires them.

Demotion never makes eviction wait for the disk: the evicted block's bytes are copied into a bounded staging area
(memory outside the host pool, `ssd.staging_bytes`) and the slot is free at once; a background thread writes staged
blocks to the record store in batches. A block staged or stored is present for lookups. When staging is full an
evicted block is dropped, and counted. Reads take staged bytes first, then the store; the store's reads verify every
record, so a bad one ends the prefix there.

Keys here are the namespace digest + the block hash (32 bytes): stable across restarts, unlike namespace ids.
Thread safety: `lock` guards the staging area and is held only for dict updates and copies, so eviction (under the
daemon's state lock) never waits for the disk; `io` serialises the store. Callers never hold the daemon's state
lock across a read.
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Any

from kvstore.config import SsdConfig
from kvstore.tiers.ssd import SsdStore

log = logging.getLogger("kvstore")
WRITE_BATCH = 32


class SsdTier:
    def __init__(self, cfg: SsdConfig) -> None:
        self.cfg = cfg
        self.store = SsdStore(cfg.dir, cfg.capacity, cfg.sync)
        self.staging: dict[bytes, bytes] = {}
        self.staged_bytes = 0
        self.dropped = 0
        self.rewrites_saved = 0
        self.lock = threading.Condition()
        self.io = threading.Lock()
        self._stop = False
        self._writing: set[bytes] = set()
        self._thread = threading.Thread(target=self._run, name="kvstore-demote", daemon=True)

    def open(self) -> "SsdTier":
        def progress(done: int, total: int) -> None:
            log.info("ssd: scanned %d/%d files of %s", done, total, self.cfg.dir)

        self.store.open(progress)
        log.info("ssd: %d block(s) ready in %s (%d bytes of %d)", len(self.store.index), self.cfg.dir,
                 self.store.used_bytes(), self.cfg.capacity)
        self._thread.start()
        return self

    # ----- demotion -----
    def demote(self, key: bytes, data: memoryview) -> bool:
        """Stage a copy of an evicted block for its SSD write; False (dropped, counted) when staging is full.
        A block the tier holds already is not written again: a key names its bytes (a chained hash of the tokens,
        in one namespace), and a delete removes the SSD copy too."""
        with self.lock:
            if key in self.staging or key in self.store.index:
                self.rewrites_saved += 1
                return True
            if self.staged_bytes + len(data) > self.cfg.staging_bytes:
                self.dropped += 1
                return False
            old = self.staging.pop(key, None)
            self.staged_bytes += len(data) - (len(old) if old is not None else 0)
            self.staging[key] = bytes(data)
            self.lock.notify()
        return True

    def _run(self) -> None:
        while True:
            with self.lock:
                while not self.staging and not self._stop:
                    self.lock.wait()
                if not self.staging and self._stop:
                    return
                batch = list(self.staging.items())[:WRITE_BATCH]
            with self.io:
                self.store.put_many([(k[:16], k[16:], v) for k, v in batch])
            with self.lock:
                for k, v in batch:
                    if self.staging.get(k) is v:           # not deleted or staged again meanwhile
                        del self.staging[k]
                        self.staged_bytes -= len(v)

    # ----- reads -----
    def has(self, key: bytes) -> bool:
        with self.lock:
            return key in self.staging or key in self.store.index

    def read(self, keys: Sequence[bytes], outs: Sequence[memoryview]) -> int:
        """Copy the longest prefix of `keys` that this tier holds and verifies into `outs`; returns its length."""
        n = 0
        while n < len(keys):
            with self.lock:
                staged = self.staging.get(keys[n])
                if staged is not None:
                    outs[n][:] = staged
                    n += 1
                    continue
                end = n                                     # a run on disk, of one namespace
                while end < len(keys) and keys[end] not in self.staging and keys[end][:16] == keys[n][:16]:
                    end += 1
            with self.io:
                got = self.store.get_many(keys[n][:16], [k[16:] for k in keys[n:end]], outs[n:end])
            if got < end - n:
                return n + got
            n = end
        return n

    def delete(self, key: bytes) -> bool:
        with self.lock:
            staged = self.staging.pop(key, None)
            if staged is not None:
                self.staged_bytes -= len(staged)
        with self.io:
            return self.store.delete(key[:16], key[16:]) or staged is not None

    def resize(self, capacity: int) -> int:
        with self.io:
            self.cfg.capacity = capacity
            return self.store.resize(capacity)

    # ----- inspection -----
    def stats(self) -> dict[str, Any]:
        with self.io, self.lock:
            s = self.store
            return {"tier": "ssd", "capacity_bytes": self.cfg.capacity, "mapped_bytes": s.file_bytes(),
                    "used_bytes": s.used_bytes(), "resident_bytes": s.file_bytes(), "blocks": len(s.index),
                    "segments": len(s.files), "staged_blocks": len(self.staging), "staged_bytes": self.staged_bytes,
                    "dropped": self.dropped, "rewrites_saved": self.rewrites_saved, "counters": dict(s.counters),
                    "namespaces": {d.hex(): n for d, n in s.by_namespace().items()}}

    def close(self) -> None:
        """Write what is staged, then close the store."""
        with self.lock:
            self._stop = True
            self.lock.notify()
        self._thread.join()
        self.store.close()
