"""A connector's save of a request's whole chain in one reserve (the blocks it hit and the blocks it computed, in
chain order): blocks stored already are refreshed so the chain leaves tail first, and, without a lower tier, the
reserve never evicts its own chain's blocks to store deeper ones (the deeper ones would follow a hole). With an SSD
tier an eviction demotes, and a chain longer than the pool is stored whole (tests/daemon/test_cli.py: 200 blocks in
128 slots). `Namespace.put` reserves in batches from the head and commits from the tail, so what it stores is a
prefix wherever it stops; a chain larger than the tenant's share of reservations goes in windows, the last first,
and keeps its head (tests/policy/test_eviction.py), by evicting its own tail."""
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


def held_chain(ns, hs: list[bytes]) -> list[bool]:
    """Which of the chain's blocks the daemon holds, block by block (a lookup stops at the first miss)."""
    return [ns.lookup([h]) == 1 for h in hs]


@pytest.mark.parametrize("policy", POLICIES)
def test_a_put_that_runs_out_of_room_keeps_a_prefix_never_a_tail(start_daemon, policy):
    """Before, `Namespace.put` reserved its batches from the tail: with room for 40 blocks of a 96-block chain (the
    rest of the pool pinned), it stored its last batch and 8 blocks of the middle one, the head got no slot, and
    the 40 blocks it held were never read (a lookup of the chain hit none). Now the chain is reserved head first:
    blocks 0..39 are stored, the rest refused, and nothing after the first block refused."""
    d = start_daemon(capacity="2MiB", segment="1MiB", env={"KVSTORE_POOL_EVICTION": policy})
    with d.client() as c:
        ns = c.namespace(spec())
        others = hashes(216, tag=b"pinned")
        assert ns.put(others, bufs(216)).stored == 216
        with ns.acquire(others):                                  # 216 of 256 slots pinned: room for 40
            hs = hashes(96)
            r = ns.put(hs, bufs(96), batch=32)
            assert (r.stored, r.no_space) == (40, 56)
            assert held_chain(ns, hs) == [True] * 40 + [False] * 56
            outs = [bytearray(len(block(0))) for _ in range(96)]
            assert ns.get(hs, outs) == 40 and [bytes(o) for o in outs[:40]] == bufs(40)


@pytest.mark.parametrize("policy", POLICIES)
def test_a_put_larger_than_its_share_goes_in_windows_and_keeps_a_prefix(start_daemon, policy):
    """One reserve may take half the pool (server.max_reserved_fraction 0.5: 128 of 256 slots). A 200-block chain
    with 156 slots free (100 pinned) goes in windows of 128, the last first: its head is committed last, evicts
    the tail of its own last window, and the daemon holds blocks 0..155 — a prefix, its head the most recent."""
    d = start_daemon(capacity="2MiB", segment="1MiB", env={"KVSTORE_POOL_EVICTION": policy})
    with d.client() as c:
        ns = c.namespace(spec())
        others = hashes(100, tag=b"pinned")
        assert ns.put(others, bufs(100)).stored == 100
        with ns.acquire(others):
            hs = hashes(200)
            r = ns.put(hs, bufs(200))
            assert r.stored + r.no_space == 200 and r.stored >= 156
            assert held_chain(ns, hs) == [True] * 156 + [False] * 44
            assert ns.put(hashes(40, tag=b"later"), bufs(40)).stored == 40     # the chain's tail goes first
            assert held_chain(ns, hs) == [True] * 116 + [False] * 84


def test_a_put_of_the_blocks_a_request_missed_does_not_evict_the_prefix_it_hit(start_daemon):
    """A client that puts only the blocks it computed names the prefix it hit (`after`): the daemon does not evict
    that prefix to store them (the new blocks would follow a hole), and refreshes it behind them, as a whole-chain
    save does. 256 slots: a hit prefix of 200 blocks, 100 new ones — the first 56 are stored after the prefix, the
    rest refused, the prefix is whole, and later evictions take the chain from its tail."""
    d = start_daemon(capacity="2MiB", segment="1MiB", env={"KVSTORE_POOL_EVICTION": "lru",
                                                            "KVSTORE_SERVER_MAX_RESERVED_FRACTION": "1"})
    with d.client() as c:
        ns = c.namespace(spec())
        hs = hashes(300)
        assert ns.put(hs[:200], bufs(200)).stored == 200
        r = ns.put(hs[200:], bufs(100), after=hs[:200])
        assert (r.stored, r.no_space) == (56, 44)
        assert held_chain(ns, hs) == [True] * 256 + [False] * 44
        assert c.stats()["counters"]["kept_own_chain"] >= 1
        # the prefix named was refreshed behind the new blocks: pressure takes the chain's tail, not the prefix's
        assert ns.put(hashes(10, tag=b"later"), bufs(10)).stored == 10
        assert held_chain(ns, hs) == [True] * 246 + [False] * 54


@pytest.mark.parametrize("policy", POLICIES)
def test_a_put_may_evict_its_own_chains_later_blocks_held_behind_a_hole(start_daemon, policy):
    """Blocks 20..29 of a chain are held without 0..19 (stored on their own: never read) and are the pool's least
    recent. Before, a put of the whole chain found its victim in its own chain and stored nothing (a put never
    evicted any block of the chain it stores). Only the blocks before the one being stored need to stay: the put
    now evicts 20..29 for the head, stores them again in turn, and the chain is held whole."""
    d = start_daemon(capacity="2MiB", segment="1MiB", env={"KVSTORE_POOL_EVICTION": policy, **ONE_ENGINE})
    with d.client() as c:
        ns = c.namespace(spec())
        hs = hashes(40)
        assert ns.put(hs[20:30], bufs(10)).stored == 10
        assert ns.put(hashes(246, tag=b"filler"), bufs(246)).stored == 246          # the pool is full
        assert ns.lookup(hs) == 0
        assert save(ns, hs) == ["RESERVED"] * 40
        assert held_chain(ns, hs) == [True] * 40
        assert c.stats()["counters"]["kept_own_chain"] == 0


def test_a_reserve_naming_more_blocks_before_it_than_a_request_holds_is_refused_before_it_is_sent(start_daemon):
    """`after` is bounded like the keys (client.max_keys): the client says so and sends nothing; the daemon's own
    bound (the schema's) is fuzzed in tests/protocol. A put names at most the last max_keys of its prefix."""
    d = start_daemon(capacity="2MiB", segment="1MiB")
    with d.client() as c:
        ns = c.namespace(spec())
        hs = hashes(c.max_keys + 2)
        with pytest.raises(ValueError, match="at most"):
            ns.reserve(hs[-1:], after=hs[:-1])
        r = ns.put(hs[-1:], bufs(1), after=hs[:-1])             # the put sends the last max_keys of them
        assert r.stored == 1 and ns.lookup(hs[-1:]) == 1
