"""Memory moving between block sizes of one tenant (kvstore.tiers.host, kvstore.index.capacity): a size class of
small blocks gets segments sized in slots, and gives a segment up to a bigger class only when most of its blocks
are staler than that class's coldest — a class living in one segment is not wiped, hot blocks and all, because
its coldest block is old (found by bench_forkkv, where rank-16 residuals beside 2 MiB base blocks lost every
residual at each move)."""
from __future__ import annotations

from kvstore.protocol.geometry import Geometry
from kvstore.tiers.host import SMALL_CLASS_SHARE, SMALL_CLASS_SLOTS, HostPool
from tests.conftest import GEOM, block, hashes, spec

SMALL = Geometry(layers=1, tokens=16, kv_heads=1, head_dim=16, dtype="float16")     # 1 KiB blocks
MIB = 1 << 20


def test_small_blocks_get_segments_sized_in_slots_never_below_a_share_of_the_segment():
    pool = HostPool(1 << 30, 64 * MIB)
    assert pool.segment_size(2 * MIB) == 64 * MIB                     # 32 slots: as before
    assert pool.segment_size(3 * MIB) == 63 * MIB and pool.tail_bytes(3 * MIB) == MIB
    assert pool.slots_per_segment(32 << 10) == SMALL_CLASS_SLOTS       # rank-16 residuals: 8 MiB segments
    assert pool.tail_bytes(32 << 10) == 0
    assert pool.segment_size(1024) == 64 * MIB // SMALL_CLASS_SHARE    # tiny blocks: 4 MiB, not 256 KiB
    assert pool.slots_per_segment(128 * MIB) == 1                      # a block above the segment: one a segment


def test_a_small_class_keeps_its_hot_blocks_while_a_big_class_grows_and_gives_up_a_stale_segment(start_daemon):
    d = start_daemon(capacity="4MiB", segment="1MiB")
    small_keys, big_keys = hashes(200, tag=b"small"), hashes(2000, tag=b"big")
    hot = small_keys[50:]
    with d.client() as c:
        small = c.namespace(spec("small", SMALL))
        big = c.namespace(spec("big"))
        small.put(small_keys, [block(i, SMALL.full_bytes) for i in range(200)])

        def store_big(start: int, n: int) -> None:
            big.put(big_keys[start:start + n], [block(10_000 + i) for i in range(start, start + n)])

        for start in range(0, 800, 16):                              # the big class outgrows the pool ...
            store_big(start, 16)
            with small.acquire(hot):                                 # ... while 150 of the 200 small blocks stay hot
                pass
        assert small.lookup(hot) == len(hot)                         # the small class kept its segment
        outs = [bytearray(SMALL.full_bytes) for _ in hot]
        assert small.get(hot, outs) == len(hot)
        assert [bytes(o) for o in outs] == [block(i, SMALL.full_bytes) for i in range(50, 200)]
        held_before = c.list()["namespaces"]
        big_before = next(n["blocks"] for n in held_before if n["model"] == "big")
        for start in range(800, 2000, 16):                           # the small blocks go cold: their segment is
            store_big(start, 16)                                     # all stale, and goes to the big class
        listed = c.list()["namespaces"]
        stats = c.stats()
    assert big_before == 3 * (MIB // GEOM.full_bytes)               # 3 big segments beside the small one
    assert not any(n["model"] == "small" and n["blocks"] for n in listed)
    assert next(n["blocks"] for n in listed if n["model"] == "big") > big_before
    assert stats["counters"]["segment_moves"] + stats["counters"]["segment_moves_inline"] >= 1
