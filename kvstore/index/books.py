"""The index: which key lives in which slot, who holds it, and what to evict. It keeps the books; it never moves
a byte (clients copy into and out of the slots it hands out).

Guarantees
- Two-phase store: `reserve` hands out slots; the client copies; `commit` makes the blocks visible. Until then no
  lookup or acquire sees them; `abort` — or the client's connection ending — frees them.
- `lookup` and `acquire` answer the longest contiguous prefix of the keys asked: a load takes only that prefix.
- A pinned block (acquired and not yet released) is never evicted, overwritten or freed; a delete of a pinned
  block hides it at once and frees its slot at the last release. Pins and reservations belong to a connection and
  are dropped with it.
- Keys carry their namespace id, so namespaces never see each other's blocks.
- Allocation never exceeds the pool's cap: a full size class evicts its least valuable unpinned block (the policy
  decides), or reclaims an idle segment of another size, or answers "no space".
- With an SSD tier, an evicted block is demoted (its bytes staged for the disk) instead of dropped; inside an op
  the staging copy is made after the state lock is left (`deferring` / `run_deferred`), and the victim's slot is
  neither freed nor written before it; lookups count blocks in either tier; `plan_promotion` reserves host slots for blocks only the SSD holds and
  `finish_promotion` publishes them after the caller has read them in, unless a delete came in between.

All methods run under the daemon's state lock (promotion reads happen between plan and finish, without it).
"""
from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvstore.protocol.keys import NamespaceSpec
from kvstore.index.keytable import KeyTable
from kvstore.policy import make_policy
from kvstore.tiers.host import HostPool, Segment, gid_of, split_gid
from kvstore.protocol import Code, ProtocolError, ReserveStatus
from kvstore.tiers.ssd.tier import SsdTier

RESERVED, EXISTS, IN_PROGRESS, NO_SPACE = (ReserveStatus.RESERVED, ReserveStatus.EXISTS, ReserveStatus.IN_PROGRESS,
                                          ReserveStatus.NO_SPACE)


@dataclass(slots=True)
class NamespaceEntry:
    id: int
    spec: NamespaceSpec
    digest: bytes
    prefix: bytes               # the 4 bytes that start each of its keys in the table
    slot_bytes: int
    blocks: int = 0


@dataclass(slots=True)
class Holdings:
    """What one connection holds: released when it ends."""
    reserved: dict[bytes, int] = field(default_factory=dict)   # key → gid
    pins: Counter[int] = field(default_factory=Counter)        # gid → count
    namespaces: set[int] = field(default_factory=set)
    segments: set[int] = field(default_factory=set)             # whose handles were sent on this connection


@dataclass(slots=True)
class ResizeResult:
    capacity: int
    released_segments: int
    evicted: int
    draining_bytes: int
    seconds: float


