"""Tenants' host quotas and lending (SwiftCache §3.5 and Algorithm 1), as the decisions the capacity books ask for.

A tenant's quota is host-pool memory guaranteed to it; what it *holds* is the bytes of its segments (mapped, not
draining). Memory moves between tenants a whole segment at a time: the segment is the elastic unit.

- **Reclaim (ScaleUp).** A tenant within its quota (holding + one segment <= quota) that needs memory when the pool
  is full takes it back from a borrower (a tenant holding more than its quota): one segment of the borrower is
  retired for it, an idle one if any. It grows by exactly the demand that came (one segment per allocation that
  found no slot), within one allocation: the reclaim latency is that allocation's (`reclaim_seconds`).
- **Around pins (issue 29).** A borrower's pinned or reserved slots do not keep its segment from reclaim: the
  segment's unpinned blocks leave (moved or evicted as below) and the pool hollows it (kvstore.tiers.host): only
  its busy slots' pages stay charged — to the borrower (`held`), until they are released — so a segment with one
  pinned block gives back all the rest at once, and the allocation retires as many as it needs (idle ones first,
  then the least busy). So whatever a neighbour pins within its own quota, a tenant within its quota gets room
  at once; pins beyond the neighbour's quota (its held cap allowing) last until their lease (server.pin_lease_s).
  The borrower may end below its quota by less than a segment while its pins hold, as with any reclaim; when they
  go, that memory is free and its to grow into again.
- **Borrowing (lending on).** A tenant at or over its quota may create segments while the pool has room, and take a
  segment of another tenant only where that tenant stays at or above its quota (another borrower: memory follows
  use among them), or where that tenant's coldest block has not been used for `window_s` (ScaleDown: a lender
  keeps the memory its demand of the last window used; the rest is lent). A tenant is never pushed below its quota
  by another's load, except through blocks idle for the window while lending is on (the point of lending) and, in
  a reclaim, by less than one segment where no borrower is a whole segment over (quotas hold to the segment).
- **What the owner loses** when a segment of it goes is decided by its own policy, not by which blocks happen to
  share the segment (sessions interleave: one request's chain spans most of a tenant's segments, so retiring any
  segment as it stands cut every hot chain — measured, bench_tenants): the books first move the segment's blocks
  into the owner's other segments, evicting the owner's coldest blocks for room (kvstore.index.allocation,
  `_compact`; its most recently used `compact_bytes` of them, copied under the state lock: the bound on that
  stall). The rest leave with the segment as before.
- **Static partitions (lending off).** A tenant never holds more than its quota.
- With no quota anywhere and lending on (the default), every tenant is a borrower with nothing to protect: one LRU
  shared by all, as before quotas existed.

Elastic unit: a segment holds slots of one size only (kvstore.tiers.host), so memory moving between tenants or block
sizes loses nothing but each segment's tail (segment_bytes mod slot size; none for small blocks, whose segments are
sized in slots, kvstore.tiers.host): SwiftCache's LCM unit (eq. 6–9) is what
one region shared by two block sizes would need. `fragmentation()` reports both, measured on the live pool.
"""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from kvstore.histogram import Histogram
from kvstore.tiers.host import HostPool, Segment


@dataclass(slots=True)
class TenantFigures:
    """What one tenant did since start (the hit counts come from the lookups, see kvstore.daemon.ops)."""
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    reclaims: int = 0           # segments it took back from borrowers
    lent_segments: int = 0      # its idle segments given to a borrower
    taken: int = 0              # segments of it taken back by their owners (it was borrowing)


