"""The daemon process's own guards, set once at start.

- Not dumpable (`PR_SET_DUMPABLE` 0): no core dump of the pool, and no other process of the same user can take
  the daemon's segment fds through /proc/<pid>/fd or attach to it with ptrace.
- The soft limit on open files raised to the hard limit: every segment is a memfd and every connection a socket
  (a 64 GiB pool in 64 MiB segments alone needs 1024 fds, the usual soft limit).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging
import resource

log = logging.getLogger("kvstore")
_PR_SET_DUMPABLE, _PR_GET_DUMPABLE = 4, 3
_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def harden() -> dict[str, object]:
    """Apply the guards; what they came to (for `kvstore stats`)."""
    if _libc.prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
        log.warning("could not make the daemon non-dumpable (errno %d): its fds stay reachable through /proc",
                    ctypes.get_errno())
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError) as e:
            log.warning("could not raise the open-file limit from %d to %d (%s)", soft, hard, e)
    return state()


def state() -> dict[str, object]:
    return {"dumpable": bool(_libc.prctl(_PR_GET_DUMPABLE, 0, 0, 0, 0)),
            "fd_limit": resource.getrlimit(resource.RLIMIT_NOFILE)[0]}
