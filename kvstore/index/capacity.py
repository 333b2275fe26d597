"""The host pool's capacity books: which slot a new block gets, which block leaves when there is none, and which
segments go when the pool shrinks. Decisions only: the pool (kvstore.tiers.host) owns the memory, the policy
(kvstore.policy) ranks the candidates, and each evicted block is handed, as an `Eviction`, to the sink the daemon
gave (the demotion mover), which may hold its slot until it has copied the bytes.

- Allocation never exceeds the pool's cap: a full size class evicts the policy's victim and takes its slot, or
  retires an idle segment of another block size whose victim is staler (memory follows use), or reclaims an idle
  segment of another size, or answers "no space".
- A pinned block is never evicted; a segment chosen for release drains: it allocates nothing and goes when its
  last pin or reservation does. Shrinking costs the blocks in the released segments, never the pool's size.
"""
from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass
from typing import Protocol

from kvstore.index.keytable import KeyTable
from kvstore.index.namespaces import Namespaces, SlotKey
from kvstore.policy import EvictionPolicy
from kvstore.tiers.host import HostPool, Segment, gid_of, split_gid


@dataclass(frozen=True, slots=True)
class Eviction:
    """A block leaving the host pool, as the books decided it."""
    block_id: bytes         # namespace digest + block hash: its name in the lower tiers
    gid: int                # the slot it occupied
    nbytes: int
    handed_over: bool       # the slot goes to the evicting caller, who writes it only after the sink copied it
    draining: bool          # the slot's segment is being released: a copy must be made now


class EvictionSink(Protocol):
    def __call__(self, e: Eviction) -> bool:
        """(Under the state lock.) Take note of an eviction; True to hold the slot (pinned) until `let_go`."""
        ...


@dataclass(slots=True)
class ResizeResult:
    capacity: int
    released_segments: int
    evicted: int
    draining_bytes: int
    seconds: float


