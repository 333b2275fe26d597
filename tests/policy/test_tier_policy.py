"""A lower tier's policies (kvstore.policy.lru.LruOrder; the workflow policy, which without hints is LRU), scenario
by scenario: tiny keys, outcomes as data."""
from __future__ import annotations

import pytest

from kvstore.policy import make_tier_policy


def k(i: int) -> bytes:
    return i.to_bytes(32, "big")


@pytest.mark.parametrize("name", ["lru", "workflow", "history"])
def test_victims_are_least_recent_per_class(name):
    p = make_tier_policy(name)
    for i, cls in ((1, 512), (2, 1024), (3, 512), (4, 1024)):
        p.added(k(i), cls)
    assert (p.victim(512), p.victim(1024)) == (k(1), k(2))      # each class has its own order
    p.accessed(k(1))                                             # read: the most recent of its class
    assert p.victim(512) == k(3)
    p.removed(k(3))
    assert p.victim(512) == k(1)
    p.removed(k(1))
    assert p.victim(512) is None and p.victim(2048) is None       # empty, and never seen


@pytest.mark.parametrize("name", ["lru", "workflow", "history"])
def test_a_key_added_again_moves_to_its_new_class_and_end(name):
    p = make_tier_policy(name)
    p.added(k(1), 512)
    p.added(k(2), 512)
    p.added(k(1), 1024)                                          # rewritten with another size
    assert (p.victim(512), p.victim(1024)) == (k(2), k(1))
    p.accessed(k(9))                                             # unknown keys are ignored
    p.removed(k(9))
    assert p.victim(512) == k(2)


def test_unknown_policy_names_the_known_ones():
    with pytest.raises(ValueError, match="known: lru, history, workflow"):
        make_tier_policy("fifo")


def test_the_workflow_policy_shares_the_hints_books():
    """The SSD tier's workflow policy reads the Workflows it is given (the daemon's, shared with the host pool)."""
    from kvstore.workflows import Touch, Workflows

    flows = Workflows()
    p = make_tier_policy("workflow", flows)
    flows.call("w", "agent")
    p.added(k(1), 512, Touch("w", "agent"))
    p.added(k(2), 512)
    assert p.victim(512) == k(2)                                  # no workflow: retired, first
    p.removed(k(2))
    flows.end("w")
    assert p.victim(512) == k(1)
