"""Write-through (ssd.write_through): committed blocks go to the SSD tier at once, in the store lane, and survive a
kill -9 of the daemon; a delete racing a write batch (write-through or demotion) never leaves the block on disk."""
from __future__ import annotations

import signal
import time

from kvstore.tiers.ssd.record import HEADER_BYTES, record_bytes
from tests.conftest import GEOM, DaemonProc, spec, ssd_settled
from tests.workers import content, key

RECORD = record_bytes(GEOM.full_bytes)


def start(tmp_path, started: list[DaemonProc], **env: str) -> DaemonProc:
    d = DaemonProc(capacity="1MiB", segment="1MiB",
                   env={"KVSTORE_SSD_DIR": str(tmp_path / "ssd"), "KVSTORE_SSD_CAPACITY": "64MiB", **env})
    started.append(d)
    return d.start()


def test_stored_blocks_are_on_ssd_at_once_and_survive_kill_9(tmp_path, daemons):
    d = start(tmp_path, daemons, KVSTORE_SSD_WRITE_THROUGH="true")
    hs = [key(i) for i in range(10)]
    with d.client() as c:
        ns = c.namespace(spec())
        assert ns.put(hs, [content(h) for h in hs]).stored == 10
        s = ssd_settled(c)
        assert s["counters"]["written_through"] == 10 and s["counters"]["evictions"] == 0
        assert s["tiers"][1]["blocks"] == 10
        store = s["traffic"][0]["lanes"]["store"]
        assert store["bytes"] == 10 * (RECORD + HEADER_BYTES)          # payloads and headers, in the store lane
        assert s["traffic"][0]["lanes"]["background"]["bytes"] == 0    # nothing was demoted
        c.evict(everything=True)                                       # their eviction writes nothing more
        s = ssd_settled(c)
        assert s["tiers"][1]["rewrites_saved"] == 10 and s["traffic"][0]["lanes"]["background"]["bytes"] == 0
    d.stop(signal.SIGKILL)
    d = start(tmp_path, daemons)
    with d.client() as c:
        ns = c.namespace(spec())
        outs = [bytearray(GEOM.full_bytes) for _ in hs]
        assert ns.get(hs, outs) == 10
        assert [bytes(o) for o in outs] == [content(h) for h in hs]


def test_a_delete_racing_write_through_leaves_nothing_on_disk(tmp_path, daemons):
    d = start(tmp_path, daemons, KVSTORE_SSD_WRITE_THROUGH="true", KVSTORE_SLOW_DEVICE="ssd:500KB:2")
    hs = [key(i) for i in range(12)]
    with d.client() as c:
        ns = c.namespace(spec())
        assert ns.put(hs, [content(h) for h in hs]).stored == 12
        assert ns.delete(hs[6:]) == 6                   # while their SSD writes are queued or running
        s = ssd_settled(c)
        assert s["tiers"][1]["blocks"] == 6 and ns.lookup(hs) == 6
        assert ns.get(hs[6:7], [bytearray(GEOM.full_bytes)]) == 0
    d.stop()
    d = start(tmp_path, daemons)
    with d.client() as c:
        ns = c.namespace(spec())
        assert c.stats()["tiers"][1]["blocks"] == 6
        assert ns.lookup(hs[:6]) == 6 and all(ns.lookup([h]) == 0 for h in hs[6:])


def test_a_delete_racing_a_demotion_batch_leaves_nothing_on_disk(tmp_path, daemons):
    d = start(tmp_path, daemons, KVSTORE_SLOW_DEVICE="ssd:500KB:3")
    hs = [key(i) for i in range(40)]
    with d.client() as c:
        ns = c.namespace(spec())
        assert ns.put(hs, [content(h) for h in hs]).stored == 40
        c.evict(everything=True)                         # 40 demoted: the first batch of 32 is taken at once
        time.sleep(0.05)
        assert ns.delete(hs[:20]) == 20                  # mostly blocks of the batch being written
        s = ssd_settled(c)
        assert s["tiers"][1]["blocks"] == 20
        assert ns.lookup(hs[20:]) == 20 and all(ns.lookup([h]) == 0 for h in hs[:20])
    d.stop()
    d = start(tmp_path, daemons)
    with d.client() as c:
        ns = c.namespace(spec())
        assert c.stats()["tiers"][1]["blocks"] == 20 and all(ns.lookup([h]) == 0 for h in hs[:20])
