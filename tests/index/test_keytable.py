"""The key table, native and pure Python: the same scenarios (tiny keys, expected outcomes as data), a random run of
each against a reference model, and the two run side by side on the same operations."""
from __future__ import annotations

import os
import random
import subprocess
import sys
from collections import OrderedDict

import pytest

from kvstore.index import keytable

try:
    from kvstore._kvindex import KeyTable as Native
except ImportError:
    Native = None

IMPLS = [pytest.param(keytable.PyKeyTable, id="python"),
         pytest.param(Native, id="native", marks=pytest.mark.skipif(Native is None, reason="native not built"))]
needs_native = pytest.mark.skipif(Native is None, reason="native not built")

NS = (1).to_bytes(4, "big")
U64_MAX = (1 << 64) - 1


def k(i: int, ns: int = 1) -> bytes:
    return ns.to_bytes(4, "big") + i.to_bytes(16, "big")


def hashes(*ids: int) -> bytes:
    return b"".join(i.to_bytes(16, "big") for i in ids)


def order(t, cls: int) -> list[int]:
    """The linked keys of cls, least recently used first, as tiny ids (the table is left as it was)."""
    keys = []
    while (o := t.oldest(cls)) is not None:
        keys.append(o[0])
        t.unlink(o[0])
    for key in keys:
        t.relink(key)
    return [int.from_bytes(key[4:], "big") for key in keys]


@pytest.fixture(params=IMPLS)
def T(request):
    return request.param


# (operations, then {cls: expected LRU order}); an operation is (method, *args) with ids for keys, and its expected
# result. Every scenario starts from keys 1, 2, 3 inserted in class 0 (values 10, 20, 30) and key 9 in class 1.
SCENARIOS = {
    "insert order is LRU order": ([], {0: [1, 2, 3], 1: [9]}),
    "touch moves to the MRU end": ([("touch", 1, True)], {0: [2, 3, 1]}),
    "touch of the MRU key changes nothing": ([("touch", 3, True)], {0: [1, 2, 3]}),
    "touch of an absent key is False": ([("touch", 7, False)], {0: [1, 2, 3]}),
    "get and set_value leave the order": ([("get", 1, 10), ("set_value", 1, 11, None), ("get", 1, 11)],
                                          {0: [1, 2, 3]}),
    "unlink pins, twice is fine": ([("unlink", 2, None), ("unlink", 2, None), ("is_linked", 2, False),
                                    ("class_len", 0, 2), ("get", 2, 20)], {0: [1, 3]}),
    "touch keeps a pinned key unlinked": ([("unlink", 1, None), ("touch", 1, True), ("is_linked", 1, False)],
                                          {0: [2, 3]}),
    "relink puts back at the MRU end": ([("unlink", 1, None), ("relink", 1, None), ("is_linked", 1, True)],
                                        {0: [2, 3, 1]}),
    "relink of a linked key does not move it": ([("relink", 1, None)], {0: [1, 2, 3]}),
    "remove returns the value once": ([("remove", 2, 20), ("remove", 2, None), ("get", 2, None),
                                       ("class_len", 0, 2)], {0: [1, 3]}),
    "remove of a pinned key": ([("unlink", 3, None), ("remove", 3, 30), ("class_len", 0, 2)], {0: [1, 2]}),
    "classes are separate lists": ([("touch", 9, True), ("cls_of", 9, 1), ("cls_of", 1, 0), ("oldest", 1, (9, 90)),
                                    ("class_len", 1, 1), ("oldest", 2, None), ("class_len", 65535, 0)],
                                   {0: [1, 2, 3], 1: [9]}),
    "oldest follows removals": ([("remove", 1, 10), ("oldest", 0, (2, 20)), ("remove", 2, 20), ("remove", 3, 30),
                                 ("oldest", 0, None)], {0: []}),
    "reinsert after remove is at the MRU end": ([("remove", 1, 10), ("insert", 1, 5, 0, None)], {0: [2, 3, 1]}),
    "prefix_len stops at the first absent key": ([("prefix_len", [1, 2, 7, 3], 2), ("prefix_len", [7, 1], 0),
                                                  ("prefix_len", [], 0), ("prefix_len", [3, 9, 1], 3)],
                                                 {0: [1, 2, 3]}),
    "prefix_len touch touches only the counted keys": ([("prefix_len_touch", [2, 1, 7, 3], 2)], {0: [3, 2, 1]}),
    "prefix_len touch keeps pinned keys unlinked": ([("unlink", 1, None), ("prefix_len_touch", [1, 2], 2)],
                                                    {0: [3, 2]}),
}


