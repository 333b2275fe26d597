"""Sharing across models and adapters against a live daemon (issue 18; kvstore.index.sharing): share groups
(ICaRus) give one model another's prefix and refuse a geometry the group does not hold; base/residual pairs
(ForkKV) answer both prefixes in one request, a surviving residual is a partial hit, forks inherit base blocks by
reference and survive their parent's residuals, and eviction is decoupled unless `pool.pair_eviction: coupled`."""
from __future__ import annotations

import re

import pytest

from kvstore.client import Client, KVStoreError
from kvstore.protocol.geometry import Geometry
from tests.conftest import GEOM, DaemonProc, block, hashes, spec

RANK = 8
RES = Geometry(layers=GEOM.layers, tokens=GEOM.tokens, kv_heads=1, head_dim=RANK, dtype="float16")   # xA, r wide


def base_spec(group: str = "llama-lora") -> object:
    return spec("llama", group=group)


def res_spec(adapter: str, group: str = "llama-lora") -> object:
    return spec("llama", RES, group=group, adapter=adapter, role="residual")


def rblock(seed: int) -> bytes:
    return block(seed, RES.full_bytes)


def test_models_of_one_group_share_a_prefix_and_another_model_never_hits(daemon: DaemonProc):
    keys = hashes(6, tag=b"ctx")
    with daemon.client() as a, daemon.client() as b, daemon.client() as c:
        na = a.namespace(spec("agent-a", group="g1"))
        na.put(keys, [block(i) for i in range(6)])
        nb = b.namespace(spec("agent-b", group="g1"))
        nc = c.namespace(spec("agent-c"))                # no group: the model is its own
        assert nb.id == na.id and nc.id != na.id
        assert nb.lookup(keys) == 6 and nc.lookup(keys) == 0
        outs = [bytearray(GEOM.full_bytes) for _ in keys]
        assert nb.get(keys, outs) == 6
        assert [bytes(o) for o in outs] == [block(i) for i in range(6)]
        listed = a.list()
    g1 = next(g for g in listed["groups"] if g["group"] == "g1")
    assert g1["models"] == ["agent-a", "agent-b"] and g1["declared"] and g1["blocks"] == 6
    assert not any("agent-c" in g["models"] for g in listed["groups"] if g["group"] == "g1")
    row = next(n for n in listed["namespaces"] if n["id"] == na.id)
    assert row["models"] == ["agent-a", "agent-b"] and row["group"] == "g1"


def test_a_group_refuses_a_geometry_it_does_not_hold_and_names_both_models(daemon: DaemonProc):
    other = Geometry(layers=GEOM.layers, tokens=GEOM.tokens, kv_heads=4, head_dim=32, dtype="float16")
    with daemon.client() as a, daemon.client() as b:
        a.namespace(spec("agent-a", group="g1"))
        with pytest.raises(KVStoreError) as e:
            b.namespace(spec("agent-b", other, group="g1"))
        assert e.value.code == "wrong_geometry"
        for part in ("share group 'g1'", "'agent-a'", "'agent-b'", "4 heads", "2 heads"):
            assert part in str(e.value), (part, str(e.value))
        b.namespace(spec("agent-b", other, group="g2"))        # its own group: fine
        b.namespace(spec("agent-a", other))                     # the default group is not checked
        assert b.ping()["pong"]
    with daemon.client() as c:                                  # nobody holds g1 any more: a new geometry may
        c.namespace(spec("agent-b", other, group="g1"))


def test_a_pair_answers_both_prefixes_in_one_request_and_a_surviving_residual_is_a_partial_hit(daemon: DaemonProc):
    keys = hashes(8, tag=b"pair")
    with daemon.client() as c:
        pair = c.pair(base_spec(), res_spec("math"))
        pair.base.put(keys, [block(i) for i in range(8)])
        pair.residual.put(keys[:6], [rblock(100 + i) for i in range(6)])
        hit = pair.lookup(keys)
        assert (hit.base, hit.residual, hit.full, hit.base_only_missing) == (8, 6, 6, 0)
        assert pair.base.delete(keys[3:5]) == 2                  # the base of blocks 3, 4 is gone
        hit = pair.lookup(keys)
        assert (hit.base, hit.residual, hit.full, hit.base_only_missing) == (3, 6, 3, 3)
        bouts = [bytearray(GEOM.full_bytes) for _ in keys]
        routs = [bytearray(RES.full_bytes) for _ in keys]
        assert pair.get(keys, bouts, routs) == (3, 6)
        assert [bytes(o) for o in bouts[:3]] == [block(i) for i in range(3)]
        assert [bytes(o) for o in routs[:6]] == [rblock(100 + i) for i in range(6)]
        base, res = pair.acquire(keys)
        assert (len(base), len(res)) == (3, 6)
        base.release()
        res.release()


