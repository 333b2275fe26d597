"""Tenants' quotas and lending against a live daemon (issue 17, parts 1-4 and 7; kvstore.index.quotas): a tenant
within its quota takes borrowed memory back, a loaded tenant borrows what nobody uses (free memory, a lender's idle
segments), nobody is pushed below its quota by another's load, static partitions never lend, quotas change online,
and the cap holds under concurrent load. Blocks of 128 KiB in 1 MiB segments: 8 blocks a segment."""
from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
import zlib
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvstore.client import Client, KVStoreError
from kvstore.protocol.geometry import Geometry
from tests.conftest import DaemonProc, block, hashes, spec
from tests.daemon.test_metrics import free_port, scrape

MIB = 1 << 20
GEOM = Geometry(layers=2, tokens=16, kv_heads=8, head_dim=128, dtype="float16")
BLOCK = GEOM.full_bytes
PER_SEG = MIB // BLOCK
SECRETS = {"a": "secret-a", "b": "secret-b"}


def quota_daemon(tmp_path: Path, daemons: list[DaemonProc], quotas: dict[str, str], capacity: str = "8MiB",
                 env: dict[str, str] | None = None, policy: str = "", **tenancy: Any) -> DaemonProc:
    """A daemon with the tenants of `quotas` (name → host quota), each under `policy` (empty: pool.eviction)."""
    conf = tmp_path / "kvstore.yaml"
    conf.write_text(yaml.safe_dump({
        "tenants": [{"name": n, "secret": SECRETS[n], "host": q, "policy": policy} for n, q in quotas.items()],
        "tenancy": {"window_s": 600, **tenancy}}))
    d = DaemonProc(capacity=capacity, segment="1MiB", env={"KVSTORE_CONFIG": str(conf), **(env or {})}).start()
    daemons.append(d)
    return d


class Tenant:
    """One tenant's client and namespace; blocks named by (tag, i) so each tenant's chains are its own."""

    def __init__(self, d: DaemonProc, name: str) -> None:
        self.name = name
        self.c = Client(d.socket, tenant=name, secret=SECRETS[name])
        self.ns = self.c.namespace(spec(geometry=GEOM))

    def put(self, start: int, n: int) -> int:
        stored = 0
        for s in range(start, start + n, PER_SEG):       # one segment's worth a put: its own short chain
            k = min(PER_SEG, start + n - s)
            stored += self.ns.put(self.keys(s, k), [self.data(i) for i in range(s, s + k)]).stored
        return stored

    def fill(self, start: int, n: int) -> int:
        """Put again each segment's worth of blocks [start, start + n) that the daemon does not hold whole; how many
        of them it holds then. (A put's `stored` counts only new blocks: summing it over retries misses a chunk
        refused before a later one was stored.)"""
        for s in range(start, start + n, PER_SEG):
            k = min(PER_SEG, start + n - s)
            if self.held(s, k) < k:
                self.put(s, k)
        return self.held(start, n)

    def held(self, start: int, n: int) -> int:
        """How many of blocks [start, start + n) the daemon still holds (each looked up alone)."""
        return sum(self.ns.lookup(self.keys(i, 1)) for i in range(start, start + n))

    def intact(self, start: int, n: int) -> bool:
        outs = [bytearray(BLOCK) for _ in range(n)]
        return self.ns.get(self.keys(start, n), outs) == n and all(
            bytes(o) == self.data(start + i) for i, o in enumerate(outs))

    def keys(self, start: int, n: int) -> list[bytes]:
        return hashes(n, start, tag=self.name.encode())

    def data(self, i: int) -> bytes:
        return block(zlib.crc32(f"{self.name}/{i}".encode()), BLOCK)

    def close(self) -> None:
        self.c.close()


def rows(d: DaemonProc) -> dict[str, dict[str, Any]]:
    with d.client() as c:
        return {r["tenant"]: r for r in c.tenants()["tenants"]}


