"""Configuration: the embedded default (configs/default.yaml), a user file, then KVSTORE_* environment overrides.

Validated once, with one message per invalid field, all of them reported together.
"""
from __future__ import annotations

import dataclasses
import importlib.resources
import ipaddress
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from kvstore.policy import POLICIES
from kvstore.protocol.paths import default_socket_path
from kvstore.tiers.ssd.files import IO_MODES
from kvstore.tiers.ssd.writes import SYNC_POLICIES
from kvstore.units import parse_size


class ConfigError(ValueError):
    """Raised with every invalid field listed, one per line."""


@dataclass(slots=True)
class ServerConfig:
    socket: str = "auto"
    max_connections: int = 64
    max_frame_bytes: int = 1 << 20
    max_keys_per_request: int = 1024
    shutdown_timeout_s: float = 10.0
    send_timeout_s: float = 10.0        # a client that stops reading its replies this long is disconnected
    admin_uids: list[int] = field(default_factory=list)   # who may resize, evict, list others ("auto": our uid)
    max_held_fraction: float = 1.0      # one connection's reserved + pinned bytes, as a share of the pool
    max_reserved_fraction: float = 0.5  # one connection's reservations not committed yet, as a share of the pool
    max_namespaces_per_connection: int = 64
    reservation_lease_s: float = 60.0   # an uncommitted reservation older than this is aborted
    min_block_bytes: int = 512          # a namespace whose full block is smaller is refused
    idle_timeout_s: float = 600.0       # a connection pinning nothing that sends nothing this long is closed


@dataclass(slots=True)
class TenantConfig:
    """A tenant: who may speak as it (`uids`, any if empty) and its `secret` (none if empty); a connection that
    names no tenant gets the first one listing its uid. `host`: the host-pool bytes guaranteed to it (its quota; 0:
    none, it lives on what others leave, see `tenancy`). `ssd`: the SSD tier's bytes guaranteed to it
    (kvstore.tiers.ssd.owners). `policy`: the eviction policy of its host blocks (empty: pool.eviction)."""
    name: str
    uids: list[int] = field(default_factory=list)
    secret: str = ""
    host: int = 0
    policy: str = ""
    ssd: int = 0


@dataclass(slots=True)
class TenancyConfig:
    """Quotas and lending between tenants (kvstore.index.quotas, SwiftCache §3.5). With no quota anywhere, the pool
    is one LRU shared by all (memory follows use)."""
    lending: bool = True                # a tenant may grow past its quota into memory no one else needs now
    window_s: float = 60.0              # a lender's segment untouched this long is idle: it may be lent
    default_host: int = 0               # the quota of a tenant not listed (the daemon's user "", "uid:<n>")
    default_ssd: int = 0                # its SSD quota (SSD quotas are on when any tenant has one at start)
    compact_bytes: int = 16 << 20       # of a segment going to another tenant, its blocks moved to the owner's other
                                        # segments (evicting the owner's coldest instead): copied under the lock
    unknown: str = "share"              # share | refuse: a hello from a user of no listed tenant (but the daemon's)


@dataclass(slots=True)
class PoolConfig:
    capacity: int = 0  # 0 after loading means "auto" was resolved already; see _resolve_auto
    segment_bytes: int = 64 << 20
    eviction: str = "lru"
    pair_eviction: str = "decoupled"    # decoupled | coupled: whether a base block's residuals leave with it (ForkKV)
    small_segment_slots: int = 256      # a size of small blocks gets segments of this many (0: segment_bytes for all)


@dataclass(slots=True)
class SsdConfig:
    dir: str = ""                       # empty: no SSD tier
    capacity: int = 16 << 30
    sync: str = "batch"
    staging_bytes: int = 256 << 20      # evicted blocks waiting in memory for their SSD write
    promote_reserve: int = 2            # free host slots per block size kept for promotions (movers/reserve.py)
    write_through: bool = False         # also write every committed block to SSD at once (store lane)
    io: str = "auto"                    # auto | io_uring | threads: how record payloads reach the disk
    persist_on_stop: bool = True        # a graceful stop writes the host pool's blocks to SSD first
    eviction: str = "lru"               # which record makes room at the cap (kvstore.policy)
    durable_timeout_s: float = 5.0      # a durable commit or flush naming no deadline waits at most this long
    durable_timeout_max_s: float = 20.0  # ... and one naming a longer deadline this long (below clients' timeouts)


