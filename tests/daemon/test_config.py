"""Configuration: the embedded default < a YAML file < KVSTORE_* variables, validated once, one message per invalid
field, all of them reported together; and `kvstore serve` refusing an invalid one."""
from __future__ import annotations

import glob
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvstore.daemon.config import ConfigError, auto_capacity, default_socket_path, load_config

ROOT = Path(__file__).resolve().parents[2]
GiB, MiB = 1 << 30, 1 << 20


def write(tmp_path: Path, data: Any, name: str = "kvstore.yaml") -> str:
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else yaml.safe_dump(data))
    return str(path)


def errors_of(excinfo: pytest.ExceptionInfo[ConfigError]) -> list[str]:
    """The one-per-line messages of a ConfigError."""
    return [line.strip() for line in str(excinfo.value).splitlines() if line.strip() != "invalid configuration:"]


def test_embedded_default_loads_and_validates():
    cfg = load_config(env={})
    assert cfg.server.socket == default_socket_path() and os.path.isabs(cfg.server.socket)
    s = cfg.server
    assert (s.max_connections, s.max_frame_bytes, s.max_keys_per_request) == (64, MiB, 1024)
    assert cfg.server.shutdown_timeout_s == 10.0
    assert cfg.server.admin_uids == [os.getuid()]            # "auto": the daemon's own user
    assert (s.max_held_fraction, s.max_namespaces_per_connection, s.reservation_lease_s) == (1.0, 64, 60.0)
    assert (s.min_block_bytes, s.idle_timeout_s) == (512, 600.0)
    assert cfg.tenants == []
    assert cfg.pool.capacity == auto_capacity() > 0          # "auto": a quarter of memory, at most 64 GiB
    assert cfg.pool.capacity <= 64 * GiB
    assert (cfg.pool.segment_bytes, cfg.pool.eviction) == (64 * MiB, "history")
    assert (cfg.metrics.enabled, cfg.metrics.host, cfg.metrics.port) == (False, "127.0.0.1", 9464)
    assert cfg.log.level == "info"


