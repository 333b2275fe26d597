"""Supervised workers against a live daemon: a worker loop that raises (a fault injected at a named point, as a bug
would) is restarted and counted, and the work it had left is done — no tier is left silently stuck."""
from __future__ import annotations

import numpy as np

from tests.conftest import GEOM, DaemonProc, block, hashes, spec, ssd_daemon, ssd_settled


def start(daemons: list[DaemonProc], fault: str, times: int, **env: str) -> DaemonProc:
    return ssd_daemon(daemons, "1MiB", KVSTORE_FAULT_AT=fault, KVSTORE_FAULT_TIMES=str(times), **env)


def test_a_demotion_writer_that_fails_is_restarted_and_writes_what_is_staged(daemons: list[DaemonProc]) -> None:
    d = start(daemons, "demote_loop", 2)
    hs = hashes(20, tag=b"demote")
    with d.client() as c:
        ns = c.namespace(spec())
        assert ns.put(hs, [block(i) for i in range(20)]).stored == 20
        assert c.evict(everything=True)["blocks"] == 20
        s = ssd_settled(c)
        ssd = s["tiers"][1]
        assert ssd["writer_restarts"] == 2 and ssd["blocks"] == 20 and ssd["staged_blocks"] == 0
        outs = [np.zeros(GEOM.full_bytes, np.uint8) for _ in hs]
        assert ns.get(hs, outs) == 20 and all(o.tobytes() == block(i) for i, o in enumerate(outs))
    assert "worker kvstore-demote failed (restart 2" in d.read_log()


def test_a_write_through_worker_that_fails_is_restarted(daemons: list[DaemonProc]) -> None:
    d = start(daemons, "write_through_loop", 1, KVSTORE_SSD_WRITE_THROUGH="true")
    hs = hashes(8, tag=b"wt")
    with d.client() as c:
        ns = c.namespace(spec())
        assert ns.put(hs, [block(i) for i in range(8)]).stored == 8
        s = ssd_settled(c)
        assert s["counters"]["written_through"] == 8 and s["tiers"][1]["blocks"] == 8
    assert "worker kvstore-writethrough failed (restart 1" in d.read_log()
