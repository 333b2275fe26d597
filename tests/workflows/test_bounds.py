"""The hints' books per tenant and their bounds (kvstore/workflows: books.Workflows.model, predictor.TransitionModel,
predictor.Gaps), on their own: one tenant's hints never change another's lookahead; pairs, successors and bytes stay
within their bounds; a lookahead's work is bounded; a retired workflow's pending predictions go with it."""
from __future__ import annotations

import math

from kvstore.workflows import END, Workflows
from kvstore.workflows.books import Bounds
from kvstore.workflows.predictor import OTHER, Gaps, TransitionModel, survival


def test_each_tenant_learns_from_its_own_hints() -> None:
    flows = Workflows()
    flows.call("a/mine", "coder", "codegen", tenant="a")
    for i in range(50):                               # b: codegen ends right after coder
        flows.call(f"b/{i}", "coder", "codegen", tenant="b")
        flows.end(f"b/{i}")
    flows.call("b/probe", "coder", "codegen", tenant="b")
    assert flows.alive("b/probe") == [0.0, 0.0, 0.0]
    assert flows.alive("a/mine") == [1.0, 1.0, 1.0]
    assert flows.value("a/mine") > flows.value("b/probe") == 0.0
    assert set(flows.models) == {"a", "b"}


def test_successors_beyond_the_cap_are_pooled_and_the_end_is_kept() -> None:
    m = TransitionModel(max_successors=4)
    for i in range(100):
        m.observe("t", "router", f"tool-{i}")
    m.observe("t", "router", END)
    m.observe("t", "router", "tool-99")               # a repeat: counted, nothing pooled
    c = m.counts[("t", "router")]
    assert len([a for a in c if a not in (END, OTHER)]) == 4 and c[END] == 1 and c[OTHER] == 96
    assert sum(c.values()) == 102                     # no transition lost: pooled, not dropped
    assert m.stats()["pooled"] == 2 * 96              # (t, router) and the type-agnostic (ANY, router)
    assert math.isclose(m.next_of("t", "router")[END], 1 / 102)


def test_a_lookahead_keeps_the_likeliest_agents_and_all_the_mass() -> None:
    m = TransitionModel(max_successors=3)
    for i in range(10):                               # router → tool-i (i+1 times each), tool-i → END
        for _ in range(i + 1):
            m.observe("t", "router", f"tool-{i}")
        m.observe("t", f"tool-{i}", END)
    ahead = m.lookahead("t", "router", 3)
    assert {a for a in ahead[0] if a not in (END, OTHER)} <= {"tool-9", "tool-8", "tool-7", "tool-6"}
    for step in ahead:
        assert math.isclose(math.fsum(step.values()), 1.0)
        assert len([a for a in step if a not in (END, OTHER)]) <= 3
    assert survival(ahead)[1] < 1.0                   # the kept tools' ends are learned
    assert 0 < m.max_expansions <= 3 * (3 + 2) ** 2


def test_pairs_and_bytes_stay_bounded() -> None:
    m = TransitionModel(max_keys=64, max_bytes=64 << 10)
    for i in range(5000):
        m.observe(f"type-{i}-" + "x" * 200, "coder", "tester-" + "y" * 200)
    assert len(m.counts) <= 64 and m.bytes <= 64 << 10 and m.stats()["forgotten"] > 0
    gaps = Gaps(max_keys=4096, max_bytes=64 << 10)
    for i in range(5000):
        gaps.observe(f"type-{i}", "coder", 1.0)
    assert gaps.bytes() <= 64 << 10 and len(gaps) >= 2


def test_a_retired_workflow_leaves_no_pending_prediction() -> None:
    flows = Workflows(bounds=Bounds(max_keys=16, max_successors=2, max_bytes=64 << 10))
    for i in range(1000):
        flows.call(f"w{i}", "coder", f"t{i}", tenant="b")
        flows.call(f"w{i}", "tester", f"t{i}", tenant="b")
        if i % 2:
            flows.end(f"w{i}")
        else:
            flows.retire(f"w{i}")
    s = flows.footprint()
    assert (s["active"], s["pending"]) == (0, 0)
    assert s["keys"] <= 16 and s["bytes"] <= 2 * (64 << 10)
