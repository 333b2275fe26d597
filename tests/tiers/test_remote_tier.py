"""The remote tier on a real Mooncake Store: one `mooncake_master` (and Mooncake's HTTP metadata server) and
several kvstore daemons on loopback, each with its own socket, pool and segment — the nodes. Blocks cross nodes
byte-exact, stay in their namespace, are verified against their writer's CRC-32C, survive the loss of the node that
wrote them (replicas 2), and the daemons keep serving while the master is down and link again when it is back."""
from __future__ import annotations

import signal
import time
from collections.abc import Callable, Iterable
from typing import Any

import pytest

from kvstore.checksum import crc32c
from kvstore.client import Client
from kvstore.tiers.remote import trailer
from kvstore.tiers.remote.client import store_key
from tests.conftest import GEOM, DaemonProc, block, hashes, spec
from tests.mooncake_master import MooncakeMaster, master_binary, setup_on_loopback

pytestmark = [pytest.mark.mooncake,
              pytest.mark.skipif(master_binary() is None, reason="Mooncake Store is not installed: pip install "
                                 "'kvstore[mooncake]' (make test installs it)")]


def node(daemons: list[DaemonProc], m: MooncakeMaster, capacity: str = "16MiB", **env: str) -> DaemonProc:
    d = DaemonProc(capacity, "1MiB", env=m.env(**env))
    daemons.append(d)
    d.start()
    wait_for(lambda: remote_of(d)["up"], "the remote tier links")
    return d


def remote_of(d: DaemonProc, c: Client | None = None) -> dict[str, Any]:
    if c is None:
        with d.client() as c2:
            return remote_of(d, c2)
    return next(t for t in c.stats()["tiers"] if t.get("tier") == "remote")


