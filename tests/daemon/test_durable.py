"""A durability point a client can ask for (issue 19): a durable put or commit, and a flush, answer once the blocks
are on disk and synced in the SSD tier (durable), or at their deadline (timeout: stored, not on disk yet), or
no_ssd_tier, or unsynced under ssd.sync never; a block deleted meanwhile counts as done. Write-through never leaves
the durable path silently: skips are counted, the oldest pending write's age and the lag are in the stats, and a
write-through block evicted before its write goes down in the store lane."""
from __future__ import annotations

import signal
import threading
import time

from tests.conftest import GEOM, DaemonProc, spec, ssd_daemon, ssd_settled
from tests.workers import content, key

SLOW = "ssd:200KB:1"          # ~60 ms a record (8 KiB payload + its header): writes are seen queued


def start(tmp_path, started: list[DaemonProc], **env: str) -> DaemonProc:
    return ssd_daemon(started, "1MiB", KVSTORE_SSD_DIR=str(tmp_path / "ssd"), **env)


def get_all(d: DaemonProc, hs: list[bytes]) -> list[bytes | None]:
    with d.client() as c:
        ns = c.namespace(spec())
        out: list[bytes | None] = []
        for h in hs:
            buf = bytearray(GEOM.full_bytes)
            out.append(bytes(buf) if ns.get([h], [buf]) == 1 else None)
        return out


def test_a_durable_put_is_on_disk_when_it_returns_and_survives_kill_9(tmp_path, daemons):
    d = start(tmp_path, daemons)                       # write-through off: only the durable put writes at once
    hs = [key(i) for i in range(40)]
    with d.client() as c:
        ns = c.namespace(spec())
        r = ns.put(hs, [content(h) for h in hs], durable=True)
        assert (r.stored, r.durability, r.not_durable) == (40, "durable", 0)
        s = c.stats()                                  # no settling: the reply was the durability point
        assert s["tiers"][1]["blocks"] == 40 and s["write_through"]["pending"] == 0
        assert s["traffic"][0]["lanes"]["background"]["bytes"] == 0       # written in the store lane
        plain = [key(100 + i) for i in range(4)]
        assert ns.put(plain, [content(h) for h in plain]).durability is None
        assert c.stats()["tiers"][1]["blocks"] == 40   # a plain put does not go to disk (write-through off)
    d.stop(signal.SIGKILL)
    d = start(tmp_path, daemons)
    assert get_all(d, hs) == [content(h) for h in hs]  # every durable block, byte-exact


def test_a_durable_commit_answers_for_its_blocks(tmp_path, daemons):
    d = start(tmp_path, daemons)
    hs = [key(i) for i in range(8)]
    with d.client() as c:
        ns = c.namespace(spec())
        with ns.reserve(hs) as res:
            res.write_blocks([content(h) for h in hs])
            assert res.commit(durable=True, durable_timeout_s=10) == 8
        assert res.durability == {"durability": "durable", "blocks": 8, "pending": 0, "failed": 0}
        assert c.stats()["tiers"][1]["blocks"] == 8


def test_a_slow_disk_answers_timeout_then_the_blocks_become_durable(tmp_path, daemons):
    d = start(tmp_path, daemons, KVSTORE_SLOW_DEVICE=SLOW)
    hs = [key(i) for i in range(24)]
    with d.client() as c:
        ns = c.namespace(spec())
        r = ns.put(hs, [content(h) for h in hs], durable=True, durable_timeout_s=0.05)
        assert r.stored == 24 and r.durability == "timeout" and 0 < r.not_durable <= 24
        assert ns.lookup(hs) == 24                      # stored all the same
        s = c.stats()["write_through"]
        assert s["pending"] > 0 and s["oldest_pending_s"] > 0
        answer = ns.wait_durable(hs, timeout_s=25)      # their writes went on: this waits for the rest
        assert answer == {"durability": "durable", "blocks": answer["blocks"], "pending": 0, "failed": 0}
        s = c.stats()
        assert s["tiers"][1]["blocks"] == 24 and s["write_through"]["pending"] == 0
        assert s["write_through"]["settled"]["answer.timeout"] == 1


def test_without_an_ssd_tier_the_answer_is_no_ssd_tier(start_daemon):
    d = start_daemon()
    hs = [key(i) for i in range(4)]
    with d.client() as c:
        ns = c.namespace(spec())
        r = ns.put(hs, [content(h) for h in hs], durable=True)
        assert (r.stored, r.durability) == (4, "no_ssd_tier")
        assert ns.lookup(hs) == 4                       # stored in the host pool all the same
        assert c.flush_durable()["durability"] == "no_ssd_tier"