class CapacityBooks:
    """The capacity half of the index (see `kvstore.index.books.Index`, which adds reads and two-phase stores)."""
    pool: HostPool
    table: KeyTable
    policy: EvictionPolicy
    namespaces: Namespaces
    pins: Counter[int]
    zombies: dict[int, bytes]
    counters: Counter[str]
    on_evict: EvictionSink | None

    def _unpin(self, gid: int) -> None: raise NotImplementedError

    # ----- operator eviction and resize -----
    def evict(self, nid: int | None = None, nbytes: int = 0, everything: bool = False) -> tuple[int, int]:
        """Evict unpinned blocks until `nbytes` are freed or, with `everything`, all of them: by the policy's
        order per size class, or for one namespace in table order (an operator's clean-up, not a hot path).
        Returns (blocks, bytes)."""
        blocks = freed = 0
        if nid is not None:
            ns = self.namespaces.by_id[nid]
            for key, gid in [(k, g) for k, g in self.table.items() if k[:4] == ns.prefix]:
                if (everything or freed < nbytes) and self.pins[gid] == 0 and self._remove(key, evicted=True):
                    blocks, freed = blocks + 1, freed + ns.slot_bytes
            return blocks, freed
        for (_, slot_bytes), cls in list(self.namespaces.classes.items()):
            while everything or freed < nbytes:
                victim = self.policy.victim(cls)
                if victim is None:
                    break
                self._remove(victim, evicted=True)
                blocks, freed = blocks + 1, freed + slot_bytes
        return blocks, freed

    def resize(self, capacity: int) -> ResizeResult:
        """Grow: raise the cap (segments come when needed). Shrink: release whole segments — idle ones with the
        fewest blocks first, evicting only their unpinned blocks; segments with pins drain and go at the last
        release. Cost: the blocks in the released segments, never the pool's size."""
        t0 = time.perf_counter()
        self.pool.capacity = capacity
        released = evicted = 0
        over = self.pool.mapped_bytes - capacity - self._draining_bytes()
        if over > 0:
            for seg in sorted(self.pool.segments.values(), key=lambda s: (s.busy > 0, s.live)):
                if over <= 0:
                    break
                if seg.draining:
                    continue
                evicted += self._retire(seg)
                over -= seg.size
                released += seg.id not in self.pool.segments
        return ResizeResult(capacity, released, evicted, self._draining_bytes(), time.perf_counter() - t0)

    def _draining_bytes(self) -> int:
        return sum(s.size for s in self.pool.segments.values() if s.draining)

    # ----- allocation -----
    def _allocate(self, slot: SlotKey, cls: int) -> int | None:
        """A slot of the class `slot` (tenant, slot bytes), whose eviction class is `cls`."""
        tenant, slot_bytes = slot
        while True:
            gid = self.pool.allocate(slot_bytes, tenant)
            if gid is not None:
                return gid
            key = self.policy.victim(cls)
            stale = self._staler_segment(slot, key) if len(self.pool.classes) > 1 else None
            if stale is not None:
                self._retire(stale, inline=True)   # memory moves to this block size: a new segment fits
            elif key is not None:
                gid = self._evict_for_slot(key)
                if gid:
                    return gid
            elif not self._reclaim_other(slot):
                return None

    def _staler_segment(self, slot: SlotKey, victim: bytes | None) -> Segment | None:
        """An idle segment of another class (block size or tenant) whose next victim was used before ours: the
        whole segment goes, so that memory follows use across classes instead of staying with whoever filled the
        pool first. Looks at one candidate per class: O(classes)."""
        if victim is None:
            return None
        seg, i = self._where(victim)
        mine = seg.used[i]
        best: tuple[int, Segment] | None = None
        for other, cls in self.namespaces.classes.items():
            key = self.policy.victim(cls) if other != slot else None
            if key is None:
                continue
            seg, i = self._where(key)
            used = seg.used[i]
            if seg.busy == 0 and not seg.draining and used < mine and (best is None or used < best[0]):
                best = (used, seg)
        return None if best is None else best[1]

    def _where(self, key: bytes) -> tuple[Segment, int]:
        gid = self.table.get(key)
        assert gid is not None, "a policy victim is always a stored block"
        return self._seg_slot(gid)

    def _seg_slot(self, gid: int) -> tuple[Segment, int]:
        seg_id, slot = split_gid(gid)
        return self.pool.segments[seg_id], slot

    def _reclaim_other(self, slot: SlotKey) -> bool:
        """Free a whole idle segment of another class (fewest blocks first) so this one can grow."""
        idle = [s for s in self.pool.segments.values() if s.slot_key != slot and s.busy == 0 and not s.draining]
        while idle and not self.pool.fits(slot[1]):
            seg = min(idle, key=lambda s: s.live)
            idle.remove(seg)
            self._retire(seg, inline=True)
        return self.pool.fits(slot[1])

    # ----- leaving the pool -----
    def _retire(self, seg: Segment, inline: bool = False) -> int:
        """Drain a segment and evict its unpinned blocks; it is released now if nothing holds it, else at the
        last release or commit. Returns the blocks evicted."""
        self.pool.drain(seg)
        seg.urgent = inline
        n = self._empty(seg)
        if seg.live == 0 and seg.id in self.pool.segments:
            self.pool.release(seg, inline)
        return n

    def _empty(self, seg: Segment) -> int:
        """Evict every unpinned block of a segment; returns how many."""
        n = 0
        for slot, key in enumerate(seg.keys):
            # the key may since live elsewhere (deleted while pinned here, then stored again): check the slot
            gid = gid_of(seg.id, slot)
            if key is not None and self.table.get(key) == gid and self.pins[gid] == 0:
                self._remove(key, evicted=True)
                n += 1
        return n

    def _evict_for_slot(self, key: bytes) -> int:
        """Evict the victim `key` for its slot: its gid, still allocated and now the caller's, who writes it only
        after the eviction sink has copied the block; 0 when the slot cannot be handed over (pinned, or its
        segment drains): the block is then evicted as usual and the caller allocates again."""
        gid = self.table.get(key)
        if gid is None or self.pins[gid] or self.pool.segment_of(gid).draining:
            self._remove(key, evicted=True)
            return 0
        self._remove(key, evicted=True, keep=True)
        return gid

    def _remove(self, key: bytes, evicted: bool = False, keep: bool = False) -> bool:
        """Take a block out of the host pool; an evicted one goes to the eviction sink, which may hold its slot.
        With `keep` (only from `_evict_for_slot`), its unpinned slot stays allocated for the caller."""
        gid = self.table.remove(key)
        if gid is None:
            return False
        ns = self.namespaces.owner(key)
        ns.blocks -= 1
        if evicted:
            self.counters["evictions"] += 1
            if self.on_evict is not None:
                seg = self.pool.segment_of(gid)
                e = Eviction(ns.block_id(key[4:]), gid, ns.slot_bytes, keep, seg.draining)
                if self.on_evict(e) and not keep:
                    self.pins[gid] += 1                 # held for the sink's copy, keeping its segment alive:
                    seg.busy += 1                       # `let_go` frees it
        if self.pins[gid]:
            self.zombies[gid] = key
        elif keep:
            self.pool.segment_of(gid).keys[gid & 0xFFFFFFFF] = None
        else:
            self.pins.pop(gid, None)
            self._free(gid)
        if ns.blocks == 0:
            self.namespaces.forget_unused(ns)
        return True

    def let_go(self, gids: list[int]) -> None:
        """The eviction sink is done with the slots it held: they are freed (or their segments released)."""
        for gid in gids:
            self._unpin(gid)

    def _free(self, gid: int) -> None:
        seg = self.pool.segment_of(gid)
        self.pool.free(gid)
        if seg.draining and seg.live == 0:
            self.pool.release(seg, seg.urgent)

    def _unbusy(self, seg: Segment) -> None:
        seg.busy -= 1
        if seg.draining and seg.busy == 0:
            self._empty(seg)