@pytest.mark.parametrize("ops,orders", SCENARIOS.values(), ids=SCENARIOS.keys())
def test_scenario(T, ops, orders):
    t = T()
    for i in (1, 2, 3):
        t.insert(k(i), 10 * i, 0)
    t.insert(k(9), 90, 1)
    for method, *args, want in ops:
        if method.startswith("prefix_len"):
            got = t.prefix_len(NS, hashes(*args[0]), touch=method.endswith("touch"))
        elif method in ("oldest", "class_len"):
            got = getattr(t, method)(args[0])
            got = (int.from_bytes(got[0][4:], "big"), got[1]) if method == "oldest" and got else got
        else:
            got = getattr(t, method)(k(args[0]), *args[1:])
        assert got == want, (method, args)
    for cls, want in orders.items():
        assert order(t, cls) == want
        assert t.class_len(cls) == len(want)


def test_items_len_contains(T):
    t = T()
    for i, cls in ((1, 0), (2, 0), (3, 5)):
        t.insert(k(i), i * 10, cls)
    t.unlink(k(2))
    assert sorted(t.items()) == [(k(1), 10), (k(2), 20), (k(3), 30)]   # pinned keys are listed too
    assert (len(t), k(3) in t, k(3, ns=2) in t, bool(T())) == (3, True, False, False)


def test_items_is_a_snapshot(T):
    t = T()
    for i in range(100):
        t.insert(k(i), i, 0)
    it = t.items()
    first = next(it)
    for i in range(100, 1000):                     # grows the table under the iterator
        t.insert(k(i), i, 0)
    for i in range(100):
        t.remove(k(i))
    assert sorted([first, *it]) == [(k(i), i) for i in range(100)]


@pytest.mark.parametrize("value,cls", [(0, 0), (U64_MAX, 65535), (1 << 63, 1), (True, False)])
def test_boundary_values(T, value, cls):
    t = T()
    t.insert(k(1), value, cls)
    assert (t.get(k(1)), t.cls_of(k(1)), t.oldest(cls)) == (int(value), int(cls), (k(1), int(value)))
    t.set_value(k(1), U64_MAX - int(value))
    assert t.get(k(1)) == U64_MAX - int(value)


# (method, args with "K" for a present key, expected exception)
REFUSALS = [
    ("insert", (b"short", 1, 0), ValueError),
    ("insert", (k(1) + b"x", 1, 0), ValueError),
    ("insert", (bytearray(k(5)), 1, 0), TypeError),
    ("insert", (k(5), 1 << 64, 0), OverflowError),
    ("insert", (k(5), -1, 0), OverflowError),
    ("insert", (k(5), 1.0, 0), TypeError),
    ("insert", (k(5), 1, 65536), ValueError),
    ("insert", (k(5), 1, -1), ValueError),
    ("insert", (k(5), 1, 1 << 70), ValueError),
    ("insert", ("K", 2, 0), ValueError),            # a key is inserted once
    ("get", ("not bytes",), TypeError),
    ("get", (k(1)[:19],), ValueError),
    ("remove", (None,), TypeError),
    ("set_value", (k(5), 1), KeyError),
    ("set_value", ("K", -5), OverflowError),
    ("unlink", (k(5),), KeyError),
    ("relink", (k(5),), KeyError),
    ("is_linked", (k(5),), KeyError),
    ("cls_of", (k(5),), KeyError),
    ("oldest", (65536,), ValueError),
    ("class_len", (-1,), ValueError),
    ("prefix_len", (b"abc", bytes(16)), ValueError),
    ("prefix_len", (NS, bytes(15)), ValueError),
    ("prefix_len", ("abcd", bytes(16)), TypeError),
]


@pytest.mark.parametrize("method,args,exc", REFUSALS, ids=[f"{m}-{i}" for i, (m, _, _) in enumerate(REFUSALS)])
def test_bad_arguments_are_refused(T, method, args, exc):
    t = T()
    t.insert(k(1), 1, 3)
    with pytest.raises(exc):
        getattr(t, method)(*(k(1) if a == "K" else a for a in args))
    assert (len(t), t.get(k(1)), order(t, 3)) == (1, 1, [1])   # nothing changed by the refusal


