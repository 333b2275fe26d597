"""The donated tier inside a real daemon (issue 17, item 5): a donor process lends shared memory through the
daemon's donors' socket; blocks evicted from the host pool land there (between the host pool and the SSD), come back
byte-exact on a get — served by the donated tier, as its counters show — and move to the SSD when the donor takes its
memory back, while clients keep reading: a reclaim whose deadline lets every block move down never turns a read into
a miss, and no read ever returns wrong bytes. Without a donor, evictions go straight to the SSD.

Which blocks the host pool evicts is the daemon's choice (a put's chain loses its tail first): the tests ask it
(`lookup`: not in the host pool, and no block on the SSD yet) rather than guess."""
from __future__ import annotations

import os
import threading

from kvstore.client import Client
from tests.conftest import GEOM, DaemonProc, spec, ssd_settled
from tests.tiers.test_donated_tier import DonorProc
from tests.workers import content, key

HOST_BLOCKS = 128                                   # a 1 MiB host pool of 8 KiB blocks
EVICTED = 64                                        # blocks a put of HOST_BLOCKS + EVICTED evicts


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
    ns = c.namespace(spec())
    hs = [key(i) for i in ids]
    assert ns.put(hs, [content(h) for h in hs]).stored == len(hs)


def read(c: Client, i: int) -> bytes | None:
    buf = bytearray(GEOM.full_bytes)
    return bytes(buf) if c.namespace(spec()).get([key(i)], [buf]) == 1 else None


def below_host(c: Client, ids: range) -> list[int]:
    """The blocks of `ids` the host pool does not hold (asked, not guessed: see the module docstring)."""
    ns = c.namespace(spec())
    return [i for i in ids if c.call("lookup", ns=ns.id, keys=key(i))["host"] == 0]


def served(c: Client) -> tuple[int, int, int]:
    """(blocks the donated tier served, promotions read from it, promotions read from the SSD) so far."""
    s = c.stats()
    donated = next(t for t in s["tiers"] if t["tier"] == "donated")
    return donated["counters"].get("reads", 0), s["counters"]["reads_donated"], s["counters"]["reads_ssd"]


def fill_region(c: Client, ids: range) -> list[int]:
    """Put `ids` (HOST_BLOCKS + EVICTED blocks) into an emptied host pool: the EVICTED it evicts land in the
    region lent, and nothing on the SSD; which they are."""
    put(c, ids)
    ssd_settled(c)
    in_donated = below_host(c, ids)
    assert len(in_donated) == EVICTED and tier_row(c, "donated")["blocks"] == EVICTED
    assert tier_row(c, "ssd")["blocks"] == 0
    return in_donated


