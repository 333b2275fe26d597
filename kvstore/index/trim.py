"""The operator's trims of the host pool (part of the capacity books, kvstore.index.capacity): eviction on demand
and resize. The blocks and segments leave through `Removal` (kvstore.index.removal), its collaborator.

- An operator's eviction is made in chunks (`evict_plan`, `evict_some`): the caller may let go of the state lock
  between them. A namespace's eviction walks its class's slots (kvstore.index.sweep), not the key table.
- Shrinking releases whole segments and costs the blocks in them, never the pool's size: a segment with pins
  drains (it allocates nothing) and goes at its last release.
"""
from __future__ import annotations

import time

from kvstore.index.capacity import EvictPlan, ResizeResult
from kvstore.index.removal import Removal
from kvstore.index.state import Books
from kvstore.index.sweep import SlotCursor


class Trim:
    def __init__(self, books: Books, removal: Removal) -> None:
        self.pool = books.pool
        self.table = books.table
        self.policy = books.policy
        self.namespaces = books.namespaces
        self.pins = books.pins
        self._remove = removal.remove
        self._retire = removal.retire

    def evict(self, nid: int | None = None, nbytes: int = 0, everything: bool = False) -> tuple[int, int]:
        """Evict unpinned blocks until `nbytes` are freed or, with `everything`, all of them, in one go (see
        `evict_plan` for the order). Returns (blocks, bytes)."""
        plan = self.evict_plan(nid, nbytes, everything)
        while not self.evict_some(plan, 1 << 62):
            pass
        return plan.blocks, plan.freed

    def evict_plan(self, nid: int | None = None, nbytes: int = 0, everything: bool = False) -> EvictPlan:
        """An eviction to make with `evict_some`: by the policy's order per class, or for one namespace in slot
        order (an operator's clean-up, not a hot path)."""
        if nid is None:
            return EvictPlan(nbytes, everything, left=len(self.table))
        ns = self.namespaces.by_id[nid]
        return EvictPlan(nbytes, everything, ns, SlotCursor(ns.slot_key, ns.prefix))

    def evict_some(self, plan: EvictPlan, budget: int) -> bool:
        """Evict up to `budget` more blocks of the plan (a namespace's walk also looks at most 16 slots a block);
        True when the plan is done. Between two calls the caller may let go of the state lock."""
        if plan.ns is None:
            self._evict_victims(plan, min(budget, plan.left))
        elif self.namespaces.get(plan.ns.id) is not plan.ns:
            plan.done = True                            # forgotten meanwhile: none of its blocks is left
        else:
            self._evict_walk(plan, budget)
        return plan.done

    def _evict_walk(self, plan: EvictPlan, budget: int) -> None:
        assert plan.ns is not None and plan.cursor is not None
        for key, gid in plan.cursor.chunk(self.pool, self.table, 16 * budget, budget):
            if not plan.wants():
                break
            if self.pins[gid] == 0 and self._remove(key, evicted=True):
                plan.blocks, plan.freed = plan.blocks + 1, plan.freed + plan.ns.slot_bytes
        plan.done = plan.cursor.done or not plan.wants()

    def _evict_victims(self, plan: EvictPlan, budget: int) -> None:
        n = 0
        for (_, slot_bytes), cls in list(self.namespaces.classes.items()):
            while plan.wants() and n < budget:
                victim = self.policy.victim(cls)
                if victim is None:
                    break
                self._remove(victim, evicted=True)
                plan.blocks, plan.freed, n = plan.blocks + 1, plan.freed + slot_bytes, n + 1
        plan.left -= n
        plan.done = n < budget or plan.left <= 0 or not plan.wants()

    def resize(self, capacity: int) -> ResizeResult:
        """Grow: raise the cap (segments come when needed). Shrink: release whole segments — idle ones with the
        fewest blocks first, evicting only their unpinned blocks (released once those are copied down, before
        the reply); segments with pins drain and go at the last release. Cost: the blocks in the released
        segments, never the pool's size."""
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
                released += seg.id not in self.pool.segments or seg.busy == seg.copying
        held = sum(s.size for s in self.pool.segments.values() if s.draining and s.busy > s.copying)
        return ResizeResult(capacity, released, evicted, held, time.perf_counter() - t0)

    def _draining_bytes(self) -> int:
        return sum(s.size for s in self.pool.segments.values() if s.draining)
