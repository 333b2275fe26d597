"""The host pool's capacity books: which slot a new block gets, which block leaves when there is none, and which
segments go when the pool shrinks. Decisions only: the pool (kvstore.tiers.host) owns the memory, the policy
(kvstore.policy) ranks the candidates, and each evicted block is handed, as an `Eviction`, to the sink the daemon
gave (the demotion mover), which may hold its slot until it has copied the bytes.

- Allocation never charges more than the pool's cap: a full size class evicts the policy's victim and takes its
  slot, or retires an idle segment of another class (block size or tenant) whose victim is staler (memory follows
  use), or reclaims an idle segment of another class, or answers "no space".
- Memory that moves to another class does not wait for the retiring segment: the segment is lent
  (kvstore.tiers.host: at most one at a time, so the memory really held is at most the cap plus one segment, until
  its punch) and its blocks leave in drain steps of MOVE_CHUNK blocks: the first by the allocation that moved it,
  the next ones at the start of each later reserve, commit, acquire or release, so that no request holds the lock
  for more than one step's evictions (a 64 MiB segment of 4 KiB blocks is 16384 of them). Until its step, a
  block is a host hit as before (a pinned one stays until its last release); an evicted one is booked in the
  lower tier at once (its readers wait for its copy) and the sink copies it after the state lock is left, holding
  its slot meanwhile; the segment is released with its last slot and punched by the reaper. While one segment is
  lent, a second move is made the old way: its blocks copied (`Eviction.copy_now`) and its pages punched under the
  lock, the cap exact (counted: `segment_moves_inline`).
- A pinned block is never evicted; a segment chosen for release drains: it allocates nothing and goes when its
  last pin or reservation does. Shrinking costs the blocks in the released segments, never the pool's size.
- An operator's eviction is made in chunks (`evict_plan`, `evict_some`): the caller may let go of the state lock
  between them. A namespace's eviction walks its class's slots (kvstore.index.sweep), not the key table.
"""
from __future__ import annotations

import time
from collections import Counter, deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from kvstore.index.keytable import KeyTable
from kvstore.index.namespaces import PREFIX_BYTES, NamespaceEntry, Namespaces, SlotKey
from kvstore.index.quotas import Quotas
from kvstore.index.sweep import SlotCursor
from kvstore.policy import EvictionPolicy
from kvstore.tiers.host import HostPool, Segment, gid_of, split_gid

if TYPE_CHECKING:
    from kvstore.workflows import Touch


@dataclass(frozen=True, slots=True)
class Eviction:
    """A block leaving the host pool, as the books decided it."""
    block_id: bytes         # namespace digest + block hash: its name in the lower tiers
    gid: int                # the slot it occupied
    nbytes: int
    handed_over: bool       # the slot goes to the evicting caller, who writes it only after the sink copied it
    draining: bool          # the slot's segment is being released
    copy_now: bool = False  # ... under the lock, for an allocation that waits for it: no copy may be deferred


class EvictionSink(Protocol):
    def __call__(self, e: Eviction) -> bool:
        """(Under the state lock.) Take note of an eviction; True to hold the slot (pinned) until `let_go`."""
        ...


@dataclass(slots=True)
class EvictPlan:
    """An operator's eviction, made a chunk at a time (`CapacityBooks.evict_some`): of one namespace (a walk over
    its slots) or in the policy's order per class; until `nbytes` are freed or, with `everything`, all of them."""
    nbytes: int
    everything: bool
    ns: NamespaceEntry | None = None
    cursor: SlotCursor | None = None
    left: int = 0               # policy order: at most the blocks there were at the start (writers go on meanwhile)
    blocks: int = 0
    freed: int = 0
    done: bool = False

    def wants(self) -> bool:
        return self.everything or self.freed < self.nbytes


@dataclass(slots=True)
class ResizeResult:
    capacity: int
    released_segments: int
    evicted: int
    draining_bytes: int
    seconds: float


MOVE_CHUNK = 256        # blocks of a lent segment evicted per drain step (a few milliseconds under the lock)


STALE_SAMPLE = 64           # slots a same-tenant segment move looks at to judge a segment stale (_mostly_stale)


