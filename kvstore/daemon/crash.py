"""Named crash points for the durability tests: `KVSTORE_CRASH_AT=<name>` makes the daemon exit on the spot (as a
kill -9 would: no clean-up, no flush) the `KVSTORE_CRASH_AFTER`-th time (default 1) it passes that point. Named
fault points for the supervision tests: `KVSTORE_FAULT_AT=<name>` raises InjectedFault the first
`KVSTORE_FAULT_TIMES` times (default 1) a worker passes that point. Unset, either costs one comparison."""
from __future__ import annotations

import os

_WANTED = os.environ.get("KVSTORE_CRASH_AT", "")
_AFTER = int(os.environ.get("KVSTORE_CRASH_AFTER", "1") or 1)
_seen = 0
_FAULT = os.environ.get("KVSTORE_FAULT_AT", "")
_FAULT_TIMES = int(os.environ.get("KVSTORE_FAULT_TIMES", "1") or 1)
_faults = 0

POINTS = ("after_payload", "mid_header", "mid_eviction")
FAULTS = ("demote_loop", "write_through_loop")


class InjectedFault(RuntimeError):
    """A failure a test asked for (KVSTORE_FAULT_AT)."""


def crash_point(name: str) -> None:
    global _seen
    if name == _WANTED:
        _seen += 1
        if _seen >= _AFTER:
            os._exit(137)


def fault_point(name: str) -> None:
    global _faults
    if name == _FAULT and _faults < _FAULT_TIMES:
        _faults += 1
        raise InjectedFault(f"fault injected at {name} ({_faults} of {_FAULT_TIMES})")
