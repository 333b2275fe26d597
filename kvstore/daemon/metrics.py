"""Numbers the daemon keeps about itself: op latency histograms and errors by code, plus a Prometheus endpoint that
serves what `kvstore stats` shows (the same snapshot function feeds both).

What the endpoint tells whom (issue 29). It listens on loopback (metrics.host; another address only with a token),
so every local user can reach it: by default it serves the daemon's own figures and no series that names a tenant
(`kvstore_tenant_*`: names, quotas, usage). `metrics.per_tenant: true` adds them; `metrics.token_file` makes every
request carry `Authorization: Bearer <the file's token>` (else 401, compared in constant time). The token file must
be the daemon user's own and readable by nobody else (`read_token`). `serve_metrics(cfg, snapshot)` starts it from
the metrics section.
"""
from __future__ import annotations

import errno
import hmac
import ipaddress
import os
import stat
import threading
from collections import Counter
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from kvstore.histogram import BUCKETS, Histogram

if TYPE_CHECKING:
    from kvstore.daemon.config import MetricsConfig


class OpMetrics:
    def __init__(self) -> None:
        self.latency: dict[str, Histogram] = {}
        self.errors: Counter[str] = Counter()
        self.refused_connections = 0
        self.accept_errors = 0          # accepts that failed for want of fds or memory

    def observe(self, op: str, seconds: float) -> None:
        h = self.latency.get(op)
        if h is None:
            h = self.latency[op] = Histogram()
        h.observe(seconds)


def read_token(path: str) -> str:
    """The bearer token in `path`: ValueError (the message says what to do) unless the path is absolute, a regular
    file of the daemon's user that neither group nor others may read, holding one token of 16 to 4096 printable
    characters."""
    if not os.path.isabs(path):
        raise ValueError(f"must be an absolute path, got {path!r}")
    try:
        st = os.stat(path)
        with open(path, encoding="ascii") as f:
            token = f.read(8192).strip()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot read {path}: {getattr(e, 'strerror', None) or e}") from None
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
        raise ValueError(f"{path} must be a file of this user readable by nobody else (chmod 600)")
    if not 16 <= len(token) <= 4096 or not token.isprintable() or " " in token:
        raise ValueError(f"{path} must hold one token of 16 to 4096 printable characters, no spaces")
    return token


def serve_metrics(cfg: MetricsConfig, snapshot: Callable[[], dict[str, Any]]) -> Any:
    """Serve /metrics as the metrics section says (module docstring). Returns the HTTP server."""
    try:
        token = read_token(cfg.token_file) if cfg.token_file else ""
    except ValueError as e:                     # checked at load; changed since
        raise OSError(errno.EACCES, f"metrics.token_file: {e}") from None
    return start_prometheus(cfg.host, cfg.port, snapshot, token=token, per_tenant=cfg.per_tenant)


def start_prometheus(host: str, port: int, snapshot: Callable[[], dict[str, Any]], token: str = "",
                     per_tenant: bool = False) -> Any:
    """Serve /metrics at host:port from `snapshot()` (the stats op's reply): tenants' series only with
    `per_tenant`, every request with the bearer `token` where one is given; a non-loopback host without a token
    is refused (OSError). Returns the HTTP server (`shutdown()` stops it)."""
    if not token and not ipaddress.ip_address(host).is_loopback:
        raise OSError(errno.EACCES, "a non-loopback address needs metrics.token_file")
    from prometheus_client import CollectorRegistry
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

    class Collector:
        def collect(self) -> Any:
            s = snapshot()
            for name in ("capacity_bytes", "mapped_bytes", "used_bytes", "resident_bytes", "blocks"):
                g = GaugeMetricFamily(f"kvstore_tier_{name}", f"{name} per tier", labels=["tier"])
                for tier in s["tiers"]:
                    g.add_metric([tier["tier"]], tier[name])
                yield g
            yield from _traffic_metrics(s.get("traffic", []))
            for name, value in s["counters"].items():
                yield CounterMetricFamily(f"kvstore_{name}", f"{name} since start", value=value)
            for name in ("connections", "reserved", "pinned", "namespaces"):
                yield GaugeMetricFamily(f"kvstore_{name}", name, value=s[name])
            errs = CounterMetricFamily("kvstore_errors", "errors by code", labels=["code"])
            for code, n in s["errors"].items():
                errs.add_metric([code], n)
            yield errs
            lat = HistogramMetricFamily("kvstore_op_seconds", "op latency in the daemon", labels=["op"])
            for op, h in s["latency"].items():
                lat.add_metric([op], _cumulative(h), h["sum"])
            yield lat
            host = s["tiers"][0] if s["tiers"] else {}
            yield GaugeMetricFamily("kvstore_host_retiring_bytes", "host pool bytes lent while memory moves "
                                    "between block sizes or tenants (over the cap until punched)",
                                    value=host.get("retiring_bytes", 0))
            yield from _workflow_metrics(s.get("workflows") or {}, s.get("hit_rates") or {})
            yield from _remote_metrics(next((t for t in s["tiers"] if t["tier"] == "remote"), None))
            if per_tenant:
                yield from _tenant_metrics(s.get("tenants") or {})
            wt = s.get("write_through") or {}
            if "lag" in wt:
                yield GaugeMetricFamily("kvstore_durable_pending_blocks", "blocks on their way to disk",
                                        value=wt["pending"])
                yield GaugeMetricFamily("kvstore_durable_oldest_pending_seconds", "age of the oldest block on its "
                                        "way to disk", value=wt["oldest_pending_s"])
                lag = HistogramMetricFamily("kvstore_durable_lag_seconds", "commit to synced on disk")
                lag.add_metric([], _cumulative(wt["lag"]), wt["lag"]["sum"])
                yield lag

    registry = CollectorRegistry()
    registry.register(Collector())  # type: ignore[arg-type]
    return _serve(host, port, registry, token)


