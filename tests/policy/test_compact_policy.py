"""The host pool's compact workflow policy (kvstore/policy/compact.py) evicts in the same order as the reference
model (kvstore/policy/workflow.py's dict books) on random operation sequences: stores, reads and re-stores with
and without hint context, pins, removals, evictions and admissions, blocks left out by a put and blocks stored again
after they left (their touch counts come back: kvstore.policy.evicted), workflows beginning, calling agents, ending
and expiring, over two eviction classes and slots spread over several segments (rows are dropped with a segment's
last block); and, with moves (compaction: a block moved to a free slot, `moved`), still in the reference's order,
which is keyed by key and never sees a move."""
from __future__ import annotations

import random

import pytest

from kvstore.index.keytable import KeyTable
from kvstore.policy.compact import ABSENT, CompactWorkflowPolicy
from kvstore.policy.workflow import WorkflowPolicy
from kvstore.workflows import Touch, Workflows

AGENTS = ["planner", "coder", "tester", "reviewer", "a4", "a5", "a6", "a7", "a8", "a9"]   # > 8: masks clamp


class Both:
    """The two forms over one Workflows; every block at a slot of its own (gid), as in the host pool."""

    def __init__(self, budget: int, inherit: bool, per_segment: int, timed: bool = False) -> None:
        self.now = 0.0
        self.flows = Workflows(idle_s=50.0, clock=lambda: self.now, timed=timed)
        self.ref = WorkflowPolicy(self.flows, tag_budget=budget, inherit=inherit)
        self.table = KeyTable()
        self.keys: dict[int, bytes] = {}
        self.new = CompactWorkflowPolicy(self.table, self.flows, self.keys.get, tag_budget=budget, inherit=inherit,
                                         pick_s=0.0)
        self.per_segment = per_segment
        self.free: list[int] = []
        self.next_slot = 0
        self.pinned: set[bytes] = set()
        self.gone: list[bytes] = []                 # keys removed (stored again at times: EvictedTouches)

    def slot(self) -> int:
        if self.free:
            return self.free.pop()
        n = self.next_slot
        self.next_slot += 1
        return (n // self.per_segment + 1) << 32 | n % self.per_segment

    def add(self, key: bytes, cls: int, touch: Touch | None) -> None:
        gid = self.slot()
        self.keys[gid] = key
        self.table.insert(key, gid, cls)
        self.ref.added(key, cls, touch)
        self.new.added(key, cls, touch)

    def remove(self, key: bytes) -> None:
        self.gone.append(key)
        self.ref.removed(key)
        self.new.removed(key)
        gid = self.table.remove(key)
        assert gid is not None
        del self.keys[gid]
        self.free.append(gid)
        self.pinned.discard(key)

    def move(self, key: bytes, rng: random.Random) -> None:
        """As the index's compaction: the block goes to a free slot (of another segment where there is one), the
        key table maps it there, the policy is told, the old slot is freed."""
        src = self.table.get(key)
        assert src is not None
        away = [g for g in self.free if g >> 32 != src >> 32]
        if away:
            dst = rng.choice(away)
            self.free.remove(dst)
        else:
            dst = self.slot()
        self.keys[dst] = self.keys.pop(src)
        self.table.set_value(key, dst)
        self.new.moved(key, src, dst)
        self.free.append(src)

    def check(self) -> None:
        for cls in (0, 1):
            assert self.new.victim(cls) == self.ref.victim(cls)
        assert self.new.counts() == self.ref.counts()
        rows = {seg << 32 | i for seg, ch in self.new.chunks.items() for i, g in enumerate(ch.group) if g != ABSENT}
        assert rows == set(self.keys), "a row for every stored block's slot, and none for a free one"
        assert all(ch.live == sum(g != ABSENT for g in ch.group) > 0 for ch in self.new.chunks.values())


@pytest.mark.parametrize("seed,budget,inherit,timed", [(1, 4, True, False), (2, 4, False, False),
                                                       (3, 2, True, False), (4, 1, True, False), (5, 3, False, False),
                                                       (6, 4, True, False), (7, 8, True, False), (8, 4, True, True),
                                                       (9, 2, True, True), (10, 4, False, True)])
@pytest.mark.parametrize("moves", [False, True])
def test_the_compact_form_evicts_like_the_reference(seed: int, budget: int, inherit: bool, timed: bool,
                                                    moves: bool) -> None:
    rng = random.Random(seed)
    b = Both(budget, inherit, per_segment=rng.choice([3, 16, 64]), timed=timed)
    wids: list[str] = []
    made = 0
    for _ in range(3000):
        b.now += rng.random()
        live = list(b.flows.active)
        op = rng.random()
        if op < 0.08 or not live:
            made += 1
            wid = f"w{made}"                                   # never reused: see compact.py on numbers
            b.flows.call(wid, rng.choice(AGENTS[:4]), rng.choice(["code", "chat", ""]))
            wids.append(wid)
        elif op < 0.20:
            w = b.flows.active[rng.choice(live)]
            b.flows.call(w.wid, rng.choice(AGENTS), w.wtype)
        elif op < 0.25:
            b.flows.end(rng.choice(live) if rng.random() < 0.9 else "nobody")
        elif op < 0.27:
            b.flows.expire()
        touch = None
        if rng.random() < 0.8 and wids:
            touch = Touch(rng.choice(wids[-12:]), rng.choice(AGENTS))    # ended ones too: ignored
        keys = list(b.keys.values())
        op = rng.random()
        if op < 0.35 or len(keys) < 4:
            back = [g for g in b.gone[-20:] if b.table.get(g) is None]
            key = rng.choice(back) if back and rng.random() < 0.3 else rng.randbytes(20)
            b.add(key, rng.choice((0, 0, 1)), touch)
            assert b.new.describe(key) == b.ref.describe(key)
        elif op < 0.55:
            key = rng.choice(keys)
            b.ref.accessed(key, touch)
            b.new.accessed(key, touch)
        elif op < 0.62:
            key = rng.choice(keys)
            if key not in b.pinned:
                b.pinned.add(key)
                b.ref.pinned(key)
                b.new.pinned(key)
        elif op < 0.70 and b.pinned:
            key = rng.choice(sorted(b.pinned))
            b.pinned.discard(key)
            b.ref.unpinned(key)
            b.new.unpinned(key)
        elif op < 0.78:
            b.remove(rng.choice(keys))
        elif op < 0.82 and touch is not None and b.gone:           # a put left these out (Refusing)
            left = [g for g in b.gone[-8:] if b.table.get(g) is None]
            b.ref.refused(left, 0, touch)
            b.new.refused(left, 0, touch)
        else:
            cls = rng.choice((0, 1))
            v = b.ref.victim(cls)
            assert b.new.victim(cls) == v
            if v is not None and touch is not None:           # admitted alike, for a block seen before or not
                coming = rng.choice(b.gone[-8:] + [rng.randbytes(20)])
                assert b.new.admits(v, touch, coming) == b.ref.admits(v, touch, coming)
            if v is not None:
                assert v not in b.pinned
                b.remove(v)
        if moves and b.keys and rng.random() < 0.15:         # pinned ones too: the policy keeps them pinned
            b.move(rng.choice(list(b.keys.values())), rng)
        b.check()
    for cls in (0, 1):                                  # the whole order, to the last unpinned block
        while (v := b.ref.victim(cls)) is not None:
            assert b.new.victim(cls) == v
            b.remove(v)
        assert b.new.victim(cls) is None
    assert b.new.counts() == b.ref.counts()


def test_rows_are_small_and_go_with_a_segments_last_block() -> None:
    flows = Workflows()
    table = KeyTable()
    keys: dict[int, bytes] = {}
    pol = CompactWorkflowPolicy(table, flows, keys.get, slots_of=lambda seg: 1000)
    flows.call("w", "agent")
    for i in range(1000):
        gid = 7 << 32 | i
        keys[gid] = i.to_bytes(20, "big")
        table.insert(keys[gid], gid, 0)
        pol.added(keys[gid], 0, Touch("w", "agent"))
    assert pol.counts() == {"retired": 0, "active": 1000, "workflows": 1}
    assert sum(ch.nbytes() for ch in pol.chunks.values()) == 1000 * (4 + 8 + 8 + 4 * 4 + 4 + 1)   # 41 B a slot
    flows.end("w")
    assert pol.counts()["retired"] == 1000
    for key in keys.values():
        pol.removed(key)
        table.remove(key)
    assert pol.chunks == {} and pol.groups == {}


def one_segment(flows: Workflows, n: int, touch: Touch | None) -> tuple[CompactWorkflowPolicy, KeyTable,
                                                                         dict[int, bytes], list[bytes]]:
    """A policy over `n` blocks in slots 0..n-1 of segment 1, added in order (the first is the least recent)."""
    table = KeyTable()
    keys: dict[int, bytes] = {}
    pol = CompactWorkflowPolicy(table, flows, keys.get, inherit=False, pick_s=0.0)   # scores read a head's row
    for i in range(n):
        gid = 1 << 32 | i
        keys[gid] = i.to_bytes(20, "big")
        table.insert(keys[gid], gid, 0)
        pol.added(keys[gid], 0, touch)
    return pol, table, keys, list(keys.values())


def move(pol: CompactWorkflowPolicy, table: KeyTable, keys: dict[int, bytes], key: bytes, dst: int) -> None:
    src = table.get(key)
    assert src is not None
    keys[dst] = keys.pop(src)
    table.set_value(key, dst)
    pol.moved(key, src, dst)


def evict_all(pol: CompactWorkflowPolicy, table: KeyTable, keys: dict[int, bytes]) -> list[bytes]:
    out = []
    while (v := pol.victim(0)) is not None:
        out.append(v)
        pol.removed(v)
        gid = table.remove(v)
        assert gid is not None
        del keys[gid]
    return out


@pytest.mark.parametrize("hinted", [False, True])
def test_a_moved_block_keeps_its_place_in_its_group(hinted: bool) -> None:
    """Head, middle and tail of one group's list move to another segment: the victims come in the order they
    would have without the moves (an append would put the moved ones last), and a block added next follows the
    moved tail (the group's tail is the new slot)."""
    flows = Workflows()
    flows.call("w", "agent")
    touch = Touch("w", "agent") if hinted else None
    pol, table, keys, order = one_segment(flows, 6, touch)
    for j, i in enumerate((2, 0, 5)):
        move(pol, table, keys, order[i], 2 << 32 | j)
    last = keys[1 << 32 | 6] = b"\xff" * 20
    table.insert(last, 1 << 32 | 6, 0)
    pol.added(last, 0, touch)
    assert pol.counts()["active" if hinted else "retired"] == 7
    assert evict_all(pol, table, keys) == [*order, last]
    assert pol.chunks == {} and pol.groups == {}


def test_a_moved_pinned_block_stays_pinned() -> None:
    flows = Workflows()
    pol, table, keys, order = one_segment(flows, 4, None)
    pol.pinned(order[1])
    move(pol, table, keys, order[1], 2 << 32 | 0)
    assert pol.describe(order[1]) == {"standing": "pinned", "workflows": [], "agents": {}, "touched": 0, "done": []}
    assert pol.counts()["retired"] == 3
    pol.unpinned(order[1])                               # a candidate again, as if just used
    assert evict_all(pol, table, keys) == [order[0], order[2], order[3], order[1]]


def test_moving_a_segments_last_row_frees_its_chunk() -> None:
    flows = Workflows()
    pol, table, keys, order = one_segment(flows, 2, None)
    move(pol, table, keys, order[0], 3 << 32 | 4)
    assert set(pol.chunks) == {1, 3} and pol.chunks[1].live == 1 and pol.chunks[3].live == 1
    move(pol, table, keys, order[1], 3 << 32 | 0)
    assert set(pol.chunks) == {3} and pol.chunks[3].live == 2
    assert evict_all(pol, table, keys) == order
