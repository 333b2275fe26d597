"""Capacity: LRU eviction at the cap, pins never evicted, no space when everything is pinned, a killed client's
pins and reservations released."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from kvstore.client import KVStoreError
from tests.conftest import GEOM, block, hashes, spec

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# 1 MiB segments of 8 KiB blocks = 128 slots each; a 2 MiB pool = 256 slots.
SLOTS = 256


def test_eviction_at_cap_takes_least_recently_used(start_daemon):
    d = start_daemon(capacity="2MiB", segment="1MiB")
    with d.client() as c:
        ns = c.namespace(spec())
        hs = hashes(SLOTS + 10)
        ns.put(hs[:SLOTS], [block(i) for i in range(SLOTS)])
        assert c.stats()["counters"]["evictions"] == 0
        with ns.acquire(hs[:5]):                      # use blocks 0..4 again: now the most recent
            pass
        ns.put(hs[SLOTS:], [block(i) for i in range(SLOTS, SLOTS + 10)])
        s = c.stats()
        assert s["counters"]["evictions"] == 10
        assert s["blocks"] == SLOTS
        assert s["tiers"][0]["mapped_bytes"] <= s["tiers"][0]["capacity_bytes"]
        assert ns.lookup(hs[:5]) == 5                 # recently used: kept
        # one put is one prefix: its tail is the least recent, so the 10 evicted are its last 10 blocks
        assert ns.lookup(hs[:SLOTS]) == SLOTS - 10
        assert sum(ns.lookup([h]) for h in hs[SLOTS - 10:SLOTS]) == 0
        assert ns.lookup(hs[SLOTS:]) == 10            # and the new ones


def test_pinned_blocks_are_never_evicted(start_daemon):
    d = start_daemon(capacity="2MiB", segment="1MiB")
    with d.client() as c:
        ns = c.namespace(spec())
        hs = hashes(3 * SLOTS)
        ns.put(hs[:10], [block(i) for i in range(10)])
        lease = ns.acquire(hs[:10])                   # the oldest blocks, pinned
        for i in range(10, 3 * SLOTS, 32):            # churn through the pool twice
            ns.put(hs[i:i + 32], [block(j) for j in range(i, min(i + 32, 3 * SLOTS))])
        assert c.stats()["counters"]["evictions"] >= 2 * SLOTS - 10
        assert [bytes(v) for v in lease.views] == [block(i) for i in range(10)]
        assert ns.lookup(hs[:10]) == 10
        lease.release()


def test_full_of_pins_answers_no_space_and_keeps_earlier_blocks(start_daemon):
    d = start_daemon(capacity="1MiB", segment="1MiB")
    slots = SLOTS // 2
    with d.client() as c:
        ns = c.namespace(spec())
        hs = hashes(slots + 1)
        ns.put(hs[:slots], [block(i) for i in range(slots)])
        lease = ns.acquire(hs[:slots])
        r = ns.put(hs[slots:], [block(slots)])
        assert (r.stored, r.no_space) == (0, 1)
        assert ns.lookup(hs[:slots]) == slots
        lease.release()
        assert ns.put(hs[slots:], [block(slots)]).stored == 1   # unpinned: eviction works again


def test_second_writer_of_same_key_sees_in_progress(daemon):
    with daemon.client() as a, daemon.client() as b:
        na, nb = a.namespace(spec()), b.namespace(spec())
        ra = na.reserve(hashes(2))
        rb = nb.reserve(hashes(3))
        assert rb.status == [2, 2, 0]                 # in progress elsewhere, in progress, reserved
        ra.abort()
        rb.abort()


CHILD = """
import sys, time
from kvstore.client import Client
from tests.conftest import spec, hashes, block
c = Client(sys.argv[1])
ns = c.namespace(spec())
ns.put(hashes(4), [block(i) for i in range(4)])
lease = ns.acquire(hashes(4))
res = ns.reserve(hashes(6, start=100))
print("holding", flush=True)
time.sleep(60)
"""


def test_killed_client_releases_pins_and_reservations(daemon):
    child = subprocess.Popen([sys.executable, "-c", textwrap.dedent(CHILD), daemon.socket],
                             stdout=subprocess.PIPE, cwd=ROOT)
    assert child.stdout.readline().strip() == b"holding"
    with daemon.client() as c:
        s = c.stats()
        assert (s["pinned"], s["reserved"]) == (4, 6)
        child.send_signal(signal.SIGKILL)
        child.wait()
        for _ in range(200):                           # the daemon notices the closed socket
            s = c.stats()
            if s["connections"] == 1:
                break
        assert (s["pinned"], s["reserved"]) == (0, 0)
        assert s["tiers"][0]["used_bytes"] == 4 * GEOM.full_bytes   # the 6 reserved slots are free again
        ns = c.namespace(spec())
        assert ns.lookup(hashes(6, start=100)) == 0   # never committed: never visible
        assert c.evict(everything=True)["blocks"] == 4  # the 4 blocks are unpinned now


def test_evict_by_bytes_and_by_namespace(daemon):
    with daemon.client() as c:
        a, b = c.namespace(spec("a")), c.namespace(spec("b"))
        a.put(hashes(10), [block(i) for i in range(10)])
        b.put(hashes(10), [block(i) for i in range(10)])
        assert c.evict(nbytes=3 * GEOM.full_bytes)["blocks"] == 3   # the 3 oldest: a's last three
        assert a.lookup(hashes(10)) == 7 and sum(a.lookup([h]) for h in hashes(10)[7:]) == 0
        assert c.evict(everything=True, ns=b.id)["blocks"] == 10
        assert b.lookup(hashes(10)) == 0
        assert a.lookup(hashes(10)) == 7              # the other namespace untouched
        with pytest.raises(KVStoreError) as e:
            c.call("evict")
        assert e.value.code == "bad_request"


def test_a_prefix_longer_than_the_pool_keeps_its_head(start_daemon):
    """Blocks are linked so that eviction takes a prefix's tail first: a block is no use without the ones before
    it. A put of more than the pool holds keeps the first SLOTS blocks, not the last."""
    d = start_daemon(capacity="2MiB", segment="1MiB")
    with d.client() as c:
        ns = c.namespace(spec())
        hs = hashes(SLOTS + 64)
        ns.put(hs, [block(i) for i in range(SLOTS + 64)])
        assert c.stats()["counters"]["evictions"] == 64
        assert ns.lookup(hs) == SLOTS


def test_a_get_refreshes_a_prefix_head_first(start_daemon):
    """After a get of a long prefix, its head is the most recent: pressure then evicts from its tail."""
    d = start_daemon(capacity="2MiB", segment="1MiB")
    with d.client() as c:
        ns = c.namespace(spec())
        hs = hashes(200)
        ns.put(hs, [block(i) for i in range(200)])
        other = hashes(88, tag=b"other")
        ns.put(other[:56], [block(i) for i in range(56)])          # the pool is full now
        assert ns.get(hs, [bytearray(GEOM.full_bytes) for _ in hs]) == 200   # 7 batches of 32, released
        assert ns.get(other[:56], [bytearray(GEOM.full_bytes) for _ in range(56)]) == 56   # now hs is older
        ns.put(other[56:], [block(i) for i in range(32)])           # 32 evictions, all from hs
        assert ns.lookup(other) == 88
        assert ns.lookup(hs) == 168                                 # its tail went: the prefix of 168 stays
        assert sum(ns.lookup([h]) for h in hs[168:]) == 0
