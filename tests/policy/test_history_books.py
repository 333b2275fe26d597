"""The history policy's books (issue 34's per-operation cost and memory): the bounded history of evicted blocks'
levels, native (kvstore._kvindex.History) and pure Python (PyRecords) under one contract, and the native per-block
hooks (kvstore._kvindex.Hooks) against the Python form of the same policy, step by step."""
from __future__ import annotations

import random

import pytest

from kvstore.policy.levels import HISTORY_FACTOR, MIN_RECORDS, History, PyRecords

try:
    from kvstore._kvindex import History as NativeRecords
    from kvstore._kvindex import KeyTable as NativeTable
except ImportError:
    NativeRecords = NativeTable = None

needs_native = pytest.mark.skipif(NativeRecords is None, reason="native not built")
RECORDS = [pytest.param(PyRecords, id="python"),
           pytest.param(NativeRecords, id="native", marks=needs_native)]


def k(i: int, n: int = 20) -> bytes:
    return i.to_bytes(n, "big")


@pytest.fixture(params=RECORDS)
def R(request):
    return request.param


def test_the_policy_reads_the_key_tables_placement_as_the_table_packs_it():
    from kvstore.index import keytable
    from kvstore.policy import history

    assert history.TABLE_LEVELS == keytable.LEVELS == 4 > history.TOP
    t = keytable.PyKeyTable()
    t.insert(k(1), 0, 77)
    t.set_level(k(1), 2)
    assert t.placement(k(1)) >> 2 == 77 and t.placement(k(1)) & 3 == 2


def test_the_newest_records_are_kept_and_the_oldest_forgotten(R):
    h = R(1000)
    for i in range(3000):
        h.record(k(i), 1 + i % 3)
    assert len(h) == 1000
    assert [h.level(k(i)) for i in range(2000)] == [0] * 2000
    assert [h.level(k(i)) for i in range(2000, 3000)] == [1 + i % 3 for i in range(2000, 3000)]


def test_a_key_recorded_again_keeps_its_newest_level_and_moves_to_the_newest_end(R):
    h = R(100)
    for i in range(100):
        h.record(k(i), 1)
    h.record(k(0), 3)                   # again: now the newest
    for i in range(100, 199):
        h.record(k(i), 2)               # 99 more push out 1..99, not 0
    assert len(h) == 100
    assert h.level(k(0)) == 3 and h.level(k(1)) == 0 and h.level(k(99)) == 0 and h.level(k(150)) == 2


def test_resize_keeps_the_newest_that_fit(R):
    h = R(500)
    for i in range(500):
        h.record(k(i), 1 + i % 200)
    h.resize(100)
    assert len(h) == 100 and h.capacity == 100
    assert sum(h.level(k(i)) != 0 for i in range(400)) == 0
    assert [h.level(k(i)) for i in range(400, 500)] == [1 + i % 200 for i in range(400, 500)]
    h.resize(1000)                      # growing keeps everything
    for i in range(500, 900):
        h.record(k(i), 5)
    assert len(h) == 500 and h.level(k(450)) == 1 + 450 % 200


def test_keys_of_any_length_and_bad_input(R):
    h = R(64)
    for n in (1, 7, 8, 9, 16, 20, 33):
        h.record(k(n, n), n)
    assert [h.level(k(n, n)) for n in (1, 7, 8, 9, 16, 20, 33)] == [1, 7, 8, 9, 16, 20, 33]
    for bad in (0, 256, -1):
        with pytest.raises(ValueError):
            h.record(k(1), bad)
    assert h.level(k(1, 1)) == 1        # nothing changed by a refusal


@needs_native
def test_native_and_python_records_agree_on_a_random_run():
    """Records, looks and resizes at random: the native answers what the Python form answers (a capacity at least
    eight times the gathering, HX_PENDING, so both forget at the same point)."""
    rng = random.Random(3)
    py, nat = PyRecords(400), NativeRecords(400)
    for step in range(60_000):
        op, key = rng.random(), k(rng.randrange(3000))
        if op < 0.5:
            level = rng.randrange(1, 256)
            py.record(key, level)
            nat.record(key, level)
        elif op < 0.9995:
            assert py.level(key) == nat.level(key), step
        else:
            cap = rng.randrange(256, 2000)
            py.resize(cap)
            nat.resize(cap)
    assert len(py) == len(nat)


@needs_native
def test_native_records_stay_within_32_bytes_a_record():
    """Issue 34: history memory at most 32 bytes per remembered block."""
    for cap in (10_000, 100_000, 1_000_000, 3_000_000):
        h = NativeRecords(cap)
        assert h.nbytes() / cap <= 32, (cap, h.nbytes() / cap)