def test_requests_that_pair_what_is_not_a_pair_are_refused(daemon: DaemonProc):
    keys = hashes(2)
    with daemon.client() as c:
        base = c.namespace(base_spec())
        res = c.namespace(res_spec("math"))
        other = c.namespace(res_spec("math", group="other-model"))
        coarse = c.namespace(spec("llama", Geometry(layers=2, tokens=32, kv_heads=1, head_dim=RANK),
                                  group="llama-lora", adapter="x", role="residual"))
        cases = [(res, base, "has role residual; a pair's `ns` is its base"),
                 (base, base, "a pair's `residual` must have role residual"),
                 (base, other, "group and tensor-parallel place must match"),
                 (base, coarse, "the same tokens per block")]
        for b, r, says in cases:
            for op in ("lookup", "acquire", "fork"):
                with pytest.raises(KVStoreError) as e:
                    c.call(op, ns=b.id, residual=r.id, keys=b"".join(keys))
                assert e.value.code == "bad_request" and says in str(e.value), (op, str(e.value))
        with pytest.raises(KVStoreError) as e:
            c.call("acquire", ns=base.id, residual=res.id, keys=b"".join(keys), stream=True)
        assert "not streamed" in str(e.value)
        with pytest.raises(KVStoreError) as e:
            c.call("fork", ns=base.id, residual=res.id, parent=res.id, keys=b"".join(keys))
        assert "the same namespace" in str(e.value)
        with pytest.raises(KVStoreError) as e:
            c.call("lookup", ns=base.id, residual=9999, keys=b"".join(keys))
        assert e.value.code == "unknown_namespace"


def test_a_fork_inherits_the_base_by_reference_and_outlives_its_parents_residuals(daemon: DaemonProc):
    ctx = hashes(6, tag=b"ctx")
    with daemon.client() as parent_c, daemon.client() as child_c:
        parent = parent_c.pair(base_spec(), res_spec("planner"))
        parent.base.put(ctx, [block(i) for i in range(6)])
        parent.residual.put(ctx, [rblock(200 + i) for i in range(6)])
        child = child_c.pair(base_spec(), res_spec("coder"))
        assert child.base.id == parent.base.id                   # one base namespace: keyed by tokens alone
        view = child.fork(ctx, parent=child_c.namespace(res_spec("planner")))
        assert (view.base, view.host, view.residual, view.parent) == (6, 6, 0, 6)
        child.residual.put(ctx, [rblock(300 + i) for i in range(6)])       # writes only its residuals
        before = child_c.list()
        assert parent.residual.delete(ctx) == 6                  # the parent's residuals leave
        hit = child.lookup(ctx)
        assert (hit.base, hit.residual) == (6, 6)
        bouts = [bytearray(GEOM.full_bytes) for _ in ctx]
        routs = [bytearray(RES.full_bytes) for _ in ctx]
        assert child.get(ctx, bouts, routs) == (6, 6)
        assert [bytes(o) for o in routs] == [rblock(300 + i) for i in range(6)]
        assert [bytes(o) for o in bouts] == [block(i) for i in range(6)]
        listed = child_c.list()
    base_row = next(n for n in before["namespaces"] if n["id"] == parent.base.id)
    assert base_row["blocks"] == 6                               # the base was stored once, for both agents
    fork = next(f for f in listed["forks"] if f["child"] == child.residual.id)
    assert (fork["adapter"], fork["base"], fork["context_blocks"], fork["inherited"], fork["base_held"],
            fork["residual_held"]) == ("coder", parent.base.id, 6, 6, 6, 6)
    assert fork["parent"] is not None
    pair_row = next(p for p in before["pairs"] if p["base"] == parent.base.id)
    assert sorted(pair_row["adapters"]) == ["coder", "planner"]
    assert pair_row["base_bytes"] == 6 * GEOM.full_bytes
    assert pair_row["residual_bytes"] == 12 * RES.full_bytes
    assert pair_row["unified_bytes"] == 12 * GEOM.full_bytes


