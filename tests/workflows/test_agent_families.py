"""The agent-trace families (bench/agent_families.py, issue 34 part 2): seeded and deterministic, prompts
prefix-shared, and hints that say only what a framework knows when it calls — the workflow, its type, the agent,
the step, the agents the family's call graph allows next — never the timing or which agent comes."""
from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                "bench"))
import agent_families as af  # noqa: E402


@pytest.mark.parametrize("family", af.FAMILIES)
def test_a_family_is_deterministic_and_hints_call_time_knowledge_only(family: str) -> None:
    one, two, other = af.trace(family, 8, seed=5), af.trace(family, 8, seed=5), af.trace(family, 8, seed=6)
    assert [(e.at, e.kind, e.workflow, e.agent, e.blocks) for e in one] == \
           [(e.at, e.kind, e.workflow, e.agent, e.blocks) for e in two]
    assert [e.blocks for e in one] != [e.blocks for e in other]
    steps: dict[str, int] = {}
    for e in one:
        h = e.hint()
        if e.kind != "call":
            assert h == {"kind": e.kind, "workflow": e.workflow, "type": family}
            continue
        steps[e.workflow] = steps.get(e.workflow, 0) + 1
        assert set(h) == {"kind", "workflow", "type", "agent", "step", "next"}      # no timing, no future
        assert h["step"] == steps[e.workflow]                                        # calls so far
        assert h["next"] == [a for a in af.GRAPH[family][e.agent] if a != af.END]    # the graph's, not the next one
        assert e.blocks and len(set(e.blocks)) == len(e.blocks)


def test_events_come_in_time_order_each_workflow_begun_before_its_calls_and_ended_after() -> None:
    for family in af.FAMILIES:
        events = af.trace(family, 6, seed=1)
        assert [e.at for e in events] == sorted(e.at for e in events)
        state: dict[str, str] = {}
        for e in events:
            assert state.get(e.workflow, "") == {"begin": "", "call": "begun", "end": "begun"}[e.kind], e
            state[e.workflow] = "ended" if e.kind == "end" else "begun"
        assert set(state.values()) == {"ended"}


def test_prompts_share_exactly_their_common_leading_pieces() -> None:
    a = af.Prompt().add("system", 3).add("doc", 2)
    b = af.Prompt().add("system", 3).add("other", 2)
    assert a.chain[:3] == b.chain[:3] and not set(a.chain[3:]) & set(b.chain)
    assert af.Prompt().add("doc", 2).chain[0] not in a.chain                 # a block's id is its whole prefix
