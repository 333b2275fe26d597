"""Lanes: what a transfer is for, in priority order (DualPath §5, DESIGN.md "Traffic manager").

| lane       | what                                   | share when every lane wants the path          |
|------------|----------------------------------------|-----------------------------------------------|
| critical   | a read an engine is waiting on         | the rest (0.96 by default): never starved     |
| store      | offload writes from engines            | a minimum share (0.02)                        |
| prefetch   | speculative promotion                  | idle bandwidth plus a small share (0.01)      |
| background | demotion, spill, scan, compaction      | idle bandwidth plus a share that keeps it alive (0.01) |

A share is a weight in the arbiter: when only some lanes have work, they split the path in proportion to their
weights, so an idle path is never held back for a lane that is not using it.
"""
from __future__ import annotations

from enum import IntEnum


class Lane(IntEnum):
    CRITICAL = 0
    STORE = 1
    PREFETCH = 2
    BACKGROUND = 3

    @property
    def label(self) -> str:
        return self.name.lower()


LANES = tuple(Lane)
DEFAULT_SHARES = {Lane.CRITICAL: 0.96, Lane.STORE: 0.02, Lane.PREFETCH: 0.01, Lane.BACKGROUND: 0.01}
DEFAULT_QUEUE = {Lane.CRITICAL: 8192, Lane.STORE: 4096, Lane.PREFETCH: 1024, Lane.BACKGROUND: 1024}


def parse_lane(name: str) -> Lane:
    """The lane named `name` ("critical", "store", "prefetch", "background"); ValueError otherwise."""
    try:
        return Lane[name.upper()]
    except KeyError:
        raise ValueError(f"unknown lane {name[:32]!r}; lanes: {', '.join(la.label for la in LANES)}") from None
