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

from kvstore.daemon.server_config import ServerConfig, check_server, parse_socket_mode, socket_gid, socket_mode
from kvstore.daemon.tenant_config import TenancyConfig, TenantConfig, check_tenancy, parse_tenants, uid_list
from kvstore.movers.config import PrefetchConfig
from kvstore.policy import REGISTRY as POLICIES
from kvstore.protocol.paths import default_socket_path
from kvstore.tiers import registry as tier_registry
from kvstore.tiers.donated.config import DonatedConfig
from kvstore.tiers.remote.config import PLACEMENTS, RemoteConfig
from kvstore.tiers.ssd.config import SsdConfig
from kvstore.traffic.config import TrafficConfig
from kvstore.units import parse_size

# The sections each part owns (dataclass + checks in its own package), composed here; re-exported for callers.
__all__ = ["PLACEMENTS", "Config", "ConfigError", "DonatedConfig", "PrefetchConfig", "RemoteConfig", "ServerConfig",
           "SsdConfig", "TenancyConfig", "TenantConfig", "TrafficConfig", "default_socket_path", "load_config",
           "socket_gid", "socket_mode"]


class ConfigError(ValueError):
    """Raised with every invalid field listed, one per line."""


@dataclass(slots=True)
class PoolConfig:
    capacity: int = 0  # 0 after loading means "auto" was resolved already; see _resolve_auto
    segment_bytes: int = 64 << 20
    eviction: str = "history"
    pair_eviction: str = "decoupled"    # decoupled | coupled: whether a base block's residuals leave with it (ForkKV)
    small_segment_slots: int = 256      # a size of small blocks gets segments of this many (0: segment_bytes for all)


@dataclass(slots=True)
class MetricsConfig:
    enabled: bool = False
    host: str = "127.0.0.1"             # loopback; another address only with a token_file
    port: int = 9464
    token_file: str = ""                # a file (absolute path, not readable by others) holding the bearer token
    per_tenant: bool = False            # serve the kvstore_tenant_* series (they name every tenant)


@dataclass(slots=True)
class HintsConfig:
    SIZES = ("model_bytes",)
    idle_s: float = 600.0               # a workflow or session without activity this long is retired
    max_workflows: int = 100000         # active at once, all tenants; beyond it the busiest tenant's oldest retires
    tenant_workflows: int = 100000      # active at once per tenant; beyond it its least recently active retires
    model_keys: int = 4096              # per tenant: (type, agent) pairs its predictor and gap statistics keep
    model_successors: int = 16          # per pair: successors named (the rest pooled); a lookahead's agents a step
    model_bytes: int = 4 << 20          # per tenant: the estimate of its predictor's bytes, and of its gaps' (each)


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
    extra: dict[str, Any] = field(default_factory=dict)    # the sections of tiers registered at run time

    def section(self, name: str) -> Any:
        """A section by name: a field of this class, or a registered tier's (kvstore.tiers.registry)."""
        return getattr(self, name) if name in _FIELDS else self.extra[name]

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        for t in d["tenants"]:
            t["secret"] = "***" if t["secret"] else ""     # never printed
        return d


_FIELDS = frozenset(f.name for f in dataclasses.fields(Config))
# The daemon's own sections; each tier's section comes from the tier registry (its own package's dataclass, whose
# SIZES class attribute names its size fields), so that a registered tier needs no line here.
CORE_SECTIONS = {"server": ServerConfig, "pool": PoolConfig, "traffic": TrafficConfig, "metrics": MetricsConfig,
                 "hints": HintsConfig, "prefetch": PrefetchConfig, "log": LogConfig, "tenancy": TenancyConfig}
SIZE_FIELDS = {("server", "max_frame_bytes"), ("server", "min_block_bytes"), ("pool", "capacity"),
               ("pool", "segment_bytes"), ("tenancy", "default_host"), ("tenancy", "default_ssd"),
               ("tenancy", "compact_bytes")}


