"""Which blocks a workflow is done with (kvstore/workflows/rereads.py): learned per (type, agent, touches) from
keys, not from what a pool kept; only a class measured dead changes a block's worth; the books are bounded and let
go of a workflow at its end."""
from __future__ import annotations

import pytest

from kvstore.workflows import Touch, Workflows
from kvstore.workflows import rereads as rr


def k(i: int) -> bytes:
    return i.to_bytes(4, "big")


def run(flows: Workflows, wid: str, base: int, reread: bool) -> None:
    """Two calls of agent "a": the second rereads the first's block when `reread`."""
    flows.call(wid, "a", "t")
    flows.seen(Touch(wid, "a"), k(base))
    flows.call(wid, "a", "t")
    flows.seen(Touch(wid, "a"), k(base if reread else base + 1))
    flows.end(wid)


def test_a_class_is_dead_only_once_measured_never_read_again() -> None:
    flows = Workflows()
    flows.call("w", "a", "t")
    flows.seen(Touch("w", "a"), k(0))
    assert flows.block_worth("w", k(0)) == 1.0                     # nothing measured: the convention
    for i in range(40):
        run(flows, f"old{i}", 10 * (i + 1), reread=False)          # (t, a, 1) never read again
    worth = flows.block_worth("w", k(0))
    assert worth == pytest.approx(rr.PRIOR / (80 + rr.PRIOR)) and worth < rr.DEAD_BELOW
    flows.seen(Touch("w", "a"), k(0))                              # the same call again: still one touch
    assert flows.block_worth("w", k(0)) == worth


def test_a_class_read_again_half_the_time_keeps_its_whole_worth() -> None:
    """A graded share would rank a chain's prefix below its own tail (rereads.py): only dead classes count."""
    flows = Workflows()
    for i in range(200):
        run(flows, f"old{i}", 10 * (i + 1), reread=i % 2 == 0)
    flows.call("w", "a", "t")
    flows.seen(Touch("w", "a"), k(0))
    assert flows.block_worth("w", k(0)) == 1.0


def test_a_block_read_again_after_its_eviction_counts_as_read_again() -> None:
    """The books follow keys: what the pool dropped and the workflow asked for again is a success (no policy
    here holds anything), so a pool that evicts a class does not teach itself that the class is dead."""
    flows = Workflows()
    for i in range(40):
        run(flows, f"old{i}", 10 * (i + 1), reread=True)
    flows.call("w", "a", "t")
    flows.seen(Touch("w", "a"), k(0))
    assert flows.block_worth("w", k(0)) == 1.0
    assert flows.reread_classes._classes[("", "t", "a", False, 1)] == [40.0, 40.0]


def test_the_books_are_bounded_and_let_go_of_an_ended_workflow(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rr, "MAX_PER_WORKFLOW", 3)
    flows = Workflows()
    for i in range(40):
        run(flows, f"old{i}", 10 * (i + 1), reread=False)
    flows.call("w", "a", "t")
    for i in range(5):
        flows.seen(Touch("w", "a"), k(i))
    assert len(flows.reread_classes) == 3                          # the rest untracked: the convention's 1
    assert [flows.block_worth("w", k(i)) < 1.0 for i in range(5)] == [True, True, True, False, False]
    assert flows.footprint()["reread_keys"] == 3
    flows.end("w")
    assert len(flows.reread_classes) == 0
    assert flows.block_worth("w", k(0)) == 1.0                     # not active: the books say nothing


