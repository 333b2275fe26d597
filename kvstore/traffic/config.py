"""The traffic manager's section of the configuration (`traffic:`), with its checks (kvstore.traffic.manager reads
it; the daemon's configuration composes it)."""
from __future__ import annotations

from dataclasses import dataclass


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

    def check(self) -> list[str]:
        """One message per invalid field (none: valid)."""
        t = self
        errors: list[str] = []
        if t.policy not in ("weighted", "fifo"):
            errors.append(f"traffic.policy: must be weighted or fifo, got {t.policy!r}")
        shares = {"share_store": t.share_store, "share_prefetch": t.share_prefetch,
                  "share_background": t.share_background}
        for name, v in shares.items():
            if not 0 < v < 1:
                errors.append(f"traffic.{name}: must be above 0 (a lane with no share could starve) and below 1, "
                              f"got {v}")
        if sum(shares.values()) >= 0.5:
            errors.append(f"traffic: the lower lanes' shares add up to {sum(shares.values()):.3f}; keep them "
                          "below 0.5 so that critical reads take most of a contended path")
        for name in ("queue_critical", "queue_store", "queue_prefetch", "queue_background"):
            if not 1 <= getattr(t, name) <= 1 << 20:
                errors.append(f"traffic.{name}: must be 1..1048576, got {getattr(t, name)}")
        if not 1 <= t.ssd_in_flight <= 64:
            errors.append(f"traffic.ssd_in_flight: must be 1..64, got {t.ssd_in_flight}")
        return errors
