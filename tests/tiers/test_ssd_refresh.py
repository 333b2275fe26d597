"""Storing a block again refreshes it in the SSD tier's eviction order (issue 14 part 5), as a read does: a block
demoted again, which the tier already holds, is not written again and is not the next to go at the cap."""
from __future__ import annotations

from pathlib import Path

from kvstore.daemon.config import SsdConfig
from kvstore.tiers.ssd.tier import SsdTier
from kvstore.traffic import Lane
from tests.tiers.ssd_blocks import NS, RECORD, h, payload


def test_a_block_demoted_again_is_refreshed_not_rewritten(tmp_path: Path) -> None:
    tier = SsdTier(SsdConfig(dir=str(tmp_path / "ssd"), capacity=4 * RECORD, sync="batch", io="threads"))
    tier.open(wait=True)
    try:
        bids = [NS + h(i) for i in range(5)]
        for bid, i in zip(bids[:4], range(4)):                # the cap: four records, oldest first
            tier.announce([bid])
            assert tier.write([(bid, payload(i), None)], Lane.BACKGROUND) == 1
        assert tier.stage(bids[0], len(payload(0))) is True    # evicted from the host pool again: held already
        assert tier.rewrites_saved == 1
        tier.announce([bids[4]])
        assert tier.write([(bids[4], payload(4), None)], Lane.BACKGROUND) == 1    # the cap evicts one
        assert [tier.has(b) for b in bids] == [True, False, True, True, True]    # block 1, not the refreshed 0
    finally:
        tier.close()
