"""Issue 29, part 5: the Prometheus endpoint tells a local user nothing about other tenants. It listens on loopback
(another address only with a token), shows no tenant's series unless metrics.per_tenant, and with
metrics.token_file answers 401 to a request without the bearer token. Real daemons with two tenants and their
secrets; the endpoint's own checks also against a real daemon's snapshot."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvstore.daemon.config import MetricsConfig
from kvstore.daemon.metrics import read_token, serve_metrics
from tests.conftest import DaemonProc, block, hashes, spec

TOKEN = "t0ken-0f-the-metrics-endpoint"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def token_file(tmp_path: Path, text: str = TOKEN, mode: int = 0o600) -> str:
    path = tmp_path / "metrics.token"
    path.write_text(text + "\n")
    path.chmod(mode)
    return str(path)


def tenants_daemon(tmp_path: Path, daemons: list[DaemonProc], **metrics: Any) -> tuple[DaemonProc, int]:
    """Tenants a and b (secrets, quotas), each with a block stored; metrics on at a free loopback port."""
    port = free_port()
    conf = tmp_path / "kvstore.yaml"
    conf.write_text(yaml.safe_dump({
        "tenants": [{"name": "alpha-team", "secret": "secret-a", "host": "4MiB"},
                    {"name": "beta-team", "secret": "secret-b", "host": "2MiB"}],
        "metrics": {"enabled": True, "port": port, **metrics}}))
    d = DaemonProc(capacity="8MiB", env={"KVSTORE_CONFIG": str(conf)})
    daemons.append(d)
    d.start()
    for name, secret in (("alpha-team", "secret-a"), ("beta-team", "secret-b")):
        with d.client(tenant=name, secret=secret) as c:
            c.namespace(spec()).put(hashes(1), [block(0)])
    return d, port


def get(port: int, token: str | None = None, host: str = "127.0.0.1") -> tuple[int, str]:
    req = urllib.request.Request(f"http://{host}:{port}/metrics")
    if token is not None:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def non_loopback_address() -> str | None:
    """This host's address on its first non-loopback interface (none in a bare network namespace)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))                     # TEST-NET-1: nothing is sent
        except OSError:
            return None
        addr: str = s.getsockname()[0]
    return None if addr.startswith("127.") or addr == "0.0.0.0" else addr


def test_by_default_no_tenant_is_named_and_only_loopback_listens(tmp_path, daemons):
    d, port = tenants_daemon(tmp_path, daemons)
    status, text = get(port)
    assert status == 200 and "kvstore_tier_used_bytes" in text            # the daemon's own figures
    assert "kvstore_tenant_" not in text and "alpha-team" not in text and "beta-team" not in text
    addr = non_loopback_address()
    if addr is None:
        pytest.skip("this host has no non-loopback address to try")
    with socket.socket() as s, pytest.raises(ConnectionRefusedError):
        s.settimeout(5)
        s.connect((addr, port))


def test_a_non_loopback_address_without_a_token_is_refused_at_start(tmp_path):
    d = DaemonProc(env={"KVSTORE_METRICS_ENABLED": "true", "KVSTORE_METRICS_HOST": "0.0.0.0",
                        "KVSTORE_METRICS_PORT": str(free_port())})
    try:
        r = subprocess.run([sys.executable, "-m", "kvstore", "serve"], capture_output=True, text=True, timeout=30,
                           env=d.env)
    finally:
        d.cleanup()
    assert r.returncode != 0
    assert "metrics.host: must be a loopback address (the endpoint has no auth) unless metrics.token_file is set" \
        in r.stderr, r.stderr


def test_a_token_file_must_be_private_and_hold_a_token(tmp_path):
    assert read_token(token_file(tmp_path)) == TOKEN
    with pytest.raises(ValueError, match="readable by nobody else"):
        read_token(token_file(tmp_path, mode=0o644))
    with pytest.raises(ValueError, match="16 to 4096 printable"):
        read_token(token_file(tmp_path, text="short"))
    with pytest.raises(ValueError, match="absolute"):
        read_token("metrics.token")
    d = DaemonProc(env={"KVSTORE_METRICS_TOKEN_FILE": token_file(tmp_path, mode=0o640)})
    try:
        r = subprocess.run([sys.executable, "-m", "kvstore", "serve"], capture_output=True, text=True, timeout=30,
                           env=d.env)
    finally:
        d.cleanup()
    assert r.returncode != 0 and "metrics.token_file:" in r.stderr and "chmod 600" in r.stderr, r.stderr


def test_the_endpoint_needs_its_token_and_names_tenants_only_when_asked(tmp_path, daemons):
    """The endpoint as the daemon starts it (serve_metrics), fed a live daemon's snapshot (its stats reply)."""
    d, _ = tenants_daemon(tmp_path, daemons)
    with d.client() as admin:
        snap = admin.stats()
    assert {r["tenant"] for r in snap["tenants"]["rows"]} >= {"alpha-team", "beta-team"}
    path = token_file(tmp_path)
    for per_tenant in (False, True):
        port = free_port()
        server = serve_metrics(MetricsConfig(enabled=True, port=port, token_file=path, per_tenant=per_tenant),
                               lambda: snap)
        try:
            assert get(port)[0] == 401                                  # no token
            assert get(port, "not-" + TOKEN)[0] == 401                  # a wrong one
            assert get(port, TOKEN[:-1])[0] == 401                      # a prefix of it
            status, text = get(port, TOKEN)
        finally:
            server.shutdown()
            server.server_close()
        assert status == 200 and "kvstore_tier_used_bytes" in text
        assert ('kvstore_tenant_used_bytes{tenant="alpha-team"}' in text) is per_tenant
        assert ("beta-team" in text) is per_tenant


def test_the_daemon_serves_its_token_and_per_tenant_settings(tmp_path, daemons):
    """(Needs server.py to start the endpoint with serve_metrics(config.metrics, ...).)"""
    d, port = tenants_daemon(tmp_path, daemons, token_file=token_file(tmp_path), per_tenant=True)
    assert get(port)[0] == 401
    status, text = get(port, TOKEN)
    assert status == 200 and 'kvstore_tenant_used_bytes{tenant="alpha-team"}' in text
    assert os.path.exists(d.socket)


def test_another_address_is_accepted_with_a_token(tmp_path):
    from kvstore.daemon.config import load_config

    cfg = load_config(env={"KVSTORE_METRICS_HOST": "0.0.0.0", "KVSTORE_METRICS_TOKEN_FILE": token_file(tmp_path),
                           "KVSTORE_METRICS_PER_TENANT": "true"})
    assert (cfg.metrics.host, cfg.metrics.per_tenant) == ("0.0.0.0", True)
    assert load_config(env={}).metrics.per_tenant is False and load_config(env={}).metrics.token_file == ""
