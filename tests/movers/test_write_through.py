"""Write-through (ssd.write_through): committed blocks go to the SSD tier at once, in the store lane, and survive a
kill -9 of the daemon; a delete racing a write batch (write-through or demotion) never leaves the block on disk."""
from __future__ import annotations

import signal
import time

from kvstore.tiers.ssd.record import HEADER_BYTES, record_bytes
from tests.conftest import GEOM, DaemonProc, spec, ssd_daemon, ssd_settled
from tests.workers import content, key

RECORD = record_bytes(GEOM.full_bytes)


def start(tmp_path, started: list[DaemonProc], **env: str) -> DaemonProc:
    return ssd_daemon(started, "1MiB", KVSTORE_SSD_DIR=str(tmp_path / "ssd"), **env)


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


def test_write_through_never_refuses_a_store_while_the_ssd_has_room(tmp_path, daemons):
    """Three writers into a pool a fraction of their data, write-through on, a slow disk. Before: the write-through
    pinned every committed slot until its write returned, so the pool filled with pinned blocks and 49–66% of the
    stores were refused no_space while the SSD had room. Now a slot is pinned only while its batch is written; a
    block evicted before its turn goes down by demotion instead."""
    import threading

    d = start(tmp_path, daemons, KVSTORE_POOL_CAPACITY="2MiB", KVSTORE_SSD_CAPACITY="256MiB",
              KVSTORE_SSD_WRITE_THROUGH="true", KVSTORE_SLOW_DEVICE="ssd:2MB:5")
    results: dict[int, list[int]] = {}

    def writer(w: int) -> None:
        with d.client() as c:
            ns = c.namespace(spec())
            hs = [key(10_000 * (w + 1) + i) for i in range(160)]        # 1.25 MiB each, 3.75 MiB in all
            got = [0, 0]
            for start in range(0, len(hs), 16):
                r = ns.put(hs[start:start + 16], [content(h) for h in hs[start:start + 16]])
                got[0] += r.stored
                got[1] += r.no_space
            results[w] = got

    threads = [threading.Thread(target=writer, args=(w,)) for w in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert {w: r[1] for w, r in results.items()} == {0: 0, 1: 0, 2: 0}     # nothing refused
    assert sum(r[0] for r in results.values()) == 480
    with d.client() as c:
        s = ssd_settled(c, timeout=60)
        assert s["counters"]["evictions"] > 0                            # the pool really overflowed
        ns = c.namespace(spec())
        for w in range(3):
            hs = [key(10_000 * (w + 1) + i) for i in range(160)]
            outs = [bytearray(GEOM.full_bytes) for _ in hs]
            assert ns.get(hs, outs) == 160                                # every block, byte-exact, from a tier
            assert [bytes(o) for o in outs] == [content(h) for h in hs]