def _serve(host: str, port: int, registry: Any, token: str) -> Any:
    """prometheus_client's WSGI server (as its start_wsgi_server), the app behind the bearer check."""
    from wsgiref.simple_server import make_server

    from prometheus_client import make_wsgi_app
    from prometheus_client.exposition import ThreadingWSGIServer, _get_best_family, _SilentHandler

    class Server(ThreadingWSGIServer):
        daemon_threads = True

    Server.address_family, addr = _get_best_family(host, port)
    app = make_wsgi_app(registry)
    expected = f"Bearer {token}".encode()

    def guarded(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        given = environ.get("HTTP_AUTHORIZATION", "").encode("latin-1", "replace")
        if token and not hmac.compare_digest(given, expected):
            start_response("401 Unauthorized", [("Content-Type", "text/plain"),
                                                ("WWW-Authenticate", 'Bearer realm="kvstore"')])
            return [b"401 Unauthorized: this endpoint needs its bearer token\n"]
        return app(environ, start_response)  # type: ignore[no-any-return]

    httpd = make_server(addr, port, guarded, Server, handler_class=_SilentHandler)
    threading.Thread(target=httpd.serve_forever, name="kvstore-metrics", daemon=True).start()
    return httpd


def _cumulative(h: dict[str, Any]) -> list[tuple[str, int]]:
    """A Histogram.to_dict's buckets as Prometheus wants them: (upper bound, cumulative count)."""
    cum, acc = [], 0
    for bound, c in zip([*map(str, BUCKETS), "+Inf"], h["buckets"]):
        acc += c
        cum.append((bound, acc))
    return cum


def _workflow_metrics(w: dict[str, Any], rates: dict[str, Any]) -> Any:
    """The hints' books, the predictor's accuracy, the hit-rate ceiling and the hit rate per op and tier."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    if w:
        yield GaugeMetricFamily("kvstore_workflows_active", "workflows and sessions active now", value=w["active"])
        families = {"retired_by": ("kvstore_workflows_retired", "workflows retired, by reason", "reason"),
                    "ignored": ("kvstore_hints_ignored", "hints and contexts ignored, by reason", "reason"),
                    "hints": ("kvstore_hints", "hints received, by kind", "kind")}
        for field, (name, text, label) in families.items():
            fam = CounterMetricFamily(name, text, labels=[label])
            for k, n in w[field].items():
                fam.add_metric([k], n)
            yield fam
        acc = GaugeMetricFamily("kvstore_predictor_top1_accuracy", "the predictor's top-1 accuracy",
                                labels=["steps"])
        for k, steps in (("top1_1", "1"), ("top1_3", "3")):
            if w["accuracy"][k] is not None:
                acc.add_metric([steps], w["accuracy"][k])
        yield acc
        ceiling = w["ceiling"]
        if ceiling["hit_rate"] is not None:
            yield GaugeMetricFamily("kvstore_hit_rate_ceiling", "1 - distinct blocks looked up / blocks looked up "
                                    "(HyperLogLog): the best hit rate any cache could have had",
                                    value=ceiling["hit_rate"])
        yield GaugeMetricFamily("kvstore_looked_up_distinct_blocks", "distinct blocks looked up (estimate)",
                                value=ceiling["distinct"])
        yield from _prefetch_metrics(w.get("prefetch"))
        if "blocks" in w:
            blocks = GaugeMetricFamily("kvstore_workflow_blocks", "host blocks by standing", labels=["standing"])
            for k, n in w["blocks"].items():
                blocks.add_metric([k], n)
            yield blocks
    hr = GaugeMetricFamily("kvstore_hit_rate", "share of the blocks asked, per op and where found",
                           labels=["op", "tier"])
    for op, shares in rates.items():
        for tier, v in shares.items():
            if v is not None:
                hr.add_metric([op, tier], v)
    yield hr


PREFETCH_GAUGES = {"precision", "watched", "in_flight"}    # the rest of the predictive prefetch's figures count up


def _remote_metrics(t: dict[str, Any] | None) -> Any:
    """The remote tier: whether the store answers, the blocks this node put or knows of, its transfers and the
    values that failed their check (the network path's lanes are with the other paths, path="net")."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    if t is None:
        return
    yield GaugeMetricFamily("kvstore_remote_up", "1 while the remote store answers", value=1 if t["up"] else 0)
    for name in ("blocks_put_here", "blocks_known", "blocks_quarantined", "staged_blocks", "staged_bytes"):
        yield GaugeMetricFamily(f"kvstore_remote_{name}", name.replace("_", " "), value=t[name])
    ops = CounterMetricFamily("kvstore_remote_events", "remote tier events since start", labels=["event"])
    for name, value in sorted(t.get("counters", {}).items()):
        ops.add_metric([name], value)
    yield ops
    secs = CounterMetricFamily("kvstore_remote_seconds", "wall time of the remote tier's puts and reads",
                               labels=["op"])
    for name, value in sorted(t.get("seconds", {}).items()):
        secs.add_metric([name.removesuffix("_s")], value)
    yield secs


TENANT_GAUGES = ("quota_bytes", "used_bytes", "borrowed_bytes", "lent_bytes", "ssd_quota_bytes", "ssd_used_bytes",
                 "ssd_borrowed_bytes")
TENANT_COUNTERS = ("hits", "misses", "evictions", "reclaims", "lent_segments", "taken_back", "ssd_evictions",
                   "ssd_taken")


def _tenant_metrics(t: dict[str, Any]) -> Any:
    """Per tenant (kvstore.index.quotas): quota, used, borrowed and lent bytes, hit rate; counters of lookups' hits
    and misses, evictions, segments reclaimed, lent and taken back; the reclaim latency."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

    if not t:
        return
    gauges = {n: GaugeMetricFamily(f"kvstore_tenant_{n}", f"{n.replace('_', ' ')} per tenant"
                                   f"{' (SSD tier)' if n.startswith('ssd_') else ' (host pool)'}",
                                   labels=["tenant"]) for n in TENANT_GAUGES}
    counters = {n: CounterMetricFamily(f"kvstore_tenant_{n}", f"{n.replace('_', ' ')} per tenant since start",
                                       labels=["tenant"]) for n in TENANT_COUNTERS}
    rate = GaugeMetricFamily("kvstore_tenant_hit_rate", "share of the blocks a tenant looked up that were found",
                             labels=["tenant"])
    for r in t["rows"]:
        for n, g in gauges.items():
            if n in r:                          # the SSD's figures: where the daemon has an SSD tier
                g.add_metric([r["tenant"]], r[n])
        for n, c in counters.items():
            if n in r:
                c.add_metric([r["tenant"]], r[n])
        if r["hit_rate"] is not None:
            rate.add_metric([r["tenant"]], r["hit_rate"])
    yield from gauges.values()
    yield from counters.values()
    yield rate
    h = t["reclaim_seconds"]
    lat = HistogramMetricFamily("kvstore_tenant_reclaim_seconds", "time an allocation spent taking borrowed memory "
                                "back for a tenant within its quota")
    lat.add_metric([], _cumulative(h), h["sum"])
    yield lat


def _prefetch_metrics(p: dict[str, Any] | None) -> Any:
    """The predictive prefetch (kvstore.movers.predictive): kvstore_prefetch_<figure>, counters and gauges."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    for k, v in (p or {}).items():
        if v is None:
            continue
        if k in PREFETCH_GAUGES:
            yield GaugeMetricFamily(f"kvstore_prefetch_{k}", f"predictive prefetch: {k.replace('_', ' ')}", value=v)
        else:
            yield CounterMetricFamily(f"kvstore_prefetch_{k}", f"predictive prefetch: {k.replace('_', ' ')}",
                                      value=v)


def _traffic_metrics(paths: list[dict[str, Any]]) -> Any:
    """Per path and lane: what the traffic manager moved, what waits, and how long transfers took."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

    labels = ["path", "lane"]
    counters = {name: CounterMetricFamily(f"kvstore_traffic_{name}", f"{name} per path and lane", labels=labels)
                for name in ("bytes", "transfers", "failed", "cancelled", "rejected", "escalated")}
    gauges = {name: GaugeMetricFamily(f"kvstore_traffic_{name}", f"{name} now, per path and lane", labels=labels)
              for name in ("queued", "queued_bytes", "in_flight")}
    lat = HistogramMetricFamily("kvstore_traffic_seconds", "transfer latency, queued to done", labels=labels)
    bw = GaugeMetricFamily("kvstore_traffic_bandwidth_bytes_per_second", "measured bandwidth per path",
                           labels=["path"])
    for p in paths:
        bw.add_metric([p["path"]], p["bandwidth_bps"])
        for lane, r in p["lanes"].items():
            for name, fam in counters.items():
                fam.add_metric([p["path"], lane], r[name])
            for name, g in gauges.items():
                g.add_metric([p["path"], lane], r[name])
            lat.add_metric([p["path"], lane], _cumulative(r["latency"]), r["latency"]["sum"])
    yield from counters.values()
    yield from gauges.values()
    yield lat
    yield bw
