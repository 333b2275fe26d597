"""The promotion reserve (kvstore.movers.reserve) in a real daemon: after an SSD-hit get into a full host pool, free
slots are made again in the background, so the next SSD-hit get evicts nothing on its own path; victims go down to
SSD like any eviction and come back byte-exact; 0 turns it off."""
from __future__ import annotations

import time

import pytest

from tests.conftest import GEOM, DaemonProc, spec, ssd_settled
from tests.workers import content, key

HOST_BLOCKS = 128                                   # a 1 MiB host pool of 8 KiB blocks


def start(tmp_path: str, started: list[DaemonProc], reserve: int) -> DaemonProc:
    d = DaemonProc(capacity="1MiB", segment="1MiB",
                   env={"KVSTORE_SSD_DIR": f"{tmp_path}/ssd", "KVSTORE_SSD_CAPACITY": "64MiB",
                        "KVSTORE_SSD_PROMOTE_RESERVE": str(reserve)})
    started.append(d)
    return d.start()


def settled(c, reserve_evictions: int) -> dict:  # type: ignore[no-untyped-def]
    """Stats once the reserve has evicted `reserve_evictions` blocks in all and the SSD tier is idle again."""
    deadline = time.monotonic() + 30
    while c.stats()["counters"]["reserve_evictions"] < reserve_evictions:
        assert time.monotonic() < deadline, "the reserve was not refilled"
        time.sleep(0.01)
    return ssd_settled(c)


def get(ns, i: int) -> bytes:  # type: ignore[no-untyped-def]
    buf = bytearray(GEOM.full_bytes)
    assert ns.get([key(i)], [buf]) == 1
    return bytes(buf)


def host_blocks(c) -> int:  # type: ignore[no-untyped-def]
    return int(c.stats()["tiers"][0]["blocks"])


@pytest.mark.parametrize("reserve", [2, 0])
def test_an_ssd_hit_get_finds_a_free_slot_made_in_the_background(tmp_path, daemons, reserve: int) -> None:  # type: ignore[no-untyped-def]
    d = start(str(tmp_path), daemons, reserve)
    with d.client() as c:
        ns = c.namespace(spec())
        hs = [key(i) for i in range(300)]
        assert ns.put(hs, [content(h) for h in hs]).stored == 300     # the pool full; the tail on SSD only
        s = ssd_settled(c)
        assert host_blocks(c) == HOST_BLOCKS
        evictions = s["counters"]["evictions"]
        assert get(ns, 299) == content(key(299))                        # SSD hit: a victim evicted for its slot
        s = settled(c, reserve)
        assert s["counters"]["reserve_evictions"] == reserve            # then `reserve` more, in the background
        assert s["counters"]["evictions"] == evictions + 1 + reserve
        assert host_blocks(c) == HOST_BLOCKS - reserve          # that many slots kept free
        evictions = s["counters"]["evictions"]
        assert get(ns, 298) == content(key(298))                        # the next SSD hit ...
        s = settled(c, reserve + (1 if reserve else 0))                 # (the one slot it took made again)
        on_path = s["counters"]["evictions"] - evictions - (s["counters"]["reserve_evictions"] - reserve)
        assert on_path == (0 if reserve else 1)                         # ... evicted nothing itself
        assert host_blocks(c) == HOST_BLOCKS - reserve
        assert s["counters"]["promotions"] == 2 and s["tiers"][1]["dropped"] == 0
        wrong = [i for i in range(298) if get(ns, i) != content(key(i))]     # every victim back byte-exact
        assert wrong == []
