"""The SSD tier keeps a block's writer CRC-32C: a staged copy is checked against it before it is served."""
from __future__ import annotations

from pathlib import Path

from tests.tiers.ssd_blocks import NS, PAYLOAD, RECORD, h, payload


def test_a_staged_copy_that_fails_its_writers_crc_is_a_miss(tmp_path: Path) -> None:
    """A block demoted with its writer's CRC whose bytes no longer match (its slot was written after commit) is
    never served from staging: the promotion misses, the copy is dropped and counted; a good one comes back with
    the writer's CRC. (The writer thread is kept off the staging area by holding the tier's lock: the read must
    come from staging.)"""
    import mmap

    from kvstore.checksum import crc32c
    from kvstore.daemon.config import SsdConfig
    from kvstore.tiers.ssd.tier import SsdTier
    from kvstore.traffic import Lane

    tier = SsdTier(SsdConfig(dir=str(tmp_path / "ssd"), capacity=64 * RECORD, io="threads")).open(wait=True)
    good, bad = NS + h(1), NS + h(2)
    outs = [mmap.mmap(-1, PAYLOAD) for _ in range(2)]
    with tier.lock:                                        # reentrant: stage, fill and read take it too
        for bid, i in ((good, 1), (bad, 2)):
            buf = tier.stage(bid, PAYLOAD, crc32c(payload(i)))
            assert not isinstance(buf, bool)
            tier.fill(bid, buf, memoryview(payload(i) if bid == good else payload(9)))
        crcs: list[int | None] = []
        assert tier.read([good, bad], [memoryview(o) for o in outs], Lane.CRITICAL, crcs=crcs) == 1
    assert bytes(outs[0]) == payload(1) and crcs == [crc32c(payload(1))]
    stats = tier.stats()
    assert stats["staged_crc_mismatch"] == 1 and not tier.has(bad)
    tier.close()
