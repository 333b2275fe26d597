"""The `history` policy (kvstore.policy.history): reuse-aware LRU without hints. A block used once leaves before any
block used again, an evicted block's uses are remembered (in a bounded history), and under whole-chain saves every
chain stays prefix-closed (on the public Mooncake trace)."""
from __future__ import annotations

import gzip
import json
import os

import pytest

from kvstore.policy import make_tier_policy
from kvstore.policy.history import GENERATIONS, HISTORY_FACTOR, MIN_GENERATION, History, HistoryPolicy

TRACE = os.path.join(os.path.dirname(__file__), "..", "..", "..", "shared", "traces", "mooncake-synthetic.jsonl.gz")


def k(i: int) -> bytes:
    return i.to_bytes(20, "big")


def test_a_block_used_once_leaves_before_one_used_again_however_old():
    p = HistoryPolicy()
    p.added(k(1), 0)
    p.accessed(k(1))                    # used again
    for i in range(2, 10):
        p.added(k(i), 0)                # newer, each used once
    assert p.victim(0) == k(2)
    for i in range(2, 10):
        p.removed(k(i))
    assert p.victim(0) == k(1)
    assert p.levels()["used_2"] == 1


def test_an_evicted_block_stored_again_comes_back_one_level_up():
    p = HistoryPolicy()
    p.added(k(1), 0)
    p.removed(k(1))                     # evicted: the history remembers it left at level 1
    p.added(k(2), 0)
    p.added(k(1), 0)                    # back: used twice
    assert p.victim(0) == k(2)
    assert p.levels()["used_2"] == 1


def test_pinned_blocks_are_no_candidates_until_unpinned():
    p = HistoryPolicy()
    p.added(k(1), 0)
    p.added(k(2), 0)
    p.pinned(k(1))
    assert p.victim(0) == k(2)
    p.removed(k(2))
    assert p.victim(0) is None
    p.unpinned(k(1))
    assert p.victim(0) == k(1)


def test_the_history_is_bounded_and_forgets_the_oldest_evictions():
    h = History()
    h.size_for(100)                     # 100 blocks held: 2,000 evictions remembered, in 8 generations
    gen = max(MIN_GENERATION, 100 * HISTORY_FACTOR // GENERATIONS)
    h.record(b"first", 2)
    assert h.level(b"first") == 2
    for i in range(GENERATIONS * gen):
        h.record(i.to_bytes(8, "big"), 1)
    assert h.level(b"first") == 0                              # forgotten with its generation
    assert h.remembered < GENERATIONS * gen
    frozen = h.remembered - len(h._new)
    assert h.nbytes - 100 * len(h._new) == 10 * frozen          # 10 bytes a frozen record
    h.record(b"again", 1)
    h.record(b"again", 3)
    assert h.level(b"again") == 3                               # the newest record answers


def test_the_tier_shape_is_the_same_policy():
    assert isinstance(make_tier_policy("history"), HistoryPolicy)


@pytest.mark.skipif(not os.path.exists(TRACE), reason="the public trace is not beside this checkout")
def test_chains_stay_prefix_closed_and_hits_beat_lru_on_the_public_trace():
    """Hooks in the index's order (a read is a prefix, head first; a store refreshes the whole chain tail first and
    adds the missing blocks tail first), a pool of 2% of the distinct blocks of the trace's first 1,500 requests."""
    reqs = [json.loads(line)["hash_ids"] for line in gzip.open(TRACE, "rt")][:1500]
    parent = {b: (c[i - 1] if i else None) for c in reqs for i, b in enumerate(c)}
    cap = len(parent) // 50

    def replay(policy) -> float:
        held: set[int] = set()
        hit = total = 0
        for chain in reqs:
            n = next((i for i, b in enumerate(chain) if b not in held), len(chain))
            hit, total = hit + n, total + len(chain)
            for b in chain[:n]:
                policy.accessed(k(b))
            for b in reversed(chain):
                if b in held:
                    policy.accessed(k(b))
                    continue
                held.add(b)
                policy.added(k(b), 0)
                while len(held) > cap:
                    v = int.from_bytes(policy.victim(0), "big")
                    held.discard(v)
                    policy.removed(k(v))
            orphans = [b for b in held if parent[b] is not None and parent[b] not in held]
            assert not orphans, f"blocks kept without their predecessor: {orphans[:5]}"
        return hit / total

    assert replay(HistoryPolicy()) > replay(make_tier_policy("lru"))


@pytest.mark.parametrize(("policy", "old_kept", "new_kept"), [("history", 128, 64), ("lru", 64, 128)])
def test_through_the_daemon_blocks_used_again_outlast_newer_blocks_used_once(start_daemon, policy, old_kept,
                                                                           new_kept):
    from tests.conftest import block, hashes, spec

    d = start_daemon(capacity="2MiB", segment="1MiB", env={"KVSTORE_POOL_EVICTION": policy})
    with d.client() as c:
        ns = c.namespace(spec())
        old, new = hashes(128, tag=b"old"), hashes(128, tag=b"new")
        ns.put(old, [block(i) for i in range(128)])
        assert ns.get(old, [bytearray(len(block(0))) for _ in range(128)]) == 128    # old used again
        ns.put(new, [block(i) for i in range(128)])                                  # newer, used once
        ns.put(hashes(64, tag=b"more"), [block(i) for i in range(64)])              # 64 must go
        assert (ns.lookup(old), ns.lookup(new)) == (old_kept, new_kept)             # each a prefix, tail gone
