"""The predictive prefetch (issue 14 part 4, PBKV §4.3) against a live daemon with an SSD tier and a one-segment host
pool (128 slots of 8 KiB): a workflow's blocks that went down to the SSD come back into the host pool ahead of its
next request — at a `call` hint naming the agents expected next, or when its next call is due — into free or
retired space only, never displacing an active block; a wrong prediction is counted as wasted and its blocks are the
first to go. The figures are the daemon's own (`kvstore stats` workflows.prefetch) and `list`."""
from __future__ import annotations

import time

import pytest

from kvstore.daemon.config import ConfigError, load_config
from tests.conftest import GEOM, DaemonProc, block, hashes, spec, ssd_daemon, ssd_settled

SLOTS = 128                       # a 1 MiB pool of 8 KiB blocks


def prefetch(c) -> dict:
    return c.stats()["workflows"]["prefetch"]


def in_host(c, ns, hs: list[bytes]) -> int:
    """How many of `hs` the host pool holds (from `list`)."""
    listed = {bytes(k) for k, _ in c.list(ns=ns.id, limit=10_000)["keys"]}
    return sum(h in listed for h in hs)


def landed(c, n: int, timeout: float = 20.0) -> dict:
    """The prefetch figures once `n` blocks have landed (the reads run in the background lane)."""
    deadline = time.monotonic() + timeout
    while True:
        p = prefetch(c)
        if p["landed"] >= n and p["in_flight"] == 0:
            return p
        if time.monotonic() > deadline:
            raise AssertionError(f"{n} blocks did not land in {timeout} s: {p}")
        time.sleep(0.02)


def put(ns, hs: list[bytes], seed: int, ctx) -> None:
    assert ns.put(hs, [block(seed + i) for i in range(len(hs))], context=ctx).stored == len(hs)


def get_all(ns, hs: list[bytes], seed: int, ctx) -> None:
    outs = [bytearray(GEOM.full_bytes) for _ in hs]
    assert ns.get(hs, outs, context=ctx) == len(hs)
    assert [bytes(o) for o in outs] == [block(seed + i) for i in range(len(hs))]


def daemon(daemons: list[DaemonProc], **env: str) -> DaemonProc:
    return ssd_daemon(daemons, capacity="1MiB", segment="1MiB", KVSTORE_POOL_EVICTION="workflow",
                      KVSTORE_PREFETCH_LEAD_S="0", **env)


def test_a_next_hint_prefetches_into_retired_space_never_over_active_blocks(daemons):
    d = daemon(daemons)
    with d.client() as c:
        ns = c.namespace(spec())
        a, b = c.workflow("A", type="qa"), c.workflow("B", type="bulk")
        ha, hb = hashes(32, tag=b"A"), hashes(SLOTS, tag=b"B")
        a.call("reader")
        put(ns, ha, 0, a.context("reader"))                      # A's chain: its put's keys
        c.evict(everything=True)                                 # A's blocks go down to the SSD
        ssd_settled(c)
        b.call("writer")
        put(ns, hb, 1000, b.context("writer"))                   # B's active blocks fill the pool
        evictions = c.stats()["counters"]["evictions"]
        # 1. A is expected next, but the pool holds only active blocks: nothing lands, nothing is evicted
        a.call("reader", next=["writer"])
        p = prefetch(c)
        assert (p["predicted_next"], p["queued"], p["skipped_no_room"], p["evicted_retired"]) == (1, 0, 32, 0), p
        assert in_host(c, ns, hb) == SLOTS and in_host(c, ns, ha) == 0
        assert c.stats()["counters"]["evictions"] == evictions
        # 2. B ends: its blocks are retired, and A's next call brings A's chain up in their place
        b.end()
        a.call("reader", next=["writer"])
        p = landed(c, 32)
        assert (p["predicted_next"], p["queued"], p["landed"], p["evicted_retired"]) == (2, 32, 32, 32), p
        assert in_host(c, ns, ha) == 32 and in_host(c, ns, hb) == SLOTS - 32
        assert c.stats()["workflows"]["blocks"] == {"active": 32, "retired": SLOTS - 32}   # landed in A's group
        # 3. A's request: every block a host hit, none promoted on the critical path
        before = c.stats()["counters"]
        get_all(ns, ha, 0, a.context("reader"))
        after = c.stats()["counters"]
        assert after["acquired_host"] - before["acquired_host"] == 32
        assert after["acquired_lower"] == before["acquired_lower"]
        p = prefetch(c)
        assert (p["used"], p["wasted"], p["precision"]) == (32, 0, 1.0), p
        a.end()
        assert prefetch(c)["wasted"] == 0                        # used blocks are not wasted at the end


