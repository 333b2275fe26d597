"""The SSD tier's section of the configuration (`ssd:`), with its checks: the tier owns it, the daemon's
configuration composes it (kvstore.daemon.config)."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import ClassVar

from kvstore.policy import REGISTRY as POLICIES

IO_MODES = ("auto", "io_uring", "threads")      # the values of ssd.io
SYNC_POLICIES = ("always", "batch", "never")     # the values of ssd.sync


@dataclass(slots=True)
class SsdConfig:
    SIZES: ClassVar[tuple[str, ...]] = ("capacity", "staging_bytes")     # fields given as sizes ("64GiB")
    dir: str = ""                       # empty: no SSD tier
    capacity: int = 16 << 30
    sync: str = "batch"
    staging_bytes: int = 256 << 20      # evicted blocks waiting in memory for their SSD write
    promote_reserve: int = 2            # free host slots per block size kept for promotions (movers/reserve.py)
    write_through: bool = False         # also write every committed block to SSD at once (store lane)
    io: str = "auto"                    # auto | io_uring | threads: how record payloads reach the disk
    persist_on_stop: bool = True        # a graceful stop writes the host pool's blocks to SSD first
    eviction: str = "history"           # which record makes room at the cap (kvstore.policy)
    durable_timeout_s: float = 5.0      # a durable commit or flush naming no deadline waits at most this long
    durable_timeout_max_s: float = 20.0  # ... and one naming a longer deadline this long (below clients' timeouts)

    def check(self) -> list[str]:
        """One message per invalid field (none: valid)."""
        d = self
        errors: list[str] = []
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
        return errors