def test_a_borrower_gives_memory_back_and_never_pushes_the_lender_below_its_quota(tmp_path, daemons):
    d = quota_daemon(tmp_path, daemons, {"a": "4MiB", "b": "4MiB"})
    a, b = Tenant(d, "a"), Tenant(d, "b")
    try:
        # b is quiet: a borrows the free half of the pool
        assert a.put(0, 8 * PER_SEG) == 8 * PER_SEG
        r = rows(d)
        assert (r["a"]["used_bytes"], r["a"]["borrowed_bytes"]) == (8 * MIB, 4 * MIB)
        assert r["b"]["lent_bytes"] == 4 * MIB
        # b's load comes: each of its segments is taken back from a, a's stalest first; b loses nothing
        assert b.put(0, 4 * PER_SEG) == 4 * PER_SEG
        r = rows(d)
        assert (r["a"]["used_bytes"], r["b"]["used_bytes"]) == (4 * MIB, 4 * MIB)
        assert (r["b"]["reclaims"], r["a"]["taken_back"], r["b"]["evictions"]) == (4, 4, 0)
        assert a.held(0, 4 * PER_SEG) == 0 and a.held(4 * PER_SEG, 4 * PER_SEG) == 4 * PER_SEG
        assert b.intact(0, 4 * PER_SEG)
        # a, at its quota with the pool full, evicts its own blocks: never b's
        assert a.put(100, 2 * PER_SEG) == 2 * PER_SEG
        r = rows(d)
        assert (r["a"]["used_bytes"], r["b"]["used_bytes"]) == (4 * MIB, 4 * MIB)
        assert r["b"]["evictions"] == 0 and r["a"]["evictions"] == 4 * PER_SEG + 2 * PER_SEG
        assert b.intact(0, 4 * PER_SEG) and a.intact(100, 2 * PER_SEG)
        with d.client() as c:
            t = c.tenants()
        assert t["reclaims"] == 4 and t["reclaim_seconds"]["count"] == 4
        assert t["charged_bytes"] <= t["capacity_bytes"]
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("policy", ["lru", "workflow"])
def test_memory_taken_back_costs_the_borrower_its_coldest_blocks_not_its_segment_mates(tmp_path, daemons, policy):
    """Blocks of one request's chain end up in every segment (sessions interleave): a segment given back as it
    stands cut every hot chain (bench_tenants). The segment's blocks move into the owner's other segments first, and
    its coldest blocks go instead — under either policy (the workflow policy's rows are per slot: `moved` carries a
    block's row, and its place in its group, to the new slot)."""
    d = quota_daemon(tmp_path, daemons, {"a": "4MiB", "b": "4MiB"}, policy=policy)
    a, b = Tenant(d, "a"), Tenant(d, "b")
    try:
        assert a.put(0, 8 * PER_SEG) == 8 * PER_SEG          # block i in a's segment i // PER_SEG
        hot = [s * PER_SEG + PER_SEG - 1 for s in range(8)]   # one hot block in each of a's 8 segments
        for i in hot:
            assert a.intact(i, 1)
        assert b.put(0, 4 * PER_SEG) == 4 * PER_SEG           # 4 segments go back to b
        r = rows(d)
        assert (r["a"]["used_bytes"], r["b"]["reclaims"]) == (4 * MIB, 4)
        assert sum(a.held(i, 1) for i in hot) == 8, "a lost hot blocks that merely shared a segment"
        assert all(a.intact(i, 1) for i in hot)
        assert a.held(0, 1) == 0                                # its coldest went instead
        held = sum(a.held(i, 1) for i in range(8 * PER_SEG))
        assert held == 4 * PER_SEG                              # a's 4 MiB are full: 8 hot + the 24 most recent
        with d.client() as c:
            assert c.stats()["counters"]["blocks_compacted"] > 0
        # a's books followed the moved blocks: its next evictions take its 24 others, then its least recent hot one
        assert a.put(1000, 3 * PER_SEG + 1) == 3 * PER_SEG + 1
        assert [a.held(i, 1) for i in hot] == [0] + [1] * 7
        assert b.intact(0, 4 * PER_SEG)
    finally:
        a.close()
        b.close()


def test_static_partitions_never_lend(tmp_path, daemons):
    d = quota_daemon(tmp_path, daemons, {"a": "4MiB", "b": "4MiB"}, lending=False)
    a, b = Tenant(d, "a"), Tenant(d, "b")
    try:
        assert a.put(0, 8 * PER_SEG) == 8 * PER_SEG       # stored, but a keeps only its quota's worth
        r = rows(d)
        assert (r["a"]["used_bytes"], r["a"]["borrowed_bytes"], r["b"]["lent_bytes"]) == (4 * MIB, 0, 0)
        assert a.held(0, 4 * PER_SEG) == 0 and a.held(4 * PER_SEG, 4 * PER_SEG) == 4 * PER_SEG
        assert b.put(0, 4 * PER_SEG) == 4 * PER_SEG
        r = rows(d)
        assert (r["b"]["used_bytes"], r["b"]["reclaims"], r["a"]["taken_back"]) == (4 * MIB, 0, 0)
        assert b.intact(0, 4 * PER_SEG) and a.intact(4 * PER_SEG, 4 * PER_SEG)
    finally:
        a.close()
        b.close()


