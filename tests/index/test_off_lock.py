"""The books' share of keeping work off the state lock (issue 13, part 4), as a library, scenario by scenario:

- a walk over a namespace's slots (`SlotCursor`) a chunk at a time, with the index changing between chunks, and the
  operator's eviction made of such chunks (`evict_plan`, `evict_some`);
- memory moving to another block size: the retiring segment is lent (the allocation gets its segment at once, the
  pool over its cap by that one segment until its punch), its evictions may be copied later; a second move while
  one is lent is made inline, as before.

`make test` runs this file with the native key table and with the pure-Python fallback.
"""
from __future__ import annotations

import time

import pytest

from kvstore.index import Eviction, Holdings, Index
from kvstore.index.capacity import MOVE_CHUNK
from kvstore.protocol import ReserveStatus
from kvstore.protocol.geometry import Geometry
from kvstore.protocol.keys import NamespaceSpec
from kvstore.tiers.host import HostPool

RESERVED = ReserveStatus.RESERVED
SMALL = Geometry(layers=1, tokens=1, kv_heads=1, head_dim=256, dtype="uint8", kv=2)   # 512-byte blocks
BIG = Geometry(layers=2, tokens=1, kv_heads=1, head_dim=256, dtype="uint8", kv=2)     # 1 KiB blocks
SEG = 4096                                                                             # 8 small blocks


def k(i: int) -> bytes:
    return i.to_bytes(16, "big")


class HoldingSink:
    """An eviction sink that holds every slot it may, as the demotion mover does until its deferred copy (one it
    must copy now, it copies at once and does not hold)."""

    def __init__(self) -> None:
        self.seen: list[Eviction] = []

    def __call__(self, e: Eviction) -> bool:
        self.seen.append(e)
        return not e.copy_now


def ns_of(idx: Index, model: str, geom: Geometry = SMALL, h: Holdings | None = None) -> tuple[object, Holdings]:
    h = h or Holdings()
    return idx.register(NamespaceSpec(model, geom), h), h


def put(idx: Index, ns: object, h: Holdings, ids: range | list[int]) -> list[int]:
    gids, status = idx.reserve(ns, [k(i) for i in ids], h)  # type: ignore[arg-type]
    assert status == [RESERVED] * len(status), status
    idx.commit(ns, [k(i) for i in ids], h)  # type: ignore[arg-type]
    return gids


def walk_all(idx: Index, ns: object, slots: int, limit: int, between=lambda: None) -> list[tuple[bytes, int]]:
    cursor = idx.walk(ns)  # type: ignore[arg-type]
    out: list[tuple[bytes, int]] = []
    while True:
        out += idx.keys_some(cursor, slots, limit)
        if cursor.done:
            return out
        between()


def test_a_walk_visits_each_block_once_and_only_its_namespace():
    idx = Index(HostPool(capacity=8 * SEG, segment_bytes=SEG))
    a, h = ns_of(idx, "a")
    b, _ = ns_of(idx, "b", h=h)                         # same class: its blocks share a's segments
    put(idx, a, h, range(20))
    put(idx, b, h, range(100, 110))
    got = walk_all(idx, a, slots=3, limit=2)            # many small chunks
    assert sorted(hh for hh, _ in got) == [k(i) for i in range(20)]
    assert {gid for _, gid in got} == {idx.slot(a, k(i)) for i in range(20)}  # type: ignore[arg-type]


def test_a_walk_sees_what_stayed_exactly_once_while_the_index_changes_between_chunks():
    idx = Index(HostPool(capacity=8 * SEG, segment_bytes=SEG))
    a, h = ns_of(idx, "a")
    put(idx, a, h, range(40))                           # five segments
    pinned = idx.acquire(a, [k(3)], h)  # type: ignore[arg-type]
    idx.delete(a, [k(3)])  # type: ignore[arg-type]     # deleted while pinned: its key stays in the slot
    changes = iter([lambda: idx.delete(a, [k(i) for i in range(8, 16)]),   # a whole segment emptied: released
                    lambda: put(idx, a, h, range(500, 510)),                 # new blocks, into freed slots
                    lambda: idx.delete(a, [k(30)])])  # type: ignore[arg-type]
    got = walk_all(idx, a, slots=4, limit=100, between=lambda: next(changes, lambda: None)())
    names = [hh for hh, _ in got]
    assert len(names) == len(set(names))                # no block twice
    stayed = {k(i) for i in range(40)} - {k(3), k(30)} - {k(i) for i in range(8, 16)}
    assert stayed <= set(names)                         # every block present throughout, seen
    assert k(3) not in names                            # the zombie's slot is not its block any more
    assert set(names) <= stayed | {k(i) for i in range(500, 510)} | {k(i) for i in range(8, 16)} | {k(30)}
    idx.release(pinned, h)


