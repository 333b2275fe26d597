"""The traffic manager inside a real daemon: every SSD transfer is counted in its lane, streaming acquires report
blocks as they land, a queued prefetch is cancelled by a delete and escalated by a get, the restart scan runs while
the daemon serves. A seeded slow-device model (KVSTORE_SLOW_DEVICE) stretches the SSD so that queues really form;
the assertions are about order and counts, never about how long anything took."""
from __future__ import annotations

import time

import pytest

from kvstore.client import KVStoreError
from kvstore.tiers.ssd.record import HEADER_BYTES, record_bytes
from tests.conftest import GEOM, DaemonProc, spec, ssd_settled
from tests.workers import content, key

RECORD = record_bytes(GEOM.full_bytes)


def start(tmp_path, started: list[DaemonProc], slow: str | None = None, scanned: bool = True) -> DaemonProc:
    env = {"KVSTORE_SSD_DIR": str(tmp_path / "ssd"), "KVSTORE_SSD_CAPACITY": "64MiB"}
    if slow:
        env["KVSTORE_SLOW_DEVICE"] = slow
    d = DaemonProc(capacity="1MiB", segment="1MiB", env=env)
    started.append(d)
    d.start(wait=False)
    d.wait_ready(scanned=scanned)
    return d


def on_ssd(d: DaemonProc, ids: range) -> None:
    """Store the blocks, evict them all from the host pool, wait until every one is written to disk."""
    with d.client() as c:
        ns = c.namespace(spec())
        hs = [key(i) for i in ids]
        assert ns.put(hs, [content(h) for h in hs]).stored == len(hs)
        c.evict(everything=True)
        assert ssd_settled(c)["tiers"][1]["blocks"] >= len(hs)


def lanes(c) -> dict[str, dict]:
    (path,) = c.stats()["traffic"]
    assert path["path"] == "ssd"
    return path["lanes"]


def test_lane_stats_match_the_transfers_made(tmp_path, daemons):
    d = start(tmp_path, daemons)
    on_ssd(d, range(40))
    with d.client() as c:
        ns = c.namespace(spec())
        bg = lanes(c)["background"]
        # every demoted block: one payload write of a record plus its header write; syncs move no bytes
        assert bg["bytes"] == 40 * (RECORD + HEADER_BYTES)
        assert bg["transfers"] >= 40 + 3 and bg["failed"] == 0
        outs = [bytearray(GEOM.full_bytes) for _ in range(10)]
        assert ns.get([key(i) for i in range(10)], outs) == 10
        assert [bytes(o) for o in outs] == [content(key(i)) for i in range(10)]
        crit = lanes(c)["critical"]
        assert (crit["transfers"], crit["bytes"]) == (10, 10 * RECORD)
        assert crit["latency"]["count"] == 10
        r = ns.prefetch([key(i) for i in range(20, 25)], wait=True)
        assert r["done"] == 5
        after = lanes(c)
        assert (after["prefetch"]["transfers"], after["prefetch"]["bytes"]) == (5, 5 * RECORD)
        assert after["critical"]["transfers"] == 10 and after["store"]["transfers"] == 0


def test_a_wrong_lane_is_refused(tmp_path, daemons):
    d = start(tmp_path, daemons)
    with d.client() as c:
        ns = c.namespace(spec())
        with pytest.raises(KVStoreError) as e:
            ns.acquire([key(1)], lane="urgent")
        assert e.value.code == "bad_request" and "unknown lane 'urgent'" in e.value.message
        assert ns.acquire([key(1)], lane="background").gids == []        # a valid lane: just a miss


def test_streaming_acquire_reports_blocks_as_they_land_in_key_order(tmp_path, daemons):
    d = start(tmp_path, daemons, slow="ssd:2MB:3")                    # ~6 ms a record: reads queue up
    on_ssd(d, range(48))
    with d.client() as c:
        ns = c.namespace(spec())
        hs = [key(i) for i in range(48)] + [key(999)]                  # the last one is nowhere: the prefix is 48
        lease = ns.acquire_stream(hs)
        counts = list(lease.arrivals())
        assert counts[-1] == 48 and lease.complete
        assert counts == sorted(set(counts)) and len(counts) > 1       # several replies, each one longer
        outs = [bytearray(GEOM.full_bytes) for _ in range(48)]
        lease.read_blocks(outs)
        assert [bytes(o) for o in outs] == [content(h) for h in hs[:48]]
        assert lease.verified_prefix() == 48
        lease.release()
        assert c.stats()["pinned"] == 0                                # every streamed block unpinned again
        assert lanes(c)["critical"]["transfers"] == 48


