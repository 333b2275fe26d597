"""The rules of a hybrid model's KV groups (kvstore.connectors.kv_groups): what each group needs at a prefix end,
what a save keeps, and the longest end at which every group can be restored."""
from __future__ import annotations

import itertools
import random

import pytest

from kvstore.connectors.kv_groups import FULL, STATE, WINDOW, GroupRule, usable_end


def test_what_each_kind_needs_at_a_prefix_end():
    assert list(GroupRule(FULL).needed(5)) == [0, 1, 2, 3, 4]
    assert list(GroupRule(WINDOW, 2).needed(5)) == [3, 4]
    assert list(GroupRule(WINDOW, 8).needed(5)) == [0, 1, 2, 3, 4]      # a prefix shorter than the window: all
    assert list(GroupRule(STATE).needed(5)) == [4]                     # the state after the last block
    assert list(GroupRule(STATE).needed(0)) == []


def test_bad_rules_are_refused_with_the_reason():
    with pytest.raises(ValueError, match="kind is one of"):
        GroupRule("mamba")
    with pytest.raises(ValueError, match="at least one block"):
        GroupRule(WINDOW, 0)


def test_a_window_group_keeps_the_window_before_each_step_end_and_checkpoint():
    w = GroupRule(WINDOW, 2)
    assert w.keep(0, 40, [40], every=16) == [14, 15, 30, 31, 38, 39]
    assert w.keep(40, 41, [41], every=16) == [40]                      # a decode step: the new block only
    assert w.keep(0, 40, [40], every=0) == [38, 39]                    # request ends only
    assert GroupRule(FULL).keep(3, 7, [7]) == [3, 4, 5, 6]


def brute_force(rules: list[GroupRule], full_prefix: int, held: list[list[bool] | None], align: int) -> int:
    for end in range(full_prefix, 0, -1):
        if end % align:
            continue
        if all(r.kind == FULL or all(h[p] for p in r.needed(end)) for r, h in zip(rules, held)):  # type: ignore[index]
            return end
    return 0


def test_usable_end_is_the_longest_end_every_group_restores():
    rng = random.Random(35)
    kinds = [GroupRule(FULL), GroupRule(WINDOW, 1), GroupRule(WINDOW, 3), GroupRule(STATE)]
    for _, combo, align in itertools.product(range(60), itertools.combinations(kinds, 2), (1, 2)):
        rules = [GroupRule(FULL), *combo]
        n = rng.randrange(0, 24)
        held = [None if r.kind == FULL else [rng.random() < 0.7 for _ in range(n)] for r in rules]
        assert usable_end(rules, n, held, align) == brute_force(rules, n, held, align)


def test_a_missing_state_is_never_a_hit():
    rules = [GroupRule(FULL), GroupRule(STATE)]
    assert usable_end(rules, 10, [None, [False] * 10]) == 0
    assert usable_end(rules, 10, [None, [i == 3 for i in range(10)]]) == 4


def test_a_mask_shorter_than_the_prefix_is_refused():
    with pytest.raises(ValueError, match="held mask covers 2 of 5"):
        usable_end([GroupRule(FULL), GroupRule(STATE)], 5, [None, [True, True]])