def test_embedded_default_is_found_from_a_source_tree_not_installed():
    """Run from a checkout on PYTHONPATH (as on a GPU machine with nothing installed), `kvstore.configs` does not
    exist as a package: the default comes from configs/default.yaml beside the package, the same file."""
    code = ("import sys; sys.modules['kvstore.configs'] = None\n"
            "from kvstore.daemon.config import embedded_default; import json; print(json.dumps(embedded_default()))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.returncode == 0, out.stderr
    import json
    assert json.loads(out.stdout) == yaml.safe_load((ROOT / "configs" / "default.yaml").read_text())


@pytest.mark.parametrize("path", sorted(glob.glob(str(ROOT / "configs" / "*.yaml"))))
def test_every_shipped_config_validates(path):
    load_config(path, env={})


@pytest.mark.parametrize("name, value, where, expected", [
    ("KVSTORE_POOL_CAPACITY", "2GiB", ("pool", "capacity"), 2 * GiB),
    ("KVSTORE_POOL_CAPACITY", "1.5G", ("pool", "capacity"), 3 * GiB // 2),
    ("KVSTORE_POOL_CAPACITY", "8388608", ("pool", "capacity"), 8 * MiB),
    ("KVSTORE_POOL_SEGMENT_BYTES", "1MiB", ("pool", "segment_bytes"), MiB),
    ("KVSTORE_SERVER_MAX_CONNECTIONS", "3", ("server", "max_connections"), 3),
    ("KVSTORE_SERVER_MAX_FRAME_BYTES", "64KiB", ("server", "max_frame_bytes"), 64 << 10),
    ("KVSTORE_SERVER_SHUTDOWN_TIMEOUT_S", "2.5", ("server", "shutdown_timeout_s"), 2.5),
    ("KVSTORE_SERVER_SOCKET", "/run/kv/kvstore.sock", ("server", "socket"), "/run/kv/kvstore.sock"),
    ("KVSTORE_METRICS_ENABLED", "true", ("metrics", "enabled"), True),
    ("KVSTORE_METRICS_PORT", "9100", ("metrics", "port"), 9100),
    ("KVSTORE_LOG_LEVEL", "debug", ("log", "level"), "debug"),
    ("KVSTORE_SERVER_ADMIN_UIDS", "[0, 1000]", ("server", "admin_uids"), [0, 1000]),
    ("KVSTORE_SERVER_ADMIN_UIDS", "auto", ("server", "admin_uids"), [os.getuid()]),
    ("KVSTORE_SERVER_MAX_HELD_FRACTION", "0.25", ("server", "max_held_fraction"), 0.25),
    ("KVSTORE_SERVER_MAX_RESERVED_FRACTION", "0.75", ("server", "max_reserved_fraction"), 0.75),
    ("KVSTORE_SERVER_MAX_NAMESPACES_PER_CONNECTION", "8", ("server", "max_namespaces_per_connection"), 8),
    ("KVSTORE_SERVER_RESERVATION_LEASE_S", "0.5", ("server", "reservation_lease_s"), 0.5),
    ("KVSTORE_SERVER_MIN_BLOCK_BYTES", "64KiB", ("server", "min_block_bytes"), 64 << 10),
    ("KVSTORE_SERVER_IDLE_TIMEOUT_S", "30", ("server", "idle_timeout_s"), 30.0),
])
def test_environment_overrides(name, value, where, expected):
    cfg = load_config(env={name: value})
    assert getattr(getattr(cfg, where[0]), where[1]) == expected


@pytest.mark.parametrize("name, value, where", [
    ("KVSTORE_METRICS_HOST", "::1", ("metrics", "host")),
    ("KVSTORE_SERVER_SOCKET", "/run/kv: 1/kvstore.sock", ("server", "socket")),
    ("KVSTORE_POOL_EVICTION", "lru", ("pool", "eviction")),
])
def test_string_fields_take_the_variable_as_written(name, value, where):
    assert getattr(getattr(load_config(env={name: value}), where[0]), where[1]) == value


def test_string_field_that_yaml_would_turn_into_a_bool_gets_its_own_message():
    with pytest.raises(ConfigError) as e:
        load_config(env={"KVSTORE_LOG_LEVEL": "off"})
    assert errors_of(e) == ["log.level: must be one of debug, info, warning, error, got 'off'"]


def test_environment_wins_over_the_file_which_wins_over_the_default(tmp_path):
    path = write(tmp_path, {"pool": {"capacity": "1GiB", "segment_bytes": "2MiB"}, "server": {"max_connections": 5}})
    cfg = load_config(path, env={"KVSTORE_POOL_CAPACITY": "2GiB"})
    assert (cfg.pool.capacity, cfg.pool.segment_bytes, cfg.server.max_connections) == (2 * GiB, 2 * MiB, 5)
    assert cfg.server.max_keys_per_request == 1024                  # untouched: the default


def test_other_kvstore_variables_are_not_fields():
    cfg = load_config(env={"KVSTORE_NO_NATIVE": "1", "KVSTORE_CONFIG": "/nowhere.yaml", "KVSTORE_OTHER_THING": "x",
                           "PATH": "/bin"})
    assert cfg.pool.eviction == "history"


@pytest.mark.parametrize("section, field, value, fragment", [
    ("server", "socket", 5, "expected a string"),
    ("server", "socket", "relative/kvstore.sock", "must be an absolute path"),
    ("server", "socket", "/" + "s" * 120, "longer than 100 bytes"),
    ("server", "max_connections", 0, "must be 1..4096"),
    ("server", "max_connections", "many", "expected an integer"),
    ("server", "max_connections", True, "expected an integer"),
    ("server", "max_frame_bytes", "1KiB", "must be 4KiB..64MiB"),
    ("server", "max_frame_bytes", "lots", "expected a size"),
    ("server", "max_keys_per_request", 0, "must be 1..65536"),
    ("server", "shutdown_timeout_s", -1, "must not be negative"),
    ("server", "shutdown_timeout_s", "soon", "expected a number"),
    ("server", "send_timeout_s", 0, "must be 0.1..3600 seconds"),
    ("server", "send_timeout_s", 86400, "must be 0.1..3600 seconds"),
    ("server", "admin_uids", "root", "expected auto or a list of user ids"),
    ("server", "admin_uids", [0, -1], "expected auto or a list of user ids"),
    ("server", "admin_uids", [True], "expected auto or a list of user ids"),
    ("server", "max_held_fraction", 0, "must be above 0 and at most 1"),
    ("server", "max_held_fraction", 1.5, "must be above 0 and at most 1"),
    ("server", "max_reserved_fraction", 0, "must be above 0 and at most 1"),
    ("server", "max_namespaces_per_connection", 0, "must be 1..65536"),
    ("server", "reservation_lease_s", 0, "must be 0.1..86400 seconds"),
    ("server", "min_block_bytes", 0, "must be 1B..1GiB"),
    ("server", "min_block_bytes", "2GiB", "must be 1B..1GiB"),
    ("server", "idle_timeout_s", 0, "must be 0.1..604800 seconds"),
    ("server", "pin_lease_s", 0, "must be 1..86400 seconds"),
    ("server", "max_failed_hellos", 0, "must be 1..100000"),
    ("server", "max_connections_per_uid", 65, "must be 0..server.max_connections (64)"),
    ("server", "max_connections_per_tenant", -1, "must be 0..server.max_connections (64)"),
    ("server", "socket_mode", "0999", "expected auto or an octal mode such as 0660"),
    ("server", "socket_mode", "rw-rw----", "expected auto or an octal mode such as 0660"),
    ("server", "socket_mode", "0666", "lets every local user connect"),
    ("server", "socket_group", "no-such-group-kvstore", "no group named 'no-such-group-kvstore'"),
    ("server", "admin_secret_file", "/nonexistent/kvstore-admin", "cannot read /nonexistent/kvstore-admin"),
    ("ssd", "eviction", "mru", "must be one of lru"),
    ("ssd", "sync", "sometimes", "must be one of always, batch, never"),
    ("pool", "capacity", -5, "must not be negative"),
    ("pool", "capacity", "2 parsecs", "expected a size"),
    ("pool", "segment_bytes", "512KiB", "must be at least 1MiB"),
    ("pool", "eviction", "random", "must be one of lru"),
    ("pool", "pair_eviction", "cascade", "must be decoupled or coupled"),
    ("pool", "small_segment_slots", -1, "must be 0..1048576"),
    ("metrics", "enabled", "yes please", "expected true or false"),
    ("metrics", "host", "0.0.0.0", "must be a loopback address"),
    ("metrics", "host", "localhost", "not an IP address"),
    ("metrics", "port", 0, "must be 1..65535"),
    ("metrics", "port", 70000, "must be 1..65535"),
    ("log", "level", "loud", "must be one of debug, info, warning, error"),
    ("tenancy", "unknown", "maybe", "must be share or refuse"),
    ("tenancy", "window_s", 0, "must be 0.01..86400 seconds"),
    ("tenancy", "lending", "often", "expected true or false"),
    ("tenancy", "default_host", "lots", "expected a size"),
    ("tenancy", "default_ssd", "lots", "expected a size"),
    ("donated", "kind", "tpu", "must be memfd or cuda"),
    ("donated", "socket", "donate.sock", "must be an absolute path"),
    ("donated", "max_donors", 0, "must be 1..1024"),
    ("donated", "in_flight", 0, "must be 1..64"),
])
def test_each_invalid_field_has_its_own_message(tmp_path, section, field, value, fragment):
    with pytest.raises(ConfigError) as e:
        load_config(write(tmp_path, {section: {field: value}}), env={})
    (only,) = errors_of(e)                         # exactly one complaint: the field's own
    assert only.startswith(f"{section}.{field}: ") and fragment in only


def test_all_invalid_fields_are_reported_together(tmp_path):
    path = write(tmp_path, {"server": {"max_connections": 0}, "pool": {"eviction": "fifo"},
                            "metrics": {"port": "http"}})
    with pytest.raises(ConfigError) as e:
        load_config(path, env={})
    errs = errors_of(e)
    assert sorted(line.split(":")[0] for line in errs) == ["metrics.port", "pool.eviction", "server.max_connections"]


def test_file_and_environment_errors_are_reported_together(tmp_path):
    path = write(tmp_path, {"cache": {"size": 1}, "pool": {"colour": "red", "capacity": "big"}})
    with pytest.raises(ConfigError) as e:
        load_config(path, env={"KVSTORE_METRICS_PORT": "[9100", "KVSTORE_SERVER_MAX_CONNECTIONS": "0"})
    errs = errors_of(e)
    assert len(errs) == 5, errs
    known = "server, pool, traffic, metrics, hints, prefetch, log, tenancy, ssd, remote, donated, tenants"
    assert any(x.startswith(f"cache: unknown section (known: {known})") for x in errs)
    assert any(x.startswith("pool.colour: unknown field (known: capacity") for x in errs)
    assert any(x.startswith("pool.capacity: expected a size") for x in errs)
    assert any(x.startswith("metrics.port: KVSTORE_METRICS_PORT='[9100' is not a valid YAML value") for x in errs)
    assert any(x.startswith("server.max_connections: must be 1..4096") for x in errs)


def test_tenants_are_read_from_the_file_and_their_secrets_never_printed(tmp_path):
    path = write(tmp_path, {"tenants": [{"name": "a", "uids": [1001], "secret": "s3"}, {"name": "b", "uids": [7]}]})
    cfg = load_config(path, env={})
    assert [(t.name, t.uids, t.secret) for t in cfg.tenants] == [("a", [1001], "s3"), ("b", [7], "")]
    assert [t["secret"] for t in cfg.to_dict()["tenants"]] == ["***", ""]


@pytest.mark.parametrize("tenants, fragment", [
    ({"name": "a"}, "tenants: must be a list"),
    ([{"name": "a", "secret": "x", "colour": 1}], "tenants[0]: must be a mapping of name, uids"),
    ([{"name": "", "secret": "x"}], "tenants[0].name: must be a string of 1..64 characters"),
    ([{"name": "uid:5", "secret": "x"}], "not starting with 'uid:'"),
    ([{"name": "a", "secret": "x"}, {"name": "a", "uids": [1]}], "tenants[1].name: 'a' is listed twice"),
    ([{"name": "a", "uids": ["root"]}], "tenants[0].uids: expected a list of user ids"),
    ([{"name": "a", "uids": [1], "secret": 5}], "tenants[0].secret: expected a string"),
    ([{"name": "a"}], "tenants[0]: give uids, a secret or both"),
    ([{"name": "a", "secret": "x", "host": "a lot"}], "tenants[0].host: expected a size"),
    ([{"name": "a", "secret": "x", "ssd": [1]}], "tenants[0].ssd: expected a size"),
    ([{"name": "a", "secret": "x", "policy": "fifo"}], "tenants[0].policy: must be one of lru, history, workflow"),
])
def test_each_invalid_tenant_has_its_own_message(tmp_path, tenants, fragment):
    with pytest.raises(ConfigError) as e:
        load_config(write(tmp_path, {"tenants": tenants}), env={})
    (only,) = errors_of(e)
    assert fragment in only


def test_quotas_must_fit_the_pool(tmp_path):
    """A quota is a guarantee: quotas (the default tenant's included) above the pool's capacity are refused."""
    ok = load_config(write(tmp_path, {"pool": {"capacity": "8GiB"}, "tenancy": {"default_host": "2GiB"},
                                      "tenants": [{"name": "a", "secret": "x", "host": "6GiB"}]}), env={})
    assert ([t.host for t in ok.tenants], ok.tenancy.default_host) == ([6 << 30], 2 << 30)
    with pytest.raises(ConfigError) as e:
        load_config(write(tmp_path, {"pool": {"capacity": "8GiB"}, "tenancy": {"default_host": "3GiB"},
                                     "tenants": [{"name": "a", "secret": "x", "host": "6GiB"}]}), env={})
    (only,) = errors_of(e)
    assert "the host quotas (9663676416 bytes, tenancy.default_host included) exceed pool.capacity" in only


def test_ssd_quotas_must_fit_the_ssd_tier_and_need_one(tmp_path):
    tenants = [{"name": "a", "secret": "x", "ssd": "60GiB"}]
    ok = load_config(write(tmp_path, {"ssd": {"dir": str(tmp_path / "ssd"), "capacity": "64GiB"},
                                      "tenancy": {"default_ssd": "4GiB"}, "tenants": tenants}), env={})
    assert ([t.ssd for t in ok.tenants], ok.tenancy.default_ssd) == ([60 << 30], 4 << 30)
    with pytest.raises(ConfigError) as e:
        load_config(write(tmp_path, {"ssd": {"dir": str(tmp_path / "ssd"), "capacity": "64GiB"},
                                     "tenancy": {"default_ssd": "5GiB"}, "tenants": tenants}), env={})
    (only,) = errors_of(e)
    assert "the SSD quotas (69793218560 bytes, tenancy.default_ssd included) exceed ssd.capacity" in only
    with pytest.raises(ConfigError) as e:
        load_config(write(tmp_path, {"tenants": tenants}), env={})
    (only,) = errors_of(e)
    assert "SSD quotas are set (tenants[].ssd or tenancy.default_ssd) but there is no SSD tier" in only


def test_unknown_field_from_the_environment(tmp_path):
    with pytest.raises(ConfigError) as e:
        load_config(env={"KVSTORE_POOL_CAPACTIY": "2GiB"})           # a typo is not silently ignored
    assert errors_of(e)[0].startswith("pool.capactiy: unknown field")


@pytest.mark.parametrize("host", ["0.0.0.0", "10.1.2.3", "::", "192.168.0.1"])
def test_non_loopback_metrics_host_is_refused(host):
    with pytest.raises(ConfigError, match=r"metrics.host: must be a loopback address \(the endpoint has no auth\)"):
        load_config(env={"KVSTORE_METRICS_HOST": host})


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "::1"])
def test_loopback_metrics_hosts_are_accepted(host):
    assert load_config(env={"KVSTORE_METRICS_HOST": host}).metrics.host == host