def test_under_sync_never_a_durable_put_answers_unsynced(tmp_path, daemons):
    d = start(tmp_path, daemons, KVSTORE_SSD_SYNC="never")
    hs = [key(i) for i in range(4)]
    with d.client() as c:
        ns = c.namespace(spec())
        r = ns.put(hs, [content(h) for h in hs], durable=True)
        assert (r.durability, r.not_durable) == ("unsynced", 0)
        assert c.stats()["tiers"][1]["blocks"] == 4     # written, never synced: not called durable


def test_flush_waits_for_earlier_write_back_blocks(tmp_path, daemons):
    d = start(tmp_path, daemons, KVSTORE_SLOW_DEVICE=SLOW)
    demoted = [key(i) for i in range(16)]
    hosted = [key(100 + i) for i in range(16)]
    with d.client() as c:
        ns = c.namespace(spec())
        assert ns.put(demoted, [content(h) for h in demoted]).stored == 16
        c.evict(everything=True)                        # staged: their demotion writes queue in the background
        assert ns.put(hosted, [content(h) for h in hosted]).stored == 16   # in the host pool only
        s = c.stats()
        assert s["tiers"][1]["blocks"] + s["tiers"][1]["staged_blocks"] <= 32 and s["tiers"][1]["staged_blocks"]
        r = c.flush_durable(timeout_s=25)
        assert r["durability"] == "durable" and r["pending"] == r["failed"] == 0
        assert r["blocks"] >= 16                         # at least the host pool's (some demotions were done)
        s = c.stats()                                    # no settling: the flush was the durability point
        assert s["tiers"][1]["blocks"] == 32 and s["tiers"][1]["staged_blocks"] == 0
        assert s["traffic"][0]["lanes"]["store"]["transfers"] > 0     # flushed first in line, not in the background
    d.stop(signal.SIGKILL)
    d = start(tmp_path, daemons)
    assert get_all(d, demoted + hosted) == [content(h) for h in demoted + hosted]


def test_blocks_deleted_while_a_durable_put_waits_count_as_done(tmp_path, daemons):
    d = start(tmp_path, daemons, KVSTORE_SLOW_DEVICE="ssd:100KB:2")
    hs = [key(i) for i in range(16)]
    answer: dict = {}

    def durable_put() -> None:
        with d.client() as c:
            answer["r"] = c.namespace(spec()).put(hs, [content(h) for h in hs], durable=True, durable_timeout_s=25)

    t = threading.Thread(target=durable_put)
    t.start()
    with d.client() as c:
        ns = c.namespace(spec())
        deadline = time.monotonic() + 20
        while ns.lookup(hs) < 16 or not c.stats()["write_through"]["pending"]:   # committed, waiting for disk
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert ns.delete(hs[8:]) == 8                   # while the put waits for their writes
        t.join(30)
        r = answer["r"]
        assert (r.stored, r.durability, r.not_durable) == (16, "durable", 0)    # deleted: nothing to persist
        s = ssd_settled(c)
        assert s["tiers"][1]["blocks"] == 8 and s["write_through"]["settled"]["deleted"] >= 1
        assert ns.lookup(hs) == 8


def test_write_through_shows_its_lag_oldest_pending_write_and_skips(tmp_path, daemons):
    d = start(tmp_path, daemons, KVSTORE_SSD_WRITE_THROUGH="true", KVSTORE_SLOW_DEVICE=SLOW,
              KVSTORE_SSD_STAGING_BYTES="80KiB")       # 10 blocks of 8 KiB may wait for their write
    hs = [key(i) for i in range(24)]
    with d.client() as c:
        ns = c.namespace(spec())
        for i in range(0, 24, 8):
            assert ns.put(hs[i:i + 8], [content(h) for h in hs[i:i + 8]], batch=8).stored == 8
        s = c.stats()
        skipped = s["counters"]["write_through_skipped"]
        assert skipped > 0                              # beyond staging_bytes: counted, never silent
        wt = s["write_through"]
        assert wt["enabled"] and wt["pending"] > 0 and wt["oldest_pending_s"] > 0
        s = ssd_settled(c)
        wt = s["write_through"]
        assert wt["pending"] == 0 and wt["oldest_pending_s"] == 0.0
        assert wt["lag"]["count"] == 24 - skipped == s["counters"]["written_through"]
        assert wt["max_lag_s"] > 0 and wt["lag"]["sum"] <= wt["max_lag_s"] * wt["lag"]["count"]


