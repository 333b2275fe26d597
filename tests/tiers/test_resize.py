"""Online elastic resize: grow moves nothing, shrink releases whole segments evicting only unpinned blocks."""
from __future__ import annotations

from tests.conftest import GEOM, block, hashes, spec

PER_SEG = (1 << 20) // GEOM.full_bytes   # 128 blocks per 1 MiB segment


def test_grow_adds_room_without_moving_blocks(start_daemon):
    d = start_daemon(capacity="1MiB", segment="1MiB")
    with d.client() as c:
        ns = c.namespace(spec())
        hs = hashes(2 * PER_SEG)
        ns.put(hs[:PER_SEG], [block(i) for i in range(PER_SEG)])
        before = {h: gid for h, gid in c.list(ns.id, limit=1000)["keys"]}
        r = c.resize(2 << 20)
        assert (r["capacity"], r["released_segments"], r["evicted"]) == (2 << 20, 0, 0)
        ns.put(hs[PER_SEG:], [block(i) for i in range(PER_SEG, 2 * PER_SEG)])
        s = c.stats()
        assert s["counters"]["evictions"] == 0 and s["blocks"] == 2 * PER_SEG
        after = {h: gid for h, gid in c.list(ns.id, limit=1000)["keys"]}
        assert all(after[h] == gid for h, gid in before.items())     # no block moved
        outs = [bytearray(GEOM.full_bytes) for _ in hs]
        assert ns.get(hs, outs) == 2 * PER_SEG
        assert all(bytes(o) == block(i) for i, o in enumerate(outs))


def test_shrink_releases_segments_and_evicts_only_unpinned(start_daemon):
    d = start_daemon(capacity="4MiB", segment="1MiB")
    with d.client() as c:
        ns = c.namespace(spec())
        hs = hashes(4 * PER_SEG)
        for i in range(0, 4 * PER_SEG, 64):
            ns.put(hs[i:i + 64], [block(j) for j in range(i, i + 64)])
        lease = ns.acquire(hs[:3])                       # pinned: their segment must survive the shrink
        r = c.resize(1 << 20)
        assert r["released_segments"] == 3
        assert r["evicted"] == 3 * PER_SEG
        assert r["draining_bytes"] == 0
        s = c.stats()
        assert s["tiers"][0]["mapped_bytes"] == 1 << 20 == s["tiers"][0]["capacity_bytes"]
        assert s["tiers"][0]["resident_bytes"] <= 1 << 20           # the memory really went back
        assert [bytes(v) for v in lease.views] == [block(i) for i in range(3)]
        assert ns.lookup(hs[:3]) == 3
        lease.release()


def test_shrink_below_pinned_segment_drains_then_releases(start_daemon):
    d = start_daemon(capacity="2MiB", segment="1MiB")
    with d.client() as c:
        ns = c.namespace(spec())
        hs = hashes(2 * PER_SEG)
        ns.put(hs, [block(i) for i in range(2 * PER_SEG)])
        first = ns.acquire(hs[:1])                       # one pin in the first segment
        last = ns.acquire(hs[-1:])                       # and one in the second
        r = c.resize(1 << 20)
        assert r["released_segments"] == 0               # both segments hold pins
        assert r["draining_bytes"] == 1 << 20            # one drains: it goes at its last release
        assert r["evicted"] == PER_SEG - 1               # everything unpinned in it is gone already
        last.release()
        first.release()
        s = c.stats()
        assert s["tiers"][0]["mapped_bytes"] == 1 << 20
        assert s["blocks"] == PER_SEG
        # the survivor segment still serves its blocks byte-exact
        kept = [i for i in range(2 * PER_SEG) if ns.lookup(hs[i:i + 1]) == 1]
        assert len(kept) == PER_SEG
        out = bytearray(GEOM.full_bytes)
        assert ns.get([hs[kept[5]]], [out]) == 1 and bytes(out) == block(kept[5])


def test_resize_below_one_segment_is_refused(daemon):
    import pytest

    from kvstore.client import KVStoreError

    with daemon.client() as c:
        with pytest.raises(KVStoreError) as e:
            c.resize(1000)
        assert e.value.code == "bad_request" and "below one segment" in e.value.message
