"""A streaming acquire's partial replies: blocks are sent as they land, in key order, so the client can start
copying the first ones while later ones are still being read from a lower tier. With `pieces` (the request's
field), the next block's verified start is sent too while the rest of it is still on the disk — {"slots": [],
"landing": [position in the keys, gid, bytes]}, with "crc" (the writer's CRC-32C) once the bytes are the whole
block — so that a one-block get copies most of its block during the read: those bytes are checked against the
record's marks (kvstore.tiers.ssd.record), and the block's own reply follows once it is whole and verified (a block
that fails never gets one: the client drops what it copied). The reply that pins the last block asked is the
stream's last (`ended`): the op's bookkeeping after the read is not waited for."""
from __future__ import annotations

import logging
import os
import threading
from collections import Counter
from collections.abc import Callable
from typing import Any

from kvstore.index import Holdings, Index
from kvstore.tiers.host import HostPool

log = logging.getLogger("kvstore")
Emit = Callable[..., None]     # send one reply (fields, fds to pass[, more=False: the last one])


class Stream:
    """The gids an acquire has pinned so far, and how many of them were sent. Without `emit`, nothing is sent
    early: the final reply carries them all."""

    def __init__(self, index: Index, pool: HostPool, holder: Holdings, lock: Any, emit: Emit | None,
                 pieces: bool = False, counters: Counter[str] | None = None, wanted: int = -1) -> None:
        self.index = index
        self.pool = pool
        self.holder = holder
        self.lock = lock
        self.emit = emit
        self.pieces = pieces and emit is not None
        self.counters: Counter[str] = counters if counters is not None else Counter()
        self.wanted = wanted                  # the blocks asked: once all are pinned, the reply ends at once
        self.ended = False                    # ... and the op's last reply has been sent
        self.gids: list[int] = []
        self.sent = 0
        self._sending = threading.Lock()      # a landing comes from the reading thread, blocks from the handler's

    def unsent(self) -> bool:
        return self.emit is not None and len(self.gids) > self.sent

    def publish(self, gids: list[int]) -> None:
        """(Under the state lock.) Blocks pinned for this acquire, sent at once when streaming: as the last reply
        when they complete what was asked, so that the client need not wait for the op's bookkeeping after the
        read (its caller then sends nothing more: `ended`)."""
        self.gids.extend(gids)
        self.flush(last=0 <= self.wanted <= len(self.gids))

    def flush(self, last: bool = False) -> None:
        """(Under the state lock.) Send the blocks not sent yet, with the lock released meanwhile (`last`: as the
        op's last reply). A client gone mid-stream only stops the sending: the promotion finishes, and the
        session drops its pins."""
        if not self.unsent():
            return
        part = self.gids[self.sent:]
        self.sent = len(self.gids)
        fields: dict[str, Any] = {"slots": part, "crcs": self.index.crcs_of(part)}
        if last:
            fields["generation"] = self.pool.generation
        fds = self._segments_of(part, fields)
        self.lock.release()
        try:
            self._send(fields, fds, last)
        finally:
            self.lock.acquire()

    def landing(self, pos: int, gid: int, nbytes: int, crc: int | None = None) -> None:
        """(The reading thread, without the state lock.) The first `nbytes` of the block at `pos` of the keys, in
        slot `gid` (reserved for this acquire), are read and verified: sent, for the client to copy now; with the
        writer's CRC-32C (`crc`) once they are the whole block, which the client may then use without waiting
        for the block's own reply."""
        if self.emit is None:
            return
        fields: dict[str, Any] = {"slots": [], "landing": [pos, gid, nbytes]}
        if crc is not None:
            fields["crc"] = crc
        with self.lock:
            fds = self._segments_of([gid], fields)
            self.counters["landings"] += 1          # stats: verified pieces sent ahead of their block
        self._send(fields, fds)

    def _segments_of(self, gids: list[int], fields: dict[str, Any]) -> list[int]:
        """(Under the state lock.) The handles of segments this connection has not seen ride along (the client
        cannot ask mid-stream): their fds to pass, their shapes in `fields`."""
        new = [self.pool.segments[sid] for sid in sorted({g >> 32 for g in gids} - self.holder.segments)]
        fields["segments"] = [[seg.id, seg.slot_bytes, seg.nslots] for seg in new]
        self.holder.segments.update(seg.id for seg in new)
        return [os.dup(seg.fd) for seg in new]

    def _send(self, fields: dict[str, Any], fds: list[int], last: bool = False) -> None:
        """One reply (its fds passed and closed); after the last, nothing more is sent. A client gone mid-stream
        only stops the sending: the promotion finishes, and the session drops its pins."""
        with self._sending:
            if self.emit is None:
                for fd in fds:
                    os.close(fd)
                return
            try:
                if last:
                    self.ended = True
                    self.emit(fields, fds, more=False)
                else:
                    self.emit(fields, fds)
            except OSError as e:
                log.debug("streaming acquire: the client went away (%s); not sending more", e)
                self.emit = None
            if last:
                self.emit = None

    def rest(self) -> list[int]:
        return self.gids[self.sent:]