class Readers:
    """Threads getting `ids` over and over (each its own connection, each its own order) until stopped: every
    get a hit or a miss, counted, and every hit's bytes checked."""

    def __init__(self, sock: str, ids: list[int], threads: int = 1) -> None:
        self.sock, self.ids = sock, ids
        self.hits = self.misses = 0
        self.wrong: list[int] = []
        self.stop, self.lock = threading.Event(), threading.Lock()
        self.ready = threading.Barrier(threads + 1)
        self.threads = [threading.Thread(target=self._run, args=(k,)) for k in range(threads)]
        for t in self.threads:
            t.start()
        self.ready.wait(30)

    def _run(self, k: int) -> None:
        order = self.ids[k % len(self.ids):] + self.ids[:k % len(self.ids)]
        if k % 2:
            order.reverse()
        with Client(self.sock) as rc:
            self.ready.wait(30)
            while not self.stop.is_set():
                for i in order:
                    got = read(rc, i)
                    with self.lock:
                        self.hits += got is not None
                        self.misses += got is None
                        if got is not None and got != content(key(i)):
                            self.wrong.append(i)

    def join(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(60)


def test_evictions_land_in_donated_memory_and_move_to_the_ssd_when_the_donor_reclaims(tmp_path, daemons):
    d = start(tmp_path, daemons)
    donor = DonorProc(donate_socket(d))
    try:
        # room for twice what is evicted: promotions' own evictions land there too, and none is pushed to the SSD
        region = donor.donate(2 * EVICTED * GEOM.full_bytes)
        with d.client() as c:
            ids = range(HOST_BLOCKS + EVICTED)
            in_donated = fill_region(c, ids)
            assert ssd_settled(c)["counters"]["dropped"] == 0
            before = served(c)
            assert [read(c, i) for i in in_donated[:8]] == [content(key(i)) for i in in_donated[:8]]
            after = served(c)
            assert (after[0] - before[0], after[1] - before[1], after[2] - before[2]) == (8, 8, 0)

            # the donor takes its memory back, with time to move every block, while a reader keeps getting the
            # blocks that were there: not one read misses
            held = tier_row(c, "donated")["blocks"]
            readers = Readers(d.socket, in_donated[8:])
            reply = donor.call("reclaim", region=region, deadline_ms=10_000, reuse=True)
            readers.join()
            assert "error" not in reply, reply
            # (the readers' promotions may evict more blocks into the region before the reclaim closes it)
            assert reply["unmapped"] and reply["dropped"] == 0 and reply["migrated"] >= held, (held, reply)
            assert readers.wrong == [] and readers.misses == 0 and readers.hits > 0
            assert tier_row(c, "donated")["blocks"] == 0
            # every block reads back byte-exact (from the host pool or the SSD); the donor's scribbles after the
            # reclaim touch nothing
            assert [read(c, i) for i in ids] == [content(key(i)) for i in ids]
    finally:
        donor.stop()


def test_reads_racing_reclaims_that_drop_nothing_never_miss(tmp_path, daemons):
    """Reclaim after reclaim with a generous deadline, several readers getting the region's blocks meanwhile: a
    block may move from donated memory to the SSD between the promotion choosing the donated tier and its read,
    which then finds it on the SSD; not one read misses, and none is wrong."""
    d = start(tmp_path, daemons)
    donor = DonorProc(donate_socket(d))
    misses, wrong, donated_reads, rounds = 0, [], 0, 25
    try:
        with d.client() as c:
            for r in range(rounds):
                region = donor.donate(EVICTED * GEOM.full_bytes)
                ids = range(r * 1000, r * 1000 + HOST_BLOCKS + EVICTED)
                in_donated = fill_region(c, ids)
                before = served(c)
                readers = Readers(d.socket, in_donated, threads=3)
                reply = donor.call("reclaim", region=region, deadline_ms=10_000)
                readers.join()
                assert "error" not in reply and reply["dropped"] == 0, reply
                misses, wrong = misses + readers.misses, wrong + readers.wrong
                donated_reads += served(c)[0] - before[0]
                c.namespace(spec()).delete([key(i) for i in ids])      # the next round starts empty
                ssd_settled(c)
        assert (misses, wrong) == (0, []), f"{misses} misses, wrong bytes for {wrong}, {donated_reads} donated reads"
        assert donated_reads > 0                        # the readers did read donated memory
    finally:
        donor.stop()


def test_without_a_donor_evictions_go_straight_to_the_ssd(tmp_path, daemons):
    d = start(tmp_path, daemons)
    with d.client() as c:
        put(c, range(HOST_BLOCKS + 32))
        s = ssd_settled(c)
        assert s["counters"]["dropped"] == 0
        assert tier_row(c, "ssd")["blocks"] == 32 and tier_row(c, "donated")["blocks"] == 0
        on_ssd = below_host(c, range(HOST_BLOCKS + 32))
        assert len(on_ssd) == 32
        before = served(c)
        assert [read(c, i) for i in on_ssd] == [content(key(i)) for i in on_ssd]
        after = served(c)
        assert (after[0] - before[0], after[1] - before[1], after[2] - before[2]) == (0, 0, 32)
