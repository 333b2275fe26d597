"""Issue 29, part 3: a tenant's hints cannot steer another tenant's eviction, retire its workflows, or grow the
daemon's hint state without bound — against a live daemon, two tenants with secrets, real clients. Each test is an
attack that succeeded before the workflow state was per tenant; none asserts a time."""
from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvstore.client import Client
from tests.conftest import DaemonProc, block, hashes, spec

Tenants = Callable[..., DaemonProc]
NOT_ME = 4242 if os.getuid() != 4242 else 4343      # the admin: not the test's user, so each tenant sees its own


@pytest.fixture
def two_tenants(tmp_path: Path, daemons: list[DaemonProc]) -> Tenants:
    """A daemon serving tenants a and b (each with its secret, neither the admin), with the hints settings given."""
    def start(capacity: str = "16MiB", env: dict[str, str] | None = None, **hints: Any) -> DaemonProc:
        conf = tmp_path / "kvstore.yaml"
        conf.write_text(yaml.safe_dump({"tenants": [{"name": "a", "secret": "secret-a"},
                                                    {"name": "b", "secret": "secret-b"}]}))
        env = {"KVSTORE_CONFIG": str(conf), "KVSTORE_SERVER_ADMIN_UIDS": f"[{NOT_ME}]", **(env or {}),
               **{f"KVSTORE_HINTS_{k.upper()}": str(v) for k, v in hints.items()}}
        d = DaemonProc(capacity, env=env)
        daemons.append(d)
        return d.start()
    return start


def a_and_b(d: DaemonProc) -> tuple[Client, Client]:
    return d.client(tenant="a", secret="secret-a"), d.client(tenant="b", secret="secret-b")


def rows(c: Client) -> dict[str, dict[str, Any]]:
    return {w["workflow"]: w for w in c.workflows(limit=10000)}


def state(c: Client) -> dict[str, int]:
    return c.stats()["workflows"]["state"]


def test_a_neighbours_workflows_do_not_change_my_lookahead(two_tenants: Tenants) -> None:
    """(a) 50 of b's `codegen` workflows end right after `coder`: b's model learns it, a's does not — a's own
    codegen workflow that just called its coder is still expected to go on (so its blocks are not the first to go)."""
    d = two_tenants()
    a, b = a_and_b(d)
    with a, b:
        a.workflow("mine", type="codegen").call("coder")
        assert rows(a)["mine"]["alive"] == [1.0, 1.0, 1.0]          # nothing learned yet: it goes on
        for i in range(50):                                         # b: coder, then the end, 50 times
            w = b.workflow(f"short-{i}", type="codegen")
            w.call("coder")
            w.end()
        b.workflow("probe", type="codegen").call("coder")
        assert rows(b)["probe"]["alive"] == [0.0, 0.0, 0.0]         # b's own model: coder is the last agent
        assert rows(a)["mine"]["alive"] == [1.0, 1.0, 1.0]          # a's lookahead: unchanged
        a.workflow("other", type="codegen").call("coder")           # and a's next codegen workflow too
        assert rows(a)["other"]["alive"] == [1.0, 1.0, 1.0]


def test_a_neighbours_workflows_do_not_choose_which_of_my_blocks_go(two_tenants: Tenants) -> None:
    """(a) The same attack seen in the eviction order (pool.eviction: workflow, 256 slots): a's `review` workflows
    have ended after `reader` half the time, so a's `other` (at reader) is worth less than a's `mine` (codegen, at
    coder, never seen to end). b's 50 codegen workflows ending after coder must not make `mine` the cheaper one."""
    d = two_tenants(capacity="2MiB", env={"KVSTORE_POOL_EVICTION": "workflow"})
    a, b = a_and_b(d)
    with a, b:
        ns = a.namespace(spec())
        with a.workflow("r1", type="review") as r1:                 # a learns: reader ends a review half the time
            r1.call("reader")
        with a.workflow("r2", type="review") as r2:
            r2.call("reader")
            r2.call("writer")
        other, mine = a.workflow("other", type="review"), a.workflow("mine", type="codegen")
        other.call("reader")
        mine.call("coder")
        h_other, h_mine = hashes(128, tag=b"other"), hashes(128, tag=b"mine")
        ns.put(h_other, [block(i) for i in range(128)], context=other.context("reader"))
        ns.put(h_mine, [block(i) for i in range(128)], context=mine.context("coder"))    # the pool is full
        for i in range(50):                                         # b: codegen ends right after coder
            w = b.workflow(f"short-{i}", type="codegen")
            w.call("coder")
            w.end()
        third = a.workflow("third", type="fresh")
        third.call("x")
        ns.put(hashes(64, tag=b"third"), [block(i) for i in range(64)], context=third.context("x"))   # 64 go
        assert ns.lookup(h_mine) == 128                             # a's most valuable workflow kept every block
        assert ns.lookup(h_other) == 64                             # the cheaper one's tail went


