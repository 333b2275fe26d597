"""The remote tier's section of the configuration (`remote:`), with its checks: the tier owns it, the daemon's
configuration composes it (kvstore.daemon.config)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kvstore.tiers.remote.address import is_ip

PLACEMENTS = ("auto", "write_back", "write_through", "both")


@dataclass(slots=True)
class RemoteConfig:
    """The remote tier (kvstore.tiers.remote): blocks shared by the daemons of several nodes through Mooncake Store
    (the `kvstore[mooncake]` extra). Off while `master` is empty."""
    SIZES: ClassVar[tuple[str, ...]] = ("segment_bytes", "buffer_bytes", "staging_bytes")   # given as sizes
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

    def check(self) -> list[str]:
        """One message per invalid field (none: valid)."""
        r = self
        if not r.master:
            return []
        errors: list[str] = []
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
            errors.append(f"remote.segment_bytes: must be 0 (this node lends the store nothing) or at least "
                          f"1MiB, got {r.segment_bytes}")
        if r.buffer_bytes < 1 << 20:
            errors.append(f"remote.buffer_bytes: must be at least 1MiB, got {r.buffer_bytes}")
        if r.staging_bytes < 0:
            errors.append(f"remote.staging_bytes: must not be negative, got {r.staging_bytes}")
        if not r.hostname or r.hostname.strip() != r.hostname or "/" in r.hostname:
            errors.append(f"remote.hostname: must be this node's IP address or host name as the other nodes "
                          f"reach it, got {r.hostname!r}")
        if r.bind_address and not is_ip(r.bind_address):
            errors.append(f"remote.bind_address: must be empty (remote.hostname's address), an IP address of "
                          f"this node, or 0.0.0.0 / :: (every address), got {r.bind_address!r}")
        for name in ("timeout_s", "retry_s", "known_s", "unreachable_s"):
            if not 0 < getattr(r, name) <= 3600:
                errors.append(f"remote.{name}: must be above 0 and at most 3600 seconds, got {getattr(r, name)}")
        if not 1 <= r.in_flight <= 64:
            errors.append(f"remote.in_flight: must be 1..64, got {r.in_flight}")
        return errors
