"""The host pool's compact workflow policy (kvstore/policy/compact.py) evicts in the same order as the reference
model (kvstore/policy/workflow.py's dict books) on random operation sequences: stores, reads and re-stores with
and without hint context, pins, removals, evictions, workflows beginning, calling agents, ending and expiring,
over two eviction classes and slots spread over several segments (rows are dropped with a segment's last block)."""
from __future__ import annotations

import random

import pytest

from kvstore.index.keytable import KeyTable
from kvstore.policy.compact import CompactWorkflowPolicy
from kvstore.policy.workflow import Touch, WorkflowPolicy, Workflows

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
        self.ref.removed(key)
        self.new.removed(key)
        gid = self.table.remove(key)
        assert gid is not None
        del self.keys[gid]
        self.free.append(gid)
        self.pinned.discard(key)

    def check(self) -> None:
        for cls in (0, 1):
            assert self.new.victim(cls) == self.ref.victim(cls)
        assert self.new.counts() == self.ref.counts()


@pytest.mark.parametrize("seed,budget,inherit,timed", [(1, 4, True, False), (2, 4, False, False),
                                                       (3, 2, True, False), (4, 1, True, False), (5, 3, False, False),
                                                       (6, 4, True, False), (7, 8, True, False), (8, 4, True, True),
                                                       (9, 2, True, True), (10, 4, False, True)])
def test_the_compact_form_evicts_like_the_reference(seed: int, budget: int, inherit: bool, timed: bool) -> None:
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
            key = rng.randbytes(20)
            b.add(key, rng.choice((0, 0, 1)), touch)
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
        else:
            cls = rng.choice((0, 1))
            v = b.ref.victim(cls)
            assert b.new.victim(cls) == v
            if v is not None:
                assert v not in b.pinned
                b.remove(v)
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