@dataclass(slots=True)
class TrafficConfig:
    policy: str = "weighted"            # weighted | fifo (no lanes: the benchmark's baseline)
    share_store: float = 0.02           # minimum shares of the lower lanes; critical takes the rest
    share_prefetch: float = 0.01
    share_background: float = 0.01
    queue_critical: int = 8192          # transfers waiting per lane and path; more is refused with "busy"
    queue_store: int = 4096
    queue_prefetch: int = 1024
    queue_background: int = 1024
    ssd_in_flight: int = 4              # transfers the SSD path runs at once (its worker threads)


@dataclass(slots=True)
class MetricsConfig:
    enabled: bool = False
    host: str = "127.0.0.1"
    port: int = 9464


@dataclass(slots=True)
class HintsConfig:
    idle_s: float = 600.0               # a workflow or session without activity this long is retired
    max_workflows: int = 100000         # active at once; beyond it the least recently active one is retired


@dataclass(slots=True)
class PrefetchConfig:
    """The predictive prefetch (kvstore.movers.predictive): SSD blocks of a workflow expected back soon are promoted
    into free or retired host space ahead of its request."""
    enabled: bool = True                # needs a lower tier; off: only clients' explicit prefetches
    min_p: float = 0.5                  # the timed trigger: P(the workflow calls again) at least this ...
    lead_s: float = 1.0                 # ... and its next call due within this many seconds (0: no timed trigger)
    max_chain_blocks: int = 4096        # per active workflow, the head of its latest chain kept (16 B a block)
    blocks_per_tick: int = 256          # blocks queued at most per server tick or per `next` hint


@dataclass(slots=True)
class RemoteConfig:
    """The remote tier (kvstore.tiers.remote): blocks shared by the daemons of several nodes through Mooncake Store
    (the `kvstore[mooncake]` extra). Off while `master` is empty."""
    master: str = ""                    # the mooncake_master's RPC address, host:port; empty: no remote tier
    metadata: str = ""                  # the transfer engine's metadata server; empty: the master's own (port 8080)
    protocol: str = "tcp"               # tcp | rdma
    device: str = ""                    # the RDMA device names (rdma only), e.g. "mlx5_0"
    hostname: str = "127.0.0.1"         # this node's address as the other nodes reach it (the daemon hands it to
                                        # Mooncake as MC_TCP_BIND_ADDRESS: the one setting for where bytes travel)
    bind_address: str = ""              # where the transfer engine's ports listen: "" the hostname's address only,
                                        # 0.0.0.0 or :: every address (kvstore.tiers.remote.address)
    segment_bytes: int = 512 << 20      # memory this node lends the store (held by its transfer engine); 0: none
    buffer_bytes: int = 64 << 20        # the client's own transfer buffer
    replicas: int = 1                   # copies of each block in the store (on distinct nodes' segments)
    placement: str = "auto"             # auto | write_back | write_through | both (auto: write_back without an SSD
                                        # tier, write_through beside one)
    staging_bytes: int = 256 << 20      # evicted blocks waiting in memory for their put; beyond it they are dropped
    timeout_s: float = 2.0              # the longest one store operation may hold a read before it is a miss
    retry_s: float = 2.0                # a store found down is tried again after this long
    known_s: float = 5.0                # a block the store said it holds is believed present this long (keep it
                                        # below the master's default_kv_lease_ttl, 10 s: no eviction in between)
    in_flight: int = 4                  # transfers on the network path at once
    unreachable_s: float = 12.0         # a block whose transfer failed (its node gone) is a miss this long without
                                        # asking (keep it above the master's client_ttl, 10 s, after which the
                                        # master forgets a lost node's blocks)


@dataclass(slots=True)
class DonatedConfig:
    """The donated tier (kvstore.tiers.donated, SwiftCache §3.2): memory an engine lends the daemon while it does not
    need it (shared memory, or GPU memory by CUDA IPC handle), a tier between the host pool and the SSD, handed back
    on the donor's demand within its deadline. Donors connect to their own socket (kvstore.client.donor)."""
    enabled: bool = False               # off: no donated tier, no donors' socket
    socket: str = ""                    # empty: donate.sock beside server.socket
    kind: str = "memfd"                 # memfd (shared memory, any machine) | cuda (GPU memory by CUDA IPC handle)
    max_bytes: int = 0                  # all donated regions together; 0: no cap (donors lend what they have)
    max_donors: int = 16                # donor connections at once
    max_deadline_ms: int = 60000        # a reclaim asking for a longer deadline gets this one
    in_flight: int = 2                  # copies the tier's path runs at once (its worker threads)