def test_one_tenants_workflows_cannot_use_up_anothers_books(monkeypatch: pytest.MonkeyPatch) -> None:
    """A hostile tenant's workflows touching keys without end fill their tenant's share, not the books: another
    tenant's blocks are still tracked, and its classes are its own."""
    monkeypatch.setattr(rr, "MAX_PER_TENANT", 4)
    flows = Workflows()
    for i in range(3):
        flows.call(f"h{i}", "a", "t", tenant="hostile")
        for j in range(10):
            flows.seen(Touch(f"h{i}", "a"), k(1000 * i + j))
    assert len(flows.reread_classes) == 4
    for i in range(40):
        flows.call(f"old{i}", "a", "t", tenant="b")
        flows.seen(Touch(f"old{i}", "a"), k(10 * (i + 1)))
        flows.call(f"old{i}", "a", "t", tenant="b")
        flows.end(f"old{i}")
    flows.call("w", "a", "t", tenant="b")
    flows.seen(Touch("w", "a"), k(0))
    assert flows.block_worth("w", k(0)) < rr.DEAD_BELOW                 # b's class, learned from b's workflows
    flows.call("h9", "a", "t", tenant="hostile")
    flows.seen(Touch("h9", "a"), k(5))
    assert flows.block_worth("h9", k(5)) == 1.0                         # untracked (and not b's class)
    for i in range(3):
        flows.end(f"h{i}")
    assert flows.reread_classes._by_tenant == {"b": 1}


def test_a_call_extends_an_earlier_calls_whole_chain_or_branches() -> None:
    """`Workflows.chain`: a call whose chain holds the last key of an earlier call's chain extends it (a loop's next
    turn, a worker's check of its read); one that shares only a head branches; a key found across two keys'
    boundary is not one of them."""
    flows = Workflows()
    t = Touch("w", "a")
    steps = [([1, 2], False), ([1, 2, 3], True), ([1, 4], False), ([1, 4, 5, 6], True), ([1, 7], False)]
    for chain, extends in steps:
        flows.call("w", "a", "t")
        flows.chain(t, b"".join(k(i) for i in chain[:1]), 4)      # a shorter chain first (a get's held prefix)
        flows.chain(t, b"".join(k(i) for i in chain), 4)
        assert flows.active["w"].extends is extends, chain
    flows.call("w", "a", "t")
    tail = k(7)
    flows.chain(t, b"\0\0" + tail + b"\0\0", 4)                  # k(7) only across a boundary: no
    assert not flows.active["w"].extends


def test_new_blocks_of_a_call_that_extends_are_a_class_apart() -> None:
    """A map-reduce worker's check stores blocks no call reads again, after the read's blocks it rereads: they are
    dead, while the read's own new blocks (a branch of its own, read by the check) are not."""
    flows = Workflows()
    for i in range(40):
        wid, t = f"old{i}", Touch(f"old{i}", "worker")
        read, check = [k(1000 + i), k(2000 + i)], [k(1000 + i), k(2000 + i), k(3000 + i)]
        flows.call(wid, "worker", "mr")
        flows.chain(t, b"".join(read), 4)
        for key in read:
            flows.seen(t, key)
        flows.call(wid, "worker", "mr")
        flows.chain(t, b"".join(check), 4)
        for key in check:
            flows.seen(t, key)
        flows.end(wid)
    t = Touch("x", "worker")
    flows.call("x", "worker", "mr")
    flows.chain(t, k(1) + k(2), 4)
    flows.seen(t, k(2))                                             # the read's new block: read again by a check
    assert flows.block_worth("x", k(2)) == 1.0
    flows.call("x", "worker", "mr")
    flows.chain(t, k(1) + k(2) + k(3), 4)
    flows.seen(t, k(3))                                             # the check's: never read again
    assert flows.block_worth("x", k(3)) < rr.DEAD_BELOW


def test_a_malformed_chain_changes_nothing() -> None:
    """`Workflows.chain` is fed a request's keys before the op checks them: a blob that is not bytes, or shorter
    than one key, is left for the op to refuse — no exception here, no call's chain changed."""
    flows = Workflows()
    t = Touch("w", "a")
    flows.call("w", "a", "t")
    flows.chain(t, k(1) + k(2), 4)
    for bad in ("not bytes", [k(1)], b"ab", b""):
        flows.chain(t, bad, 4)                                     # type: ignore[arg-type]
    w = flows.active["w"]
    assert (w.chain_len, w.chain_tail, w.extends) == (2, k(2), False)
    flows.chain(None, k(1), 4)                                     # no context: nothing to book
