"""Named points where a test stops, breaks or pauses the daemon, read from the environment once at import: a leaf
module (it imports nothing of kvstore), so that tiers and movers can carry their points without importing the
daemon. Unset, each point costs one comparison.

Crash points, for the durability tests: `KVSTORE_CRASH_AT=<name>` makes the daemon exit on the spot (as a kill -9
would: no clean-up, no flush) the `KVSTORE_CRASH_AFTER`-th time (default 1) it passes that point.

Fault points, for the supervision tests: `KVSTORE_FAULT_AT=<name>` raises InjectedFault the first
`KVSTORE_FAULT_TIMES` times (default 1) a worker passes that point (`acquire_after_pin`: an acquire that has
pinned its prefix, before its reply: a streaming one may have sent its last reply already).

Pause points, for tests that must order events across the daemon's threads without timing them: with
`KVSTORE_PAUSE_AT=<name>` and `KVSTORE_PAUSE_DIR=<dir>`, the thread that passes that point, the first
`KVSTORE_PAUSE_TIMES` times (default 1), creates `<dir>/<name>.<n>` (n = 1, 2, ...) and waits until the test deletes
it (at most PAUSE_LIMIT_S, then goes on and logs it). The points sit where the thread holds no lock, so that the
test can show what other clients get meanwhile.
- `between_chunks`: an operator's `list` or `evict` between two chunks of its walk (kvstore.daemon.admin).
- `draining_copy`: a request thread about to make the demotion copies of a retiring segment's blocks
  (kvstore.movers.demotion).
- `slot_write`: a queue mover (write-through, publish) with a batch taken, before writing it
  (kvstore.movers.slots).
"""
from __future__ import annotations

import logging
import os
import threading
import time

log = logging.getLogger("kvstore")
CRASH_POINTS = ("after_payload", "mid_header", "mid_eviction")
FAULT_POINTS = ("demote_loop", "write_through_loop", "acquire_after_pin")
PAUSE_POINTS = ("between_chunks", "draining_copy", "slot_write")
PAUSE_LIMIT_S = 120.0

_CRASH = os.environ.get("KVSTORE_CRASH_AT", "")
_CRASH_AFTER = int(os.environ.get("KVSTORE_CRASH_AFTER", "1") or 1)
_crashes = 0
_FAULT = os.environ.get("KVSTORE_FAULT_AT", "")
_FAULT_TIMES = int(os.environ.get("KVSTORE_FAULT_TIMES", "1") or 1)
_faults = 0
_PAUSE = os.environ.get("KVSTORE_PAUSE_AT", "")
_PAUSE_DIR = os.environ.get("KVSTORE_PAUSE_DIR", "")
_PAUSE_TIMES = int(os.environ.get("KVSTORE_PAUSE_TIMES", "1") or 1)
_pauses = 0
_pause_lock = threading.Lock()


class InjectedFault(RuntimeError):
    """A failure a test asked for (KVSTORE_FAULT_AT)."""


def crash_point(name: str) -> None:
    global _crashes
    if name == _CRASH:
        _crashes += 1
        if _crashes >= _CRASH_AFTER:
            os._exit(137)


def fault_point(name: str) -> None:
    global _faults
    if name == _FAULT and _faults < _FAULT_TIMES:
        _faults += 1
        raise InjectedFault(f"fault injected at {name} ({_faults} of {_FAULT_TIMES})")


def pause_point(name: str) -> None:
    global _pauses
    if name != _PAUSE or not _PAUSE_DIR:
        return
    with _pause_lock:
        if _pauses >= _PAUSE_TIMES:
            return
        _pauses += 1
        path = os.path.join(_PAUSE_DIR, f"{name}.{_pauses}")
    with open(path, "w"):
        pass
    deadline = time.monotonic() + PAUSE_LIMIT_S
    while os.path.exists(path):
        if time.monotonic() > deadline:
            log.warning("pause point %s: %s was not deleted within %.0f s; going on", name, path, PAUSE_LIMIT_S)
            return
        time.sleep(0.001)