def test_a_wrong_prediction_is_wasted_and_its_blocks_go_first(daemons):
    d = daemon(daemons)
    with d.client() as c:
        ns = c.namespace(spec())
        a, b, w = c.workflow("A", type="qa"), c.workflow("B", type="bulk"), c.workflow("C", type="bulk")
        ha, hb, hc = hashes(32, tag=b"A"), hashes(64, tag=b"B"), hashes(64, tag=b"C")
        a.call("reader")
        put(ns, ha, 0, a.context("reader"))
        c.evict(everything=True)
        ssd_settled(c)
        b.call("writer")
        put(ns, hb, 1000, b.context("writer"))                  # half the pool: 64 slots free
        a.call("reader", next=["writer"])
        p = landed(c, 32)
        assert (p["queued"], p["landed"], p["evicted_retired"]) == (32, 32, 0), p   # into free space
        a.end()                                                  # ... and A never came back for them
        p = prefetch(c)
        assert (p["used"], p["wasted"], p["wasted_bytes"], p["precision"]) == (0, 32, 32 * GEOM.full_bytes, 0.0)
        w.call("writer")
        put(ns, hc, 2000, w.context("writer"))                   # 32 free slots, then 32 evictions: A's go
        assert in_host(c, ns, ha) == 0
        assert in_host(c, ns, hb) == 64 and in_host(c, ns, hc) == 64


def test_a_workflow_due_soon_is_prefetched_without_a_next_hint(daemons):
    """The timed trigger: the gaps between a type's calls (~0.2 s here) are learned from its call hints; a workflow
    of that type whose next call is due within prefetch.lead_s is prefetched on the server's tick. Under LRU (no
    retired blocks) it lands in free space."""
    d = ssd_daemon(daemons, capacity="1MiB", segment="1MiB", KVSTORE_PREFETCH_LEAD_S="30")
    with d.client() as c:
        ns = c.namespace(spec())
        t = c.workflow("teacher", type="loop")
        for _ in range(4):                                       # three gaps of ~0.2 s for (loop, step)
            t.call("step")
            time.sleep(0.2)
        x = c.workflow("X", type="loop")
        hx = hashes(16, tag=b"X")
        x.call("step")
        put(ns, hx, 0, x.context("step"))                        # in the host pool: nothing to prefetch yet
        time.sleep(0.5)                                          # ticks pass
        assert prefetch(c)["predicted"] == 0
        c.evict(everything=True)                                 # X's blocks go down; it is due: they come back
        p = landed(c, 16)
        assert (p["predicted_timed"], p["predicted_next"], p["landed"]) == (1, 0, 16), p
        assert in_host(c, ns, hx) == 16
        before = c.stats()["counters"]
        get_all(ns, hx, 0, x.context("step"))
        assert c.stats()["counters"]["acquired_lower"] == before["acquired_lower"]
        assert prefetch(c)["used"] == 16