def test_write_through_blocks_evicted_before_their_write_go_down_in_the_store_lane(tmp_path, daemons):
    d = start(tmp_path, daemons, KVSTORE_SSD_WRITE_THROUGH="true", KVSTORE_SLOW_DEVICE=SLOW)
    hs = [key(i) for i in range(40)]
    with d.client() as c:
        ns = c.namespace(spec())
        assert ns.put(hs, [content(h) for h in hs]).stored == 40
        c.evict(everything=True)            # all but the batch being written (pinned) leave before their write
        s = c.stats()
        assert s["tiers"][1]["staged_blocks"] > 0 and s["tiers"][1]["staged_urgent"] > 0
        s = ssd_settled(c)
        assert s["tiers"][1]["blocks"] == 40
        assert s["traffic"][0]["lanes"]["background"]["bytes"] == 0     # never behind background demotions
        assert s["write_through"]["lag"]["count"] == 40                  # each counted once, written or demoted


def test_blocks_a_durable_put_waits_for_are_not_evicted_before_their_write(tmp_path, daemons):
    """A flood of plain puts evicts everything it can while the durable blocks wait for a slow disk, and the
    staging area is too small for the evicted blocks (dropped). Before: the durable blocks were evicted and dropped
    like the others, and the answer was `failed`; now they stay in their slots until written."""
    d = start(tmp_path, daemons, KVSTORE_SLOW_DEVICE=SLOW, KVSTORE_SSD_STAGING_BYTES="16KiB")
    hs = [key(i) for i in range(16)]
    flood = [key(1000 + i) for i in range(300)]                   # 2.3 MiB through a 1 MiB pool
    with d.client() as c:
        ns = c.namespace(spec())
        assert ns.put(hs, [content(h) for h in hs], durable=True, durable_timeout_s=0).durability == "timeout"
        for i in range(0, len(flood), 20):
            ns.put(flood[i:i + 20], [content(h) for h in flood[i:i + 20]])
        s = c.stats()
        assert s["counters"]["evictions"] > 100 and s["counters"]["dropped"] > 0
        answer = ns.wait_durable(hs, timeout_s=25)
        assert (answer["durability"], answer["failed"]) == ("durable", 0)
    assert get_all(d, hs) == [content(h) for h in hs]


def test_durable_requests_pin_at_most_the_pool_share_of_one_connections_reservations(tmp_path, daemons):
    """Clients asking for durability faster than a slow disk writes: the blocks they wait for are pinned only up to
    server.max_reserved_fraction of the pool (here 0.5 of 1 MiB: 64 blocks), so others can still store."""
    d = start(tmp_path, daemons, KVSTORE_SLOW_DEVICE=SLOW)
    hs = [key(i) for i in range(100)]
    with d.client() as c:
        ns = c.namespace(spec())
        r = ns.put(hs, [content(h) for h in hs], durable=True, durable_timeout_s=0)
        assert (r.stored, r.durability) == (100, "timeout")
        wt = c.stats()["write_through"]
        assert 0 < wt["pinned_bytes"] <= (1 << 20) // 2 and wt["settled"]["pin_cap"] > 0
    others = [key(1000 + i) for i in range(64)]
    with d.client() as c:                                # another writer still finds room
        r = c.namespace(spec()).put(others, [content(h) for h in others])
        assert (r.stored, r.no_space) == (64, 0)


def test_asyncio_durable_put_and_the_cli_flush(tmp_path, daemons, start_daemon):
    import asyncio
    import json
    import subprocess
    import sys

    from kvstore.client.aio import AsyncClient

    d = start(tmp_path, daemons)
    hs = [key(i) for i in range(6)]

    async def durable_put() -> tuple[str | None, dict]:
        async with AsyncClient(d.socket) as c:
            ns = await c.namespace(spec())
            r = await ns.put(hs, [content(h) for h in hs], durable=True, durable_timeout_s=10)
            return r.durability, await ns.wait_durable(hs)

    durability, again = asyncio.run(durable_put())
    assert durability == "durable" and again["durability"] == "durable"
    with d.client() as c:                                  # write-back blocks, then the operator's flush
        more = [key(100 + i) for i in range(5)]
        c.namespace(spec()).put(more, [content(h) for h in more])
        assert c.stats()["tiers"][1]["blocks"] == 6
    cli = subprocess.run([sys.executable, "-m", "kvstore", "--socket", d.socket, "flush", "--timeout", "10",
                          "--json"], capture_output=True, text=True, timeout=60)
    assert cli.returncode == 0, cli.stderr
    out = json.loads(cli.stdout)
    assert (out["durability"], out["blocks"], out["pending"]) == ("durable", 5, 0)
    with d.client() as c:
        assert c.stats()["tiers"][1]["blocks"] == 11
    plain = start_daemon()                                 # no SSD tier: nothing can be made durable (exit 1)
    cli = subprocess.run([sys.executable, "-m", "kvstore", "--socket", plain.socket, "flush"], capture_output=True,
                         text=True, timeout=60)
    assert cli.returncode == 1 and cli.stdout.startswith("no_ssd_tier"), cli.stdout + cli.stderr
