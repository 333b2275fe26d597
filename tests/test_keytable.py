"""The key table, native and pure Python: the same scenarios, and a long random run against a reference model."""
from __future__ import annotations

import random
from collections import OrderedDict

import pytest

from kvstore import keytable

IMPLS = [pytest.param(keytable.PyKeyTable, id="python")]
try:
    from kvstore._kvindex import KeyTable as Native

    IMPLS.append(pytest.param(Native, id="native"))
except ImportError:
    IMPLS.append(pytest.param(None, id="native", marks=pytest.mark.skip(reason="native index not built")))


def k(i: int, ns: int = 1) -> bytes:
    return ns.to_bytes(4, "big") + i.to_bytes(16, "big")


@pytest.fixture(params=IMPLS)
def T(request):
    return request.param


def test_map_and_lru_scenario(T):
    t = T()
    for i in range(5):
        t.insert(k(i), 100 + i, cls=0)               # LRU order: 0 1 2 3 4
    t.insert(k(9), 9, cls=1)
    assert (len(t), t.get(k(3)), t.get(k(7)), k(2) in t, k(7) in t) == (6, 103, None, True, False)
    assert t.oldest(0) == (k(0), 100)
    t.touch(k(0))                                    # 1 2 3 4 0
    t.unlink(k(1))                                   # pinned: 2 3 4 0
    assert (t.oldest(0), t.class_len(0), t.is_linked(k(1))) == ((k(2), 102), 4, False)
    assert t.touch(k(1)) is True and t.is_linked(k(1)) is False   # touching a pinned key keeps it unlinked
    t.relink(k(1))                                   # 2 3 4 0 1
    assert t.remove(k(2)) == 102 and t.remove(k(2)) is None
    assert t.oldest(0) == (k(3), 103)
    t.set_value(k(3), 7)
    assert t.get(k(3)) == 7 and t.cls_of(k(9)) == 1 and t.oldest(1) == (k(9), 9)
    assert sorted(t.items()) == sorted([(k(0), 100), (k(1), 101), (k(3), 7), (k(4), 104), (k(9), 9)])
    assert t.oldest(2) is None and t.class_len(2) == 0


def test_prefix_len_counts_leading_present_keys(T):
    t = T()
    for i in (0, 1, 2, 4):
        t.insert(k(i), i, 0)
    hashes = b"".join(i.to_bytes(16, "big") for i in range(6))
    ns = (1).to_bytes(4, "big")
    assert t.prefix_len(ns, hashes) == 3
    assert t.prefix_len((2).to_bytes(4, "big"), hashes) == 0     # another namespace sees nothing
    assert t.prefix_len(ns, b"") == 0
    t.prefix_len(ns, hashes[:32], touch=True)                   # 0 and 1 now most recent
    assert t.oldest(0) == (k(2), 2)


def test_bad_arguments_are_refused(T):
    t = T()
    with pytest.raises(ValueError):
        t.insert(b"short", 1, 0)
    with pytest.raises(TypeError):
        t.get("not bytes")
    with pytest.raises((OverflowError, ValueError)):
        t.insert(k(1), 1 << 64, 0)
    with pytest.raises((OverflowError, ValueError)):
        t.insert(k(1), -1, 0)
    with pytest.raises(ValueError):
        t.insert(k(1), 1, 70000)
    t.insert(k(1), 1, 0)
    with pytest.raises(ValueError):
        t.insert(k(1), 2, 0)                         # a key is inserted once
    with pytest.raises(KeyError):
        t.unlink(k(2))
    with pytest.raises(ValueError):
        t.prefix_len(b"abc", bytes(16))
    with pytest.raises(ValueError):
        t.prefix_len(bytes(4), bytes(15))
    assert len(t) == 1 and t.get(k(1)) == 1          # nothing changed by the refusals


class Model:
    """The reference: what a key table must do, written the obvious way."""

    def __init__(self) -> None:
        self.map: dict[bytes, tuple[int, int]] = {}
        self.lru: dict[int, OrderedDict[bytes, None]] = {}


def test_random_operations_match_the_reference(T):
    rng = random.Random(1234)
    t, m = T(), Model()
    universe = [k(i, ns=rng.randrange(3)) for i in range(3000)]
    for step in range(60000):
        key = rng.choice(universe)
        op = rng.random()
        if op < 0.35:
            if key not in m.map:
                cls = rng.randrange(4)
                t.insert(key, step, cls)
                m.map[key] = (step, cls)
                m.lru.setdefault(cls, OrderedDict())[key] = None
        elif op < 0.6:
            got = t.remove(key)
            e = m.map.pop(key, None)
            assert got == (e[0] if e else None)
            if e:
                m.lru[e[1]].pop(key, None)
        elif op < 0.75:
            assert t.touch(key) == (key in m.map)
            if key in m.map and key in m.lru[m.map[key][1]]:
                m.lru[m.map[key][1]].move_to_end(key)
        elif op < 0.85 and key in m.map:
            t.unlink(key)
            m.lru[m.map[key][1]].pop(key, None)
        elif op < 0.95 and key in m.map:
            t.relink(key)
            lru = m.lru[m.map[key][1]]
            if key not in lru:
                lru[key] = None
        else:
            cls = rng.randrange(4)
            lru = m.lru.get(cls)
            want = (next(iter(lru)), m.map[next(iter(lru))][0]) if lru else None
            assert t.oldest(cls) == want
            assert t.class_len(cls) == len(lru or ())
        assert t.get(key) == (m.map[key][0] if key in m.map else None)
    assert len(t) == len(m.map)
    assert sorted(t.items()) == sorted((kk, v) for kk, (v, _) in m.map.items())
    # drain every class in LRU order
    for cls, lru in m.lru.items():
        for key in list(lru):
            assert t.oldest(cls)[0] == key
            t.remove(key)
        assert t.oldest(cls) is None


def test_grows_past_many_resizes(T):
    t = T(capacity_hint=10)
    for i in range(20000):
        t.insert(k(i), i, i % 3)
    assert len(t) == 20000 and all(t.get(k(i)) == i for i in range(0, 20000, 97))
    for i in range(0, 20000, 2):
        t.remove(k(i))
    assert len(t) == 10000 and t.get(k(2)) is None and t.get(k(3)) == 3
    assert t.nbytes() > 0
