"""Write-through: blocks that engines store are also written to the SSD tier at once, in the store lane, so they
survive a daemon restart and their later eviction costs no disk write (DualPath persists each full block as soon as
it fills). Off by default (`ssd.write_through`): it spends SSD write bandwidth on blocks that may never be evicted.

No copy: the committed slot is pinned by the daemon itself and the SSD write reads straight from it; the pin is
dropped when the record is durable. Pinned bytes are bounded (`ssd.staging_bytes`): beyond the bound a block is
skipped (counted) and reaches the SSD tier the usual way, when it is evicted. A block deleted meanwhile is not
published on disk (the store drops a write whose key was deleted in flight).
"""
from __future__ import annotations

import logging
import threading
from collections import deque
from typing import TYPE_CHECKING

from kvstore.index.books import Holdings, NamespaceEntry
from kvstore.traffic import Lane

if TYPE_CHECKING:
    from kvstore.daemon.ops import State

log = logging.getLogger("kvstore")
BATCH = 32


class WriteThrough:
    def __init__(self, state: State, max_bytes: int) -> None:
        self.state = state
        self.max_bytes = max_bytes
        self.holder = Holdings()
        self.queue: deque[tuple[bytes, int, int, bytes]] = deque()   # (digest + hash, gid, bytes, index key)
        self.pinned_bytes = 0
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="kvstore-writethrough", daemon=True)
        self._thread.start()

    def committed(self, ns: NamespaceEntry, keys: list[bytes]) -> None:
        """(Under the state lock.) Queue the SSD writes of blocks just committed, pinning their slots."""
        idx = self.state.index
        for h in keys:
            key = ns.prefix + h
            gid = idx.table.get(key)
            if gid is None or (idx.ssd is not None and idx.ssd.has(ns.digest + h)):
                continue                            # gone already, or on SSD already (stored again)
            if self.pinned_bytes + ns.slot_bytes > self.max_bytes:
                idx.counters["write_through_skipped"] += 1
                continue
            idx._pin(key, gid)
            self.holder.pins[gid] += 1
            self.pinned_bytes += ns.slot_bytes
            self.queue.append((ns.digest + h, gid, ns.slot_bytes, key))
        self.state.changed.notify_all()

    def _run(self) -> None:
        st = self.state
        while True:
            with st.lock:
                while not self.queue and not self._stop:
                    st.changed.wait()
                if not self.queue:
                    return
                batch = [self.queue.popleft() for _ in range(min(BATCH, len(self.queue)))]
                live = [b for b in batch if st.index.table.get(b[3]) == b[1]]   # not deleted meanwhile
                views = [st.pool.view(gid) for _, gid, _, _ in live]
                ssd = st.index.ssd
                assert ssd is not None
                ssd.begin_batch([k for k, _, _, _ in live])    # a delete from now on cancels the write
            try:
                stored = ssd.write_batch([(k, v) for (k, _, _, _), v in zip(live, views)], Lane.STORE)
            except Exception:
                log.exception("ssd: a write-through batch of %d blocks failed; they stay in the host pool",
                              len(batch))
                stored = 0
            finally:
                for v in views:
                    v.release()
            with st.lock:
                st.index.counters["written_through"] += stored
                st.index.release([gid for _, gid, _, _ in batch], self.holder)
                self.pinned_bytes -= sum(n for _, _, n, _ in batch)

    def close(self) -> None:
        """Write what is queued (a graceful stop keeps it), then stop."""
        with self.state.lock:
            self._stop = True
            self.state.changed.notify_all()
        self._thread.join(timeout=60)


def persist_host_pool(state: State, seconds: float) -> tuple[int, int]:
    """(At a graceful stop, no client left.) Write the host pool's blocks that the SSD tier does not hold yet, so
    that a restart finds them; at most `seconds` long. Returns (written, left)."""
    import time

    st, idx, ssd = state, state.index, state.index.ssd
    assert ssd is not None
    deadline = time.monotonic() + seconds
    digests = {ns.prefix: ns.digest for ns in idx.namespaces.values()}
    todo = [(digests[key[:4]] + key[4:], gid) for key, gid in idx.table.items() if not ssd.has(
        digests[key[:4]] + key[4:])]
    written = 0
    for start in range(0, len(todo), BATCH):
        if time.monotonic() > deadline:
            break
        batch = todo[start:start + BATCH]
        views = [st.pool.view(gid) for _, gid in batch]
        try:
            ssd.begin_batch([k for k, _ in batch])
            written += ssd.write_batch([(k, v) for (k, _), v in zip(batch, views)], Lane.BACKGROUND)
        finally:
            for v in views:
                v.release()
    return written, len(todo) - written
