"""The index: which key lives in which host slot, who holds it, and which slots are reserved or being promoted. It
keeps the books and moves no byte (clients copy into and out of the slots it hands out; movers copy between tiers).

Guarantees
- Two-phase store: `reserve` hands out slots; the client copies; `commit` makes the blocks visible. Until then no
  lookup or acquire sees them; `abort` — or the client's connection ending — frees them.
- `host_prefix` and `acquire` answer the longest contiguous prefix of the keys asked: a load takes only that prefix.
- A pinned block (acquired and not yet released) is never evicted, overwritten or freed; a delete of a pinned
  block hides it at once and frees its slot at the last release. Pins and reservations belong to a connection (its
  `Holdings`) and are dropped with it.
- Keys carry their namespace id, so namespaces never see each other's blocks.
- Per connection, the slots it reserves or pins count against `Holdings.held_share` of the pool: beyond it a
  reserve gets NO_SPACE and an acquire the prefix within it (counter `held_cap`), so one client cannot hold the
  whole pool. A store's reservation can carry a lease end; `expire` aborts those past it (`reservations_expired`).
- Capacity (kvstore.index.capacity): allocation never exceeds the pool's cap; evictions are decisions handed to the
  eviction sink.
- Promotion from a lower tier is two-phase too: `plan_promotion` reserves host slots for keys the caller found in a
  lower tier, the caller reads them in without the state lock, and `finish_promotion` publishes them, unless a
  delete came in between.

Every method runs under the daemon's state lock; the operator's walks (`keys_some`, `evict_some`) are made a chunk at
a time, and the caller may let go of the lock between chunks. A request the books cannot honour raises a `Refused`
(kvstore.index.errors) and changes nothing.
"""
from __future__ import annotations

import bisect
import time
from collections import Counter, deque
from collections.abc import Iterator, Sequence

from kvstore.index.capacity import CapacityBooks, EvictionSink
from kvstore.index.errors import InvalidRequest, NotHeld
from kvstore.index.keytable import KeyTable
from kvstore.index.namespaces import Holdings, NamespaceEntry, Namespaces
from kvstore.index.quotas import Quotas
from kvstore.index.sweep import SlotCursor
from kvstore.policy import EvictionPolicy, make_policy
from kvstore.policy.tenants import PerTenantPolicy
from kvstore.protocol import ReserveStatus
from kvstore.protocol.keys import NamespaceSpec
from kvstore.tiers.host import HostPool, Segment
from kvstore.workflows import Touch, Workflows

RESERVED, EXISTS, IN_PROGRESS, NO_SPACE = (ReserveStatus.RESERVED, ReserveStatus.EXISTS, ReserveStatus.IN_PROGRESS,
                                          ReserveStatus.NO_SPACE)


CLOCK_SAMPLE_S = 0.05      # how finely the recency clock is mapped to time