class CapacityBooks:
    """The capacity half of the index (see `kvstore.index.books.Index`, which adds reads and two-phase stores)."""
    pool: HostPool
    moving: deque[Segment]      # lent segments whose blocks drain steps are still evicting, oldest first
    table: KeyTable
    policy: EvictionPolicy
    namespaces: Namespaces
    pins: Counter[int]
    zombies: dict[int, bytes]
    counters: Counter[str]
    quotas: Quotas
    on_evict: EvictionSink | None
    _kept_own: bool = False     # the last allocation refused to evict a block of the put's own chain
    coupled: bool = False                # pool.pair_eviction coupled: residuals leave with their base block
    _compacting: Segment | None = None   # a segment whose blocks `_compact` moves out (released by `_retire`)

    def _unpin(self, gid: int) -> None: raise NotImplementedError

    def used_at(self, clock: int) -> float: raise NotImplementedError

    # ----- operator eviction and resize -----
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

    # ----- allocation -----
    def _allocate(self, slot: SlotKey, cls: int, protect: set[bytes] | None = None,
                  touch: Touch | None = None) -> int | None:
        """A slot of the class `slot` (tenant, slot bytes), whose eviction class is `cls`. With `protect` (a put's
        own chain, given only where an eviction drops the block: no lower tier), None with `_kept_own` set rather
        than evict one of its blocks, or — Belady's bypass, estimated — a block the policy values above the
        block coming (`admits`, with the request's hint context `touch`). A tenant within its quota takes borrowed
        memory back before it evicts its own (kvstore.index.quotas)."""
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
            elif protect is not None and key is not None and (key in protect or not self._admitted(key, touch)):
                self.counters["kept_own_chain" if key in protect else "not_admitted"] += 1
                self._kept_own = True
                return None
            elif key is not None:
                gid = self._evict_for_slot(key)
                if gid:
                    return gid
            elif not self._reclaim_other(slot):
                return None

    def _admitted(self, victim: bytes, touch: Touch | None) -> bool:
        """Whether the policy would evict `victim` for a block of the request `touch` (always without a context
        or under a policy that cannot tell: LRU admits everything)."""
        admits = getattr(self.policy, "admits", None)
        return touch is None or admits is None or admits(victim, touch)

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
                    and self.quotas.may_take(seg, slot[0], self.used_at(used), now) \
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
        return self._seg_slot(gid)

    def _seg_slot(self, gid: int) -> tuple[Segment, int]:
        seg_id, slot = split_gid(gid)
        return self.pool.segments[seg_id], slot

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
        return self.used_at(other.used[i])

    # ----- memory moving between tenants -----
    def _hand_over(self, seg: Segment, taker: str) -> None:
        """Retire `seg` for an allocation of `taker`; a segment of another tenant is compacted first, so that its
        owner loses its coldest blocks, not the ones that shared the segment. (Under a policy that follows a block
        to its new slot, `moved`: both do — LRU's books are by key, the workflow policy carries its row along.)"""
        if seg.tenant != taker and getattr(self._policy_of(seg), "moved", None) is not None:
            self._compact(seg)
        self._retire(seg, for_room=True)

    def _policy_of(self, seg: Segment) -> EvictionPolicy:
        """The policy of the segment's class (its tenant's, where tenants chose their own: kvstore.policy.tenants)."""
        route = getattr(self.policy, "for_class", None)
        cls = self.namespaces.classes.get(seg.slot_key)
        return route(cls) if route is not None and cls is not None else self.policy

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
        self._compacting = seg                          # ... and it stays until `_retire` releases or lends it
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
            self._compacting = None
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
        s_seg, s = self._seg_slot(src)
        d_seg, d = self._seg_slot(dst)
        with self.pool.view(src) as a, self.pool.view(dst) as b:
            b[:] = a
        d_seg.keys[d], d_seg.used[d], d_seg.crc[d] = key, s_seg.used[s], s_seg.crc[s]
        self.table.set_value(key, dst)
        self.policy.moved(key, src, dst)
        self.pool.free(src)

    # ----- leaving the pool -----
    def _retire(self, seg: Segment, for_room: bool = False) -> int:
        """Drain a segment and evict its unpinned blocks; it is released now if nothing holds it, else at the
        last release, commit or demotion copy. `for_room`: an allocation waits for its memory, so it is lent if
        none is (the copies and the punch come after the lock), else copied and punched here (the module
        docstring). Returns the blocks evicted."""
        lend = for_room and self.pool.may_lend()
        self.pool.drain(seg, lend)
        seg.urgent = for_room and not lend
        if for_room:
            self.counters["segment_moves" if lend else "segment_moves_inline"] += 1
        if lend:
            seg.walk_at = 0
            self.moving.append(seg)
            return self.drain_some()
        n = self._empty(seg)
        if seg.live == 0 and seg.id in self.pool.segments:
            self.pool.release(seg, seg.urgent)
        return n

    def drain_some(self, budget: int = MOVE_CHUNK) -> int:
        """One drain step: evict up to `budget` unpinned blocks of the lent segments, from where the last step
        stopped. A segment walked to its end leaves the list: its pinned blocks go at their last release, and the
        segment with its last slot. Returns the blocks evicted."""
        n = 0
        while self.moving and n < budget:
            seg = self.moving[0]
            if seg.id in self.pool.segments:
                n += self._empty(seg, budget - n)
                if seg.walk_at < seg.nslots:
                    break
                seg.walk_at = -1                    # from here on it drains like any other segment:
                if seg.busy == 0:                   # what was pinned when the walk passed goes now
                    n += self._empty(seg)
            self.moving.popleft()
            if seg.live == 0 and seg.id in self.pool.segments:
                self.pool.release(seg, seg.urgent)
        return n

    def _drain_step(self) -> None:
        """(At the start of the ops that may move memory or free slots.) A lent segment's next drain step."""
        if self.moving:
            self.drain_some()

    def _empty(self, seg: Segment, budget: int = 0) -> int:
        """Evict every unpinned block of a segment; with `budget`, up to that many along its walk (`walk_at`).
        Returns how many."""
        n = 0
        start = seg.walk_at if budget else 0
        for slot in range(start, seg.nslots):
            key = seg.keys[slot]
            # the key may since live elsewhere (deleted while pinned here, then stored again): check the slot
            gid = gid_of(seg.id, slot)
            if key is not None and self.table.get(key) == gid and self.pins[gid] == 0:
                self._remove(key, evicted=True)
                n += 1
                if n == budget:
                    seg.walk_at = slot + 1
                    return n
        if budget:
            seg.walk_at = seg.nslots
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

    def evict_block(self, key: bytes) -> bool:
        """Evict one unpinned block (a retired one, to make room for a prefetch), handed to the eviction sink like
        any eviction. False if the pool does not hold it."""
        gid = self.table.get(key)
        if gid is None or self.pins[gid]:
            return False
        return self._remove(key, evicted=True)

    def _remove(self, key: bytes, evicted: bool = False, keep: bool = False, now: bool = False) -> bool:
        """Take a block out of the host pool; an evicted one goes to the eviction sink, which may hold its slot.
        With `keep` (only from `_evict_for_slot`), its unpinned slot stays allocated for the caller; with `now`,
        the sink copies it at once (its slot is written next, under the same lock)."""
        self.policy.removed(key)                        # while the key table still has it
        gid = self.table.remove(key)
        if gid is None:
            return False
        ns = self.namespaces.owner(key)
        ns.blocks -= 1
        if evicted:
            self.counters["evictions"] += 1
            self.quotas.of(ns.tenant).evictions += 1
            if self.on_evict is not None:
                seg = self.pool.segment_of(gid)
                e = Eviction(ns.block_id(key[4:]), gid, ns.slot_bytes, keep, seg.draining, seg.urgent or now)
                if self.on_evict(e) and not keep:
                    self.pins[gid] += 1                 # held for the sink's copy, keeping its segment alive:
                    seg.busy += 1                       # `let_go` frees it
                    seg.copying += 1
        if self.pins[gid]:
            self.zombies[gid] = key
        elif keep:
            self.pool.segment_of(gid).keys[gid & 0xFFFFFFFF] = None
        else:
            self.pins.pop(gid, None)
            self._free(gid)
        if evicted and self.coupled and ns.id in self.namespaces.pairs.residuals and self._compacting is None:
            self._cascade(ns, key[PREFIX_BYTES:])
        if ns.blocks == 0:
            self.namespaces.forget_unused(ns)
        return True

    def _cascade(self, base: NamespaceEntry, block_hash: bytes) -> None:
        """Coupled eviction (pool.pair_eviction): a base block leaving the host pool takes along the residual
        blocks of its tokens in every namespace paired with it, except pinned ones (in use: they stay)."""
        for rid in list(self.namespaces.pairs.residuals.get(base.id, ())):
            r = self.namespaces.get(rid)
            if r is None:
                continue
            rkey = r.key(block_hash)
            gid = self.table.get(rkey)
            if gid is not None and not self.pins[gid]:
                self._remove(rkey, evicted=True)
                self.counters["evictions_coupled"] += 1

    def let_go(self, gids: list[int]) -> None:
        """The eviction sink is done with the slots it held: they are freed (or their segments released)."""
        for gid in gids:
            self.pool.segment_of(gid).copying -= 1
            self._unpin(gid)

    def _free(self, gid: int) -> None:
        seg = self.pool.segment_of(gid)
        self.pool.free(gid)
        if seg.draining and seg.live == 0 and seg is not self._compacting:
            self.pool.release(seg, seg.urgent)

    def _unbusy(self, seg: Segment) -> None:
        seg.busy -= 1
        if seg.draining and seg.busy == 0 and seg.walk_at < 0:     # a lent one being walked: by drain steps
            self._empty(seg)
