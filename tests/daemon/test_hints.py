"""Hints (issue 14, parts 1 and 8) against a live daemon: every kind of hint changes the daemon's books (seen in
`workflows` and the stats); meaningless ones are answered ok, counted and ignored, malformed ones are bad_request;
workflows are per tenant; idle and surplus workflows retire; a request's context rides on get, put and lookup; the
stats carry the hit rate per tier and the hit-rate ceiling (a HyperLogLog over the keys looked up)."""
from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from kvstore.client import Client, Context, KVStoreError
from kvstore.client.aio import AsyncClient
from tests.conftest import GEOM, DaemonProc, block, hashes, spec, ssd_daemon, ssd_settled

NOT_ME = 4242 if os.getuid() != 4242 else 4343      # an admin uid that is not the test's


def rows(c: Client) -> dict[str, dict]:
    return {w["workflow"]: w for w in c.workflows()}


def books(c: Client) -> dict:
    return c.stats()["workflows"]


def test_every_kind_of_hint_changes_the_books(daemon):
    with daemon.client() as c:
        w = c.workflow("w1", type="codegen")
        assert w.begin() == {"workflow": "w1", "active": True, "steps": 0}
        assert rows(c)["w1"]["type"] == "codegen" and rows(c)["w1"]["agent"] == ""
        r = w.call("coder", step=1, next=["tester"], priority=2)            # a call: one step more
        assert r == {"workflow": "w1", "active": True, "steps": 1}
        assert w.call("tester", priority="high")["steps"] == 2
        row = rows(c)["w1"]
        assert (row["agent"], row["steps"], row["next"], row["priority"]) == ("tester", 2, [], 2)
        # a call of a workflow nobody began begins it, of the type the call names
        assert c.workflow("w2", type="chain").call("a") == {"workflow": "w2", "active": True, "steps": 1}
        assert rows(c)["w2"]["type"] == "chain"
        s = c.session("chat-9")                                             # a chat session and its turns
        assert s.begin()["active"] and s.turn()["steps"] == 1 and s.turn()["steps"] == 2
        assert rows(c)["session:chat-9"]["type"] == "session"
        b = books(c)
        assert b["active"] == 3 and b["hints"] == {"begin": 1, "call": 5, "session_begin": 1}
        assert w.end() == {"workflow": "w1", "active": False, "steps": 0}   # ends: retired
        assert s.end()["active"] is False
        assert set(rows(c)) == {"w2"}
        b = books(c)
        assert (b["active"], b["retired"], b["retired_by"]["ended"]) == (1, 2, 2)
        assert b["ignored"] == {}
        assert b["accuracy"]["top1_1"] is not None                          # calls were scored: w1 coder→tester
        with c.workflow("w3", type="chain") as w3:                          # a context manager begins and ends
            assert rows(c)["w3"]["steps"] == 0
            w3.call("a")
        assert "w3" not in rows(c) and books(c)["retired_by"]["ended"] == 3


def test_meaningless_hints_are_counted_and_answered_ok(daemon):
    with daemon.client() as c:
        ns = c.namespace(spec())
        assert c.workflow("nobody").end()["ignored"] == "unknown_workflow"   # the end of a workflow never begun
        w = c.workflow("w1")
        w.call("a")
        w.end()
        assert w.end()["ignored"] == "ended"                                # a second end
        assert w.call("b") == {"workflow": "w1", "active": False, "steps": 0, "ignored": "ended"}   # late call
        assert c.hint("pause", workflow="w1")["ignored"] == "unknown_kind"  # a kind this daemon does not know
        r = c.workflow("w4").call("a", priority="urgent")                   # an unknown priority: the rest applies
        assert r["ignored"] == "priority" and r["active"] and rows(c)["w4"]["priority"] is None
        assert ns.lookup(hashes(2), context=("never-begun", "a")) == 0      # a context naming no active workflow
        assert ns.lookup(hashes(2), context=("w1", "a")) == 0               # ... or an ended one
        assert books(c)["ignored"] == {"unknown_workflow": 1, "ended": 2, "unknown_kind": 1, "priority": 1,
                                       "unknown_context": 1, "ended_context": 1}
        assert w.begin()["active"]                                          # a begin opens an ended id again
        assert w.call("b")["steps"] == 1
        assert c.stats()["errors"] == {}


