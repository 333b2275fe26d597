"""The engines' hints (connectors/hints.py): what a request's parameters say about its workflow, agent and session,
checked against the daemon's limits so that a hint can never get a request refused, and sent to a real daemon."""
from __future__ import annotations

import logging

import pytest

from kvstore.connectors.hints import RequestHints, parse_hints, send_end, send_start

log = logging.getLogger("tests.hints")

FULL = {"workflow": "w1", "workflow_type": "codegen", "agent": "coder", "step": 3, "next": ["tester"],
        "workflow_end": True, "session": "chat-9", "session_end": True, "priority": 2}


def test_the_flat_fields_map_one_to_one():
    h = parse_hints(FULL, log)
    assert h == RequestHints(workflow="w1", wtype="codegen", agent="coder", step=3, next=("tester",), priority=2,
                             session="chat-9", workflow_end=True, session_end=True)
    assert h.context == ("w1", "coder")                          # a workflow's context wins over its session's
    assert parse_hints({"session": "chat-9"}, log).context == ("session:chat-9", "")


@pytest.mark.parametrize("params", [None, {}, {"kvstore_durable": True}, {"agent": "coder", "priority": 3},
                                    "w1", ["workflow"], {"workflow": 7}, {"workflow": ""}, {"workflow": "x" * 257}])
def test_no_workflow_and_no_session_is_no_hint(params):
    assert parse_hints(params, log) is None                       # the common case: nothing sent, nothing carried


def test_bad_fields_are_dropped_and_the_rest_applies(caplog):
    caplog.set_level(logging.DEBUG, logger="tests.hints")
    h = parse_hints({"workflow": "w1", "agent": "é" * 129, "step": -1, "next": ["a", 5, "b"], "priority": True,
                     "workflow_end": "yes", "workflow_type": None}, log)
    assert h == RequestHints(workflow="w1", next=("a", "b"))      # 258 bytes of agent, a bool for a priority: out
    assert "agent: want a non-empty string of at most 256 bytes" in caplog.text
    assert parse_hints({"workflow": "w1", "next": [f"a{i}" for i in range(17)]}, log).next == ()
    assert parse_hints({"workflow": "w1", "priority": "urgent"}, log).priority is None
    assert parse_hints({"workflow": "w1", "priority": "high"}, log).priority == "high"


def test_dynamo_agent_hints_and_context_map_onto_a_workflow():
    body = {"nvext": {"agent_hints": {"priority": 5, "osl": 1024, "speculative_prefill": True},
                      "agent_context": {"session_type_id": "deep_research", "session_id": "run-42",
                                        "trajectory_id": "run-42:researcher", "parent_trajectory_id": "run-42:plan"}}}
    h = parse_hints(body, log)
    assert h == RequestHints(workflow="run-42", wtype="deep_research", agent="researcher", priority=5)
    # the flat fields win; Dynamo's hints alone (no agent_context) name no workflow
    assert parse_hints({**body, "agent": "critic", "priority": 1}, log).agent == "critic"
    assert parse_hints({"nvext": {"agent_hints": {"priority": 5}}}, log) is None


def test_sglang_session_id_is_a_session():
    assert parse_hints({"session_id": "s-1"}, log) == RequestHints(session="s-1")


def test_hints_reach_the_daemon_and_its_refusals_never_raise(daemon):
    with daemon.client() as c:
        send_start(c, parse_hints(FULL, log), log)
        rows = {w["workflow"]: w for w in c.call("workflows")["workflows"]}
        assert rows["w1"]["type"] == "codegen" and rows["w1"]["agent"] == "coder" and rows["w1"]["steps"] == 1
        assert "session:chat-9" in rows
        send_end(c, parse_hints(FULL, log), log)
        assert c.call("workflows")["workflows"] == []
        send_end(c, parse_hints(FULL, log), log)                 # ends of what ended: ignored, counted, no raise
        assert sum(c.stats()["workflows"]["ignored"].values()) >= 2
