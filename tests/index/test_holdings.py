"""A connection's holdings as the books keep them (issue 13, part 2): the bytes it holds against its share of the
pool, the leases of its reservations, its namespaces and their forgetting, and slot classes per tenant. Tiny keys,
expected outcomes as data."""
from __future__ import annotations

import pytest

from kvstore.index import Holdings, Index, OverLimit
from kvstore.protocol import ReserveStatus
from kvstore.protocol.geometry import Geometry
from kvstore.protocol.keys import NamespaceSpec
from kvstore.tiers.host import HostPool

RESERVED, EXISTS, IN_PROGRESS, NO_SPACE = ReserveStatus
SMALL = Geometry(layers=1, tokens=1, kv_heads=1, head_dim=256, dtype="uint8", kv=2)   # 512-byte blocks
SEG = 4096                                                                           # 8 blocks a segment


def k(*ids: int) -> list[bytes]:
    return [i.to_bytes(16, "big") for i in ids]


@pytest.fixture
def idx() -> Index:
    return Index(HostPool(capacity=4 * SEG, segment_bytes=SEG))   # 32 blocks


def test_held_bytes_follow_reserve_commit_acquire_release_and_stop_at_the_share(idx):
    h = Holdings(held_share=0.25)                       # 8 blocks of 32
    ns = idx.register(NamespaceSpec("m", SMALL), h)
    _, status = idx.reserve(ns, k(*range(10)), h)
    assert status == [RESERVED] * 8 + [NO_SPACE] * 2 and h.held_bytes == 8 * 512
    assert idx.counters["held_cap"] == 2
    idx.commit(ns, k(*range(8)), h)
    assert h.held_bytes == 0
    got = idx.acquire(ns, k(*range(8)), h) + idx.acquire(ns, k(0), h)   # a second pin of one slot costs nothing
    assert len(got) == 9 and h.held_bytes == 8 * 512
    assert idx.reserve(ns, k(20), h)[1] == [NO_SPACE]
    idx.release(got, h)
    assert h.held_bytes == 0 and idx.reserve(ns, k(20), h)[1] == [RESERVED]


def test_an_acquire_stops_at_the_share(idx):
    w, r = Holdings(), Holdings(held_share=0.125)       # the reader may pin 4 blocks
    ns = idx.register(NamespaceSpec("m", SMALL), w)
    idx.register(NamespaceSpec("m", SMALL), r)
    idx.reserve(ns, k(*range(6)), w)
    idx.commit(ns, k(*range(6)), w)
    assert len(idx.acquire(ns, k(*range(6)), r)) == 4 and idx.at_cap(r, 512)


def test_expired_leases_are_aborted_oldest_first_and_committed_ones_left(idx):
    h = Holdings()
    ns = idx.register(NamespaceSpec("m", SMALL), h)
    idx.reserve(ns, k(1, 2), h, lease_until=10.0)
    idx.reserve(ns, k(3), h, lease_until=20.0)
    idx.commit(ns, k(2), h)
    assert idx.expire(h, 5.0) == 0
    assert idx.expire(h, 15.0) == 1 and list(h.reserved) == [ns.key(k(3)[0])]   # 1 expired, 2 was committed
    assert idx.expire(h, 25.0) == 1 and not h.reserved and not h.leases and h.held_bytes == 0
    assert idx.counters["reservations_expired"] == 2 and len(idx.pending) == 0


def test_namespaces_per_holder_are_capped(idx):
    h = Holdings(max_namespaces=1)
    idx.register(NamespaceSpec("a", SMALL), h)
    idx.register(NamespaceSpec("a", SMALL), h)          # the same one again: free
    with pytest.raises(OverLimit, match="server.max_namespaces_per_connection"):
        idx.register(NamespaceSpec("b", SMALL), h)


def test_a_namespace_is_forgotten_when_unused_and_its_id_never_reused(idx):
    a, b = Holdings(), Holdings()
    ns = idx.register(NamespaceSpec("m", SMALL), a)
    idx.register(NamespaceSpec("m", SMALL), b)
    idx.reserve(ns, k(1), a)
    idx.commit(ns, k(1), a)
    idx.disconnect(a)
    idx.disconnect(b)
    assert idx.namespaces.get(ns.id) is ns              # a block of it is still in the host pool
    idx.evict(everything=True)
    assert idx.namespaces.get(ns.id) is None and idx.stats()["namespaces_forgotten"] == 1
    again = idx.register(NamespaceSpec("m", SMALL), Holdings())
    assert again.id > ns.id and again.digest == ns.digest


def test_tenants_get_their_own_digests_classes_and_segments(idx):
    a, b, plain = Holdings(tenant="a"), Holdings(tenant="b"), Holdings()
    spec = NamespaceSpec("m", SMALL)
    na, nb, n0 = (idx.register(spec, h) for h in (a, b, plain))
    assert n0.digest == spec.digest() and len({na.digest, nb.digest, n0.digest}) == 3
    assert len({na.cls, nb.cls, n0.cls}) == 3
    (ga,), _ = idx.reserve(na, k(1), a)
    (gb,), _ = idx.reserve(nb, k(1), b)                 # the same hash: another key, another tenant's segment
    sa, sb = idx.pool.segment_of(ga), idx.pool.segment_of(gb)
    assert (sa.tenant, sb.tenant) == ("a", "b") and sa is not sb


def test_a_chain_carried_between_reserves_is_bounded():
    """`more` carries a put's chain to the connection's next reserve (protected, and its held blocks refreshed with
    the next one's). A client that sends `more` for ever does not grow it past RUN_KEYS: the run ends there and its
    held blocks are refreshed at once."""
    from kvstore.index.stores import RUN_KEYS

    idx = Index(HostPool(capacity=64 * SEG, segment_bytes=SEG))
    h = Holdings()
    ns = idx.register(NamespaceSpec("m", SMALL), h)
    idx.reserve(ns, k(*range(8)), h)
    idx.commit(ns, k(*range(8)), h)
    grew = 0
    for i in range(0, RUN_KEYS + 4096, 1024):                  # held keys (refreshed later), a long chain named
        _, status = idx.reserve(ns, k(*range(8)), h, after=k(*range(1000 + i, 2024 + i)), more=True)
        assert status == [EXISTS] * 8
        assert len(h.run) + len(h.carry) <= RUN_KEYS
        grew = max(grew, len(h.run))
    assert grew > RUN_KEYS - 2048                              # it was carried, up to the bound
    idx.reserve(ns, k(99), h)                                  # a reserve without `more` ends the run
    assert h.run == set() and h.carry == []