@dataclass(slots=True)
class Quotas:
    pool: HostPool
    quotas: dict[str, int] = field(default_factory=dict)    # tenant -> guaranteed host bytes
    default: int = 0                                        # the quota of a tenant not listed
    lending: bool = True
    window_s: float = 60.0
    compact_bytes: int = 16 << 20                           # a segment's blocks moved, not dropped, when it goes
    figures: dict[str, TenantFigures] = field(default_factory=dict)
    reclaim_seconds: Histogram = field(default_factory=Histogram)
    counters: Counter[str] = field(default_factory=Counter)

    # ----- the books -----
    def quota(self, tenant: str) -> int:
        return self.quotas.get(tenant, self.default)

    def held(self, tenant: str) -> int:
        return self.pool.held[tenant]

    def of(self, tenant: str) -> TenantFigures:
        f = self.figures.get(tenant)
        if f is None:
            f = self.figures[tenant] = TenantFigures()
        return f

    @property
    def active(self) -> bool:
        """Whether any tenant has a guarantee or a cap; else the pool is one shared LRU."""
        return not self.lending or self.default > 0 or any(self.quotas.values())

    def total(self) -> int:
        """The bytes guaranteed: every listed quota and the default one (which any unlisted tenant may claim)."""
        return sum(self.quotas.values()) + self.default

    def set(self, tenant: str, nbytes: int) -> None:
        """A quota changed at run time: O(1). Lowered below what the tenant holds, it becomes a borrower of the
        difference (taken back as others need it); raised, it reclaims as its load needs. ValueError where the
        quotas would exceed the pool's capacity."""
        others = sum(q for t, q in self.quotas.items() if t != tenant) + self.default
        if others + nbytes > self.pool.capacity:
            raise ValueError(f"the quotas would total {others + nbytes} bytes, over the pool's capacity "
                             f"({self.pool.capacity} bytes): a quota is a guarantee")
        self.quotas[tenant] = nbytes

    # ----- decisions -----
    def within(self, tenant: str, nbytes: int) -> bool:
        """Whether `nbytes` more (a new segment) keeps the tenant within its guarantee."""
        return self.held(tenant) + nbytes <= self.quota(tenant)

    def may_grow(self, tenant: str, nbytes: int) -> bool:
        """Whether the tenant may map a new segment of `nbytes` where the pool has room."""
        return self.lending or self.within(tenant, nbytes)

    def may_take(self, seg: Segment, taker: str, cold_at: float, now: float) -> bool:
        """Whether an allocation of `taker` may retire `seg` (of another class) for its memory; `cold_at`: when
        the owner's coldest block (its policy's victim) was last used."""
        owner = seg.tenant
        if owner == taker:
            return True                          # its own memory, another block size
        if not self.lending and not self.within(taker, seg.size):
            return False                         # static partitions: never past the quota
        if self.held(owner) - seg.size >= self.quota(owner):
            return True                          # another borrower, left at or above its quota
        return self.lending and now - cold_at >= self.window_s   # a lender holding memory its demand left idle

    def borrowed_segment(self, taker: str) -> Segment | None:
        """(ScaleUp.) A borrower's segment for a tenant within its quota: of a tenant left at or above its quota if
        any, else of one holding more than its quota; idle (nothing pinned or reserved) if any, else the one with
        the fewest busy slots (it gives back the rest: `Removal.retire`), never one with every slot busy; then the
        one with the fewest blocks (the books move its blocks into the owner's other segments first, evicting the
        owner's coldest ones: which segment goes decides only what is copied). None if no tenant borrows."""
        best: tuple[bool, int, int, Segment] | None = None
        for cls in self.pool.classes.values():
            owner = cls.tenant
            if owner == taker:
                continue
            held, quota = self.held(owner), self.quota(owner)
            if held <= quota:
                continue
            for seg in cls.segments.values():
                if seg.draining or seg.busy >= seg.nslots:
                    continue
                rank = (held - (seg.nslots - seg.busy) * seg.slot_bytes < quota, seg.busy, seg.live, seg)
                if best is None or rank[:3] < best[:3]:
                    best = rank
        return None if best is None else best[3]

    def took(self, seg: Segment, taker: str, reclaim: bool) -> None:
        """Book one segment moving from its owner to `taker`."""
        if seg.tenant == taker:
            return
        if reclaim:
            self.of(taker).reclaims += 1
            self.of(seg.tenant).taken += 1
            self.counters["reclaims"] += 1
        elif self.held(seg.tenant) - seg.size < self.quota(seg.tenant):
            self.of(seg.tenant).lent_segments += 1
            self.counters["lent_segments"] += 1

    # ----- what `kvstore tenants` shows -----
    def rows(self, tenants: list[str]) -> list[dict[str, Any]]:
        """Per tenant: quota, used (held), borrowed (held above the quota), lent (its unused quota that borrowers
        occupy: the borrowing beyond the memory no quota covers, shared among lenders by their unused quota), hit
        rate of its lookups, evictions, reclaims."""
        names = sorted(set(tenants) | set(self.quotas) | {c.tenant for c in self.pool.classes.values()})
        held = {t: self.held(t) for t in names}
        quota = {t: self.quota(t) for t in names}
        borrowed = {t: max(0, held[t] - quota[t]) for t in names}
        unused = {t: max(0, quota[t] - held[t]) for t in names}
        spare = max(0, self.pool.capacity - sum(quota.values()))
        occupied = max(0, sum(borrowed.values()) - spare)
        total_unused = sum(unused.values())
        rows = []
        for t in names:
            f = self.of(t)
            asked = f.hits + f.misses
            lent = round(occupied * unused[t] / total_unused) if total_unused else 0
            rows.append({"tenant": t, "quota_bytes": quota[t], "used_bytes": held[t], "borrowed_bytes": borrowed[t],
                         "lent_bytes": min(lent, unused[t]), "hit_rate": f.hits / asked if asked else None,
                         "hits": f.hits, "misses": f.misses, "evictions": f.evictions, "reclaims": f.reclaims,
                         "lent_segments": f.lent_segments, "taken_back": f.taken})
        return rows

    def fragmentation(self) -> dict[str, Any]:
        """The bytes lost to the elastic unit, measured: segments' tails (segment_bytes mod slot size) now, against
        SwiftCache's minimum elastic unit (the LCM of the block sizes in the pool) had one region served them all."""
        sizes = sorted({c.slot_bytes for c in self.pool.classes.values()})
        tails = sum(self.pool.tail_bytes(s.slot_bytes) for s in self.pool.segments.values())
        lcm = math.lcm(*sizes) if sizes else 0
        return {"unit": "segment", "segment_bytes": self.pool.segment_bytes, "tail_bytes": tails,
                "tail_share": tails / max(1, self.pool.mapped_bytes + tails), "block_sizes": sizes,
                "meu_bytes": lcm, "meu_over_segment": lcm / self.pool.segment_bytes if lcm else 0.0}

    def stats(self) -> dict[str, Any]:
        return {"active": self.active, "lending": self.lending, "window_s": self.window_s,
                "reclaims": self.counters["reclaims"], "lent_segments": self.counters["lent_segments"],
                "reclaim_seconds": self.reclaim_seconds.to_dict()}
