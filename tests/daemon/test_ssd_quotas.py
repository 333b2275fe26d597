"""Tenants' SSD quotas against a live daemon (issue 17 part 1; kvstore.tiers.ssd.owners): blocks demoted by a busy
tenant never push a quiet tenant's SSD blocks below its quota, whose each block is survives a restart before any
engine says hello again, and the quotas show in `kvstore tenants` and Prometheus and change online from the CLI."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import zlib
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvstore.client import Client, KVStoreError
from kvstore.protocol.geometry import Geometry
from kvstore.tiers.ssd.record import HEADER_BYTES
from tests.conftest import DaemonProc, block, spec, ssd_settled
from tests.daemon.test_metrics import free_port, scrape
from tests.daemon.test_quotas import BLOCK, PER_SEG, SECRETS, Tenant, rows

RECORD = HEADER_BYTES + BLOCK              # one SSD record: 132 KiB
KIB = 1024


def ssd_quota_daemon(tmp_path: Path, daemons: list[DaemonProc], ssd_quota: int | None,
                     env: dict[str, str] | None = None) -> DaemonProc:
    """Tenants a and b with `ssd_quota` records each (None: no SSD quota), a 2 MiB host pool (16 blocks) and an SSD
    tier of 16 records, in tmp_path/ssd (restarts share it)."""
    conf = tmp_path / "kvstore.yaml"
    tenants = [{"name": n, "secret": SECRETS[n]} for n in ("a", "b")]
    if ssd_quota is not None:
        for t in tenants:
            t["ssd"] = f"{ssd_quota * RECORD // KIB}KiB"
    conf.write_text(yaml.safe_dump({"tenants": tenants, "ssd": {"dir": str(tmp_path / "ssd"),
                                                                 "capacity": f"{16 * RECORD // KIB}KiB"}}))
    d = DaemonProc(capacity="2MiB", segment="1MiB", env={"KVSTORE_CONFIG": str(conf), **(env or {})}).start()
    daemons.append(d)
    return d


def flood(d: DaemonProc) -> None:
    """b stores 32 blocks (16 go down to the SSD: it borrows the whole tier), then a stores 32 (b's other 16 and a's
    first 16 go down). A segment's worth at a time, each put's demotions written before the next: a write batch
    never holds more blocks than the tier has records (its later blocks would find every record taken by its
    earlier ones, unpublished yet, and be dropped — whatever the quotas)."""
    with d.client() as c:
        for t in (Tenant(d, "b"), Tenant(d, "a")):
            for i in range(4):
                assert t.put(i * PER_SEG, PER_SEG) == PER_SEG
                ssd_settled(c)
            t.close()


def test_a_busy_tenant_never_pushes_a_quiet_one_below_its_ssd_quota(tmp_path, daemons):
    port = free_port()
    d = ssd_quota_daemon(tmp_path, daemons, 8, env={"KVSTORE_METRICS_ENABLED": "true",
                                                    "KVSTORE_METRICS_PORT": str(port),
                                                    "KVSTORE_METRICS_PER_TENANT": "true"})
    flood(d)
    r = rows(d)
    assert (r["a"]["ssd_used_bytes"], r["b"]["ssd_used_bytes"]) == (8 * RECORD, 8 * RECORD)
    assert (r["b"]["ssd_taken"], r["a"]["ssd_taken"]) == (8, 0)       # b gave back what it borrowed, no more
    assert r["b"]["ssd_quota_bytes"] == 8 * RECORD
    m = scrape(port)
    for t in ("a", "b"):
        labels = (("tenant", t),)
        for name in ("ssd_quota_bytes", "ssd_used_bytes", "ssd_borrowed_bytes"):
            assert m[(f"kvstore_tenant_{name}", labels)] == r[t][name], (t, name)
        for name in ("ssd_evictions", "ssd_taken"):
            assert m[(f"kvstore_tenant_{name}_total", labels)] == r[t][name], (t, name)

    d.stop()                                        # a restart: the owners come from the tier's directory
    d.start()
    r = rows(d)                                     # before any tenant's hello
    assert (r["a"]["ssd_used_bytes"], r["b"]["ssd_used_bytes"]) == (8 * RECORD, 8 * RECORD)
    b = Tenant(d, "b")
    try:
        assert b.intact(24, 8)                      # b's newest 8 blocks come back from the SSD, byte for byte
    finally:
        b.close()


def test_without_ssd_quotas_the_busy_tenant_takes_the_whole_tier(tmp_path, daemons):
    d = ssd_quota_daemon(tmp_path, daemons, None)
    flood(d)
    r = rows(d)
    assert (r["a"]["ssd_used_bytes"], r["b"]["ssd_used_bytes"]) == (16 * RECORD, 0)
    with d.client() as c:
        assert c.tenants()["ssd_quotas"] is False
        with pytest.raises(KVStoreError, match="SSD quotas are off"):
            c.set_quota("a", ssd=RECORD)


def test_ssd_quotas_change_online_from_the_cli(tmp_path, daemons):
    d = ssd_quota_daemon(tmp_path, daemons, 8)

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "kvstore", "--socket", d.socket, "tenants", *args],
                              capture_output=True, text=True, env={**os.environ, **d.env}, timeout=60)

    out = cli("set", "a", "--ssd", f"{9 * RECORD // KIB}KiB")          # b's 8 records still guaranteed: 17 > 16
    assert out.returncode == 1 and "above the tier's capacity" in out.stderr, out
    out = cli("set", "b", "--ssd", f"{4 * RECORD // KIB}KiB")
    assert out.returncode == 0 and "ssd quota 1.0 MiB -> 528.0 KiB" in out.stdout, out
    out = cli("set", "a", "--ssd", f"{12 * RECORD // KIB}KiB", "--host", "1MiB")
    assert out.returncode == 0, out
    got: dict[str, Any] = json.loads(cli("--json").stdout)
    quotas = {r["tenant"]: (r["quota_bytes"], r["ssd_quota_bytes"]) for r in got["tenants"]}
    assert quotas["a"] == (1 << 20, 12 * RECORD) and quotas["b"] == (0, 4 * RECORD)
    table = cli().stdout
    assert "SSD tier" in table and "taken by others" in table, table
    flood(d)
    r = rows(d)                                     # b keeps its new quota's worth, a takes the rest
    assert (r["a"]["ssd_used_bytes"], r["b"]["ssd_used_bytes"]) == (12 * RECORD, 4 * RECORD)


SMALL_GEOM = Geometry(layers=2, tokens=16, kv_heads=4, head_dim=128, dtype="float16")    # another model: 64 KiB
SMALL_RECORD = HEADER_BYTES + SMALL_GEOM.full_bytes


class SmallTenant(Tenant):
    """A tenant whose model has half the KV per block: its SSD records live in another file."""

    def __init__(self, d: DaemonProc, name: str) -> None:
        self.name = name
        self.c = Client(d.socket, tenant=name, secret=SECRETS[name])
        self.ns = self.c.namespace(spec(model="small", geometry=SMALL_GEOM))

    def put(self, start: int, n: int) -> int:
        return sum(self.ns.put(self.keys(s, min(16, start + n - s)),
                               [self.data(i) for i in range(s, min(s + 16, start + n))]).stored
                   for s in range(start, start + n, 16))

    def data(self, i: int) -> bytes:
        return block(zlib.crc32(f"{self.name}/{i}".encode()), SMALL_GEOM.full_bytes)


def test_a_quota_holds_against_another_models_blocks(tmp_path, daemons):
    """b's model has smaller blocks and fills the SSD first; a's demotions then take b's borrowed records out of
    b's file (punched) and grow a's own: each ends at its quota — a to within one of its records, since the two
    sizes do not tile and b is never pushed below its own — and a's blocks come back byte for byte.

    Where b ends depends on the order of the two tenants' demotions, and either end is right: at 17 of its records
    (a's 8th finds that b could free only one, with room for a's record needing two, and evicts none of b's for
    nothing), or at 16 with that room free (a run whose b wrote last took it back). What holds in both: b could
    not give a another record without going below its quota."""
    d = ssd_quota_daemon(tmp_path, daemons, 8)
    b = SmallTenant(d, "b")
    assert b.put(0, 64) == 64                       # 2 MiB host pool: 32 of b's go down, the SSD holds 16 × 132 KiB
    with d.client() as c:
        ssd_settled(c)
    assert rows(d)["b"]["ssd_used_bytes"] > 8 * RECORD                    # b borrowed a's share
    a = Tenant(d, "a")
    try:
        assert a.put(0, 4 * PER_SEG) == 4 * PER_SEG
        with d.client() as c:
            s = ssd_settled(c)
        r = rows(d)
        a_used, b_used = r["a"]["ssd_used_bytes"], r["b"]["ssd_used_bytes"]
        assert 7 * RECORD <= a_used <= 8 * RECORD        # a's quota to within one of its records: sizes do not
        assert b_used >= 8 * RECORD                       # tile, and b is not pushed below its own
        ssd = next(t for t in s["tiers"] if t["tier"] == "ssd")
        assert ssd["counters"]["punched"] > 0 and ssd["resident_bytes"] <= 16 * RECORD
        free = 16 * RECORD - ssd["resident_bytes"]
        givable = (b_used - 8 * RECORD) // SMALL_RECORD * SMALL_RECORD   # b's records above its quota
        assert free + givable < RECORD, (a_used, b_used, free)           # no room left that a could have had
        down = [i for i in range(16) if a.held(i, 1)]   # a's blocks that went down, as many as its records ...
        assert len(down) == a_used // RECORD
        a.ns.delete(a.keys(16, 16))                      # room in the host pool: the reads below evict nothing
        outs = [bytearray(BLOCK) for _ in down]          # ... come back from the SSD byte for byte
        assert a.ns.get([a.keys(i, 1)[0] for i in down], outs) == len(down)
        assert all(bytes(o) == a.data(i) for i, o in zip(down, outs))
    finally:
        a.close()
        b.close()


def test_a_quota_change_is_all_or_nothing_and_bad_ones_say_why(tmp_path, daemons):
    d = ssd_quota_daemon(tmp_path, daemons, 8)
    with d.client() as c:
        with pytest.raises(KVStoreError, match="give host, ssd or both"):
            c.call("tenant_quota", tenant="a")
        with pytest.raises(KVStoreError, match="field .ssd. must be a non-negative integer"):
            c.set_quota("a", ssd=-1)
        with pytest.raises(KVStoreError, match="over the pool's capacity"):
            c.set_quota("a", ssd=4 * RECORD, host=64 << 20)        # the SSD part fits, the host part does not
        got = {r["tenant"]: r for r in c.tenants()["tenants"]}
        assert (got["a"]["ssd_quota_bytes"], got["a"]["quota_bytes"]) == (8 * RECORD, 0)   # neither changed


def test_an_ssd_quota_needs_an_ssd_tier(daemons):
    d = DaemonProc(capacity="2MiB", segment="1MiB").start()
    daemons.append(d)
    with d.client() as c, pytest.raises(KVStoreError, match="this daemon has no SSD tier"):
        c.set_quota("", ssd=1 << 20)