@pytest.mark.parametrize("fields, fragment", [
    ({"workflow": 7}, "'workflow' must be a string"),
    ({"workflow": "é" * 129}, "at most 256 bytes"),                       # 258 bytes of UTF-8
    ({"workflow": "w", "next": [f"a{i}" for i in range(17)]}, "at most 16"),
    ({"workflow": "w", "next": "tester"}, "'next' must be a list"),
    ({"workflow": "w", "step": -1}, "'step' must be a non-negative integer"),
    ({"workflow": "w", "priority": 1.5}, "'priority' must be"),
    ({"workflow": "w", "session": "s"}, "exactly one of 'workflow' and 'session' (both given)"),
    ({}, "exactly one of 'workflow' and 'session' (neither given)"),
    ({"workflow": ""}, "must not be empty"),
    ({"workflow": "w", "color": "red"}, "unknown fields color"),
])
def test_malformed_hints_are_bad_requests(daemon, fields, fragment):
    with daemon.client() as c:
        with pytest.raises(KVStoreError) as e:
            c.hint("call", **fields)
        assert e.value.code == "bad_request" and fragment in e.value.message, e.value
        assert c.workflow("w").call(123)["ignored"].startswith("bad_request")   # a handle never raises
        assert c.ping()["pong"] and books(c)["active"] == 0                  # the connection serves on


def test_a_context_of_the_wrong_type_is_a_bad_request_and_the_session_kinds_need_a_session(daemon):
    with daemon.client() as c:
        ns = c.namespace(spec())
        with pytest.raises(KVStoreError) as e:
            c.call("lookup", ns=ns.id, keys=b"".join(hashes(1)), wf=["w"])
        assert e.value.code == "bad_request" and "'wf' must be a string" in e.value.message
        with pytest.raises(KVStoreError) as e:
            c.hint("session_begin", workflow="w")
        assert e.value.code == "bad_request" and "needs field 'session'" in e.value.message


def test_context_rides_on_put_get_lookup_and_acquire(daemon):
    with daemon.client() as c:
        ns = c.namespace(spec())
        w = c.workflow("w1", type="chain")
        w.call("writer")
        hs, blocks = hashes(40), [block(i) for i in range(40)]
        ctx = w.context("writer")
        assert ctx == Context("w1", "writer")
        assert ns.put(hs, blocks, batch=16, context=ctx).stored == 40      # reserve + pipelined commits
        assert ns.lookup(hs, context=("w1", "reader")) == 40
        outs = [bytearray(GEOM.full_bytes) for _ in range(40)]
        assert ns.get(hs, outs, context=ctx) == 40 and [bytes(o) for o in outs] == blocks
        with ns.acquire(hs[:4], context=ctx) as lease:
            assert len(lease) == 4
        with ns.reserve(hashes(2, start=100), context=ctx) as r:           # a reservation's commit carries it
            r.write_blocks([block(100), block(101)])
            assert r.commit() == 2
        s = c.session("chat")
        s.turn()
        assert ns.lookup(hs, context=s.context()) == 40
        st = c.stats()
        assert st["errors"] == {} and st["workflows"]["ignored"] == {}     # every context named an active workflow
        assert st["counters"]["puts"] == 42


def test_workflows_are_per_tenant(tmp_path: Path, daemons: list[DaemonProc]):
    """Two tenants' "w1" are two workflows; neither can end or see the other's (the admin role sees every
    tenant's, as with `list`: here no client has it)."""
    conf = tmp_path / "kvstore.yaml"
    conf.write_text(yaml.safe_dump({"tenants": [{"name": "a", "secret": "sa"}, {"name": "b", "secret": "sb"}]}))
    d = DaemonProc(env={"KVSTORE_CONFIG": str(conf), "KVSTORE_SERVER_ADMIN_UIDS": f"[{NOT_ME}]"}).start()
    daemons.append(d)
    with d.client(tenant="a", secret="sa") as a, d.client(tenant="b", secret="sb") as b:
        a.workflow("w1", type="codegen").call("coder")
        assert b.workflow("w1").end()["ignored"] == "unknown_workflow"     # b cannot end a's workflow
        assert rows(a)["w1"]["steps"] == 1 and rows(b) == {}
        assert b.workflow("w1").call("x")["steps"] == 1                     # b's own "w1": another workflow
        assert rows(a)["w1"]["agent"] == "coder" and rows(b)["w1"]["agent"] == "x"
        assert [w["tenant"] for w in a.workflows()] == ["a"]
        ns = a.namespace(spec())
        ns.lookup(hashes(1), context=("w1", "coder"))                       # a's context names a's w1
        assert books(a)["ignored"] == {"unknown_workflow": 1} and books(a)["active"] == 2
        assert a.workflow("w1").end()["active"] is False
        assert rows(b)["w1"]["steps"] == 1 and books(b)["active"] == 1