@pytest.mark.parametrize("budget", [1, 3, 1000])
def test_a_namespace_evict_in_chunks_takes_every_unpinned_block_and_nothing_else(budget):
    idx = Index(HostPool(capacity=8 * SEG, segment_bytes=SEG))
    a, h = ns_of(idx, "a")
    b, _ = ns_of(idx, "b", h=h)
    put(idx, a, h, range(20))
    put(idx, b, h, range(100, 110))
    lease = idx.acquire(a, [k(0), k(1)], h)  # type: ignore[arg-type]
    plan = idx.evict_plan(a.id, everything=True)  # type: ignore[attr-defined]
    chunks = 1
    while not idx.evict_some(plan, budget):
        chunks += 1
    assert (plan.blocks, plan.freed) == (18, 18 * 512)
    assert chunks >= 18 // budget
    assert [idx.host_prefix(a, k(i)) for i in range(4)] == [1, 1, 0, 0]  # type: ignore[arg-type]
    assert idx.host_prefix(b, b"".join(k(i) for i in range(100, 110))) == 10  # type: ignore[arg-type]
    idx.release(lease, h)


def test_a_namespace_evict_by_bytes_stops_there_and_ends_when_the_namespace_is_forgotten():
    idx = Index(HostPool(capacity=8 * SEG, segment_bytes=SEG))
    a, h = ns_of(idx, "a")
    put(idx, a, h, range(20))
    plan = idx.evict_plan(a.id, nbytes=5 * 512)  # type: ignore[attr-defined]
    while not idx.evict_some(plan, 2):
        pass
    assert plan.blocks == 5 and idx.stats()["blocks"] == 15
    plan = idx.evict_plan(a.id, everything=True)  # type: ignore[attr-defined]
    assert not idx.evict_some(plan, 2)
    idx.delete(a, [k(i) for i in range(20)])  # type: ignore[arg-type]
    idx.disconnect(h)                                   # no user, no block: the namespace is forgotten
    assert idx.evict_some(plan, 2) and plan.blocks == 2


def test_an_evict_in_policy_order_stops_at_the_blocks_it_started_with():
    idx = Index(HostPool(capacity=8 * SEG, segment_bytes=SEG))
    a, h = ns_of(idx, "a")
    put(idx, a, h, range(10))
    plan = idx.evict_plan(everything=True)
    n = 100
    while not idx.evict_some(plan, 3):
        put(idx, a, h, [n])                             # a writer goes on between chunks
        n += 1
    assert plan.blocks == 10                            # not chasing the writer for ever


def test_memory_moves_to_another_size_by_lending_the_retiring_segment():
    sink = HoldingSink()
    idx = Index(HostPool(capacity=2 * SEG, segment_bytes=SEG), on_evict=sink)
    small, h = ns_of(idx, "small")
    big, _ = ns_of(idx, "big", BIG, h)
    put(idx, small, h, range(16))                       # both segments hold small blocks
    put(idx, big, h, [500])                             # one small segment moves to the big size
    pool = idx.pool
    assert (idx.counters["segment_moves"], idx.counters["segment_moves_inline"]) == (1, 0)
    moved = [e for e in sink.seen if e.draining]
    assert len(moved) == 8 and not any(e.copy_now for e in moved)   # copies may wait until after the lock
    assert pool.retiring_bytes == SEG                   # lent: not charged
    assert pool.mapped_bytes == 3 * SEG                 # the new segment exists before the old one is gone
    assert pool.mapped_bytes + pool.reaping_bytes - pool.retiring_bytes <= pool.capacity
    # a second move while one is lent is made inline: its copies now, its pages punched under the lock
    put(idx, big, h, range(501, 509))
    assert idx.counters["segment_moves_inline"] == 1
    inline = [e for e in sink.seen if e.copy_now]
    assert len(inline) == 8 and all(e.draining for e in inline)
    assert pool.mapped_bytes + pool.reaping_bytes - pool.retiring_bytes <= pool.capacity
    idx.let_go([e.gid for e in sink.seen if not e.handed_over and not e.copy_now])   # copied: the lent one goes
    wait_punched(pool)
    assert pool.mapped_bytes <= pool.capacity and pool.retiring_bytes == 0
    assert sum(idx.host_prefix(big, k(i)) for i in range(501, 509)) == 8  # type: ignore[arg-type]