def test_memory_for_n_agents_is_one_base_plus_n_residuals(daemon: DaemonProc):
    ctx = hashes(10, tag=b"shared")
    n_agents = 5
    with daemon.client() as c:
        base = c.namespace(base_spec())
        base.put(ctx, [block(i) for i in range(10)])
        for k in range(n_agents):
            p = c.pair(base_spec(), res_spec(f"agent{k}"))
            p.fork(ctx)
            p.residual.put(ctx, [rblock(1000 * k + i) for i in range(10)])
        row = next(p for p in c.list()["pairs"] if p["base"] == base.id)
    held = row["base_bytes"] + row["residual_bytes"]
    assert held == 10 * GEOM.full_bytes + n_agents * 10 * RES.full_bytes
    assert row["unified_bytes"] == n_agents * 10 * GEOM.full_bytes
    # ForkKV's M = 1/N + r/n: here 1/5 + 1/8 of storing each agent's blocks whole
    assert held / row["unified_bytes"] == pytest.approx(1 / n_agents + RES.full_bytes / GEOM.full_bytes)


@pytest.mark.parametrize("mode", ["decoupled", "coupled"])
def test_base_and_residual_are_evicted_independently_unless_coupled(start_daemon, mode: str):
    # a 4 MiB pool of 1 MiB segments; other blocks of the base's size are stored until the pair's base blocks (the
    # stalest) are all evicted: decoupled, their residuals (another size class, used after them) are still there
    d = start_daemon(capacity="4MiB", env={"KVSTORE_POOL_PAIR_EVICTION": mode})
    ctx = hashes(16, tag=b"old")
    with d.client() as c:
        pair = c.pair(base_spec(), res_spec("math"))
        pair.base.put(ctx, [block(i) for i in range(16)])
        pair.residual.put(ctx, [rblock(i) for i in range(16)])
        assert pair.lookup(ctx).full == 16
        filler = c.namespace(spec("other"))
        many = hashes(1024, tag=b"fill")
        stored = 0
        while pair.base.lookup(ctx) and stored < len(many):
            filler.put(many[stored:stored + 8], [block(j) for j in range(stored, stored + 8)])
            stored += 8
        hit = pair.lookup(ctx)
        stats = c.stats()
    assert hit.base == 0 and stored < len(many)                 # the old base blocks were evicted
    if mode == "decoupled":
        assert hit.residual == 16 and hit.base_only_missing == 16   # a partial hit: recompute the base only
        assert stats["counters"]["evictions_coupled"] == 0
    else:
        assert hit.residual == 0                                 # they left with their base
        assert stats["counters"]["evictions_coupled"] == 16


def test_a_pair_survives_a_daemon_restart_through_the_clients_reconnect(start_daemon, tmp_path):
    d = start_daemon()
    keys = hashes(3, tag=b"r")
    c = Client(d.socket)
    try:
        pair = c.pair(base_spec(), res_spec("math"))
        c.namespace(spec("padding"))                             # ids after a restart differ from these
        pair.base.put(keys, [block(i) for i in range(3)])
        d.stop()
        d.start()
        other = Client(d.socket)
        other.namespace(spec("first-after-restart"))             # takes id 1 on the new daemon
        pair.residual.put(keys, [rblock(i) for i in range(3)])  # reconnects: its namespaces said hello again
        hit = pair.lookup(keys)
        assert (hit.base, hit.residual) == (0, 3)                # the new daemon has no base block (no SSD)
        other.close()
    finally:
        c.close()


def test_kvstore_ls_shows_groups_pairs_and_forks(daemon: DaemonProc):
    from tests.daemon.test_cli import kvstore
    ctx = hashes(4, tag=b"cli")
    with daemon.client() as a, daemon.client() as b:
        a.namespace(spec("agent-a", group="g1")).put(ctx, [block(i) for i in range(4)])
        b.namespace(spec("agent-b", group="g1"))
        parent = a.pair(base_spec(), res_spec("planner"))
        parent.base.put(ctx, [block(i) for i in range(4)])
        parent.residual.put(ctx, [rblock(i) for i in range(4)])
        child = b.pair(base_spec(), res_spec("coder"))
        child.fork(ctx, parent=b.namespace(res_spec("planner")))
        child.residual.put(ctx[:2], [rblock(9 + i) for i in range(2)])
        text = kvstore("ls", sock=daemon.socket).stdout
    assert re.search(r"^g1\s+agent-a, agent-b\s+1\s+4\s+32\.0 KiB$", text, re.M), text
    held = 4 * GEOM.full_bytes + 6 * RES.full_bytes
    assert re.search(rf"^{parent.base.id}\s+llama-lora\s+(coder, planner|planner, coder)\s+32\.0 KiB\s+6\.0 KiB\s+"
                     rf"{held / 1024:.1f} KiB\s+48\.0 KiB$", text, re.M), text
    assert re.search(rf"^{child.residual.id}\s+coder\s+\d+\s+{parent.base.id}\s+4\s+4\s+4\s+2$", text, re.M), text