def test_a_lenders_idle_segments_are_lent_and_taken_back_when_its_load_returns(tmp_path, daemons):
    """SwiftCache's ScaleDown (keep what the last window touched, lend the rest) and ScaleUp (take back what the
    demand needs). b borrows only what a left untouched for window_s."""
    d = quota_daemon(tmp_path, daemons, {"a": "4MiB", "b": "4MiB"}, window_s=0.5)
    a, b = Tenant(d, "a"), Tenant(d, "b")
    try:
        assert a.put(0, 4 * PER_SEG) == 4 * PER_SEG and b.put(0, 4 * PER_SEG) == 4 * PER_SEG   # the pool is full
        # a's segments were just touched: b, over its quota, evicts its own
        assert b.put(100, PER_SEG) == PER_SEG
        r = rows(d)
        assert (r["a"]["used_bytes"], r["b"]["used_bytes"], r["a"]["lent_segments"]) == (4 * MIB, 4 * MIB, 0)
        assert a.held(0, 4 * PER_SEG) == 4 * PER_SEG
        # a goes quiet but keeps reading one segment's blocks; the other three go idle and are lent
        deadline = time.monotonic() + 1.5
        while time.monotonic() < deadline:
            assert a.intact(3 * PER_SEG, PER_SEG)
            time.sleep(0.1)
        assert b.put(200, 3 * PER_SEG) == 3 * PER_SEG
        r = rows(d)
        assert (r["a"]["used_bytes"], r["b"]["used_bytes"], r["a"]["lent_segments"]) == (MIB, 7 * MIB, 3)
        assert r["a"]["lent_bytes"] == 3 * MIB and r["b"]["borrowed_bytes"] == 3 * MIB
        assert a.intact(3 * PER_SEG, PER_SEG)                # its hot segment stayed
        # a's load returns: within its quota, it takes back what it needs, one segment per allocation
        assert a.put(300, 2 * PER_SEG) == 2 * PER_SEG
        r = rows(d)
        assert (r["a"]["used_bytes"], r["b"]["used_bytes"]) == (3 * MIB, 5 * MIB)
        assert (r["a"]["reclaims"], r["b"]["taken_back"]) == (2, 2)
        assert a.intact(300, 2 * PER_SEG) and a.intact(3 * PER_SEG, PER_SEG)
    finally:
        a.close()
        b.close()


def test_quotas_hold_and_the_cap_is_never_exceeded_under_concurrent_load(tmp_path, daemons):
    """Both tenants want twice their quota at once: each ends with its quota, every block read back is the one
    stored, and the pool's charged bytes (sampled throughout) never pass the cap."""
    d = quota_daemon(tmp_path, daemons, {"a": "3MiB", "b": "5MiB"})
    errors: list[BaseException] = []
    samples: list[int] = []
    stop = threading.Event()

    def load(name: str, segments: int) -> None:
        t = Tenant(d, name)
        try:
            for rnd in range(3):
                for s in range(segments):
                    base = rnd * 1000 + s * PER_SEG
                    t.put(base, PER_SEG)
                    outs = [bytearray(BLOCK) for _ in range(PER_SEG)]
                    n = t.ns.get(t.keys(base, PER_SEG), outs)
                    assert all(bytes(o) == t.data(base + i) for i, o in enumerate(outs[:n])), "wrong bytes"
        except BaseException as e:  # noqa: BLE001 - reported by the test thread
            errors.append(e)
        finally:
            t.close()

    def sample() -> None:
        with d.client() as c:
            while not stop.is_set():
                t = c.tenants()
                samples.append(t["charged_bytes"] - t["capacity_bytes"])
                time.sleep(0.01)

    threads = [threading.Thread(target=load, args=("a", 6)), threading.Thread(target=load, args=("b", 10))]
    sampler = threading.Thread(target=sample)
    sampler.start()
    for th in threads:
        th.start()
    for th in threads:
        th.join(120)
    stop.set()
    sampler.join(10)
    assert not errors, errors
    assert len(samples) > 10 and max(samples) <= 0, max(samples)
    r = rows(d)
    assert (r["a"]["used_bytes"], r["b"]["used_bytes"]) == (3 * MIB, 5 * MIB)
    assert r["a"]["evictions"] > 0 and r["b"]["evictions"] > 0