class Index(CapacityBooks):
    def __init__(self, pool: HostPool, policy: str = "lru", on_evict: EvictionSink | None = None,
                 counters: Counter[str] | None = None, workflows: Workflows | None = None,
                 quotas: Quotas | None = None, tenant_policies: dict[str, str] | None = None) -> None:
        self.pool = pool
        self.quotas = quotas if quotas is not None else Quotas(pool)   # tenants' guarantees and lending
        self.on_evict = on_evict                    # where evicted blocks are handed (the demotion mover)
        self.table = KeyTable()
        self.workflows = workflows if workflows is not None else Workflows()   # the hints' books (the daemon's)
        self.namespaces = Namespaces()
        self.policy = self._make_policies(policy, tenant_policies or {})
        self.promoting: set[bytes] = set()          # keys being read from a lower tier into a reserved slot
        self.cancelled: set[bytes] = set()          # ... and deleted meanwhile: never published
        self.pending: dict[bytes, int] = {}         # reserved keys (any connection) → gid
        self.deleting: Counter[bytes] = Counter()   # keys a delete is taking out of the lower tiers: not promoted
        self.pins: Counter[int] = Counter()         # gid → pins across connections (and the sink's holds)
        self.zombies: dict[int, bytes] = {}         # deleted or evicted while pinned: gid → key, freed at last unpin
        self.moving: deque[Segment] = deque()       # lent segments still being emptied by drain steps
        self.counters: Counter[str] = Counter() if counters is None else counters
        self._clock = 1                             # advances per commit and acquire: recency across sizes
        self._clock_times: deque[tuple[int, float]] = deque([(1, time.monotonic())])   # when the clock was where

    def _make_policies(self, default: str, chosen: dict[str, str]) -> EvictionPolicy:
        """The host pool's policy: `default` for all, or — where tenants chose others (`tenants[].policy`) — one
        instance per policy named, each tenant's classes routed to its own (kvstore.policy.tenants)."""
        def make(name: str) -> EvictionPolicy:
            return make_policy(name, self.table, self.workflows, self._key_at,
                               lambda seg: self.pool.segments[seg].nslots)
        chosen = {t: p for t, p in chosen.items() if p and p != default}
        if not chosen:
            return make(default)
        policies = {name: make(name) for name in {default, *chosen.values()}}
        return PerTenantPolicy(self.table, policies, chosen, default, self.namespaces.class_tenants.__getitem__)

    def _advance(self) -> None:
        """The recency clock moves on (a commit or an acquire); when it did so is noted every CLOCK_SAMPLE_S, so
        that a block's last use (a clock value) can be told in time (`used_at`: the lending window)."""
        self._clock += 1
        now = time.monotonic()
        times = self._clock_times
        if now - times[-1][1] >= CLOCK_SAMPLE_S:
            times.append((self._clock, now))
            horizon = now - 2 * self.quotas.window_s
            while len(times) > 2 and times[1][1] < horizon:
                times.popleft()

    def used_at(self, clock: int) -> float:
        """About when (time.monotonic(), within CLOCK_SAMPLE_S) the clock stood at `clock`; a clock older than the
        samples kept (twice the lending window) is answered with the oldest sample's time."""
        times = self._clock_times
        i = bisect.bisect_right(times, clock, key=lambda t: t[0])
        return times[max(0, i - 1)][1]

    # ----- namespaces -----
    def register(self, spec: NamespaceSpec, holder: Holdings) -> NamespaceEntry:
        return self.namespaces.register(spec, holder, self.pool.capacity)

    def namespace(self, nid: int, holder: Holdings) -> NamespaceEntry:
        return self.namespaces.of(nid, holder)

    # ----- reads -----
    def host_prefix(self, ns: NamespaceEntry, hashes: bytes) -> int:
        """How many leading blocks of `hashes` (a blob of 16-byte hashes) the host pool holds."""
        return self.table.prefix_len(ns.prefix, hashes)

    def holds(self, ns: NamespaceEntry, block_hash: bytes) -> bool:
        return ns.key(block_hash) in self.table

    def slot(self, ns: NamespaceEntry, block_hash: bytes) -> int | None:
        """The gid of a stored block, or None (no recency effect)."""
        return self.table.get(ns.key(block_hash))

    def _key_at(self, gid: int) -> bytes | None:
        """The key of the block in a slot (the policy's way back from a gid)."""
        return self.pool.segments[gid >> 32].keys[gid & 0xFFFFFFFF]

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

    def crcs_of(self, gids: list[int]) -> list[int | None]:
        out = []
        for gid in gids:
            seg, slot = self._seg_slot(gid)
            out.append(seg.crc[slot])
        return out

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
        return gids

    # ----- two-phase store -----
    def reserve(self, ns: NamespaceEntry, hashes: list[bytes], holder: Holdings, lease_until: float = 0.0,
                touch: Touch | None = None) -> tuple[list[int], list[ReserveStatus]]:
        """Slots for the blocks not stored yet. Returns (gids, status) per block; gid 0 unless RESERVED. With
        `lease_until` (a time.monotonic() value), `expire` aborts the reservations still open at that time.

        A block stored already is stored again: it is refreshed (issue 14 part 5), so that the prefix's order holds
        (tails before heads): those after the last block reserved here now, tail first; the others when the block
        reserved after them is committed (`Holdings.refresh`), so that each ends up more recent than the blocks
        after it, holes filled or not."""
        self._drain_step()
        gids, status = [], []
        waiting: list[bytes] = []                    # blocks stored already, since the last one reserved
        room = holder.reserved_share * self.pool.capacity if holder.reserved_share else None
        # A put never drops its own chain's blocks to store later ones (they would follow a hole), nor blocks
        # worth more than its own (`_allocate`); with a lower tier an eviction demotes instead of dropping, so
        # there the chain may overflow the pool (its head read back from below).
        mine = {ns.key(h) for h in hashes} if self.on_evict is None else None
        stopped = False
        for h in hashes:
            key = ns.key(h)
            if stopped:                              # the rest of the chain would follow a hole: not stored
                gids.append(0)
                status.append(EXISTS if key in self.table else NO_SPACE)
                continue
            if room is not None and holder.reserved_bytes + ns.slot_bytes > room and key not in self.table \
                    and key not in self.pending:
                self.counters["held_cap"] += 1           # server.max_reserved_fraction: the rest waits for commits
                gids.append(0)
                status.append(NO_SPACE)
                continue
            gid, st = self._reserve_one(key, ns, holder, protect=mine, touch=touch)
            stopped = st == NO_SPACE and self._kept_own
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
        for key in reversed(waiting):
            self.policy.accessed(key, touch)
        return gids, status

    def _reserve_one(self, key: bytes, ns: NamespaceEntry, holder: Holdings, evict: bool = True,
                     protect: set[bytes] | None = None, touch: Touch | None = None) -> tuple[int, ReserveStatus]:
        """A slot for one key not stored yet; without `evict`, from free space only (a prefetch). The blocks in
        `protect` (the put's own chain) are never evicted for it, nor (with `touch`, under a policy that can tell)
        a block worth more than the one coming: then NO_SPACE, and `_kept_own` says why — the rest of the chain
        would be worth no more (see `_allocate`)."""
        self._kept_own = False
        if key in self.table:
            return 0, EXISTS                          # refreshed by `reserve` (a promotion stops here)
        if key in self.pending:
            return 0, IN_PROGRESS
        if not self._may_hold(holder, ns.slot_bytes):
            return 0, NO_SPACE
        gid = self._allocate(ns.slot_key, ns.cls, protect, touch) if evict else \
            self.pool.allocate(ns.slot_bytes, ns.tenant)
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
        return bool(holder.held_share) and holder.held_bytes + nbytes > holder.held_share * self.pool.capacity

    def _may_hold(self, holder: Holdings, nbytes: int) -> bool:
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
        self._advance()
        return len(full)

    def _publish(self, ns: NamespaceEntry, key: bytes, gid: int, crc: int | None = None,
                 touch: Touch | None = None) -> None:
        seg, slot = self._seg_slot(gid)
        seg.keys[slot] = key
        seg.used[slot] = self._clock
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

    def disconnect(self, holder: Holdings) -> None:
        """A connection ended: its reservations are freed, its pins released, its namespaces let go of."""
        for key, gid in list(holder.reserved.items()):
            self._drop_reservation(key, gid)
        self.counters["aborts"] += len(holder.reserved)
        holder.reserved.clear()
        holder.leases.clear()
        holder.refresh.clear()
        for gid, n in holder.pins.items():
            for _ in range(n):
                self._unpin(gid)
        holder.pins.clear()
        holder.held_bytes = holder.reserved_bytes = 0
        self.namespaces.left(holder)

    # ----- pins -----
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

    def _pin(self, key: bytes, gid: int, touch: Touch | None = None) -> None:
        seg = self.pool.segment_of(gid)
        seg.used[gid & 0xFFFFFFFF] = self._clock
        if self.pins[gid] == 0:
            self.policy.pinned(key)
            seg.busy += 1
            if touch is not None:
                self.policy.accessed(key, touch)     # its tags: the block is relinked at its unpin
        else:
            self.policy.accessed(key, touch)
        self.pins[gid] += 1

    def _unpin(self, gid: int) -> None:
        self.pins[gid] -= 1
        if self.pins[gid] > 0:
            return
        del self.pins[gid]
        seg = self.pool.segment_of(gid)
        key = self.zombies.pop(gid, None)
        if key is not None:
            self._unbusy(seg)
            self._free(gid)
            return
        key = seg.keys[gid & 0xFFFFFFFF]
        if key is not None:
            self.policy.unpinned(key)
        self._unbusy(seg)

    def _drop_reservation(self, key: bytes, gid: int) -> None:
        del self.pending[key]
        ns = self.namespaces.owner(key)              # alive: a reservation keeps its entry
        ns.pending -= 1
        self._unbusy(self.pool.segment_of(gid))
        self._free(gid)
        self.namespaces.forget_unused(ns)

    # ----- inspection -----
    def stats(self) -> dict[str, int]:
        out = {"blocks": len(self.table), "reserved": len(self.pending), "pinned": len(self.pins),
               "zombies": len(self.zombies), "namespaces": len(self.namespaces),
               "namespaces_forgotten": self.namespaces.forgotten}
        counts = getattr(self.policy, "counts", None)
        if counts is not None:                      # the workflow policy: retired and active blocks
            c = counts()
            out.update(retired_blocks=c["retired"], active_blocks=c["active"])
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
