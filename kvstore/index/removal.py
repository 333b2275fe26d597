"""Blocks leaving the host pool and the slots they free (part of the capacity books, kvstore.index.capacity): pins
and last releases, removals (evictions handed to the eviction sink, deletes), frees, and retiring segments with
their drain steps. Pins live here because a pin is what keeps a block from leaving.

- A pinned block is never evicted, overwritten or freed: one deleted or evicted while pinned is hidden at once (a
  zombie) and its slot freed at the last unpin; a segment chosen for release drains: it allocates nothing and goes
  when its last pin or reservation does.
- An evicted block goes to the eviction sink (an `Eviction`), which may hold its slot (a pin) until it has copied
  the bytes (`let_go`). Coupled eviction (pool.pair_eviction): a base block takes along its residual blocks.
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
- A segment retired for room while some of its slots are pinned or reserved (a reclaim for a tenant within its
  quota: kvstore.index.quotas) is never lent: its unpinned blocks leave at once (copied under the lock), and the
  pool hollows it (kvstore.tiers.host): the pages of its free slots are punched and no longer charged, the busy
  slots' pages stay until their last release or commit, which releases the segment.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from kvstore.index.capacity import MOVE_CHUNK, Eviction
from kvstore.index.namespaces import PREFIX_BYTES, NamespaceEntry
from kvstore.index.state import Books
from kvstore.tiers.host import Segment, gid_of

if TYPE_CHECKING:
    from kvstore.workflows import Touch


class Removal:
    def __init__(self, books: Books) -> None:
        self._books = books             # for what changes under it: `coupled`, `compacting`
        self.pool = books.pool
        self.table = books.table
        self.policy = books.policy
        self.namespaces = books.namespaces
        self.quotas = books.quotas
        self.counters = books.counters
        self.pins = books.pins
        self.zombies = books.zombies
        self.moving = books.moving
        self.on_evict = books.on_evict
        self.clock = books.clock

    # ----- pins -----
    def pin(self, key: bytes, gid: int, touch: Touch | None = None) -> None:
        """One more pin of the stored block `key` in slot `gid` (its holder's books are the caller's)."""
        seg = self.pool.segment_of(gid)
        seg.used[gid & 0xFFFFFFFF] = self.clock.now
        if self.pins[gid] == 0:
            self.policy.pinned(key)
            seg.busy += 1
            if touch is not None:
                self.policy.accessed(key, touch)     # its tags: the block is relinked at its unpin
        else:
            self.policy.accessed(key, touch)
        self.pins[gid] += 1

    def unpin(self, gid: int) -> None:
        """One pin fewer; at the last, a zombie's slot is freed, a stored block goes back to the policy — or, in a
        hollowed segment (kvstore.tiers.host), leaves it, its slot's pages given back."""
        self.pins[gid] -= 1
        if self.pins[gid] > 0:
            return
        del self.pins[gid]
        seg = self.pool.segment_of(gid)
        key = self.zombies.pop(gid, None)
        if key is not None:
            self.unbusy(seg)
            self.free(gid)
            return
        key = seg.keys[gid & 0xFFFFFFFF]
        if key is not None:
            self.policy.unpinned(key)
        self.unbusy(seg)
        if seg.hollow and key is not None and self.table.get(key) == gid and not self.pins[gid]:
            self.remove(key, evicted=True)

    def let_go(self, gids: list[int]) -> None:
        """The eviction sink is done with the slots it held: they are freed (or their segments released)."""
        for gid in gids:
            self.pool.segment_of(gid).copying -= 1
            self.unpin(gid)

    # ----- removal -----
    def evict_block(self, key: bytes) -> bool:
        """Evict one unpinned block (a retired one, to make room for a prefetch), handed to the eviction sink like
        any eviction. False if the pool does not hold it."""
        gid = self.table.get(key)
        if gid is None or self.pins[gid]:
            return False
        return self.remove(key, evicted=True)

    def evict_for_slot(self, key: bytes) -> int:
        """Evict the victim `key` for its slot: its gid, still allocated and now the caller's, who writes it only
        after the eviction sink has copied the block; 0 when the slot cannot be handed over (pinned, or its
        segment drains): the block is then evicted as usual and the caller allocates again."""
        gid = self.table.get(key)
        if gid is None or self.pins[gid] or self.pool.segment_of(gid).draining:
            self.remove(key, evicted=True)
            return 0
        self.remove(key, evicted=True, keep=True)
        return gid

    def remove(self, key: bytes, evicted: bool = False, keep: bool = False, now: bool = False) -> bool:
        """Take a block out of the host pool; an evicted one goes to the eviction sink, which may hold its slot.
        With `keep` (only from `evict_for_slot`), its unpinned slot stays allocated for the caller; with `now`,
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
            self.free(gid)
        books = self._books
        if evicted and books.coupled and ns.id in self.namespaces.pairs.residuals and books.compacting is None:
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
                self.remove(rkey, evicted=True)
                self.counters["evictions_coupled"] += 1

    def free(self, gid: int) -> None:
        """Give a slot back to the pool; a draining segment goes with its last slot (not while it is compacted)."""
        seg = self.pool.segment_of(gid)
        self.pool.free(gid)
        if seg.draining and seg.live == 0 and seg is not self._books.compacting:
            self.pool.release(seg, seg.urgent)

    def unbusy(self, seg: Segment) -> None:
        """A pin or reservation of the segment ended: a draining one (not being walked) loses its unpinned blocks."""
        seg.busy -= 1
        if seg.draining and seg.busy == 0 and seg.walk_at < 0:     # a lent one being walked: by drain steps
            self._empty(seg)

    # ----- segments leaving -----
    def retire(self, seg: Segment, for_room: bool = False) -> int:
        """Drain a segment and evict its unpinned blocks; it is released now if nothing holds it, else at the
        last release, commit or demotion copy. `for_room`: an allocation waits for its memory, so it is lent if
        none is (the copies and the punch come after the lock), else copied and punched here (the module
        docstring). Returns the blocks evicted."""
        lend = for_room and seg.busy == 0 and self.pool.may_lend()
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
        elif for_room:
            self.pool.hollow(seg)               # kept by pinned or reserved slots: the rest of it goes now
            self.counters["segments_hollowed"] += 1
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

    def drain_step(self) -> None:
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
                self.remove(key, evicted=True)
                n += 1
                if n == budget:
                    seg.walk_at = slot + 1
                    return n
        if budget:
            seg.walk_at = seg.nslots
        return n
