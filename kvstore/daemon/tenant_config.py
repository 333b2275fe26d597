"""The tenants' part of the configuration: the `tenants:` list (who may speak as each tenant, with what secret,
and what each is guaranteed: host and SSD quotas, its own eviction policy) and the `tenancy:` section (lending
between tenants), each checked with one message per invalid field. kvstore.daemon.config composes them."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvstore.policy import REGISTRY as POLICIES
from kvstore.units import parse_size

if TYPE_CHECKING:
    from kvstore.daemon.config import Config


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


def parse_tenants(raw: list[Any], errors: list[str]) -> list[TenantConfig]:
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
        elif not uid_list(uids):
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


def uid_list(v: Any) -> bool:
    return isinstance(v, list) and all(isinstance(u, int) and not isinstance(u, bool) and 0 <= u < 1 << 32
                                       for u in v)


def check_tenancy(cfg: Config) -> list[str]:
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
