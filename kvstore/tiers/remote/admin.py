"""The remote tier's operator side: deletes, the books per namespace, the stats row, and the stop.

- A delete forgets blocks here at once — staged (its room back, or back once the writer has it: writeback.py),
  announced for a write-through (cancelled: puts.py), known, put here, quarantined — and removes them from the store
  as a background transfer: a delete is a delete for every node sharing the namespace.
- The store's capacity is the segments its nodes contribute (remote.segment_bytes on each node): it is not resized
  from here.
- `stats`: the tier's row (capacity: the segment this node lends the store; blocks: those it put or staged), its
  books, whether the store answers (link.py) and the tier's counters; its network path's lanes are in the traffic
  stats (path `net`).
- `close`: a graceful stop puts what is staged for at most CLOSE_FLUSH_S (while the store answers), stops the link
  and writer threads, then the network path (no transfer may call the client after its close), then the client,
  and unmaps the registered memory.
"""
from __future__ import annotations

import time
from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from kvstore.tiers.remote.wire import TierPart, Wire

if TYPE_CHECKING:
    from kvstore.tiers.remote.books import Books
    from kvstore.tiers.remote.link import Link
    from kvstore.tiers.remote.writeback import WriteBack

CLOSE_FLUSH_S = 5.0             # a graceful stop puts what is staged for at most this long


class Admin(TierPart):
    def __init__(self, wire: Wire, link: Link, books: Books, writeback: WriteBack, placement: str,
                 write_back: bool) -> None:
        super().__init__(wire)
        self.link = link
        self.books = books
        self.writeback = writeback
        self.placement = placement
        self.write_back = write_back

    def delete(self, bid: bytes) -> bool:
        return self.delete_many([bid])[0]

    def delete_many(self, bids: Sequence[bytes]) -> list[bool]:
        """Forget blocks here and in the store (the store's removal is a background transfer: a delete is a
        delete for every node sharing the namespace)."""
        found = []
        now = time.monotonic()
        b = self.books
        with self.lock:
            for bid in bids:
                found.append(b.has_locked(bid, now) or bid in b.announced)
                s = b.staged.get(bid)
                if s is not None:
                    s.deleted = True
                    if s.filled and not s.putting and self.staging is not None:   # else its fill or put gives
                        self.writeback.unstage(bid, s)                            # its room back
                    elif b.staged.get(bid) is s:
                        del b.staged[bid]                    # out of the books now: a new stage books anew
                b.announced.discard(bid)
                b.bad.pop(bid, None)
                b.forgot_locked([bid])
        if any(found):
            b.remove_later([bid for bid, f in zip(bids, found) if f])
        return found

    def resize(self, capacity: int) -> dict[str, Any]:
        raise RuntimeError("remote: the store's capacity is the segments its nodes contribute "
                           "(remote.segment_bytes on each node); it is not resized from here")

    def namespaces(self) -> dict[bytes, int]:
        with self.lock:
            c = Counter(b[:16] for b in self.books.mine)
            c.update(b[:16] for b, s in self.books.staged.items() if not s.deleted)
        return dict(c)

    def stats(self) -> dict[str, Any]:
        """The tier's row (capacity: the segment this node lends the store; blocks: those it put or staged) and
        its books; its network path's lanes are in the traffic stats (path `net`)."""
        b, link = self.books, self.link
        with self.lock:
            staged = sum(s.nbytes for s in b.staged.values())
            mapped = (self.staging.size if self.staging is not None else 0) + self.pad.size
            return {"tier": self.name, "capacity_bytes": self.cfg.segment_bytes, "mapped_bytes": mapped,
                    "used_bytes": staged + b.mine_bytes, "resident_bytes": mapped,
                    "blocks": len(b.mine) + len(b.staged), "put_here_bytes": b.mine_bytes,
                    "endpoint": dict(self.client.endpoint),
                    "segments": 1, "kind": "mooncake", "master": self.cfg.master, "up": link.up,
                    "down_s": 0.0 if link.up else round(time.monotonic() - link.down_since, 3),
                    "last_error": "" if link.up else link.last_error, "placement": self.placement,
                    "replicas": self.cfg.replicas, "blocks_put_here": len(b.mine), "blocks_known": len(b.known),
                    "blocks_quarantined": len(b.bad), "staged_blocks": len(b.staged), "staged_bytes": staged,
                    "staging_capacity": self.staging.size if self.staging is not None else 0,
                    "counters": dict(self.counters), "seconds": dict(self.seconds)}

    def close(self) -> None:
        """Put what is staged (for at most CLOSE_FLUSH_S), then let go of the store."""
        deadline = time.monotonic() + CLOSE_FLUSH_S
        with self.cond:
            while self.writeback.queue and self.link.up and time.monotonic() < deadline:
                self.cond.wait(0.05)
            self.link.stopping = True
            self.cond.notify_all()
        if self.write_back:
            self.writeback.thread.join(timeout=CLOSE_FLUSH_S)
        self.link.thread.join(timeout=1.0)
        self.path.close()                            # no transfer may call the client after its close
        self.client.close()
        if self.staging is not None:
            self.staging.close()
        self.pad.close()
