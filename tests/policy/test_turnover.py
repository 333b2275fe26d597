"""The workflow policy's horizon (kvstore.policy.turnover) and the hit density it prices a workflow by
(kvstore.workflows.predictor.Gaps.density): a workflow likely back within the time the pool keeps a block outranks
one surely back later, and a pool that keeps blocks longer orders them by the expected wait, as before."""
from __future__ import annotations

import pytest

from kvstore.policy.turnover import MIN_STORES, REACH, Turnover
from kvstore.workflows.predictor import Gaps


def test_the_horizon_is_the_pools_turnover_measured_from_its_stores() -> None:
    now = [0.0]
    t = Turnover(lambda: now[0])
    for _ in range(MIN_STORES - 1):
        now[0] += 0.5
        t.stored(100)
    assert t.horizon() is None                              # too few stores to say
    now[0] += 0.5
    t.stored(100)
    assert t.horizon() == pytest.approx(REACH * 100 * 0.5)  # 100 blocks, one new every half second
    frozen = Turnover(lambda: 7.0)
    for _ in range(2 * MIN_STORES):
        frozen.stored(100)
    assert frozen.horizon() is None                         # every store at one instant: no time scale


def bimodal() -> Gaps:
    """A user who replies within seconds three times in four, else comes back after minutes."""
    g = Gaps(keep=0)
    for i in range(400):
        g.observe("chat", "assistant", 200.0 if i % 4 == 3 else 5.0)
    return g


def test_a_short_horizon_prefers_the_workflow_likely_back_soon() -> None:
    g = bimodal()
    just_called = g.density("chat", "assistant", 0.5, 20.0)
    away = g.density("chat", "assistant", 150.0, 20.0)
    assert just_called is not None and away is not None
    assert just_called > 0.05 and away == 0.0              # 75% back within the horizon, against nothing in it
    # the expected residual wait says the opposite: 50 s for the one away, ~53 s for the one that just called
    assert g.residual("chat", "assistant", 150.0) < g.residual("chat", "assistant", 0.5)


def test_a_horizon_beyond_every_gap_is_the_residual_wait_order() -> None:
    g = bimodal()
    for waited in (0.5, 150.0):
        density = g.density("chat", "assistant", waited, 10_000.0)
        assert density == pytest.approx(1.0 / g.residual("chat", "assistant", waited), rel=1e-6)
    assert g.density("chat", "assistant", 150.0, 10_000.0) > g.density("chat", "assistant", 0.5, 10_000.0)
    assert Gaps().density("chat", "assistant", 1.0, 10.0) is None          # nothing learned yet


def test_in_a_pool_that_keeps_blocks_seconds_the_workflow_away_for_minutes_goes_first() -> None:
    """Two chat sessions of one type, gaps learned bimodal: one called half a second ago (three times in four back
    within 5 s), one has been away 160 s (back at 200 s, surely). A pool whose horizon is 17 s evicts the one away
    first; priced by the expected residual wait (no horizon) it would keep it (40 s against ~50 s)."""
    from kvstore.policy.workflow import WorkflowPolicy
    from kvstore.workflows import Touch, Workflows

    now = [0.0]
    flows = Workflows(clock=lambda: now[0])
    pol = WorkflowPolicy(flows)
    for i in range(40):                                  # teach the gaps: 5, 5, 5, 200 s ...
        flows.call("teach", "assistant", "chat")
        now[0] += 200.0 if i % 4 == 3 else 5.0
    flows.end("teach")
    flows.call("away", "assistant", "chat")
    pol.added((1).to_bytes(4, "big"), 0, Touch("away", "assistant"))
    now[0] += 159.5
    flows.call("back", "assistant", "chat")
    pol.added((2).to_bytes(4, "big"), 0, Touch("back", "assistant"))
    now[0] += 0.5
    assert flows.value("away") > flows.value("back")            # the residual-wait order
    assert flows.value("away", 17.0) < flows.value("back", 17.0)  # the hit density within the horizon
    turnover = pol.turnover                                      # as if 17 s: 17 / REACH blocks, one a second
    turnover.stores, turnover.held, turnover.gap = MIN_STORES, int(17 / REACH), 1.0
    assert turnover.horizon() == pytest.approx(17.0, abs=1.0)
    assert pol.victim(0) == (1).to_bytes(4, "big")
    turnover.stores = 0                                          # no horizon yet: the residual-wait order
    assert pol.victim(0) == (2).to_bytes(4, "big")
