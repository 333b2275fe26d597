"""The Grafana dashboard (configs/grafana-kvstore.json) asks only for metrics the daemon serves: every metric name
in its PromQL is on a live daemon's /metrics — a daemon with an SSD tier and two tenants, so the SSD's, the
durable path's and the tenants' series exist. The remote tier's panels (marked in their description) are checked
against the names the code registers for a remote tier (kvstore.daemon.metrics), without starting a Mooncake
master. And the JSON ships in the wheel (package data of kvstore.configs)."""
from __future__ import annotations

import fnmatch
import json
import re
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import block, hashes, spec, ssd_settled
from tests.daemon.test_metrics import free_port

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "configs" / "grafana-kvstore.json"
REMOTE_MARK = "Remote tier only"
SUFFIXES = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_count", "_sum"), "untyped": ("",)}


def queries(dash: dict[str, Any]) -> list[tuple[str, str]]:
    """(panel description, PromQL) of every target, and of the template variables' queries."""
    found = [(p.get("description", ""), t["expr"]) for p in dash["panels"] for t in p.get("targets", [])]
    return found + [("", v["definition"]) for v in dash["templating"]["list"] if v["type"] == "query"]


def metric_names(expr: str) -> set[str]:
    """The kvstore_* metric names a PromQL expression reads (label values in quotes left out)."""
    return set(re.findall(r"\bkvstore_[A-Za-z0-9_:]+", re.sub(r'"[^"]*"', '""', expr)))


def served(families: Any) -> set[str]:
    """Every series name the families give: their samples, and for a family with none yet (errors before the
    first), the names its type would give."""
    names = set()
    for f in families:
        names |= {s.name for s in f.samples} | {f.name + suffix for suffix in SUFFIXES.get(f.type, ("",))}
    return names


def remote_names() -> set[str]:
    """The series names kvstore.daemon.metrics registers for a remote tier's row (any field it reads: 0)."""
    from kvstore.daemon.metrics import _remote_metrics

    class Row(dict[str, Any]):
        def __missing__(self, key: str) -> int:
            return 0
    return served(_remote_metrics(Row(tier="remote")))


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def test_every_metric_the_dashboard_queries_is_served_by_a_live_daemon(start_daemon, tmp_path, dashboard):
    port = free_port()
    conf = tmp_path / "kvstore.yaml"
    conf.write_text(yaml.safe_dump({"tenants": [{"name": "a", "secret": "sa"}, {"name": "b", "secret": "sb"}]}))
    d = start_daemon(capacity="1MiB", env={"KVSTORE_METRICS_ENABLED": "true", "KVSTORE_METRICS_PER_TENANT": "true",
                                           "KVSTORE_METRICS_PORT": str(port),
                                           "KVSTORE_SSD_DIR": str(tmp_path / "ssd"), "KVSTORE_CONFIG": str(conf)})
    with d.client() as c:                       # some of everything: puts that demote, lookups, gets, a durable put
        ns = c.namespace(spec())
        hs = hashes(200)
        assert ns.put(hs, [block(i) for i in range(200)]).stored == 200
        assert ns.lookup(hs) == 200
        assert ns.get(hs[:4], [bytearray(len(block(0))) for _ in range(4)]) == 4
        assert ns.put(hashes(1, start=500), [block(500)], durable=True).durability == "durable"
        ssd_settled(c)
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        live = served(text_string_to_metric_families(r.read().decode()))
    remote = remote_names()
    asked = {(name, REMOTE_MARK in desc) for desc, expr in queries(dashboard) for name in metric_names(expr)}
    assert len(asked) > 40                                           # the parse found the queries
    missing = sorted(name for name, marked in asked if name not in (remote if marked else live))
    assert not missing, f"the dashboard queries metrics nobody serves: {missing}"
    unmarked = sorted(name for name, marked in asked if name.startswith("kvstore_remote_") and not marked)
    assert not unmarked, f"remote-tier metrics in panels not marked '{REMOTE_MARK}': {unmarked}"
    assert {"kvstore_tier_used_bytes", "kvstore_hits_host_total", "kvstore_tenant_hits_total",
            "kvstore_traffic_seconds_bucket", "kvstore_durable_lag_seconds_bucket"} <= {n for n, _ in asked}
    assert {n for n, marked in asked if marked} >= {"kvstore_remote_up", "kvstore_remote_events_total"}


def test_the_dashboard_is_importable_and_ships_in_the_wheel(dashboard):
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids)) and dashboard["uid"] == "kvstore"
    names = {v["name"] for v in dashboard["templating"]["list"]}
    assert names == {"datasource", "instance", "tenant"}
    for p in dashboard["panels"]:
        assert set(p["gridPos"]) == {"h", "w", "x", "y"} and p["gridPos"]["x"] + p["gridPos"]["w"] <= 24
        if p["type"] != "row":
            assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
            assert all('instance=~"$instance"' in t["expr"] for t in p["targets"]), p["title"]
    tomllib = pytest.importorskip("tomllib")
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    assert any(fnmatch.fnmatch(DASHBOARD.name, pat) for pat in data["kvstore.configs"])