@pytest.mark.parametrize("text, fragment", [
    ("server: [1, 2\n", "is not valid YAML"),
    ("- server\n- pool\n", "the top level must be a mapping of sections"),
    ("pool: 5\n", "pool: must be a mapping"),
])
def test_malformed_files(tmp_path, text, fragment):
    with pytest.raises(ConfigError, match=fragment):
        load_config(write(tmp_path, text), env={})


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match=f"cannot read configuration {tmp_path}/absent.yaml: No such file"):
        load_config(str(tmp_path / "absent.yaml"), env={})


def serve(tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    sock = str(tmp_path / "run" / "kvstore.sock")
    full_env = {**os.environ, "KVSTORE_SERVER_SOCKET": sock, "KVSTORE_POOL_CAPACITY": "16MiB", **(env or {})}
    return subprocess.run([sys.executable, "-m", "kvstore", "serve", *args], env=full_env, capture_output=True,
                          text=True, timeout=30)


def test_serve_with_an_invalid_config_file_exits_with_every_message(tmp_path):
    path = write(tmp_path, {"server": {"max_connections": 0}, "pool": {"eviction": "fifo"},
                            "metrics": {"host": "0.0.0.0"}})
    r = serve(tmp_path, "--config", path)
    assert r.returncode == 1
    assert r.stderr.startswith("kvstore: invalid configuration:")
    for field in ("server.max_connections", "pool.eviction", "metrics.host"):
        assert f"  {field}: " in r.stderr
    assert "Traceback" not in r.stderr
    assert not (tmp_path / "run").exists()           # refused before touching the socket


@pytest.mark.parametrize("env, args, fragment", [
    ({"KVSTORE_POOL_SEGMENT_BYTES": "1KiB"}, (), "pool.segment_bytes: must be at least 1MiB"),
    ({"KVSTORE_CONFIG": "/nonexistent/kvstore.yaml"}, (), "cannot read configuration /nonexistent/kvstore.yaml"),
    ({}, ("--capacity", "lots"), "pool.capacity: expected a size"),
])
def test_serve_with_invalid_settings_exits_nonzero(tmp_path, env, args, fragment):
    r = serve(tmp_path, *args, env=env)
    assert r.returncode == 1
    assert fragment in r.stderr and "Traceback" not in r.stderr


def test_traffic_and_ssd_io_settings_are_checked(tmp_path):
    path = write(tmp_path, {"traffic": {"policy": "lifo", "share_store": 0, "share_prefetch": 0.3,
                                        "share_background": 0.3, "queue_prefetch": 0, "ssd_in_flight": 100},
                            "ssd": {"io": "aio"}})
    with pytest.raises(ConfigError) as e:
        load_config(path, env={})
    errs = errors_of(e)
    assert sorted(line.split(":")[0] for line in errs) == [
        "ssd.io", "traffic", "traffic.policy", "traffic.queue_prefetch", "traffic.share_store",
        "traffic.ssd_in_flight"]
    assert any("could starve" in x for x in errs) and any("keep them below 0.5" in x for x in errs)
    cfg = load_config(env={"KVSTORE_TRAFFIC_SHARE_BACKGROUND": "0.05", "KVSTORE_TRAFFIC_POLICY": "fifo"})
    assert (cfg.traffic.share_background, cfg.traffic.policy, cfg.ssd.io) == (0.05, "fifo", "auto")


def test_the_hints_section_is_checked():
    cfg = load_config(env={"KVSTORE_HINTS_IDLE_S": "0.5", "KVSTORE_HINTS_MAX_WORKFLOWS": "10"})
    assert (cfg.hints.idle_s, cfg.hints.max_workflows) == (0.5, 10)
    assert (load_config(env={}).hints.idle_s, load_config(env={}).hints.max_workflows) == (600.0, 100000)
    with pytest.raises(ConfigError) as e:
        load_config(env={"KVSTORE_HINTS_IDLE_S": "0", "KVSTORE_HINTS_MAX_WORKFLOWS": "0"})
    errs = errors_of(e)
    assert errs == ["hints.idle_s: must be 0.05..604800 seconds, got 0.0",
                    "hints.max_workflows: must be 1..10000000, got 0"], errs


def test_the_admin_secret_is_read_once_from_its_file_and_never_twice_configured(tmp_path):
    secret = tmp_path / "admin"
    secret.write_text("s3cret\n")
    assert load_config(env={"KVSTORE_SERVER_ADMIN_SECRET_FILE": str(secret)}).server.admin_secret == "s3cret"
    empty = tmp_path / "empty"
    empty.write_text("\n")
    for env, fragment in (({"KVSTORE_SERVER_ADMIN_SECRET_FILE": str(empty)}, "is empty"),
                          ({"KVSTORE_SERVER_ADMIN_SECRET_FILE": str(secret), "KVSTORE_SERVER_ADMIN_SECRET": "x"},
                           "set one, not both")):
        with pytest.raises(ConfigError, match=fragment):
            load_config(env=env)
    assert load_config(env={"KVSTORE_SERVER_SOCKET_MODE": "660"}).server.socket_mode == "0660"
