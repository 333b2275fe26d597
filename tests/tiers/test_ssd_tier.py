"""The SSD tier inside a real daemon: demotion on eviction, promotion on acquire, restart and kill -9 recovery,
corrupt records cut the prefix, deletes, one owner per directory."""
from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time

import pytest

from kvstore.tiers.ssd.record import HEADER_BYTES
from kvstore.tiers.ssd.store import SsdStore
from tests.conftest import GEOM, DaemonProc, spec, ssd_settled
from tests.workers import content, key

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HOST_BLOCKS = 128                                   # a 1 MiB host pool of 8 KiB blocks


@pytest.fixture
def ssd_dir(tmp_path):
    return str(tmp_path / "ssd")


def start(ssd_dir: str, started: list[DaemonProc], **env: str) -> DaemonProc:
    d = DaemonProc(capacity="1MiB", segment="1MiB",
                   env={"KVSTORE_SSD_DIR": ssd_dir, "KVSTORE_SSD_CAPACITY": "64MiB", **env})
    started.append(d)
    return d.start()


def put(d: DaemonProc, ids: range) -> None:
    with d.client() as c:
        ns = c.namespace(spec())
        hs = [key(i) for i in ids]
        assert ns.put(hs, [content(h) for h in hs]).stored == len(hs)


def read(d: DaemonProc, ids: list[int]) -> list[bytes | None]:
    """Each block's bytes, or None for a miss; one block per get so a miss does not hide the rest."""
    out = []
    with d.client() as c:
        ns = c.namespace(spec())
        for i in ids:
            buf = bytearray(GEOM.full_bytes)
            out.append(bytes(buf) if ns.get([key(i)], [buf]) == 1 else None)
    return out


def test_evicted_blocks_are_demoted_then_promoted_byte_exact(ssd_dir, daemons):
    d = start(ssd_dir, daemons)
    put(d, range(300))                              # 172 more than the host pool holds
    with d.client() as c:
        ns = c.namespace(spec())
        r = c.call("lookup", ns=ns.id, keys=b"".join(key(i) for i in range(300)))
        assert r["n"] == 300 and r["host"] == 128   # the head in the host pool, the tail (evicted first) on SSD
        s = c.stats()
        assert s["counters"]["demotions"] == s["counters"]["evictions"] >= 172
        assert s["tiers"][0]["mapped_bytes"] <= s["tiers"][0]["capacity_bytes"]
    for _ in range(2):                              # promotions evict, and demote again, other blocks
        got = read(d, list(range(300)))
        assert [g == content(key(i)) for i, g in enumerate(got)] == [True] * 300
    with d.client() as c:
        s = c.stats()
        assert s["counters"]["promotions"] >= 2 * 172
        ssd = s["tiers"][1]
        assert ssd["counters"]["writes"] <= 300    # a block already on SSD is never written again
        assert ssd["rewrites_saved"] > 0


def test_a_restart_finds_every_demoted_block(ssd_dir, daemons):
    d = start(ssd_dir, daemons)
    put(d, range(200))
    with d.client() as c:
        demoted = c.stats()["counters"]["demotions"]
    assert d.stop() == 0                            # graceful: what is staged is written first
    d = start(ssd_dir, daemons)
    got = read(d, list(range(200)))
    found = [i for i, g in enumerate(got) if g is not None]
    assert len(found) >= demoted > 0                # host-only blocks are memory: gone; demoted ones: all here
    assert all(got[i] == content(key(i)) for i in found)
    with d.client() as c:
        ssd = c.stats()["tiers"][1]
        assert ssd["used_bytes"] == ssd["blocks"] * (HEADER_BYTES + GEOM.full_bytes)


