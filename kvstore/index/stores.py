"""What a connection writes into the host pool's books (the request side of the index, with kvstore.index.reads):
two-phase stores, promotions from a lower tier, deletes, expiry, and a connection's end. Slots come from
`Allocation` and leave through `Removal` (the capacity side), its collaborators.

- Two-phase store: `reserve` hands out slots; the client copies; `commit` makes the blocks visible. Until then no
  lookup or acquire sees them; `abort` — or the client's connection ending — frees them.
- Per connection, the slots it reserves or pins count against `Holdings.held_share` of the pool: beyond it a
  reserve gets NO_SPACE and an acquire the prefix within it (counter `held_cap`), so one client cannot hold the
  whole pool. A store's reservation can carry a lease end; `expire` aborts those past it (`reservations_expired`).
- Promotion from a lower tier is two-phase too: `plan_promotion` reserves host slots for keys the caller found in a
  lower tier, the caller reads them in without the state lock, and `finish_promotion` publishes them, unless a
  delete came in between.
- A delete of a pinned block hides it at once and frees its slot at the last release (kvstore.index.removal).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvstore.index.allocation import Allocation
from kvstore.index.errors import InvalidRequest, NotHeld
from kvstore.index.namespaces import Holdings, NamespaceEntry
from kvstore.index.removal import Removal
from kvstore.index.state import Books, seg_slot
from kvstore.policy import Refusing
from kvstore.protocol import ReserveStatus

if TYPE_CHECKING:
    from kvstore.workflows import Touch

RESERVED, EXISTS, IN_PROGRESS, NO_SPACE = (ReserveStatus.RESERVED, ReserveStatus.EXISTS, ReserveStatus.IN_PROGRESS,
                                          ReserveStatus.NO_SPACE)
RUN_KEYS = 1 << 14      # a connection's chain carried between reserves (`more`): at most this many keys (~1.5 MB),
#                         so that a client sending `more` for ever holds bounded memory; a longer chain's run ends


class Stores:
    def __init__(self, books: Books, removal: Removal, allocation: Allocation) -> None:
        self.pool = books.pool
        self.table = books.table
        self.policy = books.policy
        self._refused = books.policy.refused if isinstance(books.policy, Refusing) else None     # checked once
        self.namespaces = books.namespaces
        self.counters = books.counters
        self.pending = books.pending
        self.promoting = books.promoting
        self.cancelled = books.cancelled
        self.deleting = books.deleting
        self.on_evict = books.on_evict
        self.clock = books.clock
        self._allocation = allocation
        self._allocate = allocation.allocate
        self.stopped: str | None = None  # why the last `reserve` stored no more of its chain ("share", "room")
        self._pin = removal.pin
        self._unpin = removal.unpin
        self._remove = removal.remove
        self._free = removal.free
        self._unbusy = removal.unbusy
        self._drain_step = removal.drain_step

    # ----- two-phase store -----
    def reserve(self, ns: NamespaceEntry, hashes: list[bytes], holder: Holdings, lease_until: float = 0.0,
                touch: Touch | None = None, after: list[bytes] | None = None,
                more: bool = False) -> tuple[list[int], list[ReserveStatus]]:
        """Slots for the blocks not stored yet. Returns (gids, status) per block; gid 0 unless RESERVED. With
        `lease_until` (a time.monotonic() value), `expire` aborts the reservations still open at that time.

        The hashes are a chain, head first: from the first block that gets no slot on, none does (a block after a
        hole is never read), and `stopped` says why — "share" (the holder is at server.max_reserved_fraction or
        max_held_fraction: the rest may come once these are committed; each block refused so counts as `held_cap`)
        or "room" (no slot without evicting the put's own chain or a block worth more: the rest would fare no
        better). `after`: the chain's blocks before these (those a request hit when it puts only the blocks it
        computed, or a window's predecessors), never evicted for these and refreshed as if stored again. `more`: the
        holder's next reserve goes on with this chain (a put's batches): the chain so far stays protected
        (`Holdings.run`), and the blocks stored already at this one's end are refreshed with the next one's
        (`Holdings.carry`), not now.

        A block stored already is stored again: it is refreshed (issue 14 part 5), so that the prefix's order holds
        (tails before heads): those after the last block reserved here now, tail first; the others when the block
        reserved after them is committed (`Holdings.refresh`), so that each ends up more recent than the blocks
        after it, holes filled or not."""
        self._drain_step()
        gids, status = [], []
        before = [ns.key(h) for h in after or ()]
        waiting = holder.carry + [k for k in before if k in self.table]   # stored already, since the last reserved
        share = holder.reserved_share
        # A put never drops the blocks of its chain before a block to store it (the block would follow a hole),
        # nor blocks worth more than its own (`Allocation.allocate`); a block after it, held already, may go (it
        # comes again later in the put, or stays out behind a hole). With a lower tier an eviction demotes instead
        # of dropping, so there the chain may overflow the pool (its head read back from below).
        mine = holder.run if self.on_evict is None else None      # (grown in place: a long put's run is O(n))
        if mine is not None:
            mine.update(before)
        holder.carry, holder.run = [], set()
        self.stopped = None
        for h in hashes:
            key = ns.key(h)
            if mine is not None:
                mine.add(key)
            if self.stopped:                         # the rest of the chain would follow a hole: not stored
                exists = key in self.table
                self.counters["held_cap"] += self.stopped == "share" and not exists
                gids.append(0)
                status.append(EXISTS if exists else NO_SPACE)
                continue
            if share and key not in self.table and key not in self.pending \
                    and holder.over(share, self.pool.capacity, ns.slot_bytes, reserved=True):
                self.counters["held_cap"] += 1           # server.max_reserved_fraction: the rest waits for commits
                self.stopped = "share" if share < 1 else "room"
                gids.append(0)
                status.append(NO_SPACE)
                continue
            gid, st = self._reserve_one(key, ns, holder, protect=mine, touch=touch)
            if st == NO_SPACE:                       # a share of the whole pool binds only when the pool is full
                capped = holder.held_share < 1 and self.at_cap(holder, ns.slot_bytes)
                self.stopped = "share" if capped else "room"
            if st == EXISTS:
                waiting.append(key)
            elif gid and waiting:
                holder.refresh[key] = waiting
                waiting = []
            if gid:
                holder.reserved_bytes += ns.slot_bytes
            if gid and lease_until:
                holder.leases.pop(key, None)
                holder.leases[key] = lease_until     # in time order: the oldest lease first
            gids.append(gid)
            status.append(st)
        if self.stopped == "room" and touch is not None and self._refused is not None:
            self._refused([ns.key(h) for h, st in zip(hashes, status) if st == NO_SPACE], ns.cls, touch)
        run = mine or set()
        if more and not self.stopped and len(run) + len(waiting) <= RUN_KEYS:     # the next reserve goes on
            holder.carry, holder.run = waiting, run
        else:
            for key in reversed(waiting):
                self.policy.accessed(key, touch)
        return gids, status

    def _reserve_one(self, key: bytes, ns: NamespaceEntry, holder: Holdings, evict: bool = True,
                     protect: set[bytes] | None = None, touch: Touch | None = None) -> tuple[int, ReserveStatus]:
        """A slot for one key not stored yet; without `evict`, from free space only (a prefetch). The blocks in
        `protect` (the put's own chain) are never evicted for it, nor (with `touch`, under a policy that can tell)
        a block worth more than the one coming: then NO_SPACE (see `Allocation.allocate`)."""
        if key in self.table:
            return 0, EXISTS                          # refreshed by `reserve` (a promotion stops here)
        if key in self.pending:
            return 0, IN_PROGRESS
        if not self.may_hold(holder, ns.slot_bytes):
            return 0, NO_SPACE
        if evict:
            gid = self._allocate(ns.slot_key, ns.cls, protect, touch, key)
        else:
            gid = self.pool.allocate(ns.slot_bytes, ns.tenant)
        if gid is None:
            return 0, NO_SPACE
        self.pending[key] = gid
        holder.reserved[key] = gid
        holder.held_bytes += ns.slot_bytes
        ns.pending += 1
        self.pool.segment_of(gid).busy += 1
        return gid, RESERVED

    def at_cap(self, holder: Holdings, nbytes: int) -> bool:
        """Whether `nbytes` more would take the holder over its share of the pool."""
        return bool(holder.held_share) and holder.over(holder.held_share, self.pool.capacity, nbytes)

    def may_hold(self, holder: Holdings, nbytes: int) -> bool:
        """Whether the holder may reserve or pin `nbytes` more within its share of the pool; counts a refusal."""
        if self.at_cap(holder, nbytes):
            self.counters["held_cap"] += 1
            return False
        return True

    def renew(self, holder: Holdings, until: float) -> int:
        """Extend every open store reservation of the holder to `until` (a writer still copying, e.g. a long forward
        pass saving layer by layer). Returns how many; the leases stay oldest first (all end at `until`)."""
        for key in holder.leases:
            holder.leases[key] = until
        return len(holder.leases)

    def expire(self, holder: Holdings, now: float) -> int:
        """Abort the holder's store reservations whose lease ended by `now` (a later commit of them gets NotHeld).
        O(expired): leases are kept oldest first."""
        n = 0
        leases = holder.leases
        while leases:
            key, until = next(iter(leases.items()))
            if until > now:
                break
            leases.popitem(last=False)
            holder.refresh.pop(key, None)
            gid = holder.reserved.pop(key, None)
            if gid is not None:
                holder.held_bytes -= self.pool.segment_of(gid).slot_bytes
                holder.reserved_bytes -= self.pool.segment_of(gid).slot_bytes
                self._drop_reservation(key, gid)
                n += 1
        self.counters["reservations_expired"] += n
        self.counters["aborts"] += n
        return n

    def commit(self, ns: NamespaceEntry, hashes: list[bytes], holder: Holdings,
               crcs: list[int] | None = None, touch: Touch | None = None) -> int:
        """Publish reserved blocks. `crcs`, if given, is each block's CRC-32 as its writer computed it: readers get
        it back with the slot and can prove the bytes they copy are the bytes that were committed. Blocks stored
        already before one of them in its reserve are refreshed right after it (see `reserve`)."""
        full = [ns.key(h) for h in hashes]
        if crcs is not None and (len(crcs) != len(hashes) or any(c > 0xFFFFFFFF for c in crcs)):
            raise InvalidRequest(f"commit: crcs must be one CRC-32 per key ({len(hashes)}), got {len(crcs)} "
                                 "value(s); nothing was committed")
        if len(set(full)) != len(full):
            raise InvalidRequest("commit: a key appears twice; nothing was committed")
        missing = [i for i, k in enumerate(full) if k not in holder.reserved]
        if missing:
            raise NotHeld(f"commit: {len(missing)} key(s) not reserved by this connection (first at position "
                          f"{missing[0]}); nothing was committed")
        self._drain_step()
        for i in reversed(range(len(full))):     # the head of the prefix linked last: the most recent
            key = full[i]
            gid = holder.reserved.pop(key)
            holder.leases.pop(key, None)
            holder.held_bytes -= ns.slot_bytes
            holder.reserved_bytes -= ns.slot_bytes
            del self.pending[key]
            self._publish(ns, key, gid, crcs[i] if crcs is not None else None, touch)
            for before in reversed(holder.refresh.pop(key, ())):
                if before in self.table:
                    self.policy.accessed(before, touch)
        self.counters["puts"] += len(full)
        ns.put += len(full)
        self.clock.advance()
        return len(full)

    def _publish(self, ns: NamespaceEntry, key: bytes, gid: int, crc: int | None = None,
                 touch: Touch | None = None) -> None:
        seg, slot = seg_slot(self.pool, gid)
        seg.keys[slot] = key
        seg.used[slot] = self.clock.now
        seg.crc[slot] = crc
        self.table.insert(key, gid, ns.cls)
        self.policy.added(key, ns.cls, touch)
        self._unbusy(seg)
        ns.blocks += 1
        ns.pending -= 1

    def abort(self, ns: NamespaceEntry, hashes: list[bytes], holder: Holdings) -> int:
        n = 0
        for h in hashes:
            gid = holder.reserved.pop(ns.key(h), None)
            if gid is not None:
                holder.leases.pop(ns.key(h), None)
                holder.refresh.pop(ns.key(h), None)
                holder.held_bytes -= ns.slot_bytes
                holder.reserved_bytes -= ns.slot_bytes
                self._drop_reservation(ns.key(h), gid)
                n += 1
        self.counters["aborts"] += n
        return n

    def _drop_reservation(self, key: bytes, gid: int) -> None:
        del self.pending[key]
        ns = self.namespaces.owner(key)              # alive: a reservation keeps its entry
        ns.pending -= 1
        self._unbusy(self.pool.segment_of(gid))
        self._free(gid)
        self.namespaces.forget_unused(ns)

    def disconnect(self, holder: Holdings) -> None:
        """A connection ended: its reservations are freed, its pins released, its namespaces let go of."""
        for key, gid in list(holder.reserved.items()):
            self._drop_reservation(key, gid)
        self.counters["aborts"] += len(holder.reserved)
        holder.reserved.clear()
        holder.leases.clear()
        holder.refresh.clear()
        holder.carry, holder.run = [], set()
        for gid, n in holder.pins.items():
            for _ in range(n):
                self._unpin(gid)
        holder.pins.clear()
        holder.held_bytes = holder.reserved_bytes = 0
        self.namespaces.left(holder)

    # ----- promotion from a lower tier -----
    def plan_promotion(self, ns: NamespaceEntry, hashes: list[bytes], holder: Holdings,
                       evict: bool = True) -> list[tuple[bytes, int]]:
        """Reserve host slots for the leading `hashes`, which the caller found in a lower tier (without `evict`, in
        free space only: a prefetch displaces nothing); stops at a block the host pool holds or reserves. The
        caller reads them into the slots without the state lock, then calls finish_promotion."""
        plan: list[tuple[bytes, int]] = []
        for h in hashes:
            key = ns.key(h)
            if key in self.table or key in self.pending or key in self.deleting:
                break
            gid, status = self._reserve_one(key, ns, holder, evict)
            if status != RESERVED:
                break
            self.promoting.add(key)
            plan.append((h, gid))
        return plan

    def finish_promotion(self, ns: NamespaceEntry, plan: list[tuple[bytes, int]], n: int, holder: Holdings,
                         pin: bool = True, crcs: Sequence[int | None] = (), touch: Touch | None = None
                         ) -> list[int]:
        """Publish (and pin) the first `n` promoted blocks, unless deleted meanwhile; free the other slots. `crcs`:
        the writer's CRC-32C each block was verified against in its tier (None: none), which its host slot carries
        on."""
        gids: list[int] = []
        for i, (h, gid) in enumerate(plan):
            key = ns.key(h)
            self.promoting.discard(key)
            cancelled = key in self.cancelled
            self.cancelled.discard(key)
            del holder.reserved[key]
            if i < n and not cancelled and len(gids) == i:
                del self.pending[key]
                self._publish(ns, key, gid, crcs[i] if i < len(crcs) else None, touch)
                if pin:                              # the reservation's bytes stay held, as a pin
                    self._pin(key, gid)
                    holder.pins[gid] += 1
                else:
                    holder.held_bytes -= ns.slot_bytes
                gids.append(gid)
            else:
                holder.held_bytes -= ns.slot_bytes
                self._drop_reservation(key, gid)
        self.counters["promotions"] += len(gids)
        if pin:
            self.counters["gets"] += len(gids)
            ns.got += len(gids)
        return gids

    # ----- deletes -----
    def delete(self, ns: NamespaceEntry, hashes: list[bytes]) -> list[bool]:
        """Take the blocks out of the host pool (a pinned one at its last release; one being promoted is never
        published). Per block: whether the host pool held it. The lower tiers are the caller's to delete from."""
        found = []
        for h in hashes:
            key = ns.key(h)
            found.append(self._remove(key))
            if key in self.promoting:
                self.cancelled.add(key)
        return found

    def begin_delete(self, keys: list[bytes]) -> None:
        """A delete is about to take these index keys out of the lower tiers without the state lock: until
        `end_delete`, no promotion brings them back into the host pool from there."""
        self.deleting.update(keys)

    def end_delete(self, keys: list[bytes]) -> None:
        self.deleting.subtract(keys)
        for k in keys:
            if self.deleting[k] <= 0:
                del self.deleting[k]
