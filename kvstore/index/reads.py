"""What a connection reads from the host pool's books (the request side of the index, with kvstore.index.stores):
lookups, pins (`acquire`, a mover's `pin`) and their release, and the inspection walks. The pins themselves are
taken and dropped by `Removal` (kvstore.index.removal: a pin is what keeps a block from leaving); the holder's
share of the pool is checked by the `may_hold` it is given (kvstore.index.stores).

- `host_prefix` and `acquire` answer the longest contiguous prefix of the keys asked: a load takes only that prefix.
- A pinned block (acquired and not yet released) is never evicted, overwritten or freed. Pins belong to a
  connection (its `Holdings`) and are dropped with it.
- The operator's walks (`keys_some`) are made a chunk at a time: the caller may let go of the state lock between
  chunks (kvstore.index.sweep).
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from kvstore.index.errors import NotHeld
from kvstore.index.namespaces import Holdings, NamespaceEntry
from kvstore.index.removal import Removal
from kvstore.index.state import Books, seg_slot
from kvstore.index.sweep import SlotCursor
from kvstore.policy import Asking, Explaining
from kvstore.protocol.schemas import split_keys

if TYPE_CHECKING:
    from kvstore.workflows import Touch


class Reads:
    def __init__(self, books: Books, removal: Removal, may_hold: Callable[[Holdings, int], bool]) -> None:
        self.pool = books.pool
        self.table = books.table
        self.policy = books.policy
        self._asks = isinstance(books.policy, Asking)
        self.namespaces = books.namespaces
        self.counters = books.counters
        self.pending = books.pending
        self.pins = books.pins
        self.zombies = books.zombies
        self._advance = books.clock.advance
        self._may_hold = may_hold
        self._pin = removal.pin
        self._unpin = removal.unpin
        self._drain_step = removal.drain_step

    def asked(self, ns: NamespaceEntry, hashes: list[bytes] | bytes) -> None:
        """A lookup's or a get's chain (hashes, or a blob of them), head first, hit or not: told to a policy that
        learns from what requests ask (kvstore.policy.Asking: the history policy's shadows)."""
        if self._asks:
            keys = split_keys(hashes) if isinstance(hashes, bytes) else hashes
            self.policy.asked([ns.key(h) for h in keys], ns.cls)  # type: ignore[attr-defined]  # Asking

    def host_prefix(self, ns: NamespaceEntry, hashes: bytes) -> int:
        """How many leading blocks of `hashes` (a blob of 16-byte hashes) the host pool holds."""
        return self.table.prefix_len(ns.prefix, hashes)

    def holds(self, ns: NamespaceEntry, block_hash: bytes) -> bool:
        return ns.key(block_hash) in self.table

    def slot(self, ns: NamespaceEntry, block_hash: bytes) -> int | None:
        """The gid of a stored block, or None (no recency effect)."""
        return self.table.get(ns.key(block_hash))

    def acquire(self, ns: NamespaceEntry, hashes: list[bytes], holder: Holdings,
                touch: Touch | None = None) -> list[int]:
        """Pin the longest prefix in the host pool; returns its slots. `touch`: the request's hint context."""
        self._drain_step()
        gids = []
        for h in hashes:
            key = ns.key(h)
            gid = self.table.get(key)
            if gid is None:
                break
            if holder.pins[gid] == 0:
                if not self._may_hold(holder, ns.slot_bytes):
                    break
                holder.held_bytes += ns.slot_bytes
            self._pin(key, gid, touch)
            holder.pins[gid] += 1
            gids.append(gid)
        self.counters["gets"] += len(gids)
        ns.got += len(gids)
        self._advance()
        return gids

    def release(self, gids: list[int], holder: Holdings) -> None:
        need = Counter(gids)
        for gid, n in need.items():
            if holder.pins[gid] < n:
                raise NotHeld(f"slot {gid:#x} is not held {n} time(s) by this connection")
        self._drain_step()
        for gid, n in reversed(need.items()):    # unpinned tail first: the head becomes the most recent
            holder.pins[gid] -= n
            if holder.pins[gid] == 0:
                del holder.pins[gid]
                holder.held_bytes -= self.pool.segment_of(gid).slot_bytes   # still pinned: its segment is alive
            for _ in range(n):
                self._unpin(gid)

    def pin(self, ns: NamespaceEntry, block_hash: bytes, holder: Holdings) -> int | None:
        """Pin one stored block for a mover (write-through reads it from its slot); its gid, or None."""
        key = ns.key(block_hash)
        gid = self.table.get(key)
        if gid is not None:
            if holder.pins[gid] == 0:
                holder.held_bytes += ns.slot_bytes      # balanced by `release` (a mover has no cap)
            self._pin(key, gid)
            holder.pins[gid] += 1
        return gid

    def crcs_of(self, gids: list[int]) -> list[int | None]:
        out = []
        for gid in gids:
            seg, slot = seg_slot(self.pool, gid)
            out.append(seg.crc[slot])
        return out

    # ----- inspection -----
    def stats(self) -> dict[str, int]:
        out = {"blocks": len(self.table), "reserved": len(self.pending), "pinned": len(self.pins),
               "zombies": len(self.zombies), "namespaces": len(self.namespaces),
               "namespaces_forgotten": self.namespaces.forgotten}
        if isinstance(self.policy, Explaining):     # the workflow policy: retired and active blocks
            c = self.policy.counts()
            if c:
                out.update(retired_blocks=c.get("retired", 0), active_blocks=c.get("active", 0))
        return out

    def blocks(self) -> Iterator[tuple[NamespaceEntry, bytes, int]]:
        """Every block in the host pool: (namespace, block hash, gid), from a snapshot."""
        for key, gid in self.table.items():
            yield self.namespaces.owner(key), key[4:], gid

    def walk(self, ns: NamespaceEntry) -> SlotCursor:
        """A walk over the namespace's blocks, for `keys_some` (kvstore.index.sweep)."""
        return SlotCursor(ns.slot_key, ns.prefix)

    def keys_some(self, cursor: SlotCursor, max_slots: int, limit: int) -> list[tuple[bytes, int]]:
        """Up to `limit` more of a namespace's blocks (block hash, gid) along its walk, looking at most
        `max_slots` slots; the caller may let go of the state lock between two calls."""
        return [(key[4:], gid) for key, gid in cursor.chunk(self.pool, self.table, max_slots, limit)]
