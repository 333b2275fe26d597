"""Which lower tiers a daemon has, built from its configuration, fastest first.

Each entry maps a configuration section (its name, `ssd:` in the YAML, KVSTORE_SSD_* in the environment) to the
tier that owns it: the module with `open_tier(section, context) -> LowerTier | None` (None when its section leaves
the tier off), imported only when the daemon starts, and the section's dataclass ("module:Class", with a `check()`
returning one message per invalid field), imported when the configuration is loaded. A tier sees its own section
and the `TierContext` — what the daemon lends every tier — and nothing else of the daemon's configuration.

Adding a tier: a package (`config.py`: the section's dataclass; `tier.py`: the tier class, implementing
kvstore.tiers.LowerTier, and `open_tier`) and one entry here; tests/tiers/test_conformance.py states what every
tier must do. A tier registered at run time (`register`, before the configuration is loaded) works the same way:
tests/test_extending.py adds a toy tier from a test module and serves a daemon with it.
"""
from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import replace
from typing import Any, NamedTuple

from kvstore.tiers import LowerTier, LowerTiers, TierContext


class Entry(NamedTuple):
    module: str                 # the tier's module: open_tier(section, context)
    config: str                 # its section's dataclass, "module:Class"


TIER_TYPES: dict[str, Entry] = {
    "ssd": Entry("kvstore.tiers.ssd.tier", "kvstore.tiers.ssd.config:SsdConfig"),
    "remote": Entry("kvstore.tiers.remote.tier", "kvstore.tiers.remote.config:RemoteConfig"),
}
# Tiers that sit above the others (faster, and they move their blocks down to the tier below them): opened after
# them, given the first of them as `below`, and placed first (evictions from the host pool go to it).
STACKED: dict[str, Entry] = {
    "donated": Entry("kvstore.tiers.donated.tier", "kvstore.tiers.donated.config:DonatedConfig"),
}


def register(name: str, entry: Entry, stacked: bool = False) -> None:
    """Add a tier (after the built-in ones, in the order registered); before the configuration is loaded."""
    if name in TIER_TYPES or name in STACKED:
        raise ValueError(f"a tier named {name!r} is registered already")
    (STACKED if stacked else TIER_TYPES)[name] = entry


def sections() -> dict[str, type]:
    """Each registered tier's section name → its dataclass (imported now: configuration modules are light)."""
    out = {}
    for name, entry in {**TIER_TYPES, **STACKED}.items():
        module, _, cls = entry.config.partition(":")
        out[name] = getattr(importlib.import_module(module), cls)
    return out


def open_lower_tiers(sections: Mapping[str, Any], context: TierContext) -> LowerTiers:
    """Open every configured lower tier, in the order above, each with its own section; a tier that cannot start
    raises (and closes the tiers opened before it), so a daemon never runs with half its configuration."""
    opened: list[LowerTier] = []
    try:
        for name, entry in TIER_TYPES.items():
            ctx = replace(context, opened=tuple(t.name for t in opened))
            tier = importlib.import_module(entry.module).open_tier(sections[name], ctx)
            if tier is not None:
                opened.append(tier)
        for name, entry in STACKED.items():
            ctx = replace(context, opened=tuple(t.name for t in opened), below=opened[0] if opened else None)
            tier = importlib.import_module(entry.module).open_tier(sections[name], ctx)
            if tier is not None:
                opened.insert(0, tier)
    except BaseException:
        LowerTiers(opened).close()
        raise
    return LowerTiers(opened)