def test_same_call_signatures(T):
    t = T(capacity_hint=8)
    t.insert(key=k(1), value=1, cls=0)
    t.set_value(key=k(1), value=2)
    assert t.prefix_len(prefix=NS, hashes=hashes(1), touch=True) == 1
    assert t.prefix_len(NS, memoryview(hashes(1, 2))) == 1 and t.prefix_len(bytearray(NS), bytearray(16)) == 0
    with pytest.raises(TypeError):
        t.get(key=k(1))                            # single-key methods take the key positionally only
    with pytest.raises(TypeError):
        t.insert(k(2), 1)


def test_deletions_inside_crowded_probe_runs(T):
    """48 keys in the smallest table (64 slots, load 3/4) make long probe runs; removing them in random order
    shifts entries back over the holes, which must keep every key findable and every LRU list intact."""
    for seed in range(20):
        rng = random.Random(seed)
        t = T()
        ids = rng.sample(range(1, 10_000), 48)
        for i in ids:
            t.insert(k(i), i, i % 2)
        model = {c: [i for i in ids if i % 2 == c] for c in (0, 1)}
        rng.shuffle(ids)
        for n, i in enumerate(ids):
            assert t.remove(k(i)) == i
            model[i % 2].remove(i)
            rest = ids[n + 1:]
            assert all(t.get(k(j)) == j for j in rest) and len(t) == len(rest)
            if n % 8 == 0:
                assert order(t, 0) == model[0] and order(t, 1) == model[1]


