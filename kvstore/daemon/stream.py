"""A streaming acquire's partial replies: blocks are sent as they land, in key order, so the client can start
copying the first ones while later ones are still being read from a lower tier."""
from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

from kvstore.index import Holdings, Index
from kvstore.tiers.host import HostPool

log = logging.getLogger("kvstore")
Emit = Callable[[dict[str, Any], list[int]], None]     # send one partial reply (fields, fds to pass)


class Stream:
    """The gids an acquire has pinned so far, and how many of them were sent. Without `emit`, nothing is sent
    early: the final reply carries them all."""

    def __init__(self, index: Index, pool: HostPool, holder: Holdings, lock: Any, emit: Emit | None) -> None:
        self.index = index
        self.pool = pool
        self.holder = holder
        self.lock = lock
        self.emit = emit
        self.gids: list[int] = []
        self.sent = 0

    def unsent(self) -> bool:
        return self.emit is not None and len(self.gids) > self.sent

    def publish(self, gids: list[int]) -> None:
        """(Under the state lock.) Blocks pinned for this acquire, sent at once when streaming."""
        self.gids.extend(gids)
        self.flush()

    def flush(self) -> None:
        """(Under the state lock.) Send the blocks not sent yet, with the lock released meanwhile. A client gone
        mid-stream only stops the sending: the promotion finishes, and the session drops its pins."""
        if not self.unsent():
            return
        part = self.gids[self.sent:]
        self.sent = len(self.gids)
        fields: dict[str, Any] = {"slots": part, "crcs": self.index.crcs_of(part)}
        # handles of segments this connection has not seen ride along: the client cannot ask mid-stream
        new = [self.pool.segments[sid] for sid in sorted({g >> 32 for g in part} - self.holder.segments)]
        fds = [os.dup(seg.fd) for seg in new]
        fields["segments"] = [[seg.id, seg.slot_bytes, seg.nslots] for seg in new]
        self.holder.segments.update(seg.id for seg in new)
        self.lock.release()
        try:
            assert self.emit is not None
            self.emit(fields, fds)
        except OSError as e:
            log.debug("streaming acquire: the client went away (%s); not sending more", e)
            self.emit = None
        finally:
            self.lock.acquire()

    def rest(self) -> list[int]:
        return self.gids[self.sent:]