def test_streaming_acquire_starts_with_the_host_prefix(tmp_path, daemons):
    d = start(tmp_path, daemons)
    on_ssd(d, range(8))
    with d.client() as c:
        ns = c.namespace(spec())
        hs = [key(i) for i in range(8)]
        assert ns.get(hs[:3], [bytearray(GEOM.full_bytes) for _ in range(3)]) == 3   # now in the host pool
        lease = ns.acquire_stream(hs)
        counts = list(lease.arrivals())
        assert counts[0] == 3 and counts[-1] == 8                      # the host blocks come first, at once
        outs = [bytearray(GEOM.full_bytes) for _ in range(8)]
        lease.read_blocks(outs)
        assert [bytes(o) for o in outs] == [content(h) for h in hs]
        lease.release()
        assert ns.lookup(hs) == 8


def test_a_queued_prefetch_is_cancelled_by_a_delete(tmp_path, daemons):
    d = start(tmp_path, daemons, slow="ssd:500KB:5")                  # ~25 ms a record
    on_ssd(d, range(8))
    with d.client() as c:
        ns = c.namespace(spec())
        hs = [key(i) for i in range(8)]
        assert ns.prefetch(hs)["queued"] == 8        # three run at once (the lower lanes' limit); the rest wait
        assert ns.delete([hs[7]]) == 1               # the last one is still queued: its read is dropped unread
        for _ in range(500):
            if c.stats()["counters"]["prefetched"] + c.stats()["counters"]["prefetch_skipped"] == 8:
                break
            time.sleep(0.01)
        s = c.stats()
        assert s["counters"]["prefetch_cancelled"] == 1 and s["counters"]["prefetched"] == 7
        pf = lanes(c)["prefetch"]
        assert (pf["cancelled"], pf["transfers"]) == (1, 7)
        assert ns.lookup(hs) == 7 and ns.get([hs[7]], [bytearray(GEOM.full_bytes)]) == 0


def test_a_get_escalates_the_queued_prefetch_it_waits_for(tmp_path, daemons):
    d = start(tmp_path, daemons, slow="ssd:500KB:6")
    on_ssd(d, range(8))
    with d.client() as c:
        ns = c.namespace(spec())
        hs = [key(i) for i in range(8)]
        hits = c.stats()["tiers"][1]["counters"].get("hits", 0)
        ns.prefetch(hs)
        out = bytearray(GEOM.full_bytes)
        assert ns.get([hs[7]], [out]) == 1 and bytes(out) == content(hs[7])
        pf = lanes(c)["prefetch"]
        assert pf["escalated"] == 1                   # moved to the critical lane, not read a second time
        assert lanes(c)["critical"]["transfers"] == 1
        for _ in range(500):
            if c.stats()["counters"]["prefetched"] == 8:
                break
            time.sleep(0.01)
        assert c.stats()["tiers"][1]["counters"]["hits"] - hits == 8   # eight blocks, eight disk reads


def test_the_restart_scan_runs_while_the_daemon_serves(tmp_path, daemons):
    """A directory without record maps (written before them): its headers are scanned while the daemon serves; a
    block not scanned yet is a miss, and the scan writes the maps for the next start."""
    d = start(tmp_path, daemons)
    on_ssd(d, range(300))                              # two scan chunks of headers
    d.stop()
    for m in (tmp_path / "ssd").glob("*.map"):
        m.unlink()
    d = start(tmp_path, daemons, slow="ssd:500KB:7", scanned=False)   # a chunk of headers takes ~2 s
    with d.client() as c:
        scan = c.stats()["tiers"][1]["scan"]
        assert scan["state"] == "scanning" and scan["records"] >= 300 and scan["scanned"] < scan["records"]
        ns = c.namespace(spec())
        assert ns.put([key(5000)], [content(key(5000))]).stored == 1     # served meanwhile
        with pytest.raises(KVStoreError) as e:                           # but not resized under the scan
            c.resize(32 << 20, tier="ssd")
        assert e.value.code == "busy" and "still scanning" in e.value.message
    d.wait_ready(timeout=60)
    with d.client() as c:
        ssd = c.stats()["tiers"][1]
        assert ssd["scan"]["state"] == "ready" and ssd["scan"]["scanned"] == ssd["scan"]["records"]
        assert ssd["blocks"] == 300
        assert lanes(c)["background"]["bytes"] >= ssd["scan"]["records"] * HEADER_BYTES
        ns = c.namespace(spec())
        assert ns.lookup([key(i) for i in range(300)]) == 300
        assert c.resize(32 << 20, tier="ssd")["tier"] == "ssd"         # refused only while scanning
    d.stop()
    d = start(tmp_path, daemons, slow="ssd:500KB:7", scanned=False)   # the maps written by that scan
    with d.client() as c:
        assert c.stats()["tiers"][1]["scan"]["from_maps"] >= 300      # (and the block stored meanwhile)
        assert c.namespace(spec()).lookup([key(i) for i in range(300)]) == 300