def test_a_pinned_segment_never_moves():
    sink = HoldingSink()
    idx = Index(HostPool(capacity=2 * SEG, segment_bytes=SEG), on_evict=sink)
    small, h = ns_of(idx, "small")
    big, _ = ns_of(idx, "big", BIG, h)
    gids = put(idx, small, h, range(16))
    lease = idx.acquire(small, [k(0)], h)  # type: ignore[arg-type]
    held = idx.pool.segment_of(lease[0])
    put(idx, big, h, [500])
    assert not held.draining and held.id in idx.pool.segments
    assert all(idx.pool.segment_of(e.gid) is not held for e in sink.seen)
    assert len(gids) == 16 and idx.host_prefix(small, k(0)) == 1  # type: ignore[arg-type]
    idx.release(lease, h)


def test_without_a_sink_the_lent_segment_is_punched_by_the_reaper():
    idx = Index(HostPool(capacity=2 * SEG, segment_bytes=SEG))
    small, h = ns_of(idx, "small")
    big, _ = ns_of(idx, "big", BIG, h)
    put(idx, small, h, range(16))
    put(idx, big, h, [500])
    assert idx.counters["segment_moves"] == 1
    wait_punched(idx.pool)
    assert idx.pool.mapped_bytes == 2 * SEG == idx.pool.capacity


def test_a_shrink_counts_segments_held_only_for_copies_as_released():
    sink = HoldingSink()
    idx = Index(HostPool(capacity=4 * SEG, segment_bytes=SEG), on_evict=sink)
    a, h = ns_of(idx, "a")
    put(idx, a, h, range(32))
    lease = idx.acquire(a, [k(31)], h)  # type: ignore[arg-type]
    r = idx.resize(SEG)
    assert (r.released_segments, r.draining_bytes) == (3, 0)    # gone once copied: no client holds them
    assert all(not e.copy_now for e in sink.seen)
    idx.let_go([e.gid for e in sink.seen])
    assert idx.pool.mapped_bytes == SEG
    idx.release(lease, h)


def wait_punched(pool: HostPool) -> None:
    deadline = time.monotonic() + 10
    while pool.retiring_bytes or pool.reaping_bytes:
        assert time.monotonic() < deadline, "the reaper never punched the retiring segment"
        time.sleep(0.001)


def test_a_large_lent_segment_drains_one_step_per_request_and_its_blocks_stay_readable_until_their_step():
    sink = HoldingSink()
    per_seg = 3 * MOVE_CHUNK                            # three drain steps a segment
    seg = per_seg * 512
    idx = Index(HostPool(capacity=2 * seg, segment_bytes=seg, small_slots=0), on_evict=sink)   # whole segments
    small, h = ns_of(idx, "small")
    big, _ = ns_of(idx, "big", BIG, h)
    put(idx, small, h, range(2 * per_seg))              # both segments full
    gids, _ = idx.reserve(big, [k(5000)], h)  # type: ignore[arg-type]   # the move: its first step only
    assert len(sink.seen) == MOVE_CHUNK and all(e.draining and not e.copy_now for e in sink.seen)
    moving = idx.pool.segment_of(sink.seen[0].gid)
    assert idx.pool.retiring_bytes == seg and idx.moving[0] is moving
    where = {i: idx.slot(small, k(i)) for i in range(2 * per_seg)}  # type: ignore[arg-type]
    left = [i for i, g in where.items() if g is not None and idx.pool.segment_of(g) is moving]
    assert len(left) == per_seg - MOVE_CHUNK            # still host hits until their step
    last = max(left, key=lambda i: where[i] & 0xFFFFFFFF)   # the block the walk reaches last
    lease = idx.acquire(small, [k(last)], h)  # type: ignore[arg-type]   # a request: one step, then its pin
    assert len(lease) == 1 and len(sink.seen) == 2 * MOVE_CHUNK
    idx.commit(big, [k(5000)], h)  # type: ignore[arg-type]              # the last step passes the pinned block
    assert len(sink.seen) == per_seg - 1 and not idx.moving
    assert idx.host_prefix(small, k(last)) == 1  # type: ignore[arg-type]
    idx.let_go([e.gid for e in sink.seen])
    assert moving.id in idx.pool.segments               # the pin keeps it
    idx.release(lease, h)                               # its last release: the block goes, then the segment
    assert len(sink.seen) == per_seg and idx.host_prefix(small, k(last)) == 0  # type: ignore[arg-type]
    idx.let_go([sink.seen[-1].gid])
    assert moving.id not in idx.pool.segments
    wait_punched(idx.pool)
    assert idx.pool.mapped_bytes == 2 * seg and idx.counters["evictions"] == per_seg