def test_a_neighbours_hint_flood_does_not_retire_my_workflows(two_tenants: Tenants) -> None:
    """(b) With hints.max_workflows 20, b begins 200 distinct workflows: the surplus is retired from b, the tenant
    holding the most, never from a's 5 live ones."""
    d = two_tenants(max_workflows=20)
    a, b = a_and_b(d)
    with a, b:
        for i in range(5):
            a.workflow(f"live-{i}", type="codegen").call("planner")
        for i in range(200):
            b.workflow(f"flood-{i}").begin()
        assert sorted(rows(a)) == [f"live-{i}" for i in range(5)]   # every one of a's still active
        assert all(r["steps"] == 1 for r in rows(a).values())
        assert sorted(rows(b)) == [f"flood-{i}" for i in range(185, 200)]   # b keeps its 15 most recent
        assert a.stats()["workflows"]["retired_by"]["over_max"] == 185
        a.workflow("live-5").begin()                                # a may still grow to its share: b's oldest goes
        assert len(rows(a)) == 6 and len(rows(b)) == 14


def test_the_hint_state_stays_bounded(two_tenants: Tenants) -> None:
    """(c) 10 × max_workflows distinct workflow ids, each of its own type (new transition pairs every time), called
    twice: the active workflows, the pending predictions, the ended ids, the model's pairs and its bytes estimate
    stay within their bounds; a retired workflow's pending predictions are dropped with it."""
    max_workflows, keys, model_bytes = 40, 64, 64 << 10
    d = two_tenants(max_workflows=max_workflows, model_keys=keys, model_bytes="64KiB")
    a, b = a_and_b(d)
    with a, b:
        for i in range(10 * max_workflows):
            w = b.workflow(f"id-{i}", type=f"type-{i}-" + "x" * 200)   # long names: the bytes bound must hold
            w.call("coder")
            w.call("tester-" + "y" * 200)
            if i % 2:
                w.end()
        s = state(a)
        assert s["active"] <= max_workflows and s["pending"] <= s["active"], s
        assert s["ended"] <= max_workflows, s
        assert s["models"] == 1 and s["keys"] <= keys and s["forgotten"] > 0, s
        assert s["bytes"] <= 2 * model_bytes + model_bytes // 8, s  # the counts', the gaps', the self-reuse books'
        for name in rows(b):                                         # every workflow ends: nothing pending
            b.workflow(name).end()
        s = state(a)
        assert (s["active"], s["pending"]) == (0, 0), s


def test_a_huge_fan_out_costs_a_bounded_lookahead(two_tenants: Tenants) -> None:
    """(d) b's `fan` workflows follow `router` with 10 000 distinct agents: the model names at most
    hints.model_successors of them (the rest pooled: counted), and no lookahead expands more than
    K · (model_successors + 2)² successor pairs, however many successors were seen."""
    successors, cap, horizon = 10_000, 8, 3
    d = two_tenants(model_successors=cap, max_workflows=100)
    a, b = a_and_b(d)
    with a, b:
        for i in range(successors):
            w = b.workflow(f"fan-{i}", type="fan")
            w.call("router")
            w.call(f"tool-{i}")
        s = state(b)
        assert s["pooled"] >= successors - cap, s                   # beyond the cap, successors were pooled
        assert s["lookaheads"] >= successors, s                     # every call computed one ...
        assert 0 < s["max_expansions"] <= horizon * (cap + 2) ** 2, s   # ... each bounded
        assert s["successors"] <= s["keys"] * (cap + 2), s         # the books: at most cap + END + OTHER a pair


def test_the_bounds_are_settings_checked_one_message_each() -> None:
    from kvstore.daemon.config import ConfigError, load_config

    with pytest.raises(ConfigError) as e:
        load_config(env={"KVSTORE_HINTS_MODEL_KEYS": "8", "KVSTORE_HINTS_MODEL_SUCCESSORS": "0",
                         "KVSTORE_HINTS_MODEL_BYTES": "1KiB", "KVSTORE_HINTS_TENANT_WORKFLOWS": "0"})
    assert str(e.value).splitlines()[1:] == ["  hints.tenant_workflows: must be 1..10000000, got 0",
                                             "  hints.model_keys: must be 16..1048576, got 8",
                                             "  hints.model_successors: must be 1..256, got 0",
                                             "  hints.model_bytes: must be 64KiB..1GiB, got 1024"]
    assert load_config(env={"KVSTORE_HINTS_MODEL_BYTES": "8MiB"}).hints.model_bytes == 8 << 20
