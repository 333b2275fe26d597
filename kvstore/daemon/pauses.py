"""Named pause points, for tests that must order events across the daemon's threads without timing them:
with `KVSTORE_PAUSE_AT=<name>` and `KVSTORE_PAUSE_DIR=<dir>`, the thread that passes that point, the first
`KVSTORE_PAUSE_TIMES` times (default 1), creates `<dir>/<name>.<n>` (n = 1, 2, ...) and waits until the test deletes
it (at most LIMIT_S, then goes on and logs it). The points sit where the thread holds no lock, so that the test can
show what other clients get meanwhile. Unset, a pause point costs one comparison.

- `between_chunks`: an operator's `list` or `evict` between two chunks of its walk (kvstore.daemon.admin).
- `draining_copy`: a request thread about to make the demotion copies of a retiring segment's blocks
  (kvstore.movers.demotion).
"""
from __future__ import annotations

import logging
import os
import threading
import time

log = logging.getLogger("kvstore")
POINTS = ("between_chunks", "draining_copy")
LIMIT_S = 120.0
_WANTED = os.environ.get("KVSTORE_PAUSE_AT", "")
_DIR = os.environ.get("KVSTORE_PAUSE_DIR", "")
_TIMES = int(os.environ.get("KVSTORE_PAUSE_TIMES", "1") or 1)
_passes = 0
_lock = threading.Lock()


def pause_point(name: str) -> None:
    global _passes
    if name != _WANTED or not _DIR:
        return
    with _lock:
        if _passes >= _TIMES:
            return
        _passes += 1
        path = os.path.join(_DIR, f"{name}.{_passes}")
    with open(path, "w"):
        pass
    deadline = time.monotonic() + LIMIT_S
    while os.path.exists(path):
        if time.monotonic() > deadline:
            log.warning("pause point %s: %s was not deleted within %.0f s; going on", name, path, LIMIT_S)
            return
        time.sleep(0.001)