def sections() -> dict[str, Any]:
    """Every section a configuration may have: the daemon's, then each registered tier's."""
    return {**CORE_SECTIONS, **tier_registry.sections()}


def _is_size(section: str, key: str) -> bool:
    return (section, key) in SIZE_FIELDS or key in getattr(sections().get(section), "SIZES", ())
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
        raise ConfigError(f"{where}: the top level must be a mapping of sections {sorted(sections())}")
    errors = []
    for section, values in user.items():
        if section in LISTS:
            if isinstance(values, list):
                base[section] = values
            else:
                errors.append(f"{section}: must be a list" + (" (or empty)" if values is None else ""))
        elif section not in sections():
            errors.append(f"{section}: unknown section (known: {', '.join([*sections(), *LISTS])})")
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
        cls = sections().get(section)
        if cls is None:
            continue
        types = {f.name: f.type for f in dataclasses.fields(cls)}
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
    for section, cls in sections().items():
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
    extra = {name: built.pop(name) for name in list(built) if name not in _FIELDS}
    cfg = Config(**built, tenants=parse_tenants(raw.get("tenants") or [], errors), extra=extra)
    errors += _check(cfg)
    if errors:
        raise ConfigError("invalid configuration:\n  " + "\n  ".join(errors))
    return cfg


def _coerce(section: str, key: str, value: Any, typ: Any) -> Any:
    if _is_size(section, key):
        return 0 if value == "auto" else parse_size(value)
    if (section, key) == ("server", "socket_mode"):
        return parse_socket_mode(value)
    if (section, key) == ("server", "admin_uids"):
        if value == "auto":
            return [os.getuid()]
        if not uid_list(value):
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
    errors += check_server(s)
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
    errors += _check_metrics(m)
    for name in ("traffic", "prefetch", *tier_registry.sections()):      # each checks itself
        errors += cfg.section(name).check()
    errors += _check_hints(cfg.hints)
    errors += check_tenancy(cfg)
    if cfg.log.level not in LOG_LEVELS:
        errors.append(f"log.level: must be one of {', '.join(LOG_LEVELS)}, got {cfg.log.level!r}")
    return errors


def _check_hints(h: HintsConfig) -> list[str]:
    errors = []
    if not 0.05 <= h.idle_s <= 7 * 86400:
        errors.append(f"hints.idle_s: must be 0.05..604800 seconds, got {h.idle_s}")
    if not 1 <= h.max_workflows <= 10_000_000:
        errors.append(f"hints.max_workflows: must be 1..10000000, got {h.max_workflows}")
    if not 1 <= h.tenant_workflows <= 10_000_000:
        errors.append(f"hints.tenant_workflows: must be 1..10000000, got {h.tenant_workflows}")
    if not 16 <= h.model_keys <= 1 << 20:
        errors.append(f"hints.model_keys: must be 16..1048576, got {h.model_keys}")
    if not 1 <= h.model_successors <= 256:
        errors.append(f"hints.model_successors: must be 1..256, got {h.model_successors}")
    if not 64 << 10 <= h.model_bytes <= 1 << 30:
        errors.append(f"hints.model_bytes: must be 64KiB..1GiB, got {h.model_bytes}")
    return errors


def _check_metrics(m: MetricsConfig) -> list[str]:
    errors = []
    try:
        if not ipaddress.ip_address(m.host).is_loopback and not m.token_file:
            errors.append(f"metrics.host: must be a loopback address (the endpoint has no auth) unless "
                          f"metrics.token_file is set, got {m.host}")
    except ValueError:
        errors.append(f"metrics.host: not an IP address: {m.host!r}")
    if not 1 <= m.port <= 65535:
        errors.append(f"metrics.port: must be 1..65535, got {m.port}")
    if m.token_file:
        from kvstore.daemon.metrics import read_token
        try:
            read_token(m.token_file)
        except ValueError as e:
            errors.append(f"metrics.token_file: {e}")
    return errors
