"""The host pool: shared-memory segments that the daemon creates and every client maps.

Where bytes live, nothing more: the pool hands out and takes back slots; the index decides what lives in them and
what to evict. Each segment is one memfd holding whole slots of a single size (one slot = one Full Block), so a
segment is always a whole number of its blocks (SwiftCache's elastic unit, with no LCM needed because sizes never
share a segment). A segment also belongs to one tenant: slot classes are keyed by (tenant, slot size), so a
connection given the fds of its own tenant's segments can map no other tenant's bytes. One cap for all tenants.

- a segment holds `segment_bytes` of one size, rounded down to whole slots; a size of small blocks (more than
  `small_slots` of them in `segment_bytes`, pool.small_segment_slots, default 256; 0: none) gets segments of
  `small_slots` slots instead, but never below 1/SMALL_CLASS_SHARE of `segment_bytes`: memory moves between sizes
  a segment at a time, and a class of small blocks living in one big segment could only give it up with every
  block in it (measured: bench_forkkv's rank-16 residuals, a whole class wiped at each move).
- allocate / free are O(1): a free-slot stack per segment and an ordered set of segments with free slots per size.
- capacity is exact: the bytes of all live segments never exceed it; a segment is only created if it fits.
- growing moves nothing: it raises the cap, and segments are created when a size needs room.
- a segment's memfd is sealed against shrink and grow: a client holding its fd cannot truncate it.
- releasing a segment hands it to a reaper thread that punches its pages out of the memfd (so the memory returns
  to the system even while a client still maps it: that client then reads zeros, never a fault) and closes it;
  until then its bytes still count against the cap.
- moving memory to another class (block size or tenant) does not wait for the retiring segment: it is *lent*
  (`drain(seg, lend=True)`): its bytes move to `retiring_bytes`, which `fits` lets the pool exceed the cap by, so
  the allocation that retired it gets its new segment at once, while the index empties the retiring segment in
  steps (kvstore.index.capacity), the blocks' copies are made after the state lock is left, and the reaper
  punches its pages. At most one segment is lent at a time (`may_lend`): the memory really held is at most the
  cap plus one segment, and only until that punch is done; the bytes charged (`charged_bytes`: mapped + reaping -
  retiring - punched) never exceed the cap.
- a segment that must go while some of its slots are pinned or reserved (reclaimed for a tenant within its quota,
  kvstore.index.quotas) is *hollowed* (`hollow`): the pages of its free slots are punched at once, and each slot's as
  it is freed from then on, so that only its busy slots' pages stay charged (`punched_bytes` is what `fits` lets go
  of) — to its tenant too (`held`) — until the segment is released with its last slot. A reader keeps the slot it
  pinned; a client that reads another slot of the segment reads zeros (its CRC check fails), never a fault.

A slot's global id (gid) is `segment_id << 32 | slot_index`; segment ids are never reused.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import fcntl
import mmap
import os
import queue
import threading
from collections import Counter
from dataclasses import dataclass, field

SMALL_CLASS_SLOTS = 256     # slots in a segment of small blocks (the default of pool.small_segment_slots) ...
SMALL_CLASS_SHARE = 16      # ... whose segments are at least segment_bytes / this
_FALLOC_FL_KEEP_SIZE = 0x01
_FALLOC_FL_PUNCH_HOLE = 0x02
_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]


def punch_hole(fd: int, length: int) -> None:
    """Give a memfd's pages back to the system without changing its size."""
    punch_range(fd, 0, length)


def punch_range(fd: int, offset: int, length: int) -> None:
    """Give the pages of [offset, offset + length) of a memfd back to the system (whole pages: the caller aligns)."""
    if _libc.fallocate(fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE, offset, length) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"fallocate(PUNCH_HOLE, {offset}, {length}): {os.strerror(err)}")


def gid_of(segment_id: int, slot: int) -> int:
    return segment_id << 32 | slot


def split_gid(gid: int) -> tuple[int, int]:
    return gid >> 32, gid & 0xFFFFFFFF


