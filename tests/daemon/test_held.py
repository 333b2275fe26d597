"""`lookup` with `mask` (the client's `Namespace.held`): which keys any tier holds, each on its own — the question a
hybrid model's sliding-window and state groups ask (kvstore.connectors.groups), where a restorable prefix end needs
a few blocks before it, not an unbroken chain."""
from __future__ import annotations

import pytest

from kvstore.client import KVStoreError
from tests.conftest import block, hashes, spec, ssd_daemon


def test_held_answers_each_key_across_holes(daemon):
    with daemon.client() as c:
        ns = c.namespace(spec())
        hs = hashes(12)
        present = [0, 1, 4, 5, 6, 11]
        ns.put([hs[i] for i in present], [block(i) for i in present])
        assert ns.held(hs) == [i in present for i in range(12)]
        assert ns.lookup(hs) == 2                     # the chained prefix stops at the first hole, as ever
        before = c.stats()["counters"]
        assert ns.held(hs[4:7]) == [True] * 3
        after = c.stats()["counters"]
        assert (after["hits"], after["misses"]) == (before["hits"], before["misses"])    # no hit counted
        assert c.stats()["pinned"] == 0               # and nothing pinned


def test_held_sees_blocks_only_the_ssd_holds(daemons):
    d = ssd_daemon(daemons)
    with d.client() as c:
        ns = c.namespace(spec())
        hs = hashes(10)
        ns.put([hs[i] for i in (1, 3, 5)], [block(i) for i in (1, 3, 5)])
        c.flush_durable(timeout_s=20)
        c.evict(everything=True)                      # on the SSD only now
        assert c.call("lookup", ns=ns.id, keys=b"".join(hs))["host"] == 0
        assert ns.held(hs) == [i in (1, 3, 5) for i in range(10)]


def test_held_with_a_residual_is_refused(daemon):
    with daemon.client() as c:
        ns = c.namespace(spec())
        with pytest.raises(KVStoreError, match="'mask' and 'residual'"):
            c.call("lookup", ns=ns.id, keys=b"".join(hashes(2)), mask=True, residual=ns.id)
