"""`kvstore ls --ns N --tags` (issue 14 part 8): under pool.eviction: workflow, each listed block's standing
(active, retired, pinned), the workflows that touched it (their own ids, the tenant's only) and their agents."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from kvstore.client import KVStoreError
from kvstore.protocol.geometry import Geometry
from tests.conftest import DaemonProc, block, hashes, spec
from tests.daemon.test_cli import kvstore

WORKFLOW = {"KVSTORE_POOL_EVICTION": "workflow"}
NOT_ME = 4242424                          # an admin uid that is not this test's: no client here is the admin


def tags_of(c, ns, limit: int = 100) -> dict[bytes, dict]:
    data = c.list(ns.id, limit, tags=True)
    return {k: t for (k, _), t in zip(data["keys"], data["tags"])}


def test_a_blocks_tags_follow_its_workflows(start_daemon):
    d = start_daemon(env=WORKFLOW)
    with d.client() as c:
        ns = c.namespace(spec())
        w = c.workflow("review-7", type="codegen")
        w.call("coder")
        hs = hashes(3)
        ns.put(hs, [block(i) for i in range(3)], context=w.context("coder"))
        w.call("tester")
        ns.get(hs[:1], [bytearray(len(block(0)))], context=w.context("tester"))
        tags = tags_of(c, ns)
        assert tags[hs[0]] == {"standing": "active", "touched": 1, "workflows": {"review-7": ["coder", "tester"]},
                               "done": []}
        assert tags[hs[2]]["workflows"] == {"review-7": ["coder"]}
        out = json.loads(kvstore("ls", "--ns", str(ns.id), "--tags", "--json", sock=d.socket).stdout)
        assert out["tags"][0]["standing"] == "active"
        text = kvstore("ls", "--ns", str(ns.id), "--tags", sock=d.socket).stdout
        assert "review-7 (coder/tester)" in text
        w.end()
        assert {t["standing"] for t in tags_of(c, ns).values()} == {"retired"}
        assert all(t["workflows"] == {} and t["touched"] == 1 for t in tags_of(c, ns).values())


def test_under_lru_there_are_no_tags(start_daemon):
    d = start_daemon()
    with d.client() as c:
        ns = c.namespace(spec())
        ns.put(hashes(2), [block(0), block(1)])
        assert c.list(ns.id, 10, tags=True)["tags"] == [None, None]
        assert "tags" not in c.list(ns.id, 10)


def test_a_tenant_sees_only_its_own_workflow_names(tmp_path: Path, daemons: list[DaemonProc]):
    """With tenants, a's block lists a's workflow by its own id (not the books' tenant-scoped one), and b cannot
    list a's namespace, tags or not."""
    conf = tmp_path / "kvstore.yaml"
    conf.write_text(yaml.safe_dump({"tenants": [{"name": "a", "secret": "sa"}, {"name": "b", "secret": "sb"}]}))
    d = DaemonProc(env={"KVSTORE_CONFIG": str(conf), "KVSTORE_SERVER_ADMIN_UIDS": f"[{NOT_ME}]",
                        **WORKFLOW}).start()
    daemons.append(d)
    with d.client(tenant="a", secret="sa") as a, d.client(tenant="b", secret="sb") as b:
        ns = a.namespace(spec())
        w = a.workflow("secret-plan")
        w.call("x")
        ns.put(hashes(1), [block(0)], context=w.context("x"))
        assert list(tags_of(a, ns).values())[0]["workflows"] == {"secret-plan": ["x"]}
        with pytest.raises(KVStoreError, match="did not say hello to"):
            b.list(ns.id, 10, tags=True)


def test_a_block_a_full_pool_left_out_is_known_as_shared_when_it_comes_again(start_daemon):
    """Issue 34: the pool (16 slots) is full of a chain two live workflows share; a third workflow's put is not
    admitted over it (worth two against one) and its blocks are left out — remembered as touched by it. Once the
    two have ended, a fourth workflow stores the same blocks: they enter touched by two (before: by one, as new).
    (Fewer blocks than kvstore.workflows.reuse needs to judge the type: each workflow keeps its whole value.)"""
    geom = Geometry(layers=2, tokens=16, kv_heads=8, head_dim=64, dtype="float16")       # 64 KiB blocks
    d = start_daemon(capacity="1MiB", segment="1MiB", env={**WORKFLOW, "KVSTORE_SERVER_MAX_RESERVED_FRACTION": "1"})
    with d.client() as c:
        ns = c.namespace(spec(geometry=geom))
        assert geom.full_bytes == 64 << 10
        a, b, n, m = (c.workflow(w, type="t") for w in ("a", "b", "n", "m"))
        shared, mine = hashes(16, tag=b"shared"), hashes(4, tag=b"mine")
        a.call("x")
        assert ns.put(shared, [block(i, 64 << 10) for i in range(16)], context=a.context("x")).stored == 16
        b.call("x")
        assert ns.get(shared, [bytearray(64 << 10) for _ in shared], context=b.context("x")) == 16
        n.call("x")
        r = ns.put(mine, [block(i, 64 << 10) for i in range(4)], context=n.context("x"))
        assert (r.stored, r.no_space) == (0, 4) and c.stats()["counters"]["not_admitted"] >= 1
        a.end()
        b.end()
        m.call("x")
        assert ns.put(mine, [block(i, 64 << 10) for i in range(4)], context=m.context("x")).stored == 4
        tags = tags_of(c, ns)
        assert [tags[h]["touched"] for h in mine] == [2] * 4
        assert [tags[h]["workflows"] for h in mine] == [{"m": ["x"]}] * 4


def test_the_blocks_a_workflow_is_done_with_are_listed_as_done(start_daemon):
    """Issue 34 (kvstore.workflows.rereads): after forty map-reduce workers whose check rereads their read's chain
    and stores one block more, none read again, a live worker's read is not done with (its check reads it) and,
    once checked, all of its chain is — learned through the daemon, from the gets' keys with their context."""
    d = start_daemon(env=WORKFLOW)
    with d.client() as c:
        ns = c.namespace(spec())
        out = [bytearray(len(block(0))) for _ in range(3)]

        def call(w, chain: list[bytes]) -> None:
            w.call("worker")
            n = ns.get(chain, out[:len(chain)], context=w.context("worker"))
            ns.put(chain[n:], [block(i) for i in range(n, len(chain))], context=w.context("worker"))

        for i in range(40):
            w = c.workflow(f"old{i}", type="mapreduce")
            call(w, hashes(2, 100 * (i + 1)))                      # the read
            call(w, hashes(3, 100 * (i + 1)))                      # the check: the read's chain, then one more
            w.end()
        live = c.workflow("live", type="mapreduce")
        call(live, hashes(2))
        assert tags_of(c, ns, 1000)[hashes(2)[1]]["done"] == []    # the read's: its check will read it
        call(live, hashes(3))
        tags = tags_of(c, ns, 1000)
        assert [tags[h]["done"] for h in hashes(3)] == [["live"]] * 3
        text = kvstore("ls", "--ns", str(ns.id), "--tags", "--limit", "1000", sock=d.socket).stdout
        assert "live (worker, done)" in text