def wait_for(cond: Callable[[], Any], what: str, timeout: float = 30.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        got = cond()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting until {what}")
        time.sleep(0.05)


def put_through(d: DaemonProc, hs: list[bytes], seeds: Iterable[int], model: str = "tiny") -> None:
    """Put blocks on a node whose placement writes them through, and wait until the store holds them all."""
    with d.client() as c:
        before = remote_of(d, c)["counters"].get("puts", 0)
        r = c.namespace(spec(model)).put(hs, [block(i) for i in seeds])
        assert r.stored == len(hs)
        wait_for(lambda: remote_of(d, c)["counters"].get("puts", 0) - before >= len(hs), "the blocks are put")


def get_all(d: DaemonProc, hs: list[bytes], model: str = "tiny") -> list[bytes]:
    with d.client() as c:
        outs = [bytearray(GEOM.full_bytes) for _ in hs]
        n = c.namespace(spec(model)).get(hs, outs)
        return [bytes(o) for o in outs[:n]]


def get_eventually(d: DaemonProc, hs: list[bytes], want: list[bytes], what: str, timeout: float = 60.0) -> None:
    """Get until every block arrives, each answer a prefix of the right bytes. For a node's first reads after the
    store came back: the first transfer to a node opens its connection within remote.timeout_s, and on a loaded
    machine that can run out, a miss (never wrong bytes) until a later read finds the connection open."""
    def whole() -> bool:
        got = get_all(d, hs)
        assert got == want[:len(got)], "a get served wrong bytes"
        return len(got) == len(want)
    try:
        wait_for(whole, what, timeout=timeout)
    except AssertionError as e:
        raise AssertionError(f"{e}; the remote tier's counters: {remote_of(d)['counters']}") from None


def writer_and_reader(master: MooncakeMaster, daemons: list[DaemonProc], n: int, tag: bytes,
                      **reader_env: str) -> tuple[DaemonProc, DaemonProc, list[bytes]]:
    """Node A writes n blocks through to the store (seeds 0..n-1), node B starts empty."""
    a = node(daemons, master, KVSTORE_REMOTE_PLACEMENT="write_through")
    b = node(daemons, master, **reader_env)
    hs = hashes(n, tag=tag)
    put_through(a, hs, range(n))
    return a, b, hs


def test_a_block_stored_on_one_node_is_a_byte_exact_hit_on_another(master, daemons):
    a, b, hs = writer_and_reader(master, daemons, 40, b"cross")
    with b.client() as c:
        ns = c.namespace(spec())
        assert ns.lookup(hs) == 40
        s = c.stats()
        assert s["counters"]["hits_remote"] == 40 and s["counters"]["hits_host"] == 0
    assert get_all(b, hs) == [block(i) for i in range(40)]
    with b.client() as c:
        r = remote_of(b, c)
        assert r["counters"]["gets"] == 40 and r["counters"].get("crc_mismatch", 0) == 0
        assert c.stats()["counters"]["acquired_lower"] == 40
    # now in B's host pool: a second get is a host hit, nothing more from the store
    assert get_all(b, hs) == [block(i) for i in range(40)]
    assert remote_of(b)["counters"]["gets"] == 40


def test_a_prefix_ends_at_the_first_block_the_store_lacks(master, daemons):
    a = node(daemons, master, KVSTORE_REMOTE_PLACEMENT="write_through")
    b = node(daemons, master)
    hs = hashes(20, tag=b"holes")
    put_through(a, hs[:12], range(12))
    put_through(a, hs[14:], range(14, 20))
    with b.client() as c:
        assert c.namespace(spec()).lookup(hs) == 12
    got = get_all(b, hs)
    assert got == [block(i) for i in range(12)]


def test_held_answers_each_block_the_store_holds_across_holes(master, daemons):
    """A hybrid model's window and state groups ask which blocks are held, each on its own (Namespace.held): on a
    node that holds none of them itself, the store answers, holes and all, and nothing is pinned or fetched."""
    a = node(daemons, master, KVSTORE_REMOTE_PLACEMENT="write_through")
    b = node(daemons, master)
    hs = hashes(20, tag=b"held")
    present = [1, 2, 7, 19]
    put_through(a, [hs[i] for i in present], present)
    with b.client() as c:
        assert c.namespace(spec()).held(hs) == [i in present for i in range(20)]
        assert remote_of(b, c)["counters"].get("gets", 0) == 0 and c.stats()["pinned"] == 0


def test_namespaces_do_not_cross_nodes(master, daemons):
    a = node(daemons, master, KVSTORE_REMOTE_PLACEMENT="write_through")
    b = node(daemons, master)
    hs = hashes(16, tag=b"ns")
    put_through(a, hs, range(16), model="model-a")
    with b.client() as c:
        assert c.namespace(spec("model-a")).lookup(hs) == 16
        assert c.namespace(spec("model-b")).lookup(hs) == 0
        assert c.namespace(spec("model-a", salt="other")).lookup(hs) == 0
    assert get_all(b, hs, model="model-b") == []


def test_evicted_blocks_go_to_the_store_and_come_back_on_any_node(master, daemons):
    """Write-back: a pool of 2 MiB holding 8 KiB blocks evicts most of 600; they are put from staging, and come
    back byte-exact on the node itself and on another."""
    a = node(daemons, master, capacity="2MiB")                  # placement auto, no SSD: write-back
    b = node(daemons, master)
    hs = hashes(600, tag=b"evict")
    with a.client() as c:
        assert c.namespace(spec()).put(hs, [block(i) for i in range(600)]).stored == 600
        wait_for(lambda: remote_of(a, c)["counters"].get("demoted", 0) >= 300 and
                 remote_of(a, c)["staged_blocks"] == 0, "the evicted blocks are put")
        r = remote_of(a, c)
        assert r["placement"] == "write_back" and c.stats()["counters"]["evictions"] >= 300
    sample = range(0, 600, 5)
    on_b = {i: get_all(b, [hs[i]]) for i in sample}             # B holds none: each is in the store or not
    assert all(got == [block(i)] for i, got in on_b.items() if got)
    assert sum(bool(got) for got in on_b.values()) >= 0.4 * len(sample)
    assert remote_of(b)["counters"]["gets"] == sum(bool(got) for got in on_b.values())
    assert all(get_all(a, [hs[i]]) == [block(i)] for i in sample)   # A: from its pool or back from the store
    assert remote_of(a)["counters"]["gets"] > 0


def test_a_value_that_fails_its_writers_crc_is_a_miss(master, daemons):
    """A value changed in the store (a byte flipped, the trailer replaced) is never served: the prefix ends before
    it, on every reader; it is quarantined and removed from the store."""
    from mooncake.store import MooncakeDistributedStore

    a, b, hs = writer_and_reader(master, daemons, 12, b"crc")
    digest = spec().digest()
    rogue = MooncakeDistributedStore()
    assert setup_on_loopback(rogue, master.metadata, master.address, 16 << 20, 16 << 20) == 0
    try:
        bad = bytearray(block(5))
        bad[100] ^= 0xFF
        assert rogue.upsert(store_key(digest + hs[5]), bytes(bad) + trailer.pack(len(bad), crc32c(block(5)))) == 0
        assert rogue.upsert(store_key(digest + hs[8]), block(8) + bytes(trailer.SIZE)) == 0     # not our trailer
        assert get_all(b, hs) == [block(i) for i in range(5)]
        r = remote_of(b)
        assert r["counters"]["crc_mismatch"] == 1                # quarantined: not read again
        assert get_all(b, hs) == [block(i) for i in range(5)]
        assert remote_of(b)["counters"]["crc_mismatch"] == 1
        # the blocks after it are still good in the store: a get that starts there is served
        assert get_all(b, hs[6:8]) == [block(6), block(7)]
        assert get_all(b, hs[8:]) == []                       # a value without a trailer of ours: a miss
        assert remote_of(b)["counters"]["bad_value"] == 1
        # both bad values were removed from the store: the writer can put good ones again
        wait_for(lambda: rogue.batch_is_exist([store_key(digest + hs[5]), store_key(digest + hs[8])]) == [0, 0],
                 "the bad values are removed")
        with a.client() as c:                                  # A's host copies are intact
            outs = [bytearray(GEOM.full_bytes) for _ in hs]
            assert c.namespace(spec()).get(hs, outs) == 12 and bytes(outs[5]) == block(5)
    finally:
        rogue.close()


def test_a_delete_on_one_node_removes_the_block_for_all(master, daemons):
    a, b, hs = writer_and_reader(master, daemons, 8, b"del")
    with a.client() as c:
        assert c.namespace(spec()).delete(hs[4:]) == 4
    with b.client() as c:
        ns = c.namespace(spec())
        wait_for(lambda: ns.lookup(hs) == 4, "the store forgets the deleted blocks")
    assert get_all(b, hs) == [block(i) for i in range(4)]


def test_master_down_daemons_keep_serving_and_link_again_when_it_returns(master, daemons):
    a, b, hs = writer_and_reader(master, daemons, 16, b"down", KVSTORE_REMOTE_TIMEOUT_S="1")
    master.stop()
    # A's host pool keeps serving; B's lookups of remote blocks are misses, and it says the store is down
    assert get_all(a, hs) == [block(i) for i in range(16)]
    with b.client() as c:
        ns = c.namespace(spec())
        assert ns.lookup(hs) == 0
        assert ns.lookup(hs) == 0
        r = remote_of(b, c)
        assert not r["up"] and r["counters"]["went_down"] >= 1 and r["last_error"], str(r["counters"])
        assert c.stats()["counters"]["misses"] == 32
        # B's own blocks are served from its host pool meanwhile
        mine = hashes(4, tag=b"down-b")
        assert ns.put(mine, [block(100 + i) for i in range(4)]).stored == 4
    assert get_all(b, mine) == [block(100 + i) for i in range(4)]
    master.start()            # same ports; a new master knows nothing of the old blocks
    for d in (a, b):
        wait_for(lambda d=d: remote_of(d)["up"], "the tier links again", timeout=60)
    assert remote_of(b)["counters"]["connects"] >= 1
    fresh = hashes(8, tag=b"after")
    wait_for(lambda: _put_ok(a, fresh), "the store takes puts again", timeout=60)
    with b.client() as c:
        assert c.namespace(spec()).lookup(fresh) == 8
    get_eventually(b, fresh, [block(200 + i) for i in range(8)], "B gets the blocks A put after the return")


def test_a_daemon_started_before_its_master_serves_and_links_when_it_comes(daemons):
    """No master yet: the daemon starts and serves its host pool at once (nothing waits for the store), says the
    store is down, and links by itself once the master listens."""
    m = MooncakeMaster()
    try:
        d = DaemonProc("16MiB", "1MiB", env=m.env())
        daemons.append(d)
        d.start()
        hs = hashes(4, tag=b"early")
        with d.client() as c:
            ns = c.namespace(spec())
            assert ns.put(hs, [block(i) for i in range(4)]).stored == 4
            assert ns.lookup(hashes(4, tag=b"never")) == 0
            r = remote_of(d, c)
            assert not r["up"] and "does not answer" in r["last_error"]
        assert get_all(d, hs) == [block(i) for i in range(4)]
        m.start()
        wait_for(lambda: remote_of(d)["up"], "the tier links once the master listens", timeout=60)
        assert remote_of(d)["counters"]["connects"] == 1
    finally:
        m.close()


def _put_ok(d: DaemonProc, hs: list[bytes]) -> bool:
    """Store and write through again (a restarted master takes a moment before it places values)."""
    with d.client() as c:
        before = remote_of(d, c)["counters"].get("puts", 0)
        c.namespace(spec()).delete(hs)
        c.namespace(spec()).put(hs, [block(200 + i) for i in range(len(hs))])
        try:
            wait_for(lambda: remote_of(d, c)["counters"].get("puts", 0) - before >= len(hs), "put", timeout=3)
            return True
        except AssertionError:
            return False


def test_blocks_with_two_replicas_outlive_the_node_that_wrote_them(master, daemons):
    """Three nodes; A writes with replicas 2 and is killed (-9): B still gets every block, byte-exact, once the
    master has noticed A's loss (until then a read that reaches A's segment fails: a miss, never wrong bytes)."""
    a = node(daemons, master, KVSTORE_REMOTE_PLACEMENT="write_through", KVSTORE_REMOTE_REPLICAS="2")
    b = node(daemons, master)
    node(daemons, master)
    hs = hashes(16, tag=b"replicas")
    put_through(a, hs, range(16))
    a.stop(signal.SIGKILL)
    want = [block(i) for i in range(16)]

    def served() -> bool:
        got = get_all(b, hs)
        assert got == want[:len(got)]                  # a prefix of the right bytes, never others
        return len(got) == 16
    wait_for(served, "B gets every block from the surviving replicas", timeout=90)


def ssd_beside_store(master: MooncakeMaster, daemons: list[DaemonProc], ssd_dir: str, n: int, tag: bytes,
                     capacity: str = "1MiB", **env: str) -> tuple[DaemonProc, list[bytes]]:
    """A node with an SSD tier beside the store, holding n blocks in both: written through 32 at a time (each
    batch waited for) through a host pool too small for them (most evicted to the SSD), the SSD's staging
    written, the host pool emptied."""
    d = DaemonProc(capacity, "1MiB", env=master.env(
        KVSTORE_SSD_DIR=ssd_dir, KVSTORE_SSD_CAPACITY="64MiB", KVSTORE_SSD_PROMOTE_RESERVE="0", **env))
    daemons.append(d)
    d.start()
    wait_for(lambda: remote_of(d)["up"], "the remote tier links")
    hs = hashes(n, tag=tag)
    for start in range(0, n, 32):
        put_through(d, hs[start:start + 32], range(start, start + 32))
    with d.client() as c:
        wait_for(lambda: _ssd(c)["staged_blocks"] == 0, "the SSD has written what it staged")
        c.evict(everything=True)
    return d, hs


def test_the_read_goes_where_it_finishes_first(master, daemons, tmp_path):
    """DualPath: a node with an SSD tier and the store both holding its blocks reads each promotion from the path
    expected to finish first. With the SSD slowed, reads go to the store; with the network slowed, to the SSD.
    Slowed to 1 MB/s: far below what the other path is measured at even on a loaded machine (at 4 MB/s, a loaded
    2-core machine once measured the network's small puts slower, and the chooser rightly went to the SSD)."""
    for slow, slow_tier, fast in (("ssd", "ssd", "remote"), ("net", "remote", "ssd")):
        d, hs = ssd_beside_store(master, daemons, str(tmp_path / slow), 384, slow.encode(),
                                 KVSTORE_SLOW_DEVICE=f"{slow}:1MB:1")
        with d.client() as c:
            before = dict(c.stats()["counters"])
            for start in range(0, 256, 32):                    # each chunk was evicted: promoted from one holder
                outs = [bytearray(GEOM.full_bytes) for _ in range(32)]
                assert c.namespace(spec()).get(hs[start:start + 32], outs) == 32
                assert [bytes(o) for o in outs] == [block(i) for i in range(start, start + 32)]
            after = c.stats()["counters"]
        chose = {t: after[f"reads_{t}"] - before[f"reads_{t}"] for t in ("ssd", "remote")}
        assert chose[fast] > chose[slow_tier], (slow, chose)
        d.stop()


def test_a_read_the_store_cannot_serve_falls_back_to_the_ssd(master, daemons, tmp_path):
    """The store is the faster way (the SSD slowed), but its value fails its check: the same get is served from the
    SSD, byte-exact — a bad remote value costs a detour, never a miss while a local copy exists."""
    from mooncake.store import MooncakeDistributedStore

    d, hs = ssd_beside_store(master, daemons, str(tmp_path / "ssd"), 256, b"fallback",
                             KVSTORE_SLOW_DEVICE="ssd:1MB:1", KVSTORE_REMOTE_KNOWN_S="60")
    with d.client() as c:
        # until the SSD's path has measured itself slow (its bandwidth is nominal until it has moved 1 MiB)
        wait_for(lambda: next(p for p in c.stats()["traffic"] if p["path"] == "ssd")["bandwidth_bps"] < 8e6,
                 "the SSD path measures its slowness")
        for start in range(0, 64, 16):                          # and the network path its speed
            assert len(get_all(d, hs[start:start + 16])) == 16
        c.evict(everything=True)
    rogue = MooncakeDistributedStore()
    assert setup_on_loopback(rogue, master.metadata, master.address, 16 << 20, 16 << 20) == 0
    try:
        key = store_key(spec().digest() + hs[200])
        assert rogue.upsert(key, bytes(GEOM.full_bytes) + trailer.pack(GEOM.full_bytes, crc32c(block(200)))) == 0
        before = remote_of(d)["counters"].get("crc_mismatch", 0)
        assert get_all(d, hs[200:204]) == [block(i) for i in range(200, 204)]
        assert remote_of(d)["counters"].get("crc_mismatch", 0) == before + 1
    finally:
        rogue.close()


def test_concurrent_reads_split_between_two_paths_equally_fast(master, daemons, tmp_path):
    """DualPath with a mixed load: the SSD and the network equally slow, four readers at once; once one path has a
    queue, the next read is expected to finish first on the other, so both carry reads."""
    import threading

    d, hs = ssd_beside_store(master, daemons, str(tmp_path / "ssd"), 512, b"mixed", capacity="2MiB",
                             KVSTORE_SLOW_DEVICE="ssd:4MB:1,net:4MB:2")
    with d.client() as c:
        before = dict(c.stats()["counters"])
    errors: list[BaseException] = []

    def reader(k: int) -> None:
        try:
            for start in range(k * 128, (k + 1) * 128, 16):
                got = get_all(d, hs[start:start + 16])
                assert got == [block(i) for i in range(start, start + 16)]
        except BaseException as e:            # noqa: BLE001 - reported by the test thread
            errors.append(e)
    threads = [threading.Thread(target=reader, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    with d.client() as c:
        after = c.stats()["counters"]
    chose = {t: after[f"reads_{t}"] - before[f"reads_{t}"] for t in ("ssd", "remote")}
    assert chose["ssd"] >= 4 and chose["remote"] >= 4, chose


def test_prefetch_brings_the_stores_blocks_into_the_host_pool(master, daemons):
    a, b, hs = writer_and_reader(master, daemons, 24, b"prefetch")
    with b.client() as c:
        r = c.namespace(spec()).prefetch(hs, wait=True)
        assert r == {"queued": 24, "done": 24, "skipped": 0}
        assert remote_of(b, c)["counters"]["gets"] == 24
    assert get_all(b, hs) == [block(i) for i in range(24)]
    with b.client() as c:
        s = c.stats()
        assert s["counters"]["acquired_host"] == 24 and s["counters"]["acquired_lower"] == 0
        assert remote_of(b, c)["counters"]["gets"] == 24


def _ssd(c: Client) -> dict[str, Any]:
    return next(t for t in c.stats()["tiers"] if t.get("tier") == "ssd")


def test_stats_top_and_prometheus_show_the_remote_tier_and_the_network_path(master, daemons):
    import json
    import subprocess
    import sys
    import urllib.request

    from tests.mooncake_master import free_port

    port = free_port()
    a = node(daemons, master, KVSTORE_REMOTE_PLACEMENT="write_through")
    b = node(daemons, master, KVSTORE_METRICS_ENABLED="true", KVSTORE_METRICS_PORT=str(port))
    hs = hashes(8, tag=b"stats")
    put_through(a, hs, range(8))
    assert len(get_all(b, hs)) == 8

    def cli(*args: str) -> str:
        r = subprocess.run([sys.executable, "-m", "kvstore", "--socket", b.socket, *args], capture_output=True,
                           text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        return r.stdout
    text = cli("stats")
    assert f"remote store at {master.address}: up; write_back, 1 replica(s)" in text and "gets 8" in text
    row = next(t for t in json.loads(cli("stats", "--json"))["tiers"] if t["tier"] == "remote")
    assert row["counters"]["gets"] == 8 and row["capacity_bytes"] == 64 << 20
    top = json.loads(cli("top", "--json", "--interval", "0.2", "--count", "1").splitlines()[0])
    assert {r["path"] for r in top["paths"]} >= {"net"}
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        metrics = r.read().decode()
    assert "kvstore_remote_up 1.0" in metrics
    assert 'kvstore_remote_events_total{event="gets"} 8.0' in metrics
    assert 'kvstore_tier_capacity_bytes{tier="remote"} 6.7108864e+07' in metrics
    assert 'kvstore_traffic_bytes_total{lane="critical",path="net"} ' + f"{float(8 * GEOM.full_bytes)}" in metrics
    assert "kvstore_acquired_lower_total 8.0" in metrics and "kvstore_hits_remote_total 0.0" in metrics


@pytest.mark.parametrize("env, message", [
    ({"KVSTORE_REMOTE_MASTER": "nohost"}, "remote.master: must be host:port"),
    ({"KVSTORE_REMOTE_PLACEMENT": "sideways"}, "remote.placement: must be one of"),
    ({"KVSTORE_REMOTE_REPLICAS": "0"}, "remote.replicas: must be 1..8"),
    ({"KVSTORE_REMOTE_PROTOCOL": "udp"}, "remote.protocol: must be tcp or rdma"),
    ({"KVSTORE_REMOTE_METADATA": "ftp://x"}, "remote.metadata: must be an http://"),
    ({"KVSTORE_REMOTE_SEGMENT_BYTES": "4KiB"}, "remote.segment_bytes: must be 0"),
    ({"KVSTORE_REMOTE_BUFFER_BYTES": "4KiB"}, "remote.buffer_bytes: must be at least 1MiB"),
    ({"KVSTORE_REMOTE_TIMEOUT_S": "0"}, "remote.timeout_s: must be above 0"),
    ({"KVSTORE_REMOTE_IN_FLIGHT": "0"}, "remote.in_flight: must be 1..64"),
    ({"KVSTORE_REMOTE_BIND_ADDRESS": "lo"}, "remote.bind_address: must be empty"),
    ({"KVSTORE_REMOTE_HOSTNAME": ""}, "remote.hostname: must be this node's IP address"),
    ({"KVSTORE_REMOTE_UNREACHABLE_S": "0"}, "remote.unreachable_s: must be above 0"),
])
def test_remote_config_errors_are_clear(env: dict[str, str], message: str) -> None:
    from kvstore.daemon.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=message):
        load_config(None, {"KVSTORE_REMOTE_MASTER": "127.0.0.1:1", **env})


def test_a_node_may_lend_the_store_nothing() -> None:
    from kvstore.daemon.config import load_config

    assert load_config(None, {"KVSTORE_REMOTE_MASTER": "127.0.0.1:1",
                              "KVSTORE_REMOTE_SEGMENT_BYTES": "0"}).remote.segment_bytes == 0


def test_write_back_beside_an_ssd_tier_is_refused_with_the_reason(master, tmp_path):
    d = DaemonProc("16MiB", "1MiB", env=master.env(KVSTORE_SSD_DIR=str(tmp_path / "ssd"),
                                                   KVSTORE_REMOTE_PLACEMENT="write_back"))
    try:
        with pytest.raises(RuntimeError, match="beside an SSD tier the SSD takes the host pool's evictions"):
            d.start()
    finally:
        d.cleanup()