@dataclass(slots=True)
class LogConfig:
    level: str = "info"


@dataclass(slots=True)
class Config:
    server: ServerConfig = field(default_factory=ServerConfig)
    pool: PoolConfig = field(default_factory=PoolConfig)
    ssd: SsdConfig = field(default_factory=SsdConfig)
    remote: RemoteConfig = field(default_factory=RemoteConfig)
    traffic: TrafficConfig = field(default_factory=TrafficConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    hints: HintsConfig = field(default_factory=HintsConfig)
    prefetch: PrefetchConfig = field(default_factory=PrefetchConfig)
    log: LogConfig = field(default_factory=LogConfig)
    tenancy: TenancyConfig = field(default_factory=TenancyConfig)
    donated: DonatedConfig = field(default_factory=DonatedConfig)
    tenants: list[TenantConfig] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        for t in d["tenants"]:
            t["secret"] = "***" if t["secret"] else ""     # never printed
        return d


SECTIONS = {"server": ServerConfig, "pool": PoolConfig, "ssd": SsdConfig, "remote": RemoteConfig,
            "traffic": TrafficConfig,
            "metrics": MetricsConfig, "hints": HintsConfig, "prefetch": PrefetchConfig,
            "log": LogConfig, "tenancy": TenancyConfig, "donated": DonatedConfig}
SIZE_FIELDS = {("server", "max_frame_bytes"), ("server", "min_block_bytes"), ("pool", "capacity"),
               ("pool", "segment_bytes"), ("ssd", "capacity"), ("ssd", "staging_bytes"),
               ("remote", "segment_bytes"), ("remote", "buffer_bytes"), ("remote", "staging_bytes"),
               ("tenancy", "default_host"), ("tenancy", "default_ssd"), ("tenancy", "compact_bytes"),
               ("donated", "max_bytes")}
LISTS = ("tenants",)    # top-level lists, not sections: set by file only (a secret does not belong in the env)
LOG_LEVELS = ("debug", "info", "warning", "error")


def auto_capacity() -> int:
    """A quarter of physical memory, at most 64 GiB: room for the engines beside it."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return min(total // 4, 64 << 30)


def embedded_default() -> dict[str, Any]:
    try:
        text = importlib.resources.files("kvstore.configs").joinpath("default.yaml").read_text()
    except ModuleNotFoundError:   # run from a source tree on PYTHONPATH, not installed: the file beside the package
        text = (Path(__file__).resolve().parents[2] / "configs" / "default.yaml").read_text()
    return yaml.safe_load(text)


def load_config(path: str | None = None, env: dict[str, str] | None = None) -> Config:
    """Merge default < file < environment, validate every field, resolve "auto" values."""
    raw = embedded_default()
    errors: list[str] = []
    if path:
        try:
            with open(path) as f:
                user = yaml.safe_load(f) or {}
        except OSError as e:
            raise ConfigError(f"cannot read configuration {path}: {e.strerror}") from None
        except yaml.YAMLError as e:
            raise ConfigError(f"{path} is not valid YAML: {e}") from None
        errors += _merge(raw, user, path)
    errors += _apply_env(raw, os.environ if env is None else env)
    return _build(raw, errors)


def _merge(base: dict[str, Any], user: Any, where: str) -> list[str]:
    if not isinstance(user, dict):
        raise ConfigError(f"{where}: the top level must be a mapping of sections {sorted(SECTIONS)}")
    errors = []
    for section, values in user.items():
        if section in LISTS:
            if isinstance(values, list):
                base[section] = values
            else:
                errors.append(f"{section}: must be a list" + (" (or empty)" if values is None else ""))
        elif section not in SECTIONS:
            errors.append(f"{section}: unknown section (known: {', '.join([*SECTIONS, *LISTS])})")
        elif not isinstance(values, dict):
            errors.append(f"{section}: must be a mapping")
        else:
            base.setdefault(section, {}).update(values)     # a section the embedded default leaves out
    return errors


def _apply_env(raw: dict[str, Any], env: Any) -> list[str]:
    errors = []
    for name, value in env.items():
        if not name.startswith("KVSTORE_") or name in ("KVSTORE_NO_NATIVE", "KVSTORE_CONFIG"):
            continue
        rest = name[len("KVSTORE_"):].lower()
        section, _, key = rest.partition("_")
        if section not in SECTIONS:
            continue
        types = {f.name: f.type for f in dataclasses.fields(SECTIONS[section])}
        if types.get(key) in ("str", str) or not value:   # as written: YAML would make "::" a map, "off" false
            raw.setdefault(section, {})[key] = value
            continue
        try:
            raw.setdefault(section, {})[key] = yaml.safe_load(value)
        except yaml.YAMLError:
            errors.append(f"{section}.{key}: {name}={value!r} is not a valid YAML value")
    return errors


def _build(raw: dict[str, Any], errors: list[str]) -> Config:
    built: dict[str, Any] = {}
    for section, cls in SECTIONS.items():
        known = {f.name: f for f in dataclasses.fields(cls)}
        values = {}
        for key, value in raw.get(section, {}).items():
            where = f"{section}.{key}"
            if key not in known:
                errors.append(f"{where}: unknown field (known: {', '.join(known)})")
                continue
            try:
                values[key] = _coerce(section, key, value, known[key].type)
            except ValueError as e:
                errors.append(f"{where}: {e}")
        built[section] = cls(**values)
    cfg = Config(**built, tenants=_tenants(raw.get("tenants") or [], errors))
    errors += _check(cfg)
    if errors:
        raise ConfigError("invalid configuration:\n  " + "\n  ".join(errors))
    return cfg


def _tenants(raw: list[Any], errors: list[str]) -> list[TenantConfig]:
    """The `tenants:` list: each a mapping {name, uids, secret, host, ssd, policy}; names unique, neither "" nor
    "uid:<n>" (those are the implicit tenants), and each needs uids or a secret (else any local user could claim
    it)."""
    out: list[TenantConfig] = []
    for i, t in enumerate(raw):
        where = f"tenants[{i}]"
        if not isinstance(t, dict) or set(t) - {"name", "uids", "secret", "host", "ssd", "policy"}:
            errors.append(f"{where}: must be a mapping of name, uids (optional), secret (optional), host (optional: "
                          "its quota, e.g. 8GiB), ssd (optional: its SSD quota), policy (optional: its eviction "
                          "policy, else pool.eviction)")
            continue
        policy = t.get("policy") or ""
        name, uids, secret = t.get("name"), t.get("uids") or [], t.get("secret") or ""
        try:
            host = parse_size(t.get("host") or 0)
        except (ValueError, TypeError):
            errors.append(f"{where}.host: expected a size (e.g. 8GiB), got {t.get('host')!r}")
            continue
        try:
            ssd = parse_size(t.get("ssd") or 0)
        except (ValueError, TypeError):
            errors.append(f"{where}.ssd: expected a size (e.g. 100GiB), got {t.get('ssd')!r}")
            continue
        if not isinstance(name, str) or not 1 <= len(name) <= 64 or name.startswith("uid:") or "\x00" in name:
            errors.append(f"{where}.name: must be a string of 1..64 characters, not starting with 'uid:' (and "
                          f"without NUL), got {name!r}")
        elif any(o.name == name for o in out):
            errors.append(f"{where}.name: {name!r} is listed twice")
        elif not _uid_list(uids):
            errors.append(f"{where}.uids: expected a list of user ids, got {uids!r}")
        elif not isinstance(secret, str) or len(secret) > 256:
            errors.append(f"{where}.secret: expected a string of at most 256 characters")
        elif not uids and not secret:
            errors.append(f"{where}: give uids, a secret or both (otherwise any local user could claim {name!r})")
        elif policy and policy not in POLICIES:
            errors.append(f"{where}.policy: must be one of {', '.join(POLICIES)}, got {policy!r}")
        else:
            out.append(TenantConfig(name, list(uids), secret, host, policy, ssd))
    return out


def _uid_list(v: Any) -> bool:
    return isinstance(v, list) and all(isinstance(u, int) and not isinstance(u, bool) and 0 <= u < 1 << 32
                                       for u in v)


def _coerce(section: str, key: str, value: Any, typ: Any) -> Any:
    if (section, key) in SIZE_FIELDS:
        return 0 if value == "auto" else parse_size(value)
    if (section, key) == ("server", "admin_uids"):
        if value == "auto":
            return [os.getuid()]
        if not _uid_list(value):
            raise ValueError(f"expected auto or a list of user ids, got {value!r}")
        return list(value)
    if typ in ("int", int) and not (isinstance(value, int) and not isinstance(value, bool)):
        raise ValueError(f"expected an integer, got {value!r}")
    if typ in ("float", float):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"expected a number, got {value!r}")
        return float(value)
    if typ in ("bool", bool) and not isinstance(value, bool):
        raise ValueError(f"expected true or false, got {value!r}")
    if typ in ("str", str) and not isinstance(value, str):
        raise ValueError(f"expected a string, got {value!r}")
    return value


def _check(cfg: Config) -> list[str]:
    errors = []
    s, p, m = cfg.server, cfg.pool, cfg.metrics
    if s.socket == "auto":
        s.socket = default_socket_path()
    if not os.path.isabs(s.socket):
        errors.append(f"server.socket: must be an absolute path, got {s.socket!r}")
    if len(s.socket.encode()) > 100:
        errors.append(f"server.socket: path longer than 100 bytes (Unix socket limit): {s.socket}")
    if not 1 <= s.max_connections <= 4096:
        errors.append(f"server.max_connections: must be 1..4096, got {s.max_connections}")
    if not 4096 <= s.max_frame_bytes <= 64 << 20:
        errors.append(f"server.max_frame_bytes: must be 4KiB..64MiB, got {s.max_frame_bytes}")
    if not 1 <= s.max_keys_per_request <= 65536:
        errors.append(f"server.max_keys_per_request: must be 1..65536, got {s.max_keys_per_request}")
    if not 0.1 <= s.send_timeout_s <= 3600:
        errors.append(f"server.send_timeout_s: must be 0.1..3600 seconds, got {s.send_timeout_s}")
    if s.shutdown_timeout_s < 0:
        errors.append(f"server.shutdown_timeout_s: must not be negative, got {s.shutdown_timeout_s}")
    errors += _check_limits(s)
    if p.capacity == 0:
        p.capacity = auto_capacity()
    if p.segment_bytes < 1 << 20:
        errors.append(f"pool.segment_bytes: must be at least 1MiB, got {p.segment_bytes}")
    if p.eviction not in POLICIES:
        errors.append(f"pool.eviction: must be one of {', '.join(POLICIES)}, got {p.eviction!r}")
    if not 0 <= p.small_segment_slots <= 1 << 20:
        errors.append(f"pool.small_segment_slots: must be 0..1048576, got {p.small_segment_slots}")
    if p.pair_eviction not in ("decoupled", "coupled"):
        errors.append(f"pool.pair_eviction: must be decoupled or coupled, got {p.pair_eviction!r}")
    try:
        if not ipaddress.ip_address(m.host).is_loopback:
            errors.append(f"metrics.host: must be a loopback address (the endpoint has no auth), got {m.host}")
    except ValueError:
        errors.append(f"metrics.host: not an IP address: {m.host!r}")
    if not 1 <= m.port <= 65535:
        errors.append(f"metrics.port: must be 1..65535, got {m.port}")
    d = cfg.ssd
    if d.dir and not os.path.isabs(d.dir):
        errors.append(f"ssd.dir: must be an absolute path (or empty for no SSD tier), got {d.dir!r}")
    if d.io not in IO_MODES:
        errors.append(f"ssd.io: must be one of {', '.join(IO_MODES)}, got {d.io!r}")
    if not 0 <= d.promote_reserve <= 1024:
        errors.append(f"ssd.promote_reserve: must be 0 (off) to 1024 free slots, got {d.promote_reserve}")
    if d.eviction not in POLICIES:
        errors.append(f"ssd.eviction: must be one of {', '.join(POLICIES)}, got {d.eviction!r}")
    if d.sync not in SYNC_POLICIES:
        errors.append(f"ssd.sync: must be one of {', '.join(SYNC_POLICIES)}, got {d.sync!r}")
    if d.dir and d.capacity < 1 << 20:
        errors.append(f"ssd.capacity: must be at least 1MiB, got {d.capacity}")
    if not 0 < d.durable_timeout_max_s <= 3600:
        errors.append(f"ssd.durable_timeout_max_s: must be above 0 and at most 3600 seconds, got "
                      f"{d.durable_timeout_max_s}")
    if not 0 <= d.durable_timeout_s <= d.durable_timeout_max_s:
        errors.append(f"ssd.durable_timeout_s: must be 0..ssd.durable_timeout_max_s ({d.durable_timeout_max_s}) "
                      f"seconds, got {d.durable_timeout_s}")
    errors += _check_remote(cfg.remote)
    errors += _check_traffic(cfg.traffic)
    errors += _check_hints(cfg.hints)
    errors += _check_prefetch(cfg.prefetch)
    errors += _check_tenancy(cfg)
    errors += _check_donated(cfg.donated)
    if cfg.log.level not in LOG_LEVELS:
        errors.append(f"log.level: must be one of {', '.join(LOG_LEVELS)}, got {cfg.log.level!r}")
    return errors


PLACEMENTS = ("auto", "write_back", "write_through", "both")


def _check_tenancy(cfg: Config) -> list[str]:
    t = cfg.tenancy
    errors = []
    if t.unknown not in ("share", "refuse"):
        errors.append(f"tenancy.unknown: must be share or refuse, got {t.unknown!r}")
    if not 0.01 <= t.window_s <= 86400:
        errors.append(f"tenancy.window_s: must be 0.01..86400 seconds, got {t.window_s}")
    quotas = sum(x.host for x in cfg.tenants) + t.default_host
    if quotas > cfg.pool.capacity:
        errors.append(f"tenants: the host quotas ({quotas} bytes, tenancy.default_host included) exceed "
                      f"pool.capacity ({cfg.pool.capacity} bytes): a quota is a guarantee; lower them or grow the "
                      "pool")
    ssd = sum(x.ssd for x in cfg.tenants) + t.default_ssd
    if ssd and not cfg.ssd.dir:
        errors.append("tenants: SSD quotas are set (tenants[].ssd or tenancy.default_ssd) but there is no SSD tier "
                      "(ssd.dir is empty): set ssd.dir or remove them")
    elif ssd > cfg.ssd.capacity:
        errors.append(f"tenants: the SSD quotas ({ssd} bytes, tenancy.default_ssd included) exceed ssd.capacity "
                      f"({cfg.ssd.capacity} bytes): lower them or grow the tier")
    return errors


def _check_donated(d: DonatedConfig) -> list[str]:
    errors = []
    if d.kind not in ("memfd", "cuda"):
        errors.append(f"donated.kind: must be memfd or cuda, got {d.kind!r}")
    if d.socket and not os.path.isabs(d.socket):
        errors.append(f"donated.socket: must be an absolute path (or empty: beside server.socket), got {d.socket!r}")
    if not 1 <= d.max_donors <= 1024:
        errors.append(f"donated.max_donors: must be 1..1024, got {d.max_donors}")
    if not 0 <= d.max_deadline_ms <= 3_600_000:
        errors.append(f"donated.max_deadline_ms: must be 0..3600000, got {d.max_deadline_ms}")
    if not 1 <= d.in_flight <= 64:
        errors.append(f"donated.in_flight: must be 1..64, got {d.in_flight}")
    return errors


def _check_remote(r: RemoteConfig) -> list[str]:
    if not r.master:
        return []
    errors = []
    host, _, port = r.master.rpartition(":")
    if not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        errors.append(f"remote.master: must be host:port (the mooncake_master's RPC address), got {r.master!r}")
    if r.metadata and not r.metadata.startswith(("http://", "etcd://", "redis://", "P2PHANDSHAKE")):
        errors.append(f"remote.metadata: must be an http://, etcd:// or redis:// address or P2PHANDSHAKE, "
                      f"got {r.metadata!r}")
    if r.protocol not in ("tcp", "rdma"):
        errors.append(f"remote.protocol: must be tcp or rdma, got {r.protocol!r}")
    if r.placement not in PLACEMENTS:
        errors.append(f"remote.placement: must be one of {', '.join(PLACEMENTS)}, got {r.placement!r}")
    if not 1 <= r.replicas <= 8:
        errors.append(f"remote.replicas: must be 1..8, got {r.replicas}")
    if 0 < r.segment_bytes < 1 << 20:
        errors.append(f"remote.segment_bytes: must be 0 (this node lends the store nothing) or at least 1MiB, got "
                      f"{r.segment_bytes}")
    if r.buffer_bytes < 1 << 20:
        errors.append(f"remote.buffer_bytes: must be at least 1MiB, got {r.buffer_bytes}")
    if r.staging_bytes < 0:
        errors.append(f"remote.staging_bytes: must not be negative, got {r.staging_bytes}")
    if not r.hostname or r.hostname.strip() != r.hostname or "/" in r.hostname:
        errors.append(f"remote.hostname: must be this node's IP address or host name as the other nodes reach it, "
                      f"got {r.hostname!r}")
    if r.bind_address and not _is_ip(r.bind_address):
        errors.append(f"remote.bind_address: must be empty (remote.hostname's address), an IP address of this node, "
                      f"or 0.0.0.0 / :: (every address), got {r.bind_address!r}")
    for name in ("timeout_s", "retry_s", "known_s", "unreachable_s"):
        if not 0 < getattr(r, name) <= 3600:
            errors.append(f"remote.{name}: must be above 0 and at most 3600 seconds, got {getattr(r, name)}")
    if not 1 <= r.in_flight <= 64:
        errors.append(f"remote.in_flight: must be 1..64, got {r.in_flight}")
    return errors


def _is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
        return True
    except ValueError:
        return False


def _check_limits(s: ServerConfig) -> list[str]:
    errors = []
    if not 0 < s.max_held_fraction <= 1:
        errors.append(f"server.max_held_fraction: must be above 0 and at most 1, got {s.max_held_fraction}")
    if not 0 < s.max_reserved_fraction <= 1:
        errors.append(f"server.max_reserved_fraction: must be above 0 and at most 1, got {s.max_reserved_fraction}")
    if not 1 <= s.max_namespaces_per_connection <= 65536:
        errors.append(f"server.max_namespaces_per_connection: must be 1..65536, got "
                      f"{s.max_namespaces_per_connection}")
    if not 0.1 <= s.reservation_lease_s <= 86400:
        errors.append(f"server.reservation_lease_s: must be 0.1..86400 seconds, got {s.reservation_lease_s}")
    if not 1 <= s.min_block_bytes <= 1 << 30:
        errors.append(f"server.min_block_bytes: must be 1B..1GiB, got {s.min_block_bytes}")
    if not 0.1 <= s.idle_timeout_s <= 7 * 86400:
        errors.append(f"server.idle_timeout_s: must be 0.1..604800 seconds, got {s.idle_timeout_s}")
    return errors


def _check_hints(h: HintsConfig) -> list[str]:
    errors = []
    if not 0.05 <= h.idle_s <= 7 * 86400:
        errors.append(f"hints.idle_s: must be 0.05..604800 seconds, got {h.idle_s}")
    if not 1 <= h.max_workflows <= 10_000_000:
        errors.append(f"hints.max_workflows: must be 1..10000000, got {h.max_workflows}")
    return errors


def _check_prefetch(p: PrefetchConfig) -> list[str]:
    errors = []
    if not 0 <= p.min_p <= 1:
        errors.append(f"prefetch.min_p: must be a probability, 0..1, got {p.min_p}")
    if not 0 <= p.lead_s <= 3600:
        errors.append(f"prefetch.lead_s: must be 0..3600 seconds (0: no timed trigger), got {p.lead_s}")
    if not 1 <= p.max_chain_blocks <= 1 << 20:
        errors.append(f"prefetch.max_chain_blocks: must be 1..1048576, got {p.max_chain_blocks}")
    if not 1 <= p.blocks_per_tick <= 65536:
        errors.append(f"prefetch.blocks_per_tick: must be 1..65536, got {p.blocks_per_tick}")
    return errors


def _check_traffic(t: TrafficConfig) -> list[str]:
    errors = []
    if t.policy not in ("weighted", "fifo"):
        errors.append(f"traffic.policy: must be weighted or fifo, got {t.policy!r}")
    shares = {"share_store": t.share_store, "share_prefetch": t.share_prefetch,
              "share_background": t.share_background}
    for name, v in shares.items():
        if not 0 < v < 1:
            errors.append(f"traffic.{name}: must be above 0 (a lane with no share could starve) and below 1, got {v}")
    if sum(shares.values()) >= 0.5:
        errors.append(f"traffic: the lower lanes' shares add up to {sum(shares.values()):.3f}; keep them below 0.5 "
                      "so that critical reads take most of a contended path")
    for name in ("queue_critical", "queue_store", "queue_prefetch", "queue_background"):
        if not 1 <= getattr(t, name) <= 1 << 20:
            errors.append(f"traffic.{name}: must be 1..1048576, got {getattr(t, name)}")
    if not 1 <= t.ssd_in_flight <= 64:
        errors.append(f"traffic.ssd_in_flight: must be 1..64, got {t.ssd_in_flight}")
    return errors
