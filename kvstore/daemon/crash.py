"""Named crash points for the durability tests: `KVSTORE_CRASH_AT=<name>` makes the daemon exit on the spot (as a
kill -9 would: no clean-up, no flush) the `KVSTORE_CRASH_AFTER`-th time (default 1) it passes that point. Unset, a
crash point costs one dictionary lookup."""
from __future__ import annotations

import os

_WANTED = os.environ.get("KVSTORE_CRASH_AT", "")
_AFTER = int(os.environ.get("KVSTORE_CRASH_AFTER", "1") or 1)
_seen = 0

POINTS = ("after_payload", "mid_header", "mid_eviction")


def crash_point(name: str) -> None:
    global _seen
    if name == _WANTED:
        _seen += 1
        if _seen >= _AFTER:
            os._exit(137)
