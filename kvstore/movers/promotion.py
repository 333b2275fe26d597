"""Promotion: a get that runs past the host pool reads the following blocks from the lower tier that holds them into
host slots, verified, and pins them for the getter.

The index reserves the slots (two-phase, `plan_promotion`); the read runs without the state lock, in the getter's
lane; `finish_promotion` publishes what was read and verified, unless a delete came in between. A block already
being promoted (by a prefetch or another get) is waited for, never read twice, and a queued prefetch of it moves up
to the critical lane. Slots taken from evicted blocks are written only after those blocks' demotion copies; after
a promotion the reserve (movers/reserve.py) frees slots again in the background, so that the next one usually
takes a free slot and waits for no victim's copy.
"""
from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable
from threading import Condition, Lock

from kvstore.index import Holdings, Index, NamespaceEntry
from kvstore.tiers import LowerTier, LowerTiers, SharedTier
from kvstore.tiers.host import HostPool
from kvstore.traffic import Lane
from kvstore.traffic.path import rank
from kvstore.workflows import Touch

log = logging.getLogger("kvstore")
PROMOTION_WAIT_S = 5.0      # a get waiting for a promotion in flight gives up (a miss) after this long

Early = Callable[[list[int]], None]     # blocks published before the whole read is done (under the state lock)
Landing = Callable[[int, int, int, "int | None"], None]   # (i, gid, nbytes, crc): block i's slot holds its first
                                                          # nbytes, verified (crc: its writer's, once it is whole)


