"""The index and pool as a library, scenario by scenario (tiny keys, expected outcomes as data).

`make test` runs this file twice: with the native key table and with the pure-Python fallback.
"""
from __future__ import annotations

import pytest

from kvstore.index import Eviction, Holdings, Index, UnknownNamespace
from kvstore.protocol import ReserveStatus
from kvstore.protocol.geometry import Geometry
from kvstore.protocol.keys import NamespaceSpec
from kvstore.tiers.host import HostPool

RESERVED, EXISTS, IN_PROGRESS, NO_SPACE = ReserveStatus

SMALL = Geometry(layers=1, tokens=1, kv_heads=1, head_dim=256, dtype="uint8", kv=2)   # 512-byte blocks
BIG = Geometry(layers=2, tokens=1, kv_heads=1, head_dim=256, dtype="uint8", kv=2)     # 1 KiB blocks
SEG = 4096


def k(i: int) -> bytes:
    return i.to_bytes(16, "big")


def keys(*ids: int) -> list[bytes]:
    return [k(i) for i in ids]


@pytest.fixture
def idx() -> Index:
    return Index(HostPool(capacity=2 * SEG, segment_bytes=SEG))   # 16 small blocks


def ns_of(idx: Index, model: str = "m", geom: Geometry = SMALL) -> tuple[object, Holdings]:
    h = Holdings()
    return idx.register(NamespaceSpec(model, geom), h), h


def put(idx: Index, ns: object, h: Holdings, *ids: int) -> list[int]:
    gids, status = idx.reserve(ns, keys(*ids), h)  # type: ignore[arg-type]
    idx.commit(ns, [k(i) for i, s in zip(ids, status) if s == RESERVED], h)  # type: ignore[arg-type]
    return status


def test_reserve_statuses(idx):
    ns, a = ns_of(idx)
    b = Holdings()
    b.namespaces.add(ns.id)
    put(idx, ns, a, 1)
    idx.reserve(ns, keys(2), a)
    _, status = idx.reserve(ns, keys(1, 2, 3), b)
    assert status == [EXISTS, IN_PROGRESS, RESERVED]


def test_lru_evicts_oldest_unpinned(idx):
    ns, h = ns_of(idx)
    put(idx, ns, h, *range(16))                        # full: 16 slots
    idx.acquire(ns, keys(0, 1), h)                     # 0 and 1 pinned
    idx.release(idx.acquire(ns, keys(2), h), h)        # 2 used again: most recent
    assert put(idx, ns, h, 100, 101, 102) == [RESERVED] * 3
    # one commit is one prefix, linked head last: its tail is the oldest, so 15, 14, 13 went
    assert [idx.host_prefix(ns, k(i)) for i in range(16)] == [1] * 13 + [0] * 3
    assert idx.counters["evictions"] == 3


def test_no_space_when_all_pinned_and_nothing_leaks(idx):
    ns, h = ns_of(idx)
    put(idx, ns, h, *range(16))
    idx.acquire(ns, keys(*range(16)), h)
    assert put(idx, ns, h, 99) == [NO_SPACE]
    idx.disconnect(h)
    assert (len(idx.pins), idx.pool.used_bytes) == (0, 16 * 512)
    assert put(idx, ns, h, 99) == [RESERVED]


def test_disconnect_frees_reservations(idx):
    ns, h = ns_of(idx)
    idx.reserve(ns, keys(1, 2, 3), h)
    assert idx.pool.used_bytes == 3 * 512
    idx.disconnect(h)
    assert (idx.pool.used_bytes, len(idx.pending), idx.host_prefix(ns, k(1))) == (0, 0, 0)


def test_unknown_namespace_for_this_holder(idx):
    ns, _ = ns_of(idx)
    with pytest.raises(UnknownNamespace, match="not registered on this connection"):
        idx.namespace(ns.id, Holdings())


def test_other_size_reclaims_an_idle_segment(idx):
    small, h = ns_of(idx)
    big, _ = ns_of(idx, "big", BIG)
    h.namespaces.add(big.id)
    put(idx, small, h, *range(16))                     # both segments hold small blocks
    assert put(idx, big, h, 500) == [RESERVED]         # a whole small segment was emptied for it
    assert idx.pool.mapped_bytes <= idx.pool.capacity
    assert sum(idx.host_prefix(small, k(i)) for i in range(16)) == 8
    assert idx.host_prefix(big, k(500)) == 1


def test_delete_while_pinned_then_store_again(idx):
    ns, h = ns_of(idx)
    put(idx, ns, h, 7)
    gids = idx.acquire(ns, keys(7), h)
    assert idx.delete(ns, keys(7)) == [True]
    assert put(idx, ns, h, 7) == [RESERVED]           # a new block under the same key, another slot
    new = idx.table.get(ns.prefix + k(7))
    assert new != gids[0]
    idx.release(gids, h)                               # frees the old slot only
    assert idx.table.get(ns.prefix + k(7)) == new
    assert idx.pool.used_bytes == 512


def test_shrink_cost_follows_released_blocks(idx):
    ns, h = ns_of(idx)
    put(idx, ns, h, *range(8))                         # fills exactly one segment
    idx.resize(4 * SEG)
    r = idx.resize(SEG)
    assert (r.released_segments, r.evicted) == (0, 0)  # only the full segment exists: nothing to release
    put(idx, ns, h, *range(8, 16))                     # the cap is one segment now: they replace 0..7
    assert idx.pool.mapped_bytes == SEG
    assert idx.counters["evictions"] == 8


