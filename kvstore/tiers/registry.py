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


def open_lower_tiers(config: Config, traffic: TrafficManager, workflows: Workflows | None = None) -> LowerTiers:
    """Open every configured lower tier, in the order above; a tier that cannot start raises (and closes the
    tiers opened before it), so a daemon never runs with half its configuration."""
    opened: list[LowerTier] = []
    try:
        for module in TIER_TYPES.values():
            tier = importlib.import_module(module).open_tier(config, traffic, workflows)
            if tier is not None:
                opened.append(tier)
    except BaseException:
        LowerTiers(opened).close()
        raise
    return LowerTiers(opened)
