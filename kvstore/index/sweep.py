"""Walks over one namespace's blocks that an operator's op (`list` of its keys, `evict` of it) makes a chunk at a
time, letting go of the daemon's state lock between chunks: other clients' requests run meanwhile instead of
waiting behind a scan of the whole key table.

A walk follows the segments of the namespace's slot class (all its blocks live there: its tenant and block size) in
id order, slot by slot, and reads each slot's key from the segment's reverse map, not from the key table, whose
open addressing moves entries on inserts and deletes. Slots never move and segment ids only grow, so across chunks
a block present for the whole walk is visited exactly once, a block stored meanwhile may or may not be, and a
segment released meanwhile is simply not there any more. A slot counts only if the key table still maps its key
to it (a block deleted while pinned leaves its key in the slot until the last release).

Cost: the slots of the namespace's class (its blocks, its class-mates' and the free slots), never the whole table;
no memory per key. Per-namespace key sets kept as the index changes would have made a walk cost only the
namespace's own blocks, at about 85 bytes a key in Python sets (1 M keys; the native key table itself holds a key
in about 88 at that size).
"""
from __future__ import annotations

from dataclasses import dataclass

from kvstore.index.keytable import KeyTable
from kvstore.index.namespaces import SlotKey
from kvstore.tiers.host import HostPool


@dataclass(slots=True)
class SlotCursor:
    """Where a walk over the namespace with key prefix `prefix` (in slot class `slot_key`) stands."""
    slot_key: SlotKey
    prefix: bytes
    seg_id: int = 0         # the next slot to look at: (segment id, slot index)
    slot: int = 0
    done: bool = False      # the class's last slot was looked at

    def chunk(self, pool: HostPool, table: KeyTable, max_slots: int, max_found: int) -> list[tuple[bytes, int]]:
        """(Under the state lock.) The namespace's stored blocks, as (index key, gid), among the next `max_slots`
        slots, stopping after `max_found` of them; moves the cursor on, and sets `done` at the class's end."""
        found: list[tuple[bytes, int]] = []
        cls = pool.classes.get(self.slot_key)
        segments = [] if cls is None else [s for s in cls.segments.values() if s.id >= self.seg_id]
        budget = max_slots
        for seg in segments:                    # in id order: segments are added to their class as created
            if seg.id != self.seg_id:
                self.seg_id, self.slot = seg.id, 0
            end = min(seg.nslots, self.slot + budget)
            keys, base, prefix = seg.keys, seg.id << 32, self.prefix
            for i in range(self.slot, end):
                key = keys[i]
                if key is not None and key.startswith(prefix) and table.get(key) == base | i:
                    found.append((key, base | i))
                    if len(found) >= max_found:
                        self.slot = i + 1
                        return found
            budget -= end - self.slot
            self.slot = end
            if budget <= 0:
                return found
        self.done = True
        return found
