"""Which lower tiers a daemon has, built from its configuration, fastest first.

Each entry maps a configuration section to the module of the tier that owns it; the module has
`open_tier(section, context) -> LowerTier | None` (None when its section leaves the tier off), imported only when
the daemon starts. A tier sees its own section (a dataclass in its package's `config.py`, with its checks) and the
`TierContext` — what the daemon lends every tier — and nothing else of the daemon's configuration.

Adding a tier: its package (`config.py`: the section's dataclass with `check()`; `tier.py`: the tier and
`open_tier`), one line here, and the section's field in kvstore.daemon.config.Config (the embedded default
configs/default.yaml lists its keys with their meaning).
"""
from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from kvstore.tiers import LowerTier, LowerTiers, TierContext

TIER_TYPES: dict[str, str] = {
    "ssd": "kvstore.tiers.ssd.tier",
    "remote": "kvstore.tiers.remote.tier",
}
# Tiers that sit above the others (faster, and they move their blocks down to the tier below them): opened after
# them, given the first of them as `below`, and placed first (evictions from the host pool go to it).
STACKED: dict[str, str] = {
    "donated": "kvstore.tiers.donated.tier",
}
SECTIONS = (*TIER_TYPES, *STACKED)


def open_lower_tiers(sections: Mapping[str, Any], context: TierContext) -> LowerTiers:
    """Open every configured lower tier, in the order above, each with its own section; a tier that cannot start
    raises (and closes the tiers opened before it), so a daemon never runs with half its configuration."""
    opened: list[LowerTier] = []
    try:
        for name, module in TIER_TYPES.items():
            ctx = replace(context, opened=tuple(t.name for t in opened))
            tier = importlib.import_module(module).open_tier(sections[name], ctx)
            if tier is not None:
                opened.append(tier)
        for name, module in STACKED.items():
            ctx = replace(context, opened=tuple(t.name for t in opened), below=opened[0] if opened else None)
            tier = importlib.import_module(module).open_tier(sections[name], ctx)
            if tier is not None:
                opened.insert(0, tier)
    except BaseException:
        LowerTiers(opened).close()
        raise
    return LowerTiers(opened)