def test_memory_follows_use_across_block_sizes(idx):
    small, h = ns_of(idx)
    big, _ = ns_of(idx, "big", BIG)
    h.namespaces.add(big.id)
    put(idx, small, h, *range(16))                     # the small size fills the pool first, then goes idle
    for i in range(8):                                 # the big size is busy: one block at a time
        put(idx, big, h, 500 + i)
    assert sum(idx.host_prefix(big, k(500 + i)) for i in range(8)) == 8     # it got both segments, not one
    assert sum(idx.host_prefix(small, k(i)) for i in range(16)) == 0


def test_recently_used_other_size_keeps_its_segment(idx):
    small, h = ns_of(idx)
    big, _ = ns_of(idx, "big", BIG)
    h.namespaces.add(big.id)
    put(idx, small, h, *range(8))                      # one segment of small blocks
    put(idx, big, h, *range(500, 504))                 # one segment of big blocks: the pool is full
    idx.release(idx.acquire(small, keys(*range(8)), h), h)   # the small blocks are used again: fresher
    put(idx, big, h, 504)
    assert sum(idx.host_prefix(small, k(i)) for i in range(8)) == 8            # kept
    assert sum(idx.host_prefix(big, k(i)) for i in range(500, 505)) == 4      # big evicted its own oldest
    assert idx.host_prefix(big, k(503)) == 0             # its oldest: the tail of the commit


class HoldingSink:
    """An eviction sink that holds every slot it may, as the demotion mover does while it copies."""

    def __init__(self) -> None:
        self.seen: list[Eviction] = []

    def __call__(self, e: Eviction) -> bool:
        self.seen.append(e)
        return True


def test_evictions_are_decisions_held_until_let_go():
    sink = HoldingSink()
    idx = Index(HostPool(capacity=2 * SEG, segment_bytes=SEG), on_evict=sink)
    ns, h = ns_of(idx)
    put(idx, ns, h, *range(16))                        # full
    idx.evict(nbytes=3 * 512)                          # three evictions, each handed to the sink
    assert [e.block_id for e in sink.seen] == [ns.digest + k(i) for i in (15, 14, 13)]
    assert all(not e.handed_over and not e.draining and e.nbytes == 512 for e in sink.seen)
    held = [e.gid for e in sink.seen]
    assert idx.pool.used_bytes == 16 * 512             # their slots are held: not free, not reusable
    assert all(idx.pool.segment_of(g).busy > 0 for g in held)
    idx.let_go(held)
    assert idx.pool.used_bytes == 13 * 512
    assert [s.busy for s in idx.pool.segments.values()] == [0, 0]   # holds leave no busy count behind


def test_an_eviction_for_a_slot_hands_the_slot_over():
    sink = HoldingSink()
    idx = Index(HostPool(capacity=SEG, segment_bytes=SEG), on_evict=sink)     # 8 small blocks
    ns, h = ns_of(idx)
    put(idx, ns, h, *range(8))
    gids, status = idx.reserve(ns, keys(100), h)       # full: the oldest block's slot is handed over
    assert status == [RESERVED] and len(sink.seen) == 1
    e = sink.seen[0]
    assert (e.handed_over, e.gid, e.block_id) == (True, gids[0], ns.digest + k(7))
    assert idx.pins[e.gid] == 0                        # not held: the caller owns it (writes it after the copy)


@pytest.mark.parametrize("policy", ["lru", "workflow"])
def test_a_re_store_refreshes_the_prefix_tail_first(policy):
    """Issue 14 part 5: storing blocks that exist refreshes them, the head last (before: head first, so the head
    of a re-stored prefix was the first of it to go)."""
    idx = Index(HostPool(capacity=2 * SEG, segment_bytes=SEG), policy)
    ns, h = ns_of(idx)
    put(idx, ns, h, *range(1, 9))               # the prefix 1..8
    put(idx, ns, h, *range(9, 17))              # the pool is full
    assert put(idx, ns, h, *range(1, 9)) == [EXISTS] * 8     # stored again: now more recent than 9..16
    put(idx, ns, h, *range(17, 25))             # evicts 9..16
    put(idx, ns, h, 25, 26)                     # evicts the prefix's tail: 8, 7
    assert [idx.holds(ns, k(i)) for i in range(1, 9)] == [True] * 6 + [False] * 2


@pytest.mark.parametrize("policy", ["lru", "workflow"])
def test_a_hole_filled_by_a_re_store_is_older_than_the_blocks_before_it(policy):
    """A re-store with a hole: the blocks after the hole are refreshed at the reserve, the filled hole at its
    commit, the blocks before it right after that: the prefix is ordered tail first throughout."""
    idx = Index(HostPool(capacity=2 * SEG, segment_bytes=SEG), policy)
    ns, h = ns_of(idx)
    put(idx, ns, h, *range(1, 9))
    assert idx.delete(ns, keys(4)) == [True]    # a hole
    put(idx, ns, h, *range(9, 17))
    assert put(idx, ns, h, *range(1, 9)) == [EXISTS] * 3 + [RESERVED] + [EXISTS] * 4
    put(idx, ns, h, *range(17, 25))             # evicts 9..16
    put(idx, ns, h, 25, 26, 27)                 # evicts 8, 7, 6: 1..5 stay, the filled hole with them
    assert [idx.holds(ns, k(i)) for i in range(1, 9)] == [True] * 5 + [False] * 3
