"""The predictive prefetch's section of the configuration (`prefetch:`), with its checks (kvstore.movers.predictive
reads it; the daemon's configuration composes it)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class PrefetchConfig:
    """The predictive prefetch (kvstore.movers.predictive): SSD blocks of a workflow expected back soon are promoted
    into free or retired host space ahead of its request."""
    enabled: bool = True                # needs a lower tier; off: only clients' explicit prefetches
    min_p: float = 0.5                  # the timed trigger: P(the workflow calls again) at least this ...
    lead_s: float = 1.0                 # ... and its next call due within this many seconds (0: no timed trigger)
    max_chain_blocks: int = 4096        # per active workflow, the head of its latest chain kept (16 B a block)
    blocks_per_tick: int = 256          # blocks queued at most per server tick or per `next` hint

    def check(self) -> list[str]:
        """One message per invalid field (none: valid)."""
        p = self
        errors: list[str] = []
        if not 0 <= p.min_p <= 1:
            errors.append(f"prefetch.min_p: must be a probability, 0..1, got {p.min_p}")
        if not 0 <= p.lead_s <= 3600:
            errors.append(f"prefetch.lead_s: must be 0..3600 seconds (0: no timed trigger), got {p.lead_s}")
        if not 1 <= p.max_chain_blocks <= 1 << 20:
            errors.append(f"prefetch.max_chain_blocks: must be 1..1048576, got {p.max_chain_blocks}")
        if not 1 <= p.blocks_per_tick <= 65536:
            errors.append(f"prefetch.blocks_per_tick: must be 1..65536, got {p.blocks_per_tick}")
        return errors