def test_blocks_on_disk_are_hits_from_the_first_request_after_a_restart(tmp_path, daemons):
    """With the record maps, a restarted daemon knows every block on disk before it serves: hits at once, byte
    exact, while the headers are still being validated in the background."""
    d = start(tmp_path, daemons)
    on_ssd(d, range(300))
    d.stop()
    d = start(tmp_path, daemons, slow="ssd:500KB:7", scanned=False)   # validating a chunk of headers takes ~2 s
    with d.client() as c:
        scan = c.stats()["tiers"][1]["scan"]
        assert scan["state"] == "validating" and scan["from_maps"] == 300 and scan["scanned"] < scan["records"]
        ns = c.namespace(spec())
        hs = [key(i) for i in range(300)]
        assert ns.lookup(hs) == 300
        outs = [bytearray(GEOM.full_bytes) for _ in range(4)]
        assert ns.get(hs[296:], outs) == 4 and [bytes(o) for o in outs] == [content(h) for h in hs[296:]]
        assert c.stats()["tiers"][1]["scan"]["state"] == "validating"   # all of it before the validation ended
    d.wait_ready(timeout=60)
    with d.client() as c:
        ssd = c.stats()["tiers"][1]
        assert ssd["scan"]["state"] == "ready" and ssd["blocks"] == 300
        assert not any(k.startswith("bad.") for k in ssd["counters"])


def test_promoted_blocks_carry_their_checksum_to_the_reader(tmp_path, daemons):
    """A block's writer CRC-32C comes back with it when it is promoted from its SSD record: a reader verifies
    promoted slots as it verifies stored ones."""
    from kvstore.checksum import crc32c

    d = start(tmp_path, daemons)
    on_ssd(d, range(6))
    with d.client() as c:
        ns = c.namespace(spec())
        hs = [key(i) for i in range(6)]
        with ns.acquire(hs[:3]) as lease:                      # promoted by a plain acquire
            assert lease.crcs == [crc32c(content(h)) for h in hs[:3]]
            assert lease.verified_prefix() == 3
        lease = ns.acquire_stream(hs)                           # the rest by a streaming one
        lease.wait()
        assert lease.crcs == [crc32c(content(h)) for h in hs]
        lease.release()


def test_a_client_gone_mid_stream_costs_nothing(tmp_path, daemons):
    """A streaming acquire whose client closes its socket after the first partial reply: the promotion finishes,
    the pins of the dead connection are dropped, and the blocks are there for the next client."""
    import socket

    from kvstore.protocol import VERSION, encode

    d = start(tmp_path, daemons, slow="ssd:2MB:9")
    on_ssd(d, range(48))
    hs = [key(i) for i in range(48)]
    with d.client() as c:
        ns = c.namespace(spec())
        c.sock.sendall(encode({"v": VERSION, "op": "acquire", "id": 999, "ns": ns.id, "keys": b"".join(hs),
                               "stream": True}))
        c.sock.recv(1)                                   # the first partial reply has begun: leave
        c.sock.shutdown(socket.SHUT_RDWR)
    with d.client() as c:
        for _ in range(500):
            s = c.stats()
            if s["connections"] == 1 and s["pinned"] == 0 and s["counters"]["promotions"] == 48:
                break
            time.sleep(0.01)
        assert (s["connections"], s["pinned"], s["counters"]["promotions"]) == (1, 0, 48)
        ns = c.namespace(spec())
        outs = [bytearray(GEOM.full_bytes) for _ in hs]
        assert ns.get(hs, outs) == 48 and [bytes(o) for o in outs] == [content(h) for h in hs]
        assert lanes(c)["critical"]["transfers"] == 48     # served from the host pool now: read once