def test_idle_workflows_retire_and_begin_again_at_their_next_call(start_daemon):
    d = start_daemon(env={"KVSTORE_HINTS_IDLE_S": "0.3"})
    with d.client() as c:
        c.workflow("w1").call("a")
        c.session("s1").begin()
        deadline = time.monotonic() + 20
        while books(c)["active"] and time.monotonic() < deadline:           # the server's sweep retires them
            time.sleep(0.05)
        b = books(c)
        assert (b["active"], b["retired_by"]) == (0, {"ended": 0, "idle": 2, "over_max": 0})
        assert rows(c) == {}
        assert c.workflow("w1").call("b") == {"workflow": "w1", "active": True, "steps": 1}   # not an end


def test_beyond_max_workflows_the_least_recently_active_retires(start_daemon):
    d = start_daemon(env={"KVSTORE_HINTS_MAX_WORKFLOWS": "2"})
    with d.client() as c:
        ns = c.namespace(spec())
        c.workflow("w1").begin()
        c.workflow("w2").begin()
        ns.lookup(hashes(1), context=("w1", ""))                            # a request keeps w1 active
        c.workflow("w3").begin()                                            # one too many: w2 goes
        assert set(rows(c)) == {"w1", "w3"}
        assert books(c)["retired_by"]["over_max"] == 1


def test_the_asyncio_client_sends_hints_and_contexts(daemon):
    async def scenario() -> tuple[dict, list[bytes]]:
        async with AsyncClient(daemon.socket) as ac:
            ns = await ac.namespace(spec())
            hs = hashes(8)
            async with ac.workflow("aw", type="pipeline") as w:
                assert (await w.call("extract", step=1, next=["summarize"]))["steps"] == 1
                assert (await ac.workflows())[0]["workflow"] == "aw"
                assert (await ns.put(hs, [block(i) for i in range(8)], context=w.context("extract"))).stored == 8
                outs = [bytearray(GEOM.full_bytes) for _ in range(8)]
                assert await ns.get(hs, outs, context=w.context("summarize")) == 8
                assert await ns.lookup(hs, context=("aw", "x")) == 8
            s = ac.session("chat")
            assert (await s.begin())["active"] and (await s.turn())["steps"] == 1
            assert (await s.end())["active"] is False
            assert (await ac.hint("end", workflow="aw"))["ignored"] == "ended"
            return await ac.stats(), [bytes(o) for o in outs]

    stats, got = asyncio.run(scenario())
    assert got == [block(i) for i in range(8)]
    w = stats["workflows"]
    assert (w["active"], w["retired_by"]["ended"], w["ignored"]) == (0, 2, {"ended": 1})


def kvstore(sock: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvstore", "--socket", sock, *args], capture_output=True, text=True,
                          timeout=60, env=dict(os.environ))


def test_the_cli_sends_hints_and_lists_workflows(daemon):
    r = kvstore(daemon.socket, "hint", "begin", "w1", "--type", "codegen", "--json")
    assert r.returncode == 0 and json.loads(r.stdout) == {"workflow": "w1", "active": True, "steps": 0}, r
    r = kvstore(daemon.socket, "hint", "call", "w1", "--agent", "coder", "--step", "1", "--next", "tester", "fixer",
                "--priority", "high")
    assert r.returncode == 0 and r.stdout.strip() == "w1: active, 1 step(s)", r
    kvstore(daemon.socket, "hint", "call", "chat-1", "--session")
    r = kvstore(daemon.socket, "workflows", "--json")
    got = {w["workflow"]: w for w in json.loads(r.stdout)}
    assert got["w1"]["type"] == "codegen" and got["w1"]["next"] == ["tester", "fixer"] and got["w1"]["priority"] == 2
    assert got["session:chat-1"]["type"] == "session"
    table = kvstore(daemon.socket, "workflows").stdout
    assert table.splitlines()[0].split() == ["workflow", "type", "last", "agent", "steps", "idle", "priority", "next"]
    assert any(line.split()[:4] == ["w1", "codegen", "coder", "1"] for line in table.splitlines())
    assert kvstore(daemon.socket, "hint", "end", "w1").returncode == 0
    r = kvstore(daemon.socket, "hint", "end", "w1")                          # ignored: said, exit 0
    assert r.returncode == 0 and r.stdout.strip() == "w1: not active, 0 step(s) — ignored: ended", r
    r = kvstore(daemon.socket, "hint", "call", "x" * 300)                    # malformed: refused, exit 1
    assert r.returncode == 1 and "at most 256 bytes" in r.stderr, r
    text = kvstore(daemon.socket, "stats").stdout
    assert "workflows: 1 active, 1 retired (ended 1, idle 0, over_max 0); hints ignored: ended 1" in text, text
    assert "hit-rate ceiling: -" in text and "lookup hit rate: host -" in text