def test_reads_still_queued_when_the_workflow_ends_are_cancelled(daemons):
    """One SSD transfer at a time, 200 blocks to bring up: the end hint right after the call finds most of them
    still queued, and they are cancelled; every block is accounted for (landed or cancelled) and those that landed
    are wasted."""
    d = ssd_daemon(daemons, capacity="2MiB", segment="1MiB", KVSTORE_POOL_EVICTION="workflow",
                   KVSTORE_PREFETCH_LEAD_S="0", KVSTORE_TRAFFIC_SSD_IN_FLIGHT="1")
    with d.client() as c:
        ns = c.namespace(spec())
        a = c.workflow("A", type="qa")
        ha = hashes(200, tag=b"A")
        a.call("reader")
        put(ns, ha, 0, a.context("reader"))
        c.evict(everything=True)
        ssd_settled(c)
        a.call("reader", next=["writer"])
        a.end()
        deadline = time.monotonic() + 20
        while (p := prefetch(c))["landed"] + p["cancelled"] < 200 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert p["queued"] == 200 and p["landed"] + p["cancelled"] == 200 and p["cancelled"] > 0, p
        assert (p["wasted"], p["used"], p["watched"]) == (p["landed"], 0, 0), p
        assert c.stats()["counters"]["prefetch_cancelled"] == p["cancelled"]
        assert in_host(c, ns, ha) == p["landed"]


def test_a_run_the_prefetch_lane_cannot_take_at_once_goes_on_at_the_next_ticks(daemons):
    """The prefetch lane's queue holds 4 transfers and a tick queues at most 4 blocks: a chain of 40 lands whole,
    a few blocks at a time (the run goes on from where it stopped), and its blocks are used."""
    d = daemon(daemons, KVSTORE_TRAFFIC_QUEUE_PREFETCH="4", KVSTORE_PREFETCH_BLOCKS_PER_TICK="4")
    with d.client() as c:
        ns = c.namespace(spec())
        a = c.workflow("A", type="qa")
        ha = hashes(40, tag=b"A")
        a.call("reader")
        put(ns, ha, 0, a.context("reader"))
        c.evict(everything=True)
        ssd_settled(c)
        a.call("reader", next=["writer"])
        p = landed(c, 40)
        assert (p["predicted"], p["queued"], p["landed"], p["skipped_no_room"]) == (1, 40, 40, 0), p
        get_all(ns, ha, 0, a.context("reader"))
        assert prefetch(c)["used"] == 40


def test_disabled_or_without_an_ssd_tier_there_is_no_predictive_prefetch(daemons):
    d = daemon(daemons, KVSTORE_PREFETCH_ENABLED="false")
    with d.client() as c:
        ns = c.namespace(spec())
        a = c.workflow("A")
        a.call("reader")
        put(ns, hashes(8), 0, a.context("reader"))
        c.evict(everything=True)
        ssd_settled(c)
        a.call("reader", next=["writer"])
        assert c.stats()["workflows"]["prefetch"] is None
        assert c.stats()["counters"]["prefetched"] == 0
    plain = DaemonProc()
    daemons.append(plain.start())
    with plain.client() as c:
        c.workflow("A").call("reader", next=["writer"])
        assert c.stats()["workflows"]["prefetch"] is None


@pytest.mark.parametrize("key, value, message", [
    ("MIN_P", "1.5", "prefetch.min_p: must be a probability, 0..1, got 1.5"),
    ("LEAD_S", "-1", "prefetch.lead_s: must be 0..3600 seconds (0: no timed trigger), got -1.0"),
    ("MAX_CHAIN_BLOCKS", "0", "prefetch.max_chain_blocks: must be 1..1048576, got 0"),
    ("BLOCKS_PER_TICK", "100000", "prefetch.blocks_per_tick: must be 1..65536, got 100000"),
    ("ENABLED", "maybe", "prefetch.enabled: expected true or false, got 'maybe'"),
])
def test_the_prefetch_section_is_checked(key, value, message):
    with pytest.raises(ConfigError) as e:
        load_config(env={f"KVSTORE_PREFETCH_{key}": value})
    assert message in str(e.value)
    cfg = load_config(env={}).prefetch
    assert (cfg.enabled, cfg.min_p, cfg.lead_s, cfg.max_chain_blocks) == (True, 0.5, 1.0, 4096)
