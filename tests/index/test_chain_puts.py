"""A connector's save of a request's whole chain in one reserve (the blocks it hit and the blocks it computed, in
chain order): blocks stored already are refreshed so the chain leaves tail first, and, without a lower tier, the
reserve never evicts its own chain's blocks to store deeper ones (the deeper ones would follow a hole). With an SSD
tier an eviction demotes, and a chain longer than the pool is stored whole (tests/daemon/test_cli.py: 200 blocks in
128 slots). `Namespace.put` reserves in batches from the tail, so a chain longer than the pool keeps its head there
too (tests/policy/test_eviction.py), by evicting its own tail."""
from __future__ import annotations

import pytest

from tests.conftest import block, hashes, spec

POLICIES = ["lru", "workflow"]
ONE_ENGINE = {"KVSTORE_SERVER_MAX_RESERVED_FRACTION": "1"}     # one reserve may take the whole pool


def bufs(n: int) -> list[bytes]:
    return [block(i) for i in range(n)]


def save(ns, hs: list[bytes]) -> list[str]:
    """As the vLLM connector saves: one reserve of the whole chain, the reserved blocks written and committed."""
    with ns.reserve(hs) as r:
        r.write_and_commit(bufs(len(hs)))
    return [s.name for s in r.status]


@pytest.mark.parametrize("policy", POLICIES)
def test_a_put_longer_than_the_pool_keeps_its_head(start_daemon, policy):
    """256 slots, a chain of 300: the first 256 are stored, the last 44 refused (before: the put evicted its own
    head to store its tail, and a lookup of the chain hit nothing)."""
    d = start_daemon(capacity="2MiB", segment="1MiB", env={"KVSTORE_POOL_EVICTION": policy, **ONE_ENGINE})
    with d.client() as c:
        ns = c.namespace(spec())
        hs = hashes(300)
        assert save(ns, hs) == ["RESERVED"] * 256 + ["NO_SPACE"] * 44
        assert ns.lookup(hs) == 256
        assert c.stats()["counters"]["evictions"] == 0


@pytest.mark.parametrize("policy", POLICIES)
def test_a_put_may_evict_other_chains_but_not_its_own(start_daemon, policy):
    """Another chain fills half the pool; a chain of 300 over its own stored head of 100: the other chain's blocks
    go, the chain's head stays, and what does not fit after that is refused."""
    d = start_daemon(capacity="2MiB", segment="1MiB", env={"KVSTORE_POOL_EVICTION": policy, **ONE_ENGINE})
    with d.client() as c:
        ns = c.namespace(spec())
        other, mine = hashes(128, tag=b"other"), hashes(300, tag=b"mine")
        ns.put(other, bufs(128))
        ns.put(mine[:100], bufs(100))
        # 28 free slots, then the other chain's 128; the rest refused
        assert save(ns, mine) == ["EXISTS"] * 100 + ["RESERVED"] * 156 + ["NO_SPACE"] * 44
        assert ns.lookup(mine) == 256
        assert ns.lookup(other) == 0


@pytest.mark.parametrize("policy", POLICIES)
def test_a_whole_chain_put_after_a_get_leaves_tail_first(start_daemon, policy):
    """A request hits 64 blocks of its chain and computes 64 more: put as the whole chain, the chain's order is
    tail first, so evicting 96 of it leaves its head of 32 (a put of the computed blocks alone would leave them
    more recent than the hit ones: the hit prefix's tail would go first and leave a hole at 63)."""
    d = start_daemon(capacity="2MiB", segment="1MiB", env={"KVSTORE_POOL_EVICTION": policy, **ONE_ENGINE})
    with d.client() as c:
        ns = c.namespace(spec())
        chain, filler = hashes(128), hashes(128, tag=b"filler")
        ns.put(chain[:64], bufs(64))
        ns.put(filler, bufs(128))
        assert ns.get(chain, [bytearray(len(block(0))) for _ in range(128)]) == 64
        assert ns.put(chain, bufs(128)).stored == 64             # the pool is full now
        assert ns.put(hashes(224, tag=b"later"), bufs(224)).stored == 224   # the filler goes, then 96 of the chain
        assert ns.lookup(chain) == 32
        assert sum(ns.lookup([h]) for h in chain[32:]) == 0
