"""Persistence at a graceful stop: the host pool's blocks that the first lower tier does not hold yet are written
to it, so that a restart finds them (`ssd.persist_on_stop`)."""
from __future__ import annotations

import time

from kvstore.index import Index
from kvstore.movers.writethrough import BATCH
from kvstore.tiers import LowerTier
from kvstore.tiers.host import HostPool
from kvstore.traffic import Lane


def persist_host_pool(index: Index, pool: HostPool, tier: LowerTier, seconds: float) -> tuple[int, int]:
    """(At a graceful stop, no client left, under the state lock.) Write what `tier` lacks, for at most `seconds`.
    Returns (written, left)."""
    deadline = time.monotonic() + seconds
    todo = [(ns.block_id(h), gid) for ns, h, gid in index.blocks() if not tier.has(ns.block_id(h))]
    written = 0
    for start in range(0, len(todo), BATCH):
        if time.monotonic() > deadline:
            break
        batch = todo[start:start + BATCH]
        views = [pool.view(gid) for _, gid in batch]
        crcs = index.crcs_of([gid for _, gid in batch])
        try:
            tier.announce([bid for bid, _ in batch])
            written += tier.write([(bid, v, crc) for (bid, _), v, crc in zip(batch, views, crcs)], Lane.BACKGROUND)
        finally:
            for v in views:
                v.release()
    return written, len(todo) - written
