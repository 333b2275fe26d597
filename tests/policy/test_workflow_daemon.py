"""The workflow policy in the daemon (pool.eviction: workflow, KVSTORE_POOL_EVICTION): hints through the real client,
evictions by the daemon's host pool. Retired blocks go first, an active workflow's blocks stay; without hints it
evicts as LRU; a re-store refreshes a prefix tail first (issue 14 part 5), under either policy."""
from __future__ import annotations

import pytest

from tests.conftest import block, hashes, spec

SLOTS = 256                     # 2 MiB of 8 KiB blocks
WORKFLOW = {"KVSTORE_POOL_EVICTION": "workflow"}


def a_then_b_ended(c, ns, check: bool = False) -> tuple[list[bytes], list[bytes], list[bytes]]:
    """Workflows A then B each store 128 blocks (2 MiB: a full share), B ends, A stores 64 more (64 evictions):
    A's, B's and A's further hashes."""
    a, b = c.workflow("A", type="chain"), c.workflow("B", type="chain")
    a.call("writer")
    b.call("writer")
    ha, hb, more = hashes(128, tag=b"A"), hashes(128, tag=b"B"), hashes(64, tag=b"A2")
    ns.put(ha, [block(i) for i in range(128)], context=a.context("writer"))
    ns.put(hb, [block(i) for i in range(128)], context=b.context("writer"))          # the pool is full
    if check:
        assert c.stats()["workflows"]["blocks"] == {"retired": 0, "active": 256}
    b.end()
    if check:
        assert c.stats()["workflows"]["blocks"] == {"retired": 128, "active": 128}
    ns.put(more, [block(i) for i in range(64)], context=a.context("writer"))
    return ha, hb, more


def test_a_retired_workflows_blocks_go_before_an_active_ones(start_daemon):
    """A's blocks are the older, but B has ended: a put of A's evicts B's, tail first (under LRU: A's own)."""
    d = start_daemon(capacity="2MiB", segment="1MiB", env=WORKFLOW)
    with d.client() as c:
        ns = c.namespace(spec())
        ha, hb, more = a_then_b_ended(c, ns, check=True)
        assert c.stats()["counters"]["evictions"] == 64
        assert ns.lookup(ha) == 128 and ns.lookup(more) == 64
        assert ns.lookup(hb) == 64                                                  # B's tail went


@pytest.mark.parametrize("policy", ["lru", "workflow"])
def test_without_hints_it_evicts_as_lru(start_daemon, policy):
    d = start_daemon(capacity="2MiB", segment="1MiB", env={"KVSTORE_POOL_EVICTION": policy})
    with d.client() as c:
        ns = c.namespace(spec())
        old, new = hashes(128, tag=b"old"), hashes(128, tag=b"new")
        ns.put(old, [block(i) for i in range(128)])
        ns.put(new, [block(i) for i in range(128)])
        assert ns.get(old[:32], [bytearray(len(block(0))) for _ in range(32)]) == 32    # old's head: recent
        ns.put(hashes(64, tag=b"more"), [block(i) for i in range(64)])
        assert ns.lookup(old) == 64                                   # old's tail went, from its end
        assert sum(ns.lookup([h]) for h in old[64:]) == 0
        assert ns.lookup(new) == 128


@pytest.mark.parametrize("policy", ["lru", "workflow"])
def test_a_re_store_refreshes_a_prefix_tail_first(start_daemon, policy):
    """Before: the blocks of each batch of a re-store were refreshed head first, so a later eviction took the
    head of the prefix's last batch (lookup 192), not its tail."""
    d = start_daemon(capacity="2MiB", segment="1MiB", env={"KVSTORE_POOL_EVICTION": policy})
    with d.client() as c:
        ns = c.namespace(spec())
        hs, other = hashes(200), hashes(56, tag=b"other")
        ns.put(hs, [block(i) for i in range(200)])
        ns.put(other, [block(i) for i in range(56)])                 # the pool is full
        assert ns.put(hs, [block(i) for i in range(200)]).stored == 0   # stored again: refreshed
        ns.put(hashes(60, tag=b"more"), [block(i) for i in range(60)])   # other's 56, then 4 of hs
        assert ns.lookup(other) == 0
        assert ns.lookup(hs) == 196


def test_a_put_does_not_evict_blocks_worth_more_than_its_own(start_daemon):
    """Belady's bypass, estimated: a prefix two active workflows use is worth more to keep than a third workflow's
    new blocks, so the third's put stores what fits in free or retired space and no more; LRU evicts the prefix.
    (Without a lower tier: there an eviction demotes instead, and the put stores everything.)"""
    for policy, kept in (("workflow", 256), ("lru", 128)):
        d = start_daemon(capacity="2MiB", segment="1MiB",
                         env={"KVSTORE_POOL_EVICTION": policy, "KVSTORE_SERVER_MAX_RESERVED_FRACTION": "1"})
        with d.client() as c:
            ns = c.namespace(spec())
            a, b, n = c.workflow("A", type="t"), c.workflow("B", type="t"), c.workflow("N", type="t")
            shared = hashes(256, tag=b"shared")
            a.call("x")
            ns.put(shared, [block(i) for i in range(256)], context=a.context("x"))       # the pool is full
            b.call("x")
            assert ns.get(shared, [bytearray(len(block(0))) for _ in range(256)], context=b.context("x")) == 256
            n.call("x")
            with ns.reserve(hashes(128, tag=b"new"), context=n.context("x")) as r:     # as a connector saves
                r.write_and_commit([block(i) for i in range(128)])
            stored = sum(s.name == "RESERVED" for s in r.status)
            assert ns.lookup(shared) == kept, policy
            assert stored == 256 - kept, policy
        d.stop()


def test_each_tenant_evicts_by_its_own_policy(tmp_path, daemons):
    """tenants[].policy: the same puts and hints from two tenants, each in its own 2 MiB (static quotas); tenant
    `wf` (workflow) evicts the ended workflow's blocks although A's are older, tenant `plain` (pool.eviction: lru)
    evicts A's, the least recently used."""
    import yaml

    from kvstore.client import Client
    from tests.conftest import DaemonProc

    conf = tmp_path / "kvstore.yaml"
    conf.write_text(yaml.safe_dump({
        "tenants": [{"name": "wf", "secret": "s-wf", "host": "2MiB", "policy": "workflow"},
                    {"name": "plain", "secret": "s-plain", "host": "2MiB"}],
        "tenancy": {"lending": False}}))
    d = DaemonProc(capacity="4MiB", segment="1MiB", env={"KVSTORE_CONFIG": str(conf),
                                                          "KVSTORE_POOL_EVICTION": "lru"}).start()
    daemons.append(d)
    kept = {}
    for tenant in ("wf", "plain"):
        with Client(d.socket, tenant=tenant, secret=f"s-{tenant}") as c:
            ns = c.namespace(spec())
            ha, hb, _ = a_then_b_ended(c, ns)                           # its quota is full, then 64 evictions
            kept[tenant] = (ns.lookup(ha), ns.lookup(hb))
            tags = c.list(ns.id, limit=1, tags=True)["tags"]
            rows = {r["tenant"]: r for r in c.tenants()["tenants"]}
            assert rows[tenant]["policy"] == ("workflow" if tenant == "wf" else "lru")
            assert (tags[0] is not None) == (tenant == "wf")         # the workflow policy's books describe it
    assert kept["wf"] == (128, 64)                                   # B's (ended) tail went
    assert kept["plain"][1] == 128 and kept["plain"][0] < 128        # A's, the older, went
