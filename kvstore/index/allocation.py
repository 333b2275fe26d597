"""A slot within the cap for a new block (part of the capacity books, kvstore.index.capacity). It decides which
block or segment makes room; the blocks and segments leave through `Removal` (kvstore.index.removal), its
collaborator.

- Allocation never charges more than the pool's cap: a full size class evicts the policy's victim and takes its
  slot, or retires an idle segment of another class (block size or tenant) whose victim is staler (memory follows
  use), or reclaims an idle segment of another class, or answers "no space".
- A tenant within its quota takes borrowed memory back before it evicts its own; which segments a tenant may take
  is the quotas' call (kvstore.index.quotas).
- A segment that changes tenants is compacted first, so that its owner loses its coldest blocks, not the ones
  that happened to share the segment; one that stays with its tenant moves only when mostly stale.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

from kvstore.index.capacity import STALE_SAMPLE
from kvstore.index.namespaces import SlotKey
from kvstore.index.removal import Removal
from kvstore.index.state import Books, seg_slot
from kvstore.policy import Admitting, EvictionPolicy, Routing
from kvstore.tiers.host import Segment, gid_of

if TYPE_CHECKING:
    from kvstore.workflows import Touch


class Allocation:
    def __init__(self, books: Books, removal: Removal) -> None:
        self._books = books             # `compacting` is set here while a compaction runs
        self.pool = books.pool
        self.table = books.table
        self.policy = books.policy
        self._admits = books.policy.admits if isinstance(books.policy, Admitting) else None   # checked once
        self.namespaces = books.namespaces
        self.quotas = books.quotas
        self.counters = books.counters
        self.pins = books.pins
        self._used_at = books.clock.used_at
        self._remove = removal.remove
        self._retire = removal.retire
        self._evict_for_slot = removal.evict_for_slot

    def allocate(self, slot: SlotKey, cls: int, protect: set[bytes] | None = None,
                 touch: Touch | None = None, coming: bytes | None = None) -> int | None:
        """A slot of the class `slot` (tenant, slot bytes), whose eviction class is `cls`. With `protect` (a put's
        own chain, given only where an eviction drops the block: no lower tier), None rather than evict one of its
        blocks, or — Belady's bypass, estimated — a block the policy values above the block coming (`admits`, with
        the request's hint context `touch` and the key `coming`). A tenant within its quota takes borrowed memory
        back before it evicts its own (kvstore.index.quotas)."""
        tenant, slot_bytes = slot
        q = self.quotas
        unit = self.pool.segment_size(slot_bytes)
        t0 = 0.0
        while True:
            gid = self.pool.allocate(slot_bytes, tenant, grow=q.may_grow(tenant, unit))
            if gid is not None:
                if t0:
                    q.reclaim_seconds.observe(time.perf_counter() - t0)
                return gid
            if q.active and q.within(tenant, unit):
                seg = q.borrowed_segment(tenant)
                if seg is not None:             # ScaleUp: one segment of borrowed memory comes back
                    t0 = t0 or time.perf_counter()
                    q.took(seg, tenant, reclaim=True)
                    self._hand_over(seg, tenant)
                    continue
            key = self.policy.victim(cls)
            stale = self._staler_segment(slot, key) if len(self.pool.classes) > 1 else None
            if stale is not None:
                q.took(stale, tenant, reclaim=False)
                self._hand_over(stale, tenant)      # memory moves to this class: a new segment fits
            elif protect is not None and key is not None and (key in protect
                                                              or not self._admitted(key, touch, coming)):
                self.counters["kept_own_chain" if key in protect else "not_admitted"] += 1
                return None
            elif key is not None:
                gid = self._evict_for_slot(key)
                if gid:
                    return gid
            elif not self._reclaim_other(slot):
                return None

    def _admitted(self, victim: bytes, touch: Touch | None, coming: bytes | None) -> bool:
        """Whether the policy would evict `victim` for the block `coming` of the request `touch` (hints, or None;
        always under a policy that cannot tell: LRU admits everything)."""
        return self._admits is None or self._admits(victim, touch, coming)

    def _staler_segment(self, slot: SlotKey, victim: bytes | None) -> Segment | None:
        """An idle segment of another class (block size or tenant) whose next victim was used before ours: the
        whole segment goes, so that memory follows use across classes instead of staying with whoever filled the
        pool first. Looks at one candidate per class: O(classes)."""
        if victim is None:
            return None
        seg, i = self._where(victim)
        mine = seg.used[i]
        best: tuple[int, Segment] | None = None
        now = time.monotonic()
        for other, cls in self.namespaces.classes.items():
            key = self.policy.victim(cls) if other != slot else None
            if key is None:
                continue
            seg, i = self._where(key)
            used = seg.used[i]
            if seg.busy == 0 and not seg.draining and used < mine and (best is None or used < best[0]) \
                    and self.quotas.may_take(seg, slot[0], self._used_at(used), now) \
                    and (seg.tenant != slot[0] or self._mostly_stale(seg, mine)):
                best = (used, seg)
        return None if best is None else best[1]

    @staticmethod
    def _mostly_stale(seg: Segment, mine: int) -> bool:
        """Whether at least half the segment's blocks were last used before the taker's coldest block (`mine`).
        A segment moving to another block size of its tenant leaves with every block in it (no compaction: that
        is for memory changing tenants), so the coldest block alone must not decide: a class that lives in one
        segment would lose its hot blocks with its stale ones each time the other class grows (measured,
        bench_forkkv: a residual class wiped every ~80 requests). It runs on allocations that find the pool full,
        so it looks at STALE_SAMPLE slots evenly spread, not all of them: ~4 µs here, where a scan of a 4096-slot
        segment took ~270 (17 µs for 256)."""
        live = stale = 0
        step = max(1, seg.nslots // STALE_SAMPLE)
        for key, used in zip(seg.keys[::step], seg.used[::step]):
            if key is not None:
                live += 1
                stale += used < mine
        return 2 * stale >= live

    def _where(self, key: bytes) -> tuple[Segment, int]:
        gid = self.table.get(key)
        assert gid is not None, "a policy victim is always a stored block"
        return seg_slot(self.pool, gid)

    def _reclaim_other(self, slot: SlotKey) -> bool:
        """Free a whole idle segment of another class (fewest blocks first) so this one can grow: one the tenant's
        quota lets it take (kvstore.index.quotas)."""
        now = time.monotonic()
        idle = [s for s in self.pool.segments.values() if s.slot_key != slot and s.busy == 0 and not s.draining
                and self.quotas.may_take(s, slot[0], self._cold_at(s), now)]
        while idle and not self.pool.fits(slot[1]):
            seg = min(idle, key=lambda s: s.live)
            idle.remove(seg)
            self.quotas.took(seg, slot[0], reclaim=False)
            self._hand_over(seg, slot[0])
        return self.pool.fits(slot[1]) and self.quotas.may_grow(slot[0], self.pool.segment_size(slot[1]))

    def _cold_at(self, seg: Segment) -> float:
        """When the coldest block of the segment's class was last used (now if it has none)."""
        cls = self.namespaces.classes.get(seg.slot_key)
        key = self.policy.victim(cls) if cls is not None else None
        if key is None:
            return time.monotonic()
        other, i = self._where(key)
        return self._used_at(other.used[i])

    # ----- memory moving between tenants -----
    def _hand_over(self, seg: Segment, taker: str) -> None:
        """Retire `seg` for an allocation of `taker`; a segment of another tenant is compacted first, so that its
        owner loses its coldest blocks, not the ones that shared the segment. (Under a policy that follows a block
        to its new slot, `moved`: both do — LRU's books are by key, the workflow policy carries its row along.)"""
        if seg.tenant != taker:
            self._compact(seg)
        self._retire(seg, for_room=True)

    def _policy_of(self, seg: Segment) -> EvictionPolicy:
        """The policy of the segment's class (its tenant's, where tenants chose their own: kvstore.policy.tenants)."""
        cls = self.namespaces.classes.get(seg.slot_key)
        return self.policy.for_class(cls) if isinstance(self.policy, Routing) and cls is not None else self.policy

    def _compact(self, seg: Segment) -> int:
        """Move the segment's most recently used unpinned blocks, up to `quotas.compact_bytes`, into free slots of
        its owner's other segments of that size, evicting the owner's coldest blocks there for room (copied down at
        once: their slots are written next). A block that is itself the coldest leaves with the segment, and so do
        the blocks beyond the budget (their copies made off the lock, as for any retiring segment). Under the state
        lock: at most twice the budget in copies (16 MiB: a few ms here). Returns the blocks moved."""
        cls = self.namespaces.classes.get(seg.slot_key)
        budget = self.quotas.compact_bytes // seg.slot_bytes
        if cls is None or budget <= 0:
            return 0
        self.pool.drain(seg)                            # its free slots are no one's from here on
        self._books.compacting = seg                    # ... and it stays until `_retire` releases or lends it
        hot = sorted((s for s in range(seg.nslots) if seg.keys[s] is not None), key=lambda s: -seg.used[s])
        moved = 0
        try:
            for slot in hot[:budget]:
                key, gid = seg.keys[slot], gid_of(seg.id, slot)
                if key is None or self.table.get(key) != gid or self.pins[gid]:
                    continue
                dst = self._room_beside(seg, cls, key)
                if dst is None:
                    break                               # nothing of the owner is colder: the rest go with it
                if dst:
                    self._move(key, gid, dst)
                    moved += 1
        finally:
            self._books.compacting = None
        self.counters["blocks_compacted"] += moved
        return moved

    def _room_beside(self, seg: Segment, cls: int, key: bytes) -> int | None:
        """A free slot for `key` in another segment of its class: a free one, else one freed by evicting the
        class's coldest block (its copy down made now). 0 when `key` itself was evicted as the coldest; None when
        the class has no block left to evict outside `seg`."""
        while True:
            gid = self.pool.allocate(seg.slot_bytes, seg.tenant, grow=False)
            if gid is not None:
                return gid
            victim = self.policy.victim(cls)
            if victim is None:
                return None
            at = self.table.get(victim)
            self._remove(victim, evicted=True, now=True)
            if victim == key:
                return 0
            if at is not None and at >> 32 == seg.id:
                continue                                # it was in the segment anyway: no room made elsewhere

    def _move(self, key: bytes, src: int, dst: int) -> None:
        """Relocate an unpinned block between two slots of one class: bytes, CRC, recency; its key keeps its place in
        the policy's order, which the policy is told once the key table maps the key to `dst` (`moved`; no client
        holds the old slot: only pinned slots are read by clients)."""
        s_seg, s = seg_slot(self.pool, src)
        d_seg, d = seg_slot(self.pool, dst)
        with self.pool.view(src) as a, self.pool.view(dst) as b:
            b[:] = a
        d_seg.keys[d], d_seg.used[d], d_seg.crc[d] = key, s_seg.used[s], s_seg.crc[s]
        self.table.set_value(key, dst)
        self.policy.moved(key, src, dst)
        self.pool.free(src)
