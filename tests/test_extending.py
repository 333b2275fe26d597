"""The README's "Adding a tier" and "Adding an eviction policy", done from outside kvstore: a test module
(tests/extending/) registers a toy tier and a toy policy as a deployment's own code would, then serves a real daemon
(tests/extending/serve.py) configured by the environment like any other. The toy tier takes the host pool's
evictions and serves them back byte-exact; the toy policy (first in, first out) evicts the blocks LRU would keep."""
from __future__ import annotations

import os
import sys

import pytest

from tests.conftest import GEOM, DaemonProc, block, hashes, spec

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SLOTS = 256                     # 2 MiB of 8 KiB blocks


def served(daemons: list[DaemonProc], *register: str, **env: str) -> DaemonProc:
    argv = [sys.executable, "-m", "tests.extending.serve", *register]
    d = DaemonProc("2MiB", "1MiB", env={"PYTHONPATH": ROOT, **env}, argv=argv)
    daemons.append(d)
    return d.start()


def fill_then_overflow(d: DaemonProc, reread: bool) -> list[bytes]:
    """Fill the pool with two puts (A, then B: 128 blocks each), read A again where `reread`, store 10 more; the
    keys. Within a put the tail is the least recent (a read touches a prefix's head last)."""
    hs = hashes(SLOTS + 10, tag=b"ext")
    half = SLOTS // 2
    with d.client() as c:
        ns = c.namespace(spec())
        for a, b in ((0, half), (half, SLOTS)):
            assert ns.put(hs[a:b], [block(i) for i in range(a, b)]).stored == b - a
        if reread:
            with ns.acquire(hs[:half]):
                pass
        assert ns.put(hs[SLOTS:], [block(i) for i in range(SLOTS, SLOTS + 10)]).stored == 10
        assert c.stats()["counters"]["evictions"] == 10
    return hs


@pytest.mark.parametrize("policy, a_kept", [("lru", SLOTS // 2), ("fifo", SLOTS // 2 - 10)])
def test_a_policy_registered_from_outside_decides_the_evictions(daemons, policy, a_kept):
    """A is stored first and read again: LRU keeps it and evicts B's tail; first in, first out evicts A's tail."""
    d = served(daemons, "policy", KVSTORE_POOL_EVICTION=policy)
    hs = fill_then_overflow(d, reread=True)
    with d.client() as c:
        ns = c.namespace(spec())
        assert ns.lookup(hs[:SLOTS // 2]) == a_kept
        assert ns.lookup(hs[SLOTS // 2:SLOTS]) == SLOTS // 2 - (10 if policy == "lru" else 0)
        assert ns.lookup(hs[SLOTS:]) == 10


def test_a_tier_registered_from_outside_takes_evictions_and_serves_them_back(daemons):
    d = served(daemons, "tier", KVSTORE_TOY_ENABLED="true", KVSTORE_TOY_CAPACITY="4MiB")
    hs = fill_then_overflow(d, reread=False)
    evicted = hs[SLOTS // 2 - 10:SLOTS // 2]            # A's tail, the least recent: the ten evicted
    with d.client() as c:
        toy = next(t for t in c.stats()["tiers"] if t["tier"] == "toy")
        assert toy["blocks"] == 10 and toy["used_bytes"] == 10 * GEOM.full_bytes
        ns = c.namespace(spec())
        outs = [bytearray(GEOM.full_bytes) for _ in evicted]
        assert ns.get(evicted, outs) == 10
        assert [bytes(o) for o in outs] == [block(i) for i in range(SLOTS // 2 - 10, SLOTS // 2)]
        assert c.stats()["counters"]["acquired_lower"] == 10


def test_a_registered_tiers_section_is_checked_like_any_other(daemons):
    d = DaemonProc("2MiB", "1MiB", env={"PYTHONPATH": ROOT, "KVSTORE_TOY_CAPACITY": "0"},
                   argv=[sys.executable, "-m", "tests.extending.serve", "tier"])
    daemons.append(d)
    with pytest.raises(RuntimeError, match="toy.capacity: must be above 0"):
        d.start()