def test_growth_keeps_values_and_lru_order(T):
    t = T(capacity_hint=10)
    for i in range(20_000):
        t.insert(k(i), i * 3, i % 3)
        if i % 7 == 0:
            t.touch(k(i // 2))
    assert len(t) == 20_000 and all(t.get(k(i)) == i * 3 for i in range(0, 20_000, 97))
    model: dict[int, OrderedDict[int, None]] = {c: OrderedDict() for c in range(3)}
    for i in range(20_000):
        model[i % 3][i] = None
        if i % 7 == 0 and i // 2 in model[(i // 2) % 3]:
            model[(i // 2) % 3].move_to_end(i // 2)
    assert all(order(t, c) == list(model[c]) for c in range(3))
    assert t.nbytes() > 20_000 * 20
    for i in range(0, 20_000, 2):
        t.remove(k(i))
    assert (len(t), t.get(k(2)), t.get(k(3)), t.nbytes() > 10_000 * 20) == (10_000, None, 9, True)


def test_prefix_len_in_a_table_larger_than_the_caches(T):
    """150 000 keys: the native prefix_len then probes in two passes (home cache lines first, then the probe runs
    that go on); its counts and touches must be those of one key at a time."""
    rng = random.Random(5)
    t = T()
    for i in range(150_000):
        t.insert(k(i), i, i % 2)
    for _ in range(300):
        ids = [rng.randrange(160_000) for _ in range(rng.choice([1, 5, 32, 70]))]   # ids >= 150 000 are absent
        want = next((n for n, i in enumerate(ids) if i >= 150_000), len(ids))
        assert t.prefix_len(NS, hashes(*ids)) == want
    ids = list(range(1000, 1040)) + [150_001, 0]                    # 0, after an absent key, is not touched
    assert t.prefix_len(NS, hashes(*ids), touch=True) == 40
    evicted = []
    while len(evicted) < 505:
        evicted.append(int.from_bytes(t.oldest(0)[0][4:], "big"))
        t.remove(k(evicted[-1]))
    assert evicted == list(range(0, 1000, 2)) + [1040, 1042, 1044, 1046, 1048]   # 1000..1038 went to the MRU end


def random_ops(seed: int, steps: int, universe: int = 3000):
    rng = random.Random(seed)
    keys = [k(i, ns=rng.randrange(3)) for i in range(universe)]
    for step in range(steps):
        key, op = rng.choice(keys), rng.random()
        if op < 0.3:
            yield "insert", (key, step, rng.randrange(4))
        elif op < 0.5:
            yield "remove", (key,)
        elif op < 0.6:
            yield "touch", (key,)
        elif op < 0.7:
            yield "unlink", (key,)
        elif op < 0.8:
            yield "relink", (key,)
        elif op < 0.85:
            yield "oldest", (rng.randrange(4),)
        elif op < 0.9:
            yield "prefix_len", (key[:4], b"".join(rng.choice(keys)[4:] for _ in range(rng.randrange(4))),
                                 rng.random() < 0.5)
        else:
            yield rng.choice(["get", "is_linked", "cls_of"]), (key,)


def test_random_operations_match_the_reference(T):
    t = T()
    vals: dict[bytes, tuple[int, int]] = {}                         # key -> (value, cls)
    lru: dict[int, OrderedDict[bytes, None]] = {c: OrderedDict() for c in range(4)}

    def touch(key: bytes) -> None:
        if key in lru[vals[key][1]]:
            lru[vals[key][1]].move_to_end(key)

    for op, args in random_ops(1234, 40_000):
        key = args[0]
        if op == "insert" and key not in vals:
            t.insert(*args)
            vals[key] = args[1:]
            lru[args[2]][key] = None
        elif op == "remove":
            e = vals.pop(key, None)
            assert t.remove(key) == (e[0] if e else None)
            if e:
                lru[e[1]].pop(key, None)
        elif op == "touch":
            assert t.touch(key) == (key in vals)
            if key in vals:
                touch(key)
        elif op in ("unlink", "relink") and key in vals:
            getattr(t, op)(key)
            if op == "unlink":
                lru[vals[key][1]].pop(key, None)
            elif key not in lru[vals[key][1]]:
                lru[vals[key][1]][key] = None
        elif op == "oldest":
            first = next(iter(lru[key]), None)
            assert t.oldest(key) == (None if first is None else (first, vals[first][0]))
            assert t.class_len(key) == len(lru[key])
        elif op == "prefix_len":
            n = 0
            for i in range(0, len(args[1]), 16):
                if (kk := key + args[1][i:i + 16]) not in vals:
                    break
                n += 1
                if args[2]:
                    touch(kk)
            assert t.prefix_len(*args) == n
        elif op in ("is_linked", "cls_of") and key in vals:
            assert getattr(t, op)(key) == (key in lru[vals[key][1]] if op == "is_linked" else vals[key][1])
        if op not in ("oldest", "prefix_len"):
            assert t.get(key) == (vals[key][0] if key in vals else None)
    assert sorted(t.items()) == sorted((kk, v) for kk, (v, _) in vals.items())
    pinned = sorted((kk, v) for kk, (v, c) in vals.items() if kk not in lru[c])
    for cls in range(4):                                            # drain every class in LRU order
        for key in list(lru[cls]):
            assert t.oldest(cls) == (key, vals[key][0])
            t.remove(key)
        assert t.oldest(cls) is None and t.class_len(cls) == 0
    assert sorted(t.items()) == pinned and len(pinned) > 100        # the pinned keys were no candidates


def outcome(t, op, args):
    try:
        return getattr(t, op)(*args)
    except Exception as e:                                          # noqa: BLE001 - the exception is the outcome
        return type(e)


@needs_native
def test_native_and_python_agree_step_by_step():
    py, nat = keytable.PyKeyTable(), Native()
    for n, (op, args) in enumerate(random_ops(99, 30_000, universe=1000)):
        assert outcome(py, op, args) == outcome(nat, op, args), (n, op, args)
        if n % 5000 == 0:
            assert sorted(py.items()) == sorted(nat.items()) and len(py) == len(nat)


@needs_native
def test_native_details():
    t = Native.__new__(Native)                      # usable even without __init__
    t.insert(k(1), 1, 0)
    assert t.get(k(1)) == 1
    big = Native(capacity_hint=100_000)
    big.insert(k(0), 0, 0)
    before = big.nbytes()
    for i in range(1, 100_000):
        big.insert(k(i), i, 0)
    assert big.nbytes() == before < 100_000 * 130   # the hint sized it: no growth
    assert sys.getsizeof(big) >= before
    with pytest.raises(ValueError):
        Native(capacity_hint=-1)


@pytest.mark.parametrize("env,native", [("1", False), ("", Native is not None)])
def test_no_native_env_var(env, native):
    code = "import kvstore.index.keytable as m; print(m.NATIVE, m.KeyTable is m.PyKeyTable)"
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env_vars = {**os.environ, "KVSTORE_NO_NATIVE": env, "PYTHONPATH": root}
    out = subprocess.run([sys.executable, "-c", code], env=env_vars, cwd=root, capture_output=True, text=True,
                         check=True).stdout.split()
    assert out == [str(native), str(not native)]


class LevelsModel:
    """The levels' contract as a reference: per key (value, cls, level, linked), one clock of pushes, and the
    victim rule written out (kvstore/index/keytable.py's docstring)."""

    def __init__(self) -> None:
        self.keys: dict[bytes, list] = {}          # key -> [value, cls, level, tick or None (unlinked)]
        self.now = 0

    def push(self, key: bytes) -> None:
        self.now += 1
        self.keys[key][3] = self.now

    def insert(self, key, value, cls):
        self.keys[key] = [value, cls, 0, None]
        self.push(key)

    def use(self, key, top, pin=False):
        e = self.keys.get(key)
        if e is None:
            return -1
        if pin and e[3] is None:
            return e[2]
        e[2] = min(e[2] + 1, top) if e[2] < top else e[2]
        if pin:
            e[3] = None
        elif e[3] is not None:
            self.push(key)
        return e[2]

    def set_level(self, key, level):
        e = self.keys[key]
        e[2] = level
        if e[3] is not None:
            self.push(key)

    def pick(self, cls, aging=None):
        heads = []
        for level in range(keytable.LEVELS):
            linked = [(e[3], kk) for kk, e in self.keys.items() if e[1] == cls and e[2] == level and e[3]]
            if linked:
                heads.append(min(linked))
        if not heads:
            return None
        first, oldest = heads[0], min(heads)
        if aging is not None and self.now - oldest[0] > aging * (self.now - first[0]):
            first = oldest
        return first[1], self.keys[first[1]][0]


def level_ops(seed: int, steps: int, universe: int = 200):
    rng = random.Random(seed)
    keys = [k(i) for i in range(universe)]
    for step in range(steps):
        key, op = rng.choice(keys), rng.random()
        if op < 0.25:
            yield "insert", (key, step, rng.randrange(3))
        elif op < 0.35:
            yield "remove", (key,)
        elif op < 0.5:
            yield "use", (key, rng.randrange(4), rng.random() < 0.3)
        elif op < 0.6:
            yield "set_level", (key, rng.randrange(4))
        elif op < 0.7:
            yield rng.choice(["unlink", "relink", "touch"]), (key,)
        else:
            yield "pick", (rng.randrange(3), rng.choice([None, 0.0, 1.0, 2.0, 0.5]))


def test_levels_match_the_reference(T):
    """use / set_level / pick against the contract written out, with inserts, removals, pins and touches between:
    levels split a class's order, pick takes the lowest level's LRU key or, aging, the stalest one."""
    t, m = T(), LevelsModel()
    picks = 0
    for op, args in level_ops(5, 20_000):
        key = args[0]
        held = key in m.keys
        if op == "insert":
            if not held:
                t.insert(*args)
                m.insert(*args)
        elif op == "remove":
            assert t.remove(key) == (m.keys.pop(key)[0] if held else None)
        elif op == "use":
            assert t.use(*args) == m.use(*args)
        elif op == "set_level" and held:
            t.set_level(*args)
            m.set_level(*args)
        elif op in ("unlink", "relink") and held:
            getattr(t, op)(key)
            if op == "unlink":
                m.keys[key][3] = None
            elif m.keys[key][3] is None:
                m.push(key)
        elif op == "touch":
            assert t.touch(key) == held
            if held and m.keys[key][3] is not None:
                m.push(key)
        elif op == "pick":
            got = t.pick(*args)
            assert got == m.pick(*args), (args, got)
            picks += got is not None
            assert t.oldest(args[0]) == m.pick(args[0], 1.0)
            assert t.class_len(args[0]) == sum(1 for e in m.keys.values() if e[1] == args[0] and e[3])
        if held and op != "remove":
            assert t.level_of(key) == m.keys[key][2]
    assert picks > 1000
    with pytest.raises(KeyError):
        t.level_of(k(10_000))
    with pytest.raises(KeyError):
        t.set_level(k(10_000), 1)
    for bad in (("set_level", (next(iter(m.keys)), 4)), ("use", (k(1), -1)), ("pick", (0, -1.0)),
                ("pick", (65536,))):
        with pytest.raises(ValueError):
            getattr(t, bad[0])(*bad[1])


@needs_native
def test_native_and_python_levels_agree_step_by_step():
    py, nat = keytable.PyKeyTable(), Native()
    for n, (op, args) in enumerate(level_ops(17, 20_000, universe=300)):
        assert outcome(py, op, args) == outcome(nat, op, args), (n, op, args)
    assert sorted(py.items()) == sorted(nat.items())
