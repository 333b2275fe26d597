"""Which lower tiers a daemon has, built from its configuration, fastest first.

Each entry names a module and a function `open_tier(config, traffic, workflows) -> LowerTier | None` (None when
the configuration leaves the tier off; `workflows`: the daemon's hint books, for a workflow-aware eviction policy),
imported only when the daemon starts. Registering a tier is one line here.
"""
from __future__ import annotations

import importlib

from kvstore.daemon.config import Config
from kvstore.policy.workflow import Workflows
from kvstore.tiers import LowerTier, LowerTiers
from kvstore.traffic.manager import TrafficManager

TIER_TYPES: dict[str, str] = {
    "ssd": "kvstore.tiers.ssd.tier",
    "remote": "kvstore.tiers.remote.tier",
}
# Tiers that sit above the others (faster, and they move their blocks down to the tier below them): opened after
# them, given the first of them as `below`, and placed first (evictions from the host pool go to it).
STACKED: dict[str, str] = {
    "donated": "kvstore.tiers.donated.tier",
}


def open_lower_tiers(config: Config, traffic: TrafficManager, workflows: Workflows | None = None) -> LowerTiers:
    """Open every configured lower tier, in the order above; a tier that cannot start raises (and closes the
    tiers opened before it), so a daemon never runs with half its configuration."""
    opened: list[LowerTier] = []
    try:
        for module in TIER_TYPES.values():
            tier = importlib.import_module(module).open_tier(config, traffic, workflows)
            if tier is not None:
                opened.append(tier)
        for module in STACKED.values():
            tier = importlib.import_module(module).open_tier(config, traffic, workflows,
                                                             below=opened[0] if opened else None)
            if tier is not None:
                opened.insert(0, tier)
    except BaseException:
        LowerTiers(opened).close()
        raise
    return LowerTiers(opened)