class Promotion:
    def __init__(self, index: Index, pool: HostPool, lower: LowerTiers, lock: Lock, changed: Condition,
                 copy_evicted: Callable[[], None], escalate: Callable[[bytes], bool],
                 refill: Callable[[NamespaceEntry], None] | None = None,
                 shared: SharedTier | None = None, counters: Counter[str] | None = None) -> None:
        self.index = index
        self.pool = pool
        self.lower = lower
        self.lock = lock
        self.changed = changed                  # notified whenever a promotion publishes or gives up blocks
        self.copy_evicted = copy_evicted        # (without the lock) the demotion copies this thread owes
        self.escalate = escalate                # a queued prefetch of a key becomes critical
        self.refill = refill                    # the reserve of free slots (movers/reserve.py) is topped up
        self.shared = shared                    # the remote store, asked (without the lock) what it holds
        self.counters: Counter[str] = counters if counters is not None else Counter()

    def in_flight(self, ns: NamespaceEntry, block_hash: bytes) -> bool:
        return ns.key(block_hash) in self.index.promoting

    def wait(self, ns: NamespaceEntry, block_hash: bytes) -> bool:
        """(Under the state lock.) Wait for the promotion of this block in flight; False if it is still in flight
        after PROMOTION_WAIT_S."""
        key = ns.key(block_hash)
        self.escalate(key)
        deadline = time.monotonic() + PROMOTION_WAIT_S
        while key in self.index.promoting:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            self.changed.wait(left)
        return True

    def _sources(self, ns: NamespaceEntry, hashes: list[bytes], lane: Lane,
                 skip: frozenset[str]) -> list[LowerTier]:
        """(Under the state lock.) The tiers that hold the leading block, the one whose path is expected to finish
        the read first first (DualPath §6.1: its queue ahead of this lane and its measured bandwidth; the local SSD
        before the remote store on a tie). The remote store is asked (without the lock) about a block its books do
        not know only where it could be the faster way, or the only one."""
        bid = ns.block_id(hashes[0])
        nbytes = ns.slot_bytes * len(hashes)
        holders = [t for t in self.lower if t.name not in skip and t.has(bid)]
        shared = self.shared
        if shared is not None and shared.name not in skip and shared not in holders and (
                not holders or shared.path.expected_s(nbytes, lane) <
                min(t.path.expected_s(nbytes, lane) for t in holders)):
            self.lock.release()
            try:
                found = shared.probe([ns.block_id(h) for h in hashes])
            finally:
                self.lock.acquire()
            if found and shared.has(bid):
                holders.append(shared)
        return [holders[i] for i in rank([(t.path, nbytes) for t in holders], lane)]

    def promote(self, ns: NamespaceEntry, hashes: list[bytes], holder: Holdings, lane: Lane,
                early: Early | None = None, touch: Touch | None = None,
                skip: frozenset[str] = frozenset(), landing: Landing | None = None) -> list[int]:
        """(Under the state lock, released during the read.) Promote the leading blocks that one lower tier holds
        into pinned host slots; returns their gids in key order — except those already handed to `early`, which
        gets the blocks verified so far while later ones are still being read. `touch`: the request's hint
        context, which the promoted blocks are tagged with (kvstore.workflows). `landing` (without the state
        lock): the verified start of the next block to be handed to `early`, while the rest of it is still read
        (a tier that reads in checked pieces: the SSD), so that the getter copies it out meanwhile.

        A tier that serves none of them leaves the read to the tiers that hold the leading block now, looked up
        again without it: the store evicted it meanwhile, a value failed its check, or — the case that must never
        be a miss — a reclaim of donated memory moved it to the SSD between the choice and the read (the donated
        tier moves blocks under its own lock, not the state lock). Each tier is tried once per promotion at most,
        so a promotion makes as many reads as there are lower tiers at worst."""
        while True:
            sources = self._sources(ns, hashes, lane, skip)
            if not sources:
                return []
            got = self._promote_from(sources[0], ns, hashes, holder, lane, early, touch, landing)
            if got is not None:
                return got
            skip |= {sources[0].name}

    def _promote_from(self, tier: LowerTier, ns: NamespaceEntry, hashes: list[bytes], holder: Holdings, lane: Lane,
                      early: Early | None, touch: Touch | None, landing: Landing | None) -> list[int] | None:
        """(Under the state lock, released during the read.) `promote` from one tier; None if it served none of
        the blocks (it no longer holds the leading one, or the read failed): the caller looks again."""
        run = 0
        while run < len(hashes) and tier.has(ns.block_id(hashes[run])):
            run += 1
        if run == 0:                             # gone since `_sources` chose it (moved down, or evicted)
            return None
        self.counters[f"reads_{tier.name}"] += 1
        plan = self.index.plan_promotion(ns, hashes[:run], holder)
        if not plan:
            return []
        views = [self.pool.view(gid) for _, gid in plan]    # the reserved slots keep their segments mapped
        crcs: list[int | None] = []                          # each verified block's CRC-32: its slot carries it on
        done = [0, False]                                    # blocks published early; a chunk came back short

        def on_ready(n: int) -> None:                        # the reading thread, without the state lock
            with self.lock:
                if done[1]:
                    return
                chunk = plan[done[0]:n]
                part = self.index.finish_promotion(ns, chunk, len(chunk), holder, crcs=crcs[done[0]:n],
                                                   touch=touch)
                done[0], done[1] = n, len(part) < len(chunk)    # deleted meanwhile: the prefix ends there
                self.changed.notify_all()
                assert early is not None
                early(part)

        def on_piece(i: int, nbytes: int, crc: int | None) -> None:     # the reading thread, without the lock
            if landing is not None and i == done[0] and not done[1]:    # the next block out: worth copying now
                landing(i, plan[i][1], nbytes, crc)

        self.lock.release()
        try:
            self.copy_evicted()                  # slots taken by eviction: their old bytes copied down first
            pieces = {"on_piece": on_piece} if landing and early and getattr(tier, "reads_in_pieces", False) else {}
            n = tier.read([ns.block_id(h) for h, _ in plan], views, lane, on_ready if early else None, crcs, **pieces)
        except Exception as e:                   # the tier's own failure: a miss, and no slot left reserved
            log.error("%s: promotion read failed (%s: %s); serving the host prefix only", tier.name,
                      type(e).__name__, e)
            n = 0
        finally:
            for v in views:
                v.release()
            self.lock.acquire()
        rest: list[int] = []
        if done[0] < len(plan):
            rest = self.index.finish_promotion(ns, plan[done[0]:], 0 if done[1] else max(n - done[0], 0), holder,
                                               crcs=crcs[done[0]:], touch=touch)
        self.changed.notify_all()
        if self.refill is not None:
            self.refill(ns)                      # in the background: the next promotion finds a free slot
        return None if not rest and done[0] == 0 else rest