@dataclass(slots=True, eq=False)
class Segment:
    id: int
    slot_bytes: int
    nslots: int
    fd: int
    free: list[int]
    keys: list[bytes | None]      # reverse map slot → key of the block in it (None when free or reserved)
    used: list[int]               # slot → the index's clock at the block's last store or read
    crc: list[int | None]         # slot → the CRC-32C its writer committed with the block, if it gave one
    live: int = 0                 # slots not free (reserved or holding a block)
    busy: int = 0                 # slots reserved or pinned: they keep the segment alive
    draining: bool = False        # chosen for release: allocates nothing, released when busy reaches 0
    mm: mmap.mmap | None = None   # the daemon's own mapping, made when it first moves bytes (SSD tier)
    urgent: bool = False          # released for an allocation that waits: copied and punched under the lock
    lent: bool = False            # retired for an allocation that did not wait: its bytes are in retiring_bytes
    copying: int = 0              # slots held only until their demotion copy is made (part of `busy`)
    walk_at: int = -1             # lent: the next slot whose block a drain step evicts (-1: not being walked)
    tenant: str = ""              # whose blocks it holds (only that tenant's connections get its fd)
    hollow: bool = False          # draining while busy: its free slots' pages are punched (`HostPool.hollow`)
    punched: int = 0              # ... bytes of them, no longer charged

    @property
    def slot_key(self) -> tuple[str, int]:
        return (self.tenant, self.slot_bytes)

    @property
    def size(self) -> int:
        return self.nslots * self.slot_bytes


@dataclass(slots=True)
class SlotClass:
    slot_bytes: int
    tenant: str = ""
    segments: dict[int, Segment] = field(default_factory=dict)
    with_free: dict[int, Segment] = field(default_factory=dict)   # insertion-ordered set


