"""Reclaim around pinned slots, in the books (issue 29; kvstore.index.quotas, kvstore.tiers.host `hollow`): a
tenant within its quota takes back a borrower's segments even where each holds a pinned block; the unpinned blocks
leave, the free slots' pages are punched and no longer charged, the pinned ones stay charged to the borrower until
their release, which releases the segment. Page-sized blocks, 8 a segment; a pool of 8 segments."""
from __future__ import annotations

from kvstore.index import Holdings, Index
from kvstore.index.quotas import Quotas
from kvstore.protocol import ReserveStatus
from kvstore.protocol.geometry import Geometry
from kvstore.protocol.keys import NamespaceSpec
from kvstore.tiers.host import HostPool

GEOM = Geometry(layers=2, tokens=1, kv_heads=1, head_dim=1024, dtype="uint8", kv=2)    # 4 KiB blocks: a page
SLOT = GEOM.full_bytes
SEG = 8 * SLOT
RESERVED = ReserveStatus.RESERVED


def k(i: int) -> bytes:
    return i.to_bytes(16, "big")


def books(quota_a: int = 4 * SEG, quota_b: int = 4 * SEG) -> tuple[Index, dict[str, tuple[object, Holdings]]]:
    pool = HostPool(capacity=8 * SEG, segment_bytes=SEG, small_slots=0)
    idx = Index(pool, quotas=Quotas(pool, {"a": quota_a, "b": quota_b}, window_s=600))
    tenants = {}
    for t in ("a", "b"):
        h = Holdings(tenant=t)
        tenants[t] = (idx.register(NamespaceSpec("m", GEOM), h), h)
    return idx, tenants


def put(idx: Index, ns: object, h: Holdings, ids: range) -> int:
    keys = [k(i) for i in ids]
    gids, status = idx.reserve(ns, keys, h)  # type: ignore[arg-type]
    done = [key for key, st in zip(keys, status) if st == RESERVED]
    idx.commit(ns, done, h)  # type: ignore[arg-type]
    return len(done)


def test_a_segment_with_a_pinned_block_is_reclaimed_and_only_the_pinned_page_stays_charged():
    idx, t = books()
    (nb, hb), (na, ha) = t["b"], t["a"]
    pool = idx.pool
    assert put(idx, nb, hb, range(64)) == 64                  # b fills the pool: 8 segments
    pins = [idx.acquire(nb, [k(i)], hb)[0] for i in range(0, 64, 8)]   # type: ignore[arg-type]
    assert len({p >> 32 for p in pins}) == 8                  # one pinned block in each segment
    assert put(idx, na, ha, range(1000, 1032)) == 32          # a's whole quota, the pins held
    hollow = [s for s in pool.segments.values() if s.hollow]
    assert len(hollow) == 5 and all(s.live == s.busy == 1 for s in hollow)
    assert pool.punched_bytes == 5 * 7 * SLOT                 # all but the pinned slot of each
    assert pool.charged_bytes == 7 * SEG + 5 * SLOT <= pool.capacity
    assert pool.held["a"] == 4 * SEG and pool.held["b"] == 3 * SEG + 5 * SLOT
    assert idx.counters["segments_hollowed"] == 5
    assert all(idx.table.get(nb.key(k(i))) == p for i, p in zip(range(0, 64, 8), pins))  # type: ignore[attr-defined]
    idx.release(pins, hb)                                     # the last pins go: so do the hollowed segments
    assert not any(s.hollow for s in pool.segments.values())
    assert pool.punched_bytes == 0 and pool.charged_bytes == pool.mapped_bytes == 7 * SEG
    assert pool.held["b"] == 3 * SEG
    assert put(idx, nb, hb, range(200, 208)) == 8 and pool.held["b"] == 4 * SEG   # b grows back to its quota


def test_a_slot_freed_in_a_hollowed_segment_is_punched_then():
    idx, t = books()
    (nb, hb), (na, ha) = t["b"], t["a"]
    pool = idx.pool
    put(idx, nb, hb, range(64))
    pins = [idx.acquire(nb, [k(i), k(i + 1)], hb) for i in range(0, 64, 8)]   # type: ignore[arg-type]
    assert put(idx, na, ha, range(1000, 1008)) == 8           # one segment for a
    seg = next(s for s in pool.segments.values() if s.hollow)
    before = pool.punched_bytes
    idx.release([g for g in pins[0] + sum(pins[1:], []) if g >> 32 == seg.id][1:], hb)   # one of its two pins
    assert pool.punched_bytes == before + SLOT and seg.busy == 1 and seg.hollow


def test_pins_beyond_the_borrowers_quota_are_all_it_keeps():
    idx, t = books()
    (nb, hb), (na, ha) = t["b"], t["a"]
    put(idx, nb, hb, range(64))
    idx.acquire(nb, [k(i) for i in range(64) if i % 8 < 5], hb)  # type: ignore[arg-type]
    assert put(idx, na, ha, range(1000, 1032)) == 24          # 5 of 8 pinned everywhere: a gets all the rest,
    assert all(s.hollow for s in idx.pool.segments.values() if s.tenant == "b")   # every segment of b's
    assert idx.pool.held["b"] == 5 * SEG and idx.pool.charged_bytes == idx.pool.capacity   # its pins: their lease


def test_a_reserved_slot_keeps_its_page_and_its_commit_lets_the_segment_go():
    idx, t = books()
    (nb, hb), (na, ha) = t["b"], t["a"]
    pool = idx.pool
    assert put(idx, nb, hb, range(63)) == 63
    gids, _ = idx.reserve(nb, [k(63)], hb)                    # b's writer still copying into the last slot
    pins = [g for i in range(0, 56, 8) for g in idx.acquire(nb, [k(i), k(i + 1)], hb)]   # type: ignore[arg-type]
    assert put(idx, na, ha, range(1000, 1032)) == 32          # a's quota: the least busy, reserved, segment first
    seg = pool.segment_of(gids[0])
    assert seg.hollow and seg.live == seg.busy == 1
    idx.commit(nb, [k(63)], hb)                               # the commit lands, then leaves with the segment
    assert seg.id not in pool.segments and idx.host_prefix(nb, k(63)) == 0   # type: ignore[arg-type]
    idx.release(pins, hb)
    assert pool.punched_bytes == 0 and pool.charged_bytes == pool.mapped_bytes