def test_hit_rate_ceiling_is_estimated_within_a_few_percent(daemon):
    """100 k keys looked up, 20 k of them distinct (each looked up 5 times): the ceiling is 1 - 20 k / 100 k = 0.8."""
    distinct, per_lookup = 20_000, 1000
    hs = hashes(distinct, tag=b"ceiling")
    with daemon.client() as c:
        ns = c.namespace(spec())
        for i in range(100):
            start = i * per_lookup % distinct
            assert ns.lookup(hs[start:start + per_lookup]) == 0
        ceiling = c.stats()["workflows"]["ceiling"]
    assert ceiling["looked_up"] == 100 * per_lookup
    assert abs(ceiling["distinct"] / distinct - 1) < 0.03, ceiling
    assert abs(ceiling["hit_rate"] - 0.8) < 0.01, ceiling


def test_hit_rates_per_tier(daemons):
    d = ssd_daemon(daemons)
    with d.client() as c:
        ns = c.namespace(spec())
        hs = hashes(8)
        ns.put(hs[:4], [block(i) for i in range(4)])
        assert ns.lookup(hs) == 4                                           # 4 host hits, 4 misses
        c.evict(everything=True)                                            # to SSD
        ssd_settled(c)
        ns.put(hs[4:6], [block(i) for i in range(4, 6)])
        assert ns.lookup(hs) == 6                 # the prefix starts below: 6 hits of lower tiers, 2 misses
        outs = [bytearray(GEOM.full_bytes) for _ in range(8)]
        assert ns.get(hs, outs) == 6              # 4 promoted, then 2 from the host pool, 2 missed
        s = c.stats()
    cnt = s["counters"]
    assert (cnt["hits_host"], cnt["hits_lower"], cnt["misses"]) == (4, 6, 6)
    assert (cnt["acquired_asked"], cnt["acquired_host"], cnt["acquired_lower"]) == (8, 2, 4)
    assert s["hit_rates"]["acquire"] == {"host": 0.25, "lower": 0.5, "miss": 0.25}
    assert s["hit_rates"]["lookup"] == {"host": 0.25, "lower": 6 / 16, "miss": 6 / 16}


def test_the_context_reaches_the_workflow_policy(start_daemon):
    """With pool.eviction: workflow, blocks stored under an active workflow's context are active blocks, and
    retired when it ends (the stats' workflows.blocks, from the policy's own books)."""
    d = start_daemon(env={"KVSTORE_POOL_EVICTION": "workflow"})
    with d.client() as c:
        ns = c.namespace(spec())
        w = c.workflow("w1", type="chain")
        w.call("writer")
        ns.put(hashes(6), [block(i) for i in range(6)], context=w.context("writer"))
        ns.put(hashes(2, start=50), [block(50), block(51)])                 # no context: retired from the start
        assert books(c)["blocks"] == {"retired": 2, "active": 6}
        w.end()
        assert books(c)["blocks"] == {"retired": 8, "active": 0}


def test_prometheus_serves_the_workflow_figures(start_daemon):
    from tests.daemon.test_metrics import metered, scrape

    d, port = metered(start_daemon)
    with d.client() as c:
        ns = c.namespace(spec())
        hs = hashes(10)
        ns.put(hs[:5], [block(i) for i in range(5)])
        for _ in range(4):
            ns.lookup(hs)                                                   # 40 looked up, 10 distinct
        c.workflow("w1").call("a")
        c.workflow("w2").end()
        s = c.stats()
        m = scrape(port)
    assert m[("kvstore_workflows_active", ())] == 1
    assert m[("kvstore_hints_ignored_total", (("reason", "unknown_workflow"),))] == 1
    assert m[("kvstore_hints_total", (("kind", "call"),))] == 1
    assert m[("kvstore_hit_rate", (("op", "lookup"), ("tier", "host")))] == 0.5
    assert m[("kvstore_hit_rate_ceiling", ())] == s["workflows"]["ceiling"]["hit_rate"]
    assert abs(m[("kvstore_hit_rate_ceiling", ())] - 0.75) < 0.01