class HostPool:
    def __init__(self, capacity: int, segment_bytes: int, small_slots: int = SMALL_CLASS_SLOTS) -> None:
        self.capacity = capacity
        self.segment_bytes = segment_bytes
        self.small_slots = small_slots
        self.segments: dict[int, Segment] = {}
        self.classes: dict[tuple[str, int], SlotClass] = {}   # (tenant, slot bytes) → its segments
        self.mapped_bytes = 0
        self.used_bytes = 0
        self.generation = 0          # bumps when a segment is created or released
        self.reaping_bytes = 0       # released segments not yet punched out of memory
        self.retiring_bytes = 0      # lent segments (retired for another class) not yet punched: over the cap
        self.punched_bytes = 0       # pages of hollowed segments given back before their release (not charged)
        self.held: Counter[str] = Counter()   # tenant -> bytes of its segments not draining, and of the pages its
        #                                       hollowed ones keep (kvstore.index.quotas)
        self._reap_lock = threading.Lock()
        self._to_reap: queue.SimpleQueue[Segment | None] = queue.SimpleQueue()
        self._reaper: threading.Thread | None = None
        self._next_id = 1

    # ----- sizing -----
    def slots_per_segment(self, slot_bytes: int) -> int:
        whole = max(1, self.segment_bytes // slot_bytes)
        if not self.small_slots:
            return whole
        least = self.segment_bytes // SMALL_CLASS_SHARE // slot_bytes
        return min(whole, max(self.small_slots, least))

    def segment_size(self, slot_bytes: int) -> int:
        return self.slots_per_segment(slot_bytes) * slot_bytes

    def tail_bytes(self, slot_bytes: int) -> int:
        """What a segment of this size loses to rounding (`segment_bytes` not a whole number of slots); nothing
        for a small-block size, whose segments are sized in slots."""
        if self.slots_per_segment(slot_bytes) < self.segment_bytes // slot_bytes:
            return 0
        return max(0, self.segment_bytes - self.segment_size(slot_bytes))

    @property
    def charged_bytes(self) -> int:
        """The bytes held against the cap: segments mapped or not punched yet, less a lent segment's and the pages
        hollowed segments gave back."""
        with self._reap_lock:                  # the reaper changes them at once
            return self.mapped_bytes + self.reaping_bytes - self.retiring_bytes - self.punched_bytes

    def fits(self, slot_bytes: int) -> bool:
        """Whether a new segment of this size stays within the cap; a lent segment's bytes are not charged."""
        return self.charged_bytes + self.segment_size(slot_bytes) <= self.capacity

    def may_lend(self) -> bool:
        """Whether a segment may be lent now: none is lent already (the overshoot is at most one segment)."""
        with self._reap_lock:
            return self.retiring_bytes == 0

    # ----- slots -----
    def allocate(self, slot_bytes: int, tenant: str = "", grow: bool = True) -> int | None:
        """A free slot of this size in one of the tenant's segments (creating a segment if the cap and `grow`
        allow), or None: the caller must evict."""
        cls = self.classes.get((tenant, slot_bytes))
        if cls is None or not cls.with_free:
            if not grow or not self.fits(slot_bytes):
                return None
            seg = self._create(slot_bytes, tenant)
            cls = self.classes[(tenant, slot_bytes)]
        else:
            seg = next(iter(cls.with_free.values()))
        slot = seg.free.pop()
        if not seg.free:
            del cls.with_free[seg.id]
        seg.live += 1
        self.used_bytes += slot_bytes
        return gid_of(seg.id, slot)

    def free(self, gid: int) -> None:
        seg_id, slot = split_gid(gid)
        seg = self.segments[seg_id]
        seg.keys[slot] = None
        seg.free.append(slot)
        seg.live -= 1
        self.used_bytes -= seg.slot_bytes
        if not seg.draining:
            self.classes[seg.slot_key].with_free[seg.id] = seg
        elif seg.hollow:
            self._punch(seg, slot, slot + 1)

    def view(self, gid: int) -> memoryview:
        """The daemon's view of a slot's bytes (for demotion and promotion). Valid while the slot is held."""
        seg = self.segments[gid >> 32]
        if seg.mm is None:
            seg.mm = mmap.mmap(seg.fd, seg.size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        start = (gid & 0xFFFFFFFF) * seg.slot_bytes
        return memoryview(seg.mm)[start:start + seg.slot_bytes]

    def segment_of(self, gid: int) -> Segment:
        return self.segments[gid >> 32]

    # ----- segments -----
    def _create(self, slot_bytes: int, tenant: str) -> Segment:
        n = self.slots_per_segment(slot_bytes)
        seg_id = self._next_id
        self._next_id += 1
        fd = os.memfd_create(f"kvstore-seg-{seg_id}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, n * slot_bytes)
            # Clients map these fds read-write: sealed against shrink and grow (and the seals themselves), a client
            # cannot truncate a segment under the daemon (a SIGBUS for the daemon and every engine mapping it).
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
        except BaseException:
            os.close(fd)                  # whatever failed, the memfd does not leak
            raise
        seg = Segment(seg_id, slot_bytes, n, fd, list(range(n - 1, -1, -1)), [None] * n, [0] * n, [None] * n,
                      tenant=tenant)
        cls = self.classes.setdefault(seg.slot_key, SlotClass(slot_bytes, tenant))
        cls.segments[seg_id] = seg
        cls.with_free[seg_id] = seg
        self.segments[seg_id] = seg
        self.mapped_bytes += seg.size
        self.held[tenant] += seg.size
        self.generation += 1
        return seg

    def drain(self, seg: Segment, lend: bool = False) -> None:
        """Stop allocating from a segment chosen for release; with `lend`, its bytes stop counting against the cap
        at once (see the module docstring; the caller checked `may_lend`)."""
        if not seg.draining:
            self.held[seg.tenant] -= seg.size
        seg.draining = True
        self.classes[seg.slot_key].with_free.pop(seg.id, None)
        if lend and not seg.lent:
            seg.lent = True
            with self._reap_lock:
                self.retiring_bytes += seg.size

    def hollow(self, seg: Segment) -> None:
        """(A draining segment, not lent, that its busy slots keep.) Punch the pages of its free slots now, and of
        each slot freed from here on: only its busy slots' pages stay charged, to the pool and to its tenant
        (`held`), until it is released (the module docstring)."""
        assert seg.draining and not seg.lent, f"segment {seg.id} is lent or not draining"
        if seg.hollow:
            return
        seg.hollow = True
        self.held[seg.tenant] += seg.size           # what it keeps is its tenant's: less each run punched
        run: list[int] = []
        for slot in sorted(seg.free) + [-1]:
            if run and slot != run[-1] + 1:
                self._punch(seg, run[0], run[-1] + 1)
                run = []
            run.append(slot)

    def _punch(self, seg: Segment, first: int, end: int) -> None:
        """Punch the whole pages within slots [first, end) of a hollowed segment and stop charging them."""
        page = mmap.PAGESIZE
        lo = -(-first * seg.slot_bytes // page) * page
        hi = end * seg.slot_bytes // page * page
        if hi <= lo:
            return
        try:
            punch_range(seg.fd, lo, hi - lo)
        except OSError:
            return                                  # still charged: released with the segment
        seg.punched += hi - lo
        self.held[seg.tenant] -= hi - lo
        with self._reap_lock:
            self.punched_bytes += hi - lo

    def release(self, seg: Segment, inline: bool = False) -> None:
        """Return an empty segment's memory to the system (the caller has emptied it): in the background, or
        `inline` when an allocation is waiting for exactly this memory."""
        assert seg.live == 0, f"segment {seg.id} still holds {seg.live} slots"
        cls = self.classes[seg.slot_key]
        del cls.segments[seg.id]
        cls.with_free.pop(seg.id, None)
        if not cls.segments:
            del self.classes[seg.slot_key]
        del self.segments[seg.id]
        self.mapped_bytes -= seg.size
        if not seg.draining:
            self.held[seg.tenant] -= seg.size
        elif seg.hollow:
            self.held[seg.tenant] -= seg.size - seg.punched
        self.generation += 1
        if inline:
            _punch_and_close(seg)
            self._punched(seg, reaped=False)
            return
        with self._reap_lock:
            self.reaping_bytes += seg.size
        if self._reaper is None:
            self._reaper = threading.Thread(target=self._reap, name="kvstore-reaper", daemon=True)
            self._reaper.start()
        self._to_reap.put(seg)

    def _reap(self) -> None:
        """Punch released segments out of memory away from the state lock (the kernel's share of a shrink, ~50 ms
        per 256 MiB here, would otherwise stall every client). Until a segment is punched its bytes still count
        against the cap (`fits`), so the cap holds for the memory really in use."""
        while True:
            seg = self._to_reap.get()
            if seg is None:
                return
            _punch_and_close(seg)
            self._punched(seg, reaped=True)

    def _punched(self, seg: Segment, reaped: bool) -> None:
        with self._reap_lock:
            if reaped:
                self.reaping_bytes -= seg.size
            if seg.lent:
                self.retiring_bytes -= seg.size
            self.punched_bytes -= seg.punched       # its pages punched early: out of the reaping bytes' charge

    def close(self) -> None:
        if self._reaper is not None:
            self._to_reap.put(None)
            self._reaper.join()
        for seg in list(self.segments.values()):
            _unmap(seg)
            os.close(seg.fd)
        self.segments.clear()
        self.classes.clear()
        self.held.clear()
        self.mapped_bytes = self.used_bytes = 0

    def resident_bytes(self) -> int:
        """Pages actually allocated in all segments (what the system sees), read from the memfds."""
        return sum(os.fstat(s.fd).st_blocks * 512 for s in self.segments.values())


def _unmap(seg: Segment) -> None:
    if seg.mm is not None:
        try:
            seg.mm.close()
        except BufferError:
            pass  # a view still alive; the mapping goes with it, and the pages are punched already
        seg.mm = None


def _punch_and_close(seg: Segment) -> None:
    try:
        punch_hole(seg.fd, seg.size)
    except OSError:
        pass   # closing frees the memory as soon as no client maps it
    finally:
        _unmap(seg)
        os.close(seg.fd)