def test_quotas_change_online_from_the_cli(tmp_path, daemons):
    d = quota_daemon(tmp_path, daemons, {"a": "4MiB", "b": "4MiB"})
    a, b = Tenant(d, "a"), Tenant(d, "b")
    env = {**d.env}

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "kvstore", "--socket", d.socket, "tenants", *args],
                              capture_output=True, text=True, env=env, timeout=60)

    try:
        assert a.put(0, 4 * PER_SEG) == 4 * PER_SEG and b.put(0, 4 * PER_SEG) == 4 * PER_SEG
        out = cli("set", "a", "--host", "6MiB")          # b's 4 MiB still guaranteed: 10 MiB in an 8 MiB pool
        assert out.returncode == 1 and "over the pool's capacity" in out.stderr, out
        out = cli("set", "b", "--host", "2MiB")
        assert out.returncode == 0 and "4.0 MiB -> 2.0 MiB" in out.stdout, out
        out = cli("set", "a", "--host", "6MiB")
        assert out.returncode == 0, out
        table = cli().stdout
        assert "6.0 MiB" in table and "2.0 MiB" in table and "quotas with lending" in table, table
        got = json.loads(cli("--json").stdout)
        assert {r["tenant"]: r["quota_bytes"] for r in got["tenants"]} == {"a": 6 * MIB, "b": 2 * MIB}
        # nothing moved on the change; a's next load takes back what b now borrows
        assert rows(d)["b"]["used_bytes"] == 4 * MIB
        assert a.put(100, 2 * PER_SEG) == 2 * PER_SEG
        r = rows(d)
        assert (r["a"]["used_bytes"], r["b"]["used_bytes"], r["a"]["reclaims"]) == (6 * MIB, 2 * MIB, 2)
        assert a.intact(0, 4 * PER_SEG) and a.intact(100, 2 * PER_SEG)
        # quotas past the pool's capacity are refused, and the refusal says why
        out = cli("set", "a", "--host", "7MiB")
        assert out.returncode == 1 and "over the pool's capacity" in out.stderr, out
        with d.client() as c:                                # nor may the pool shrink below the quotas
            with pytest.raises(KVStoreError) as e:
                c.resize(6 * MIB)
            assert e.value.code == "bad_request" and "quotas total 8388608 bytes" in e.value.message
        out = cli("set", "nobody", "--host", "1MiB")
        assert out.returncode == 1 and "no tenant 'nobody'" in out.stderr, out
    finally:
        a.close()
        b.close()


def test_quota_changes_need_the_admin_role(tmp_path, daemons):
    conf = tmp_path / "kvstore.yaml"
    conf.write_text(yaml.safe_dump({"tenants": [{"name": "a", "secret": "secret-a", "host": "4MiB"}]}))
    d = DaemonProc(capacity="8MiB", segment="1MiB", env={"KVSTORE_CONFIG": str(conf),
                                                         "KVSTORE_SERVER_ADMIN_UIDS": "[4242]"}).start()
    daemons.append(d)
    with Client(d.socket, tenant="a", secret="secret-a") as c:
        with pytest.raises(KVStoreError) as e:
            c.set_quota("a", 8 * MIB)
        assert e.value.code == "forbidden" and "tenants set needs the admin role" in e.value.message
        assert [(r["tenant"], r["quota_bytes"]) for r in c.tenants()["tenants"]] == [("a", 4 * MIB)]
    with Client(d.socket) as c:                              # another tenant (the daemon's user's) sees its own row
        assert [r["tenant"] for r in c.tenants()["tenants"]] == [""]


def test_prometheus_shows_each_tenants_figures(tmp_path, daemons):
    port = free_port()
    d = quota_daemon(tmp_path, daemons, {"a": "4MiB", "b": "2MiB"},
                     env={"KVSTORE_METRICS_ENABLED": "true", "KVSTORE_METRICS_PORT": str(port),
                          "KVSTORE_METRICS_PER_TENANT": "true"})
    a, b = Tenant(d, "a"), Tenant(d, "b")
    try:
        assert a.put(0, 8 * PER_SEG) == 8 * PER_SEG           # a borrows 4 MiB: the whole pool
        assert b.put(0, PER_SEG) == PER_SEG                   # b takes one segment back
        assert a.held(0, 2) == 0 and b.held(0, 4) == 4        # lookups: a misses 2, b hits 4
        r = rows(d)
        m = scrape(port)
    finally:
        a.close()
        b.close()
    for t in ("a", "b"):
        labels = (("tenant", t),)
        for name in ("quota_bytes", "used_bytes", "borrowed_bytes", "lent_bytes"):
            assert m[(f"kvstore_tenant_{name}", labels)] == r[t][name], (t, name)
        for name in ("hits", "misses", "evictions", "reclaims", "taken_back"):
            assert m[(f"kvstore_tenant_{name}_total", labels)] == r[t][name], (t, name)
    assert (r["a"]["used_bytes"], r["b"]["used_bytes"], r["b"]["reclaims"]) == (7 * MIB, 1 * MIB, 1)
    assert (r["a"]["misses"], r["b"]["hits"], r["b"]["hit_rate"]) == (2, 4, 1.0)
    assert m[("kvstore_tenant_reclaim_seconds_count", ())] == 1