def test_kill_9_loop_never_serves_a_wrong_byte(ssd_dir, daemons):
    rng = random.Random(99)
    written = 0
    for it in range(int(os.environ.get("KVSTORE_STRESS_ITERATIONS", "5"))):   # `make stress` runs more
        d = start(ssd_dir, daemons)
        w = subprocess.Popen([sys.executable, "-m", "tests.workers", "writer", d.socket, str(it + 1), "400"],
                             cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert w.stdout.readline().startswith("committed")
        time.sleep(rng.uniform(0.05, 0.4))        # SIGKILL somewhere in the middle of the writes
        d.proc.send_signal(signal.SIGKILL)
        d.proc.wait()
        w.communicate(timeout=60)
        written = it + 1
    d = start(ssd_dir, daemons)
    ids = [s * 1_000_000 + i for s in range(1, written + 1) for i in range(400)]
    got = read(d, ids)
    served = [(i, g) for i, g in zip(ids, got) if g is not None]
    assert served, "nothing survived five kills: demotion never reached the disk"
    assert all(g == content(key(i)) for i, g in served)     # misses are fine, wrong bytes never


def test_corrupt_record_cuts_the_prefix_and_is_quarantined(ssd_dir, daemons):
    d = start(ssd_dir, daemons)
    put(d, range(200))
    assert d.stop() == 0
    store = SsdStore(ssd_dir, 1 << 30).open()       # find where block 10 lives, as an operator's tool would
    ns_digest = spec().digest()
    payload, rec, _ = store.index[ns_digest + key(10)]
    path, record = store.files[payload].path, store.files[payload].record
    store.close()
    with open(path, "r+b") as f:
        f.seek(rec * record + HEADER_BYTES + 123)
        f.write(b"\x5a\xa5")
    d = start(ssd_dir, daemons)
    with d.client() as c:
        ns = c.namespace(spec())
        outs = [bytearray(GEOM.full_bytes) for _ in range(20)]
        n = ns.get([key(i) for i in range(20)], outs)
        assert n == 10                              # the prefix stops at the bad block, never past it
        assert [bytes(o) for o in outs[:10]] == [content(key(i)) for i in range(10)]
        assert c.stats()["tiers"][1]["counters"]["bad.payload_checksum"] == 1
        assert ns.lookup([key(10)]) == 0            # quarantined: a miss from now on


def test_delete_reaches_the_ssd_tier(ssd_dir, daemons):
    d = start(ssd_dir, daemons)
    put(d, range(200))
    with d.client() as c:
        ns = c.namespace(spec())
        assert ns.delete([key(0), key(199)]) == 2   # one in the host pool, one demoted (the tail goes first)
        assert ns.lookup([key(0)]) == 0 and ns.lookup([key(199)]) == 0
    assert d.stop() == 0
    d = start(ssd_dir, daemons)
    assert read(d, [0, 1])[0] is None and read(d, [1])[0] == content(key(1))


def test_one_daemon_per_ssd_directory(ssd_dir, daemons):
    start(ssd_dir, daemons)
    second = DaemonProc(capacity="1MiB", segment="1MiB", env={"KVSTORE_SSD_DIR": ssd_dir})
    daemons.append(second)
    second.start(wait=False)
    assert second.proc.wait(timeout=30) == 1
    assert "another kvstore daemon owns" in second.read_log()


@pytest.mark.parametrize("point", ["after_payload", "mid_header", "mid_eviction"])
def test_named_crash_points_leave_no_wrong_byte(ssd_dir, daemons, point):
    # a small SSD cap so that the SSD tier evicts too, then a crash at the named point of a later write batch
    env = {"KVSTORE_SSD_CAPACITY": "1MiB", "KVSTORE_CRASH_AT": point, "KVSTORE_CRASH_AFTER": "3"}
    d = start(ssd_dir, daemons, **env)
    w = subprocess.run([sys.executable, "-m", "tests.workers", "writer", d.socket, "7", "600"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert d.proc.wait(timeout=30) == 137, f"the daemon did not stop at {point}:\n{d.read_log()[-2000:]}"
    assert "committed" in w.stdout
    d = start(ssd_dir, daemons)
    with d.client() as c:
        ssd = c.stats()["tiers"][1]
    assert ssd["mapped_bytes"] <= 1 << 20                       # the cap holds across the crash
    ids = [7_000_000 + i for i in range(600)]
    got = read(d, ids)
    served = [(i, g) for i, g in zip(ids, got) if g is not None]
    assert served and all(g == content(key(i)) for i, g in served)
    assert len(served) == ssd["blocks"]             # every record found after the crash is whole and served


def _counters(d: DaemonProc) -> dict[str, int]:
    with d.client() as c:
        return c.stats()["counters"]


def test_prefetch_promotes_into_free_space_ahead_of_the_get(ssd_dir, daemons):
    d = start(ssd_dir, daemons)
    put(d, range(200))
    with d.client() as c:
        ns = c.namespace(spec())
        c.evict(everything=True)                    # all 200 on SSD now, the host pool empty
        r = ns.prefetch([key(i) for i in range(32)], wait=True)
        assert r == {"queued": 32, "done": 32, "skipped": 0}
        assert c.call("lookup", ns=ns.id, keys=b"".join(key(i) for i in range(32)))["host"] == 32
        before = c.stats()["counters"]
        outs = [bytearray(GEOM.full_bytes) for _ in range(32)]
        assert ns.get([key(i) for i in range(32)], outs) == 32
        assert [bytes(o) for o in outs] == [content(key(i)) for i in range(32)]
        after = c.stats()["counters"]
        assert after["promotions"] == before["promotions"]       # the get found them in the host pool
        assert after["prefetched"] == 32


def test_prefetch_never_displaces_blocks(ssd_dir, daemons):
    d = start(ssd_dir, daemons)
    put(d, range(200))                              # the host pool is full of the newest 128
    with d.client() as c:
        ns = c.namespace(spec())
        before = c.stats()["counters"]
        r = ns.prefetch([key(i) for i in range(8)], wait=True)
        assert r == {"queued": 8, "done": 0, "skipped": 8}      # no free space: nothing moves
        after = c.stats()["counters"]
        assert after["evictions"] == before["evictions"]
        assert ns.lookup([key(i) for i in range(72, 200)]) == 128


def test_full_prefetch_queue_answers_busy_at_once(ssd_dir, daemons):
    from kvstore.client import KVStoreError

    d = start(ssd_dir, daemons, KVSTORE_TRAFFIC_QUEUE_PREFETCH="4")
    put(d, range(200))
    with d.client() as c:
        ns = c.namespace(spec())
        with pytest.raises(KVStoreError) as e:
            ns.prefetch([key(i) for i in range(10)])
        assert e.value.code == "busy" and "room for 4 more blocks" in e.value.message
        assert c.stats()["counters"]["prefetch_busy"] == 1


def test_get_of_a_block_in_flight_reads_it_once(ssd_dir, daemons):
    d = start(ssd_dir, daemons)
    put(d, range(200))
    with d.client() as c:
        ns = c.namespace(spec())
        c.evict(everything=True)
        ssd_settled(c)                               # every demoted block on disk, not in staging
        reads = c.stats()["tiers"][1]["counters"].get("hits", 0)
        ns.prefetch([key(i) for i in range(16)])    # no wait: the gets race the prefetcher
        outs = [bytearray(GEOM.full_bytes) for _ in range(16)]
        assert ns.get([key(i) for i in range(16)], outs) == 16
        assert [bytes(o) for o in outs] == [content(key(i)) for i in range(16)]
        for _ in range(500):                         # the prefetcher may still be skipping what the get took
            s = c.stats()
            if s["counters"]["prefetched"] + s["counters"]["prefetch_skipped"] == 16:
                break
        assert s["counters"]["prefetched"] + s["counters"]["prefetch_skipped"] == 16
        assert s["tiers"][1]["counters"]["hits"] - reads == 16  # each block read from disk exactly once


def test_resize_ssd_shrinks_the_files_below_the_new_cap(ssd_dir, daemons):
    d = start(ssd_dir, daemons)
    put(d, range(300))
    with d.client() as c:
        while c.stats()["tiers"][1]["staged_blocks"]:
            time.sleep(0.02)
        before = c.stats()["tiers"][1]
        r = c.resize(1 << 20, tier="ssd")
        after = c.stats()["tiers"][1]
        assert r["mapped_bytes"] == after["mapped_bytes"] <= 1 << 20 < before["mapped_bytes"]
        assert r["evicted"] == before["blocks"] - after["blocks"] > 0
        size = sum(os.path.getsize(os.path.join(ssd_dir, f)) for f in os.listdir(ssd_dir) if f.endswith(".kvs"))
        assert size <= 1 << 20                                   # the bytes on disk, not only the books
    kept = [i for i, g in enumerate(read(d, list(range(172)))) if g is not None]
    assert all(g == content(key(i)) for i, g in zip(kept, read(d, kept)))


def test_cli_ls_ssd_and_resize_ssd(ssd_dir, daemons):
    import json

    d = start(ssd_dir, daemons)
    put(d, range(200))
    cli = lambda *a: subprocess.run([sys.executable, "-m", "kvstore", "--socket", d.socket, *a],  # noqa: E731
                                    capture_output=True, text=True, cwd=ROOT)
    r = cli("ls", "--tier", "ssd", "--json")
    rows = json.loads(r.stdout)
    assert len(rows) == 1 and rows[0]["digest"] == spec().digest().hex() and rows[0]["blocks"] >= 72
    r = cli("resize", "ssd", "2MiB", "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["capacity"] == 2 << 20
    with d.client() as c:                           # the per-namespace count follows deletes
        c.namespace(spec()).delete([key(150)])
        ssd = ssd_settled(c)["tiers"][1]
    (row,) = json.loads(cli("ls", "--tier", "ssd", "--json").stdout)
    assert row["blocks"] == ssd["blocks"] == ssd["used_bytes"] // (HEADER_BYTES + GEOM.full_bytes) == 71
    r = cli("resize", "nvme", "2MiB")
    assert r.returncode == 1 and "usage: kvstore resize [host|ssd] SIZE" in r.stderr


@pytest.mark.parametrize("io", ["io_uring", "threads"])
def test_records_move_the_same_through_io_uring_and_threads(ssd_dir, daemons, io):
    """ssd.io: promotions and demotions go through a ring per worker (when the native ring's probe passes here, as
    it does on this machine's kernel) or os.preadv/pwritev, with the same bytes; a restart finds them."""
    from kvstore.tiers.ssd import uring

    d = start(ssd_dir, daemons, KVSTORE_SSD_IO=io)
    put(d, range(200))                                   # 72 demoted
    with d.client() as c:
        ssd = c.stats()["tiers"][1]
        assert ssd["io"] == ("io_uring" if io == "io_uring" and uring.available() else "threads")
    assert read(d, list(range(200))) == [content(key(i)) for i in range(200)]
    d.stop()
    d = start(ssd_dir, daemons, KVSTORE_SSD_IO=io)
    assert read(d, [0, 1, 2]) == [content(key(i)) for i in range(3)]


@pytest.mark.parametrize("persist", [True, False])
def test_a_graceful_stop_writes_the_host_pool_to_ssd(ssd_dir, daemons, persist):
    d = start(ssd_dir, daemons, KVSTORE_SSD_PERSIST_ON_STOP=str(persist).lower())
    put(d, range(200))                               # 128 in the host pool, the 72 of the tail on SSD
    assert d.stop() == 0
    assert ("wrote 128 block(s) of the host pool" in d.read_log()) == persist
    d = start(ssd_dir, daemons)
    with d.client() as c:
        assert c.stats()["tiers"][1]["blocks"] == (200 if persist else 72)
    got = read(d, list(range(200)))
    assert [g == content(key(i)) for i, g in enumerate(got)] == [True] * 200 if persist else \
        [g is None for g in got[:128]] == [True] * 128


def test_a_full_disk_caps_the_tier_cleanly(ssd_dir, daemons):
    """The file system refuses space (here the daemon runs under RLIMIT_FSIZE, which fails the allocation with
    EFBIG as a full disk fails it with ENOSPC): the tier stays at what it has, evicts within it, logs one line and
    serves every block it holds byte-exact; nothing crashes, nothing is written half."""
    limit = 2 << 20                                   # two growth steps of 64 records of 12 KiB
    d = DaemonProc(capacity="1MiB", segment="1MiB",
                   env={"KVSTORE_SSD_DIR": ssd_dir, "KVSTORE_SSD_CAPACITY": "64MiB"})
    daemons.append(d)
    d.log = open(d.log_path, "ab")
    boot = ("import resource, runpy, signal, sys; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
            f"resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, {limit})); sys.argv = ['kvstore', 'serve']; "
            "runpy.run_module('kvstore', run_name='__main__')")
    d.proc = subprocess.Popen([sys.executable, "-c", boot], env=d.env, cwd=ROOT, stdout=d.log,
                              stderr=subprocess.STDOUT)
    d.wait_ready()
    put(d, range(400))                                # 272 demoted into room for 128
    with d.client() as c:
        ssd = ssd_settled(c)["tiers"][1]
        record = HEADER_BYTES + GEOM.full_bytes
        assert ssd["counters"]["disk_full"] >= 1 and ssd["mapped_bytes"] == 128 * record
        assert ssd["blocks"] == 128 and ssd["counters"]["evictions"] >= 400 - 128 - 128
        assert ssd["counters"].get("write_errors", 0) == 0
    assert "refused" in d.read_log() and d.proc.poll() is None
    got = read(d, list(range(400)))
    served = [i for i, g in enumerate(got) if g is not None]
    assert len(served) >= 128 and all(got[i] == content(key(i)) for i in served)   # reads promote, and evict


def test_staging_copies_outside_the_state_lock_never_see_the_next_writer(ssd_dir, daemons):
    """Evictions stage their copies after the daemon leaves its state lock: a slot taken by eviction is written by
    its new owner only after the old block's copy is made, an evicted block read meanwhile waits for its copy, and
    an `evict` op's slots are free once it answers. Two writers and a reader race over a pool 8x too small; every
    block read back, from the host pool, staging or SSD, is byte-exact."""
    import threading

    d = start(ssd_dir, daemons)
    errors: list[str] = []

    def writer(base: int) -> None:
        with d.client() as c:
            ns = c.namespace(spec())
            for i in range(base, base + 512, 16):
                hs = [key(j) for j in range(i, i + 16)]
                ns.put(hs, [content(h) for h in hs])

    def reader() -> None:
        with d.client() as c:
            ns = c.namespace(spec())
            rng = random.Random(3)
            for _ in range(300):
                i = rng.randrange(1024)
                buf = bytearray(GEOM.full_bytes)
                if ns.get([key(i)], [buf]) == 1 and bytes(buf) != content(key(i)):
                    errors.append(f"block {i} read back altered")

    threads = [threading.Thread(target=writer, args=(b,)) for b in (0, 512)] + [threading.Thread(target=reader)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors[:5]
    with d.client() as c:
        s = ssd_settled(c)
        dropped = s["counters"]["dropped"]
        assert s["counters"]["demotions"] + dropped >= 1024 - HOST_BLOCKS
        used = s["tiers"][0]["used_bytes"]
        r = c.evict(16 * GEOM.full_bytes)
        s2 = c.stats()
        assert r["blocks"] == 16                           # their slots were held for the copies, then freed
        assert used - s2["tiers"][0]["used_bytes"] == 16 * GEOM.full_bytes and s2["pinned"] == 0
    got = read(d, list(range(1024)))
    assert all(b == content(key(i)) for i, b in enumerate(got) if b is not None)
    assert sum(b is not None for b in got) >= 1024 - dropped


def test_an_operators_evict_all_moves_everything_down_however_small_the_staging(ssd_dir, daemons):
    """`kvstore evict --all` of 1 MiB of blocks through 64 KiB of SSD staging: the eviction goes a chunk at a time
    as the writes make room. Before, it evicted at once and staging dropped 7 blocks in 8 (the 8K-token TTFT bench:
    an SSD-hit run found 2 of 256 blocks)."""
    d = start(ssd_dir, daemons, KVSTORE_SSD_STAGING_BYTES="64KiB")
    put(d, range(HOST_BLOCKS))
    with d.client() as c:
        assert c.evict(everything=True)["blocks"] == HOST_BLOCKS
        s = ssd_settled(c)
        assert (s["counters"]["dropped"], s["counters"]["demotions"]) == (0, HOST_BLOCKS)
    got = read(d, list(range(HOST_BLOCKS)))
    assert got == [content(key(i)) for i in range(HOST_BLOCKS)]