class Index:
    def __init__(self, pool: HostPool, policy: str = "lru", ssd: SsdTier | None = None) -> None:
        self.pool = pool
        self.ssd = ssd                              # evicted blocks are demoted there, acquires promote them
        self.promoting: set[bytes] = set()          # keys being read from the SSD tier into a reserved slot
        self.cancelled: set[bytes] = set()          # ... and deleted meanwhile: never published
        self.table = KeyTable()
        self.policy = make_policy(policy, self.table)
        self.namespaces: dict[int, NamespaceEntry] = {}
        self._by_digest: dict[bytes, NamespaceEntry] = {}
        self._class_ids: dict[int, int] = {}        # slot bytes → policy class id
        self.pending: dict[bytes, int] = {}         # reserved keys (any connection) → gid
        self.pins: Counter[int] = Counter()         # gid → pins across connections
        self.zombies: dict[int, bytes] = {}         # deleted while pinned: gid → key, freed at last release
        self.counters: Counter[str] = Counter()
        # Staging copies of evicted blocks that the thread which evicted them makes once it has left the state
        # lock (see `deferring`): per thread, (slot view, staging buffer, SSD key, gid held until copied or 0).
        self._deferred = threading.local()
        self._clock = 1                             # advances per commit and acquire: recency across sizes

    # ----- namespaces -----
    def register(self, spec: NamespaceSpec, holder: Holdings) -> NamespaceEntry:
        digest = spec.digest()
        ns = self._by_digest.get(digest)
        if ns is None:
            slot = spec.geometry.full_bytes
            if slot > self.pool.capacity:
                raise ProtocolError(Code.WRONG_GEOMETRY, f"a block of this geometry is {slot} bytes, larger than "
                                                         f"the whole pool ({self.pool.capacity} bytes)")
            nid = len(self.namespaces) + 1
            ns = NamespaceEntry(nid, spec, digest, nid.to_bytes(4, "big"), slot)
            self.namespaces[nid] = ns
            self._by_digest[digest] = ns
            self._class_ids.setdefault(slot, len(self._class_ids))
        holder.namespaces.add(ns.id)
        return ns

    def namespace(self, nid: int, holder: Holdings) -> NamespaceEntry:
        if nid not in holder.namespaces:
            raise ProtocolError(Code.UNKNOWN_NAMESPACE, f"namespace {nid} was not registered on this connection "
                                                        "(send hello with its spec first)")
        return self.namespaces[nid]

    # ----- reads -----
    def lookup(self, ns: NamespaceEntry, hashes: bytes) -> tuple[int, int]:
        """(blocks present, of which in the host pool): the longest prefix held by any tier."""
        host = n = self.table.prefix_len(ns.prefix, hashes)
        asked = len(hashes) // 16
        if self.ssd is not None:
            while n < asked:
                h = hashes[16 * n:16 * n + 16]
                if ns.prefix + h not in self.table and not self.ssd.has(ns.digest + h):
                    break
                n += 1
        self.counters["lookups"] += 1
        self.counters["hits"] += n
        self.counters["misses"] += asked - n
        return n, host

    def acquire(self, ns: NamespaceEntry, keys: list[bytes], holder: Holdings) -> list[int]:
        """Pin the longest present prefix; returns its slots."""
        gids = []
        for h in keys:
            key = ns.prefix + h
            gid = self.table.get(key)
            if gid is None:
                break
            self._pin(key, gid)
            holder.pins[gid] += 1
            gids.append(gid)
        self.counters["gets"] += len(gids)
        self._clock += 1
        return gids

    def release(self, gids: list[int], holder: Holdings) -> None:
        need = Counter(gids)
        for gid, n in need.items():
            if holder.pins[gid] < n:
                raise ProtocolError(Code.NOT_FOUND, f"slot {gid:#x} is not held {n} time(s) by this connection")
        for gid, n in reversed(need.items()):    # unpinned tail first: the head becomes the most recent
            holder.pins[gid] -= n
            if holder.pins[gid] == 0:
                del holder.pins[gid]
            for _ in range(n):
                self._unpin(gid)

    # ----- promotion from the SSD tier -----
    def plan_promotion(self, ns: NamespaceEntry, keys: list[bytes], holder: Holdings,
                       evict: bool = True) -> list[tuple[bytes, int]]:
        """Reserve host slots for the leading keys that only the SSD tier holds (without `evict`, in free space
        only: a prefetch displaces nothing). The caller reads them into the slots without the state lock, then
        calls finish_promotion."""
        plan: list[tuple[bytes, int]] = []
        cls = self._class_ids[ns.slot_bytes]
        for h in keys:
            key = ns.prefix + h
            if self.ssd is None or key in self.table or key in self.pending or not self.ssd.has(ns.digest + h):
                break
            gid, status = self._reserve_one(key, ns.slot_bytes, cls, holder, evict)
            if status != RESERVED:
                break
            self.promoting.add(key)
            plan.append((h, gid))
        return plan

    def finish_promotion(self, ns: NamespaceEntry, plan: list[tuple[bytes, int]], n: int, holder: Holdings,
                         pin: bool = True, crcs: Sequence[int | None] = ()) -> list[int]:
        """Publish (and pin) the first `n` promoted blocks, unless deleted meanwhile; free the other slots. `crcs`:
        the CRC-32 each block's SSD record was verified against, which its host slot carries on."""
        gids: list[int] = []
        cls = self._class_ids[ns.slot_bytes]
        for i, (h, gid) in enumerate(plan):
            key = ns.prefix + h
            self.promoting.discard(key)
            cancelled = key in self.cancelled
            self.cancelled.discard(key)
            del holder.reserved[key]
            if i < n and not cancelled and len(gids) == i:
                del self.pending[key]
                self._publish(ns, key, gid, cls, crcs[i] if i < len(crcs) else None)
                if pin:
                    self._pin(key, gid)
                    holder.pins[gid] += 1
                gids.append(gid)
            else:
                self._drop_reservation(key, gid)
        self.counters["promotions"] += len(gids)
        if pin:
            self.counters["gets"] += len(gids)
        return gids

    # ----- two-phase store -----
    def reserve(self, ns: NamespaceEntry, keys: list[bytes], holder: Holdings) -> tuple[list[int], list[int]]:
        """Slots for the keys not stored yet. Returns (gids, status) per key; gid 0 unless status is RESERVED."""
        gids, status = [], []
        cls = self._class_ids[ns.slot_bytes]
        for h in keys:
            gid, st = self._reserve_one(ns.prefix + h, ns.slot_bytes, cls, holder)
            gids.append(gid)
            status.append(st)
        return gids, status

    def crcs_of(self, gids: list[int]) -> list[int | None]:
        out = []
        for gid in gids:
            seg, slot = self._seg_slot(gid)
            out.append(seg.crc[slot])
        return out

    def _reserve_one(self, key: bytes, slot_bytes: int, cls: int, holder: Holdings,
                     evict: bool = True) -> tuple[int, int]:
        """A slot for one key not stored yet; without `evict`, from free space only (a prefetch)."""
        if key in self.table:
            self.policy.accessed(key)
            return 0, EXISTS
        if key in self.pending:
            return 0, IN_PROGRESS
        gid = self._allocate(slot_bytes, cls) if evict else self.pool.allocate(slot_bytes)
        if gid is None:
            return 0, NO_SPACE
        self.pending[key] = gid
        holder.reserved[key] = gid
        self.pool.segment_of(gid).busy += 1
        return gid, RESERVED

    def commit(self, ns: NamespaceEntry, keys: list[bytes], holder: Holdings, crcs: list[int] | None = None) -> int:
        """Publish reserved blocks. `crcs`, if given, is each block's CRC-32 as its writer computed it: readers get
        it back with the slot and can prove the bytes they copy are the bytes that were committed."""
        full = [ns.prefix + h for h in keys]
        if crcs is not None and (len(crcs) != len(keys) or any(c > 0xFFFFFFFF for c in crcs)):
            raise ProtocolError(Code.BAD_REQUEST, f"commit: crcs must be one CRC-32 per key ({len(keys)}), "
                                                  f"got {len(crcs)} value(s); nothing was committed")
        if len(set(full)) != len(full):
            raise ProtocolError(Code.BAD_REQUEST, "commit: a key appears twice; nothing was committed")
        missing = [i for i, k in enumerate(full) if k not in holder.reserved]
        if missing:
            raise ProtocolError(Code.NOT_FOUND, f"commit: {len(missing)} key(s) not reserved by this connection "
                                                f"(first at position {missing[0]}); nothing was committed")
        cls = self._class_ids[ns.slot_bytes]
        for i in reversed(range(len(full))):     # the head of the prefix linked last: the most recent
            key = full[i]
            gid = holder.reserved.pop(key)
            del self.pending[key]
            self._publish(ns, key, gid, cls, crcs[i] if crcs is not None else None)
        self.counters["puts"] += len(full)
        self._clock += 1
        return len(full)

    def _publish(self, ns: NamespaceEntry, key: bytes, gid: int, cls: int, crc: int | None = None) -> None:
        seg, slot = self._seg_slot(gid)
        seg.keys[slot] = key
        seg.used[slot] = self._clock
        seg.crc[slot] = crc
        self.table.insert(key, gid, cls)
        self._unbusy(seg)
        ns.blocks += 1

    def abort(self, ns: NamespaceEntry, keys: list[bytes], holder: Holdings) -> int:
        n = 0
        for h in keys:
            gid = holder.reserved.pop(ns.prefix + h, None)
            if gid is not None:
                self._drop_reservation(ns.prefix + h, gid)
                n += 1
        self.counters["aborts"] += n
        return n

    def delete(self, ns: NamespaceEntry, keys: list[bytes]) -> int:
        n = 0
        for h in keys:
            key = ns.prefix + h
            found = self._remove(key)
            if key in self.promoting:
                self.cancelled.add(key)
            if self.ssd is not None and self.ssd.delete(ns.digest + h):
                found = True
            n += found
        self.counters["deletes"] += n
        return n

    def disconnect(self, holder: Holdings) -> None:
        """A connection ended: its reservations are freed and its pins released."""
        for key, gid in list(holder.reserved.items()):
            self._drop_reservation(key, gid)
        self.counters["aborts"] += len(holder.reserved)
        holder.reserved.clear()
        for gid, n in holder.pins.items():
            for _ in range(n):
                self._unpin(gid)
        holder.pins.clear()

    # ----- capacity -----
    def evict(self, ns: NamespaceEntry | None = None, nbytes: int = 0, everything: bool = False) -> tuple[int, int]:
        """Evict unpinned blocks until `nbytes` are freed or, with `everything`, all of them: by the policy's
        order per size class, or for one namespace in table order (an operator's clean-up, not a hot path).
        Returns (blocks, bytes)."""
        blocks = freed = 0
        if ns is not None:
            for key, gid in [(k, g) for k, g in self.table.items() if k[:4] == ns.prefix]:
                if (everything or freed < nbytes) and self.pins[gid] == 0 and self._remove(key, evicted=True):
                    blocks, freed = blocks + 1, freed + ns.slot_bytes
            return blocks, freed
        for slot_bytes, cls in list(self._class_ids.items()):
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

    # ----- internals -----
    def _seg_slot(self, gid: int) -> tuple[Segment, int]:
        seg_id, slot = split_gid(gid)
        return self.pool.segments[seg_id], slot

    def _allocate(self, slot_bytes: int, cls: int) -> int | None:
        while True:
            gid = self.pool.allocate(slot_bytes)
            if gid is not None:
                return gid
            key = self.policy.victim(cls)
            stale = self._staler_segment(slot_bytes, key) if len(self.pool.classes) > 1 else None
            if stale is not None:
                self._retire(stale, inline=True)   # memory moves to this block size: a new segment fits
            elif key is not None:
                gid = self._evict_for_slot(key)
                if gid:
                    return gid
            elif not self._reclaim_other(slot_bytes):
                return None

    def _staler_segment(self, slot_bytes: int, victim: bytes | None) -> Segment | None:
        """An idle segment of another block size whose next victim was used before ours: the whole segment goes,
        so that memory follows use across block sizes instead of staying with whoever filled the pool first.
        Looks at one candidate per size class: O(classes)."""
        if victim is None:
            return None
        seg, slot = self._where(victim)
        mine = seg.used[slot]
        best: tuple[int, Segment] | None = None
        for other, cls in self._class_ids.items():
            key = self.policy.victim(cls) if other != slot_bytes else None
            if key is None:
                continue
            seg, slot = self._where(key)
            used = seg.used[slot]
            if seg.busy == 0 and not seg.draining and used < mine and (best is None or used < best[0]):
                best = (used, seg)
        return None if best is None else best[1]

    def _where(self, key: bytes) -> tuple[Segment, int]:
        gid = self.table.get(key)
        assert gid is not None, "a policy victim is always a stored block"
        return self._seg_slot(gid)

    def _reclaim_other(self, slot_bytes: int) -> bool:
        """Free a whole idle segment of another block size (fewest blocks first) so this size can grow."""
        idle = [s for s in self.pool.segments.values()
                if s.slot_bytes != slot_bytes and s.busy == 0 and not s.draining]
        while idle and not self.pool.fits(slot_bytes):
            seg = min(idle, key=lambda s: s.live)
            idle.remove(seg)
            self._retire(seg, inline=True)
        return self.pool.fits(slot_bytes)

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
        after the block's staging copy is made (see `deferring`); 0 when the slot cannot be handed over (pinned,
        or its segment drains): the block is then evicted as usual and the caller allocates again."""
        gid = self.table.get(key)
        if gid is None or self.pins[gid] or self.pool.segment_of(gid).draining:
            self._remove(key, evicted=True)
            return 0
        self._remove(key, evicted=True, keep=True)
        return gid

    def _remove(self, key: bytes, evicted: bool = False, keep: bool = False) -> bool:
        """Take a block out of the host pool; an evicted one is demoted to the SSD tier where there is one. With
        `keep` (only from `_evict_for_slot`), its unpinned slot stays allocated for the caller."""
        gid = self.table.remove(key)
        if gid is None:
            return False
        ns = self.namespaces[int.from_bytes(key[:4], "big")]
        ns.blocks -= 1
        if evicted:
            self.counters["evictions"] += 1
            if self.ssd is not None:
                self._demote(ns.digest + key[4:], gid, hold=not keep)
        if self.pins[gid]:
            self.zombies[gid] = key
        elif keep:
            self.pool.segment_of(gid).keys[gid & 0xFFFFFFFF] = None
        else:
            self.pins.pop(gid, None)
            self._free(gid)
        return True

    def _demote(self, skey: bytes, gid: int, hold: bool) -> None:
        """(Under the state lock.) Stage an evicted block for the SSD tier. Inside `deferring`, the copy (2 MiB
        for a typical block) is made after the state lock is left, and nobody writes the slot first: it is pinned
        until then (`hold`), or it goes to the thread's own caller, who writes it only after that."""
        assert self.ssd is not None
        pending = getattr(self._deferred, "pending", None)
        if pending is None or self.pool.segment_of(gid).draining:
            with self.pool.view(gid) as data:
                self.counters["demotions" if self.ssd.demote(skey, data) else "dropped"] += 1
            return
        buf = self.ssd.stage_begin(skey, self.pool.segment_of(gid).slot_bytes)
        self.counters["dropped" if buf is False else "demotions"] += 1
        if isinstance(buf, bool):
            return
        if hold:
            self.pins[gid] += 1                         # unpinned (and so freed) by run_deferred, once copied
        pending.append((self.pool.view(gid), buf, skey, gid if hold else 0))

    def deferring(self) -> None:
        """Staging copies of blocks this thread evicts from now on are made by `run_deferred`, which the thread
        calls as soon as it has left the state lock (before it replies, and before a promotion reads into a slot
        it got by eviction): the state lock is never held across a block copy."""
        if getattr(self._deferred, "pending", None) is None:
            self._deferred.pending = []

    def run_deferred(self, lock: Any, done: bool = True) -> None:
        """(Without the state lock.) Have the SSD tier make this thread's deferred staging copies, then free the
        slots held for them (taking `lock` for that); with `done`, stop deferring."""
        pending = getattr(self._deferred, "pending", None)
        if done:
            self._deferred.pending = None
        if not pending:
            return
        assert self.ssd is not None
        held = []
        for view, buf, skey, gid in pending:
            with view:
                self.ssd.stage_fill(skey, buf, view)
            if gid:
                held.append(gid)
        pending.clear()
        if held:
            with lock:
                for gid in held:
                    self._unpin(gid)

    def _free(self, gid: int) -> None:
        seg = self.pool.segment_of(gid)
        self.pool.free(gid)
        if seg.draining and seg.live == 0:
            self.pool.release(seg, seg.urgent)

    def _drop_reservation(self, key: bytes, gid: int) -> None:
        del self.pending[key]
        seg = self.pool.segment_of(gid)
        self._unbusy(seg)
        self._free(gid)

    def _unbusy(self, seg: Segment) -> None:
        seg.busy -= 1
        if seg.draining and seg.busy == 0:
            self._empty(seg)

    def _pin(self, key: bytes, gid: int) -> None:
        self.pool.segment_of(gid).used[gid & 0xFFFFFFFF] = self._clock
        if self.pins[gid] == 0:
            self.policy.pinned(key)
            self.pool.segment_of(gid).busy += 1
        else:
            self.policy.accessed(key)
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

    # ----- inspection -----
    def stats(self) -> dict[str, int]:
        return {"blocks": len(self.table), "reserved": len(self.pending), "pinned": len(self.pins),
                "zombies": len(self.zombies), "namespaces": len(self.namespaces)}

    def keys_of(self, ns: NamespaceEntry, limit: int) -> Iterator[tuple[bytes, int]]:
        n = 0
        for key, gid in self.table.items():
            if n >= limit:
                return
            if key[:4] == ns.prefix:
                yield key[4:], gid
                n += 1
