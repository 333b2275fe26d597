"""The history policy's duel of shadows (kvstore.policy.shadow) weighs the real cache too: where following the
shadows' lead costs the real cache more than it wins (each switch pays a turnover of the pool, which no shadow
pays), the class settles on lru — the no-hint default must never fall below LRU (issue 34) — and leaves it only
when another way's shadow leads lru over the long window."""
from __future__ import annotations

from kvstore.policy.shadow import INITIAL, WAYS, Duel


def k(i: int) -> bytes:
    return i.to_bytes(8, "big")


def test_a_real_cache_behind_the_lru_shadow_settles_on_lru_until_another_way_leads() -> None:
    duel = Duel(lambda key: 0)
    duel.press()                                       # the real class evicts: the shadows' hits are evidence
    hot = [k(i) for i in range(8)]
    for _ in range(100):                               # every shadow hits the chain; the real cache never does
        duel.asked(hot, 16, holds=lambda key: False)
        duel.choose()
        duel.asked([], 16)                             # (a new request: the next ask is served again)
    assert duel.settled and duel.way == "lru"
    fresh = 1000
    for _ in range(400):                               # a hot chain between scans beyond the pool: levels keep it
        duel.asked(hot[:4], 16, holds=lambda key: True)
        duel.choose()
        for _ in range(3):
            duel.asked([k(fresh + i) for i in range(8)], 16, holds=lambda key: False)
            duel.choose()
            fresh += 8
    hits = {s.way: s.long for s in duel.shadows}
    assert hits["remember"] > 1.5 * hits["lru"]        # the shadows show it
    assert not duel.settled and duel.way != "lru"


def test_without_the_real_cache_counted_the_duel_never_settles() -> None:
    duel = Duel(lambda key: 0)                         # a lower tier: scored by reads, no chain, no `holds`
    duel.press()
    hot = [k(i) for i in range(8)]
    for _ in range(100):
        duel.asked(hot, 16)
        duel.choose()
        duel.asked([], 16)
    assert not duel.settled and duel.way in WAYS


def test_before_the_real_class_evicts_the_shadows_leads_choose_nothing() -> None:
    """The shadows, sized to the class's occupancy, evict while the real class grows into free memory: their hits
    differ then in a contest the real cache is not in, and the way a full pool begins with must not come from it."""
    duel = Duel(lambda key: 0)
    hot = [k(i) for i in range(8)]

    def traffic() -> None:                             # every shadow hits the chain; the real cache never does
        for _ in range(100):
            duel.asked(hot, 16, holds=lambda key: False)
            duel.choose()
            duel.asked([], 16)

    traffic()
    assert not duel.settled and duel.way == INITIAL and duel.switches == 0
    assert all(s.hits == s.long == 0 for s in duel.shadows) and duel.real == 0
    duel.press()                                       # the first victim asked: the same traffic is evidence now
    traffic()
    assert duel.settled and duel.way == "lru"


def test_a_shadow_stores_a_chain_as_the_index_does_head_first_never_evicting_its_own_blocks() -> None:
    from kvstore.policy.shadow import Shadow

    s = Shadow("lru")
    chain = [(i, k(i)) for i in range(6)]
    s.serve(chain, 4, lambda key: 0)                  # a chain longer than the pool: its head is kept, not its tail
    assert sorted(s.where) == [0, 1, 2, 3]
    s.serve(chain, 4, lambda key: 0)
    assert s.hits == 4                                # the next ask hits the head (a tail without it hits nothing)
    other = [(10 + i, k(10 + i)) for i in range(2)]
    s.serve(other, 4, lambda key: 0)                  # two new blocks evict the chain's tail, never its head first
    assert sorted(s.where) == [0, 1, 10, 11]


def test_a_chain_that_names_a_key_twice_is_served_once_per_key() -> None:
    from kvstore.policy.shadow import Shadow

    for way in WAYS:
        s = Shadow(way)
        chain = [(i, k(i)) for i in (1, 5, 9, 13, 9)]    # a client's malformed chain (the fuzz test sends these)
        s.serve(chain, 8, lambda key: 0)
        s.serve(chain, 8, lambda key: 0)
        assert sorted(s.where) == [1, 5, 9, 13] and sum(len(lst) for lst in s.lists) == 4