def test_the_history_follows_the_class_size():
    """HISTORY_FACTOR records per block held (a quarter ahead), at least MIN_RECORDS; shrunk only when a quarter
    of it is needed."""
    h = History()
    assert h.records.capacity == MIN_RECORDS
    h.size_for(10_000)
    assert h.records.capacity == 10_000 * HISTORY_FACTOR * 5 // 4
    assert h.grow_at == h.records.capacity // HISTORY_FACTOR
    h.size_for(5_000)                   # half: kept
    assert h.records.capacity == 10_000 * HISTORY_FACTOR * 5 // 4
    assert h.shrink_at == h.records.capacity // (4 * HISTORY_FACTOR) > 2_000
    h.size_for(2_000)
    assert h.records.capacity == max(MIN_RECORDS, 2_000 * HISTORY_FACTOR * 5 // 4)


@needs_native
def test_the_native_hooks_size_each_class_history_the_same_way():
    from kvstore.policy.history import NativeHistoryPolicy

    table = NativeTable()
    p = NativeHistoryPolicy(table)
    keys = [k(i) for i in range(10_000)]
    for key in keys:
        table.insert(key, 0, 3)
        p.added(key, 3)
    hist = p.books(3).history.records
    assert hist.capacity >= 10_000 * HISTORY_FACTOR and p.levels()["history_capacity"] == hist.capacity
    for key in keys[:8_000]:
        p.removed(key)
        table.remove(key)
    assert 2_000 * HISTORY_FACTOR <= hist.capacity < 10_000 * HISTORY_FACTOR      # shrunk, still enough
    assert len(hist) == 8_000                                                        # and kept every record


def sessions(n_sessions: int, turns: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    nxt = iter(range(1, 1 << 40))
    ctx = [[next(nxt) for _ in range(rng.randint(4, 12))] for _ in range(n_sessions)]
    out = []
    for _ in range(turns):
        s = rng.randrange(n_sessions) if rng.random() < 0.7 else rng.randrange(n_sessions // 4 + 1)
        ctx[s] = ctx[s] + [next(nxt) for _ in range(rng.randint(1, 4))]
        if rng.random() < 0.05:
            ctx[s] = ctx[s][:4]                             # a session restarts from its head
        out.append(list(ctx[s]))
    return out


@needs_native
@pytest.mark.parametrize("bypass", [True, False])
def test_native_hooks_evict_exactly_as_the_python_form(bypass):
    """The same requests through the host policy with native hooks and through its Python form, each over a
    native key table, as the index drives them: the same hits, the same victims in the same order, the same levels
    and the same way chosen."""
    from kvstore.policy.history import HistoryPolicy, NativeHistoryPolicy
    from tests.policy.test_history import index_replay

    reqs = sessions(40, 3000, seed=5)
    cap = len({b for c in reqs for b in c}) // 8
    logs = []
    for cls in (HistoryPolicy, NativeHistoryPolicy):
        policy = cls(NativeTable())
        victims: list[bytes] = []
        pick = policy.victim

        def logged(c: int, pick=pick, victims=victims) -> bytes | None:
            v = pick(c)
            victims.append(v)
            return v

        policy.victim = logged
        rate = index_replay(policy, reqs, cap, bypass=bypass)
        report = policy.levels()
        levels = sorted((key, policy.table.level_of(key)) for key, _ in policy.table.items())
        logs.append((rate, victims, levels, report["classes"]["0"]["way"], report["used_1"], report["used_2"]))
    assert logs[0] == logs[1]
    assert len(logs[0][1]) > 1000 and logs[0][0] > 0.2


@needs_native
def test_native_hooks_and_the_python_form_agree_on_random_hook_calls():
    """Every hook in any order the index could make (reads pinning blocks, re-stores of pinned and unpinned blocks,
    removals of pinned ones, admits, requests between that move the way), on two native tables: the same answers,
    the same levels, the same linked keys after each call."""
    from kvstore.policy.history import HistoryPolicy, NativeHistoryPolicy

    rng = random.Random(11)
    pair = [HistoryPolicy(NativeTable()), NativeHistoryPolicy(NativeTable())]
    pinned: set[bytes] = set()
    seen: set[int] = set()
    universe = [k(i) for i in range(400)]
    for step in range(30_000):
        key, op = rng.choice(universe), rng.random()
        held = key in pair[0].table
        cls = universe.index(key) % 2
        if op < 0.3 and not held:
            for p in pair:
                p.table.insert(key, step, cls)
                p.added(key, cls)
        elif op < 0.4 and held:
            for p in pair:
                p.removed(key)
                p.table.remove(key)
            pinned.discard(key)
        elif op < 0.55 and held:
            for p in pair:
                p.accessed(key)
        elif op < 0.7 and held and key not in pinned:
            for p in pair:
                p.pinned(key)
            pinned.add(key)
        elif op < 0.8 and key in pinned:
            for p in pair:
                p.unpinned(key)
            pinned.discard(key)
        elif op < 0.9:
            got = [p.victim(cls) for p in pair]
            assert got[0] == got[1], step
            if got[0] is not None:
                assert [p.admits(got[0], None) for p in pair] == [pair[0].admits(got[0], None)] * 2
        else:
            chain = rng.sample(universe, rng.randint(1, 12))
            way = rng.choice(["remember", "forget", "bypass", "aging", "lru"]) if rng.random() < 0.2 else None
            for p in pair:
                if way is not None and p.books(cls).held:
                    p.books(cls).duel.way = way             # as if the shadows had chosen it
                p.asked(chain, cls)
        if held or op < 0.3:
            assert [p.table.placement(key) for p in pair] == [pair[0].table.placement(key)] * 2
            if key in pair[0].table:
                seen.add(pair[0].table.placement(key) & 3)
            if key in pair[0].table:
                assert pair[0].table.is_linked(key) == pair[1].table.is_linked(key)
    assert sorted((kk, pair[0].table.level_of(kk)) for kk, _ in pair[0].table.items()) == \
        sorted((kk, pair[1].table.level_of(kk)) for kk, _ in pair[1].table.items())
    counts = [[p.levels()[f"used_{i}"] for i in (1, 2, 3)] for p in pair]
    assert counts[0] == counts[1]
    assert seen == {0, 1, 2}                        # every level was visited


@needs_native
def test_native_books_refuse_bad_use_without_crashing():
    """Objects made without __init__, wrong tables and keys: precise errors, never a crash."""
    from kvstore._kvindex import Hooks

    bare = Hooks.__new__(Hooks)
    for call in (lambda: bare.added(k(1), 0), lambda: bare.victim(0), lambda: bare.removed(k(1)),
                 lambda: bare.pinned(k(1)), lambda: bare.history(0)):
        with pytest.raises(RuntimeError, match="not initialised"):
            call()
    with pytest.raises(TypeError):
        Hooks(object(), 2, 20, 8192)                    # a native key table only
    with pytest.raises(ValueError):
        Hooks(NativeTable(), 4, 20, 8192)               # top beyond the table's levels
    hooks = Hooks(NativeTable(), 2, 20, 8192)
    with pytest.raises(KeyError):
        hooks.added(k(1), 0)                            # a block the table does not hold
    with pytest.raises(ValueError):
        hooks.added(k(1, 19), 0)                        # not a 20-byte key
    with pytest.raises(ValueError):
        hooks.set_way(0, -1.0, False, False)
    assert hooks.victim(5) is None and hooks.admits(k(2)) is True
    hooks.removed(k(3))                                 # unknown blocks: nothing to do
    hooks.unpinned(k(3))
    bare_records = NativeRecords.__new__(NativeRecords)
    assert bare_records.level(k(1)) == 0
    with pytest.raises(RuntimeError):
        bare_records.record(k(1), 1)
    with pytest.raises(ValueError):
        NativeRecords(0)


@needs_native
def test_native_hooks_take_the_policy_contracts_arguments_by_name():
    """kvstore.policy's contract: added(key, cls, touch=None), accessed(key, touch=None), admits(victim, touch)."""
    from kvstore.policy.history import NativeHistoryPolicy

    p = NativeHistoryPolicy(NativeTable())
    p.table.insert(k(1), 0, 0)
    p.added(key=k(1), cls=0, touch=None)
    p.accessed(k(1), touch=None)
    assert p.table.level_of(k(1)) == 1
    assert p.admits(victim=k(1), touch=None) is True
    with pytest.raises(TypeError):
        p.added(k(1), 0, None, None)
    with pytest.raises(TypeError):
        p.accessed(k(1), when=1)


@needs_native
def test_asking_of_a_class_that_never_held_a_block_makes_no_books():
    """A lookup in a class with no block (a tenant that only reads, a namespace not yet written) costs no history."""
    from kvstore.policy.history import NativeHistoryPolicy

    p = NativeHistoryPolicy(NativeTable())
    for cls in range(50):
        p.asked([k(1), k(2)], cls)
    assert p._hooks.classes() == [] and p.levels()["history_capacity"] == 0
    assert p._hooks.held(7) == 0 and p._hooks.refusing(7) is False


@needs_native
@pytest.mark.parametrize("cap", [3, 97, 1000, 50_000])
def test_native_filters_never_hide_a_record_the_ring_holds(cap):
    """The native history's Bloom filters in front of its index are cleared a generation at a time; across many
    generations every record among the last `cap` is still found, and none older is."""
    h = NativeRecords(cap)
    rng = random.Random(cap)
    made: list[tuple[bytes, int]] = []
    for i in range(20 * cap + 500):
        key = k(rng.randrange(1 << 60))
        level = rng.randrange(1, 256)
        h.record(key, level)
        made.append((key, level))
        if i % (cap // 3 + 1) == 0:                     # look at every generation boundary's neighbourhood
            newest = dict(made[-cap:])
            assert all(h.level(kk) == lv for kk, lv in list(newest.items())[-50:])
    newest = dict(made[-cap:])
    assert all(h.level(kk) == lv for kk, lv in newest.items())
    assert sum(h.level(kk) != 0 for kk, _ in made[:-cap] if kk not in newest) == 0
