"""The donated tier inside a real daemon (issue 17, item 5): a donor process lends shared memory through the
daemon's donors' socket; blocks evicted from the host pool land there (between the host pool and the SSD), come back
byte-exact on a get, and move to the SSD when the donor takes its memory back — while a client keeps reading: every
read returns the right bytes or misses, never wrong ones. Without a donor, evictions go straight to the SSD."""
from __future__ import annotations

import os
import threading

from kvstore.client import Client
from tests.conftest import GEOM, DaemonProc, ssd_settled
from tests.tiers.test_donated_tier import DonorProc
from tests.workers import content, key

HOST_BLOCKS = 128                                   # a 1 MiB host pool of 8 KiB blocks


def start(tmp_path, daemons: list[DaemonProc]) -> DaemonProc:
    d = DaemonProc(capacity="1MiB", segment="1MiB",
                   env={"KVSTORE_SSD_DIR": str(tmp_path / "ssd"), "KVSTORE_SSD_CAPACITY": "64MiB",
                        "KVSTORE_DONATED_ENABLED": "true"})
    daemons.append(d)
    return d.start()


def donate_socket(d: DaemonProc) -> str:
    return os.path.join(os.path.dirname(d.socket), "donate.sock")


def tier_row(c: Client, name: str) -> dict:
    return next(t for t in c.stats()["tiers"] if t["tier"] == name)


def put(c: Client, ids: range) -> None:
    from tests.conftest import spec

    ns = c.namespace(spec())
    hs = [key(i) for i in ids]
    assert ns.put(hs, [content(h) for h in hs]).stored == len(hs)


def read(c: Client, i: int) -> bytes | None:
    from tests.conftest import spec

    buf = bytearray(GEOM.full_bytes)
    return bytes(buf) if c.namespace(spec()).get([key(i)], [buf]) == 1 else None


def test_evictions_land_in_donated_memory_and_move_to_the_ssd_when_the_donor_reclaims(tmp_path, daemons):
    d = start(tmp_path, daemons)
    donor = DonorProc(donate_socket(d))
    try:
        region = donor.donate(64 * GEOM.full_bytes)            # room for 64 evicted blocks
        with d.client() as c:
            put(c, range(HOST_BLOCKS + 64))                     # the first 64 are evicted: into the donor's memory
            s = ssd_settled(c)
            donated = tier_row(c, "donated")
            assert donated["blocks"] == 64 and tier_row(c, "ssd")["blocks"] == 0
            assert s["counters"]["dropped"] == 0
            assert [read(c, i) for i in range(8)] == [content(key(i)) for i in range(8)]   # promoted from it

            # the donor takes its memory back while a reader keeps reading the blocks that were there
            wrong: list[int] = []
            misses = [0]
            stop = threading.Event()

            def reader() -> None:
                with Client(d.socket) as rc:
                    while not stop.is_set():
                        for i in range(8, 64):
                            got = read(rc, i)
                            if got is None:
                                misses[0] += 1
                            elif got != content(key(i)):
                                wrong.append(i)

            t = threading.Thread(target=reader)
            t.start()
            reply = donor.call("reclaim", region=region, deadline_ms=10_000, reuse=True)
            stop.set()
            t.join(60)
            assert "error" not in reply, reply
            assert reply["unmapped"] and reply["migrated"] + reply["dropped"] >= 1
            assert wrong == []
            assert tier_row(c, "donated")["blocks"] == 0
            # what moved is on the SSD and reads back byte-exact; the donor's scribbles after reclaim touch nothing
            got = [read(c, i) for i in range(HOST_BLOCKS + 64)]
            lost = [i for i, g in enumerate(got) if g is None]
            assert all(g == content(key(i)) for i, g in enumerate(got) if g is not None)
            assert len(lost) <= reply["dropped"], (lost, reply)
    finally:
        donor.stop()


def test_without_a_donor_evictions_go_straight_to_the_ssd(tmp_path, daemons):
    d = start(tmp_path, daemons)
    with d.client() as c:
        put(c, range(HOST_BLOCKS + 32))
        s = ssd_settled(c)
        assert s["counters"]["dropped"] == 0
        assert tier_row(c, "ssd")["blocks"] == 32 and tier_row(c, "donated")["blocks"] == 0
        assert [read(c, i) for i in range(32)] == [content(key(i)) for i in range(32)]
