"""The Prometheus endpoint serves the same figures as the stats op (one snapshot feeds both): counters, tier gauges,
errors by code, op latency histograms."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvstore.client import KVStoreError
from tests.conftest import DaemonProc, block, hashes, spec, ssd_settled

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def metered(start_daemon: type[DaemonProc]) -> tuple[DaemonProc, int]:
    port = free_port()
    return start_daemon(env={"KVSTORE_METRICS_ENABLED": "true", "KVSTORE_METRICS_PORT": str(port)}), port  # type: ignore


def scrape(port: int) -> Samples:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        assert r.status == 200
        text = r.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_counters_and_gauges_equal_the_stats_op(start_daemon):
    d, port = metered(start_daemon)
    with d.client() as c:
        ns = c.namespace(spec())
        hs = hashes(6)
        ns.put(hs, [block(i) for i in range(6)])                 # 6 puts
        assert ns.lookup(hs) == 6                                # 6 hits
        assert ns.lookup(hashes(4, tag=b"absent")) == 0          # 4 misses
        outs = [bytearray(len(block(0))) for _ in range(3)]
        assert ns.get(hs[:3], outs) == 3                         # 3 gets
        assert ns.delete(hs[5:]) == 1                            # 1 delete
        lease = ns.acquire(hs[:2])                               # 2 more gets, held across the scrape
        ns.reserve(hashes(1, start=100))                         # and 1 reserved
        s = c.stats()
        m = scrape(port)
        lease.release()

    counters = s["counters"]
    assert {k: counters[k] for k in ("puts", "hits", "misses", "gets", "deletes", "lookups")} == {
        "puts": 6, "hits": 6, "misses": 4, "gets": 5, "deletes": 1, "lookups": 2}
    for name, value in counters.items():
        assert m[(f"kvstore_{name}_total", ())] == value, name
    host = s["tiers"][0]
    assert host["blocks"] == 5 and host["used_bytes"] == 6 * len(block(0))   # 5 blocks + 1 reserved slot
    for name in ("capacity_bytes", "mapped_bytes", "used_bytes", "resident_bytes", "blocks"):
        assert m[(f"kvstore_tier_{name}", (("tier", "host"),))] == host[name], name
    for name in ("connections", "reserved", "pinned", "namespaces"):
        assert m[(f"kvstore_{name}", ())] == s[name], name
    assert (s["pinned"], s["reserved"], s["connections"]) == (2, 1, 1)
    for op, h in s["latency"].items():
        if op == "stats":                                        # the stats call itself is counted after its reply
            continue
        labels = (("op", op),)
        assert m[("kvstore_op_seconds_count", labels)] == h["count"] > 0, op
        assert m[("kvstore_op_seconds_bucket", (("le", "+Inf"), ("op", op)))] == h["count"], op
        assert m[("kvstore_op_seconds_sum", labels)] == pytest.approx(h["sum"]), op
    assert s["latency"]["commit"]["count"] == 1                  # one batch of 6


def test_errors_by_code_appear_after_bad_requests(start_daemon):
    d, port = metered(start_daemon)
    assert not [k for k in scrape(port) if k[0] == "kvstore_errors_total"]     # none yet
    with d.client() as c:
        for op, fields in (("nope", {}), ("lookup", {"ns": 99, "keys": bytes(16)}),
                           ("lookup", {"ns": 98, "keys": bytes(16)}), ("lookup", {"ns": 1, "keys": bytes(15)})):
            with pytest.raises(KVStoreError):
                c.call(op, **fields)
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as raw:      # an unparsable frame
            raw.settimeout(10)
            raw.connect(d.socket)
            raw.sendall(b"\x01\x00\x00\x00\xc1")
            while raw.recv(4096):
                pass
        s = c.stats()
    m = scrape(port)
    assert s["errors"] == {"unknown_op": 1, "unknown_namespace": 2, "bad_request": 1, "bad_frame": 1}
    errors = {dict(k[1])["code"]: v for k, v in m.items() if k[0] == "kvstore_errors_total"}
    assert errors == s["errors"]


def test_metrics_port_in_use_is_a_clear_startup_error():
    d = DaemonProc()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        try:
            r = subprocess.run([sys.executable, "-m", "kvstore", "serve"], capture_output=True, text=True, timeout=30,
                               env={**d.env, "KVSTORE_METRICS_ENABLED": "true", "KVSTORE_METRICS_PORT": str(port)})
            assert r.returncode == 1
            assert f"cannot serve metrics at 127.0.0.1:{port}: Address already in use" in r.stderr
            assert "Traceback" not in r.stderr
            assert not os.path.lexists(d.socket)           # its socket, bound first, is removed again
        finally:
            d.cleanup()


def test_metrics_are_off_by_default(daemon):
    with daemon.client() as c:
        c.ping()
    log = daemon.read_log()
    assert "kvstore serving at" in log and "metrics at" not in log


def test_histogram_beyond_last_bucket_is_strict_json():
    import json

    from kvstore.daemon.metrics import Histogram

    h = Histogram()
    h.observe(2e-5)
    h.observe(50.0)                                  # beyond the last bound (10 s)
    d = h.to_dict()
    assert (d["count"], d["buckets"][1], d["buckets"][-1]) == (2, 1, 1)
    assert d["p50"] == 2.5e-5 and d["p99"] is None
    json.dumps(d, allow_nan=False)                   # no Infinity for jq and friends


def test_traffic_per_path_and_lane_equals_the_stats_op(start_daemon, tmp_path):
    port = free_port()
    d = start_daemon(capacity="1MiB", env={"KVSTORE_METRICS_ENABLED": "true", "KVSTORE_METRICS_PORT": str(port),
                                           "KVSTORE_SSD_DIR": str(tmp_path / "ssd")})
    with d.client() as c:
        ns = c.namespace(spec())
        hs = hashes(200)
        assert ns.put(hs, [block(i) for i in range(200)]).stored == 200     # 72 evicted: demoted to SSD
        ssd_settled(c)
        assert ns.get(hs[-4:], [bytearray(len(block(0))) for _ in range(4)]) == 4  # 4 critical reads (the
        # tail of the put was evicted first, so it is on SSD)
        ssd_settled(c)                                            # ... which evicted (and demoted) 4 others
        assert ns.put([hashes(201)[-1]], [block(201)], durable=True).durability == "durable"
        ssd_settled(c)                                            # (its store evicted one more: demoted)
        stats = c.stats()
        (path,) = stats["traffic"]
        m = scrape(port)
    assert path["lanes"]["critical"]["transfers"] == 4 and path["lanes"]["background"]["bytes"] > 0
    wt = stats["write_through"]                     # the durable path (a durable put, so at least one lag)
    assert m[("kvstore_durable_lag_seconds_count", ())] == wt["lag"]["count"] >= 1
    assert m[("kvstore_durable_pending_blocks", ())] == wt["pending"]
    assert m[("kvstore_host_retiring_bytes", ())] == stats["tiers"][0]["retiring_bytes"] == 0
    for lane, r in path["lanes"].items():
        labels = (("lane", lane), ("path", "ssd"))
        for name in ("bytes", "transfers", "failed", "cancelled", "rejected", "escalated"):
            assert m[(f"kvstore_traffic_{name}_total", labels)] == r[name], (lane, name)
        for name in ("queued", "queued_bytes", "in_flight"):
            assert m[(f"kvstore_traffic_{name}", labels)] == r[name], (lane, name)
        assert m[("kvstore_traffic_seconds_count", labels)] == r["latency"]["count"], lane
    assert m[("kvstore_traffic_bandwidth_bytes_per_second", (("path", "ssd"),))] > 0
    assert m[("kvstore_tier_blocks", (("tier", "ssd"),))] >= 72



def test_the_predictive_prefetch_figures_equal_the_stats_op(start_daemon, tmp_path):
    port = free_port()
    d = start_daemon(env={"KVSTORE_METRICS_ENABLED": "true", "KVSTORE_METRICS_PORT": str(port),
                          "KVSTORE_SSD_DIR": str(tmp_path / "ssd"), "KVSTORE_POOL_EVICTION": "workflow"})
    with d.client() as c:
        ns = c.namespace(spec())
        w = c.workflow("A", type="qa")
        w.call("reader")
        hs = hashes(8)
        ns.put(hs, [block(i) for i in range(8)], context=w.context("reader"))
        c.evict(everything=True)                                 # down to the SSD
        ssd_settled(c)
        w.call("reader", next=["reader"])                        # expected back: its chain comes up again
        for _ in range(200):
            if (c.stats()["workflows"]["prefetch"] or {}).get("landed") == 8:
                break
            time.sleep(0.05)
        assert ns.get(hs, [bytearray(len(block(0))) for _ in hs], context=w.context("reader")) == 8
        p = c.stats()["workflows"]["prefetch"]
        m = scrape(port)
    assert (p["landed"], p["used"], p["precision"]) == (8, 8, 1.0)
    for k, v in p.items():
        if v is not None:
            name = f"kvstore_prefetch_{k}" + ("" if k in ("precision", "watched", "in_flight") else "_total")
            assert m[(name, ())] == v, k
