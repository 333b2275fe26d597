"""The client's segment maps: the daemon's host pool is memfd segments, handed to a client by file descriptor with a
`segments` reply (or a streaming acquire's); the client maps each once, MAP_SHARED, and a slot is a view into its
segment's mapping (`slot`, `_views`: gid = segment id << 32 | slot index). This layer of `Client` owns the mappings,
their cache by segment id, and the check that keeps one across a reconnect: only if the daemon hands back the same
memory for its id (the same memfd, by device and inode). A restarted daemon numbers its segments from 1 again, and
may have the same pid (pid 1 in a container), so neither the id nor the pid tells. A segment the daemon no longer
lists as live (released by a shrink) is unmapped; `before_unmap` hooks (a GPU connector that pinned the memory)
let go of it first.

Not thread-safe, like the Client it is part of.
"""
from __future__ import annotations

import mmap
import os
from collections.abc import Callable, Iterable, Sequence

import numpy as np

from kvstore.client.wire import Wire


class _Mapped:
    """One mapped segment; `ident` (device, inode) names its memfd: what tells a restarted daemon's segment of the
    same id from this one."""

    __slots__ = ("arr", "ident", "mm", "nslots", "slot_bytes")

    def __init__(self, fd: int, slot_bytes: int, nslots: int) -> None:
        self.mm = mmap.mmap(fd, slot_bytes * nslots, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        self.arr = np.frombuffer(self.mm, dtype=np.uint8)
        self.ident = _ident(fd)
        self.slot_bytes = slot_bytes
        self.nslots = nslots

    def close(self) -> None:
        self.arr = None  # type: ignore[assignment]
        try:
            self.mm.close()
        except BufferError:
            pass  # a caller still holds a view; the daemon already returned the pages


def _ident(fd: int) -> tuple[int, int]:
    st = os.fstat(fd)
    return st.st_dev, st.st_ino


class SegmentMaps(Wire):
    """The connection, and the daemon's segments it has mapped."""

    def __init__(self, path: str | None, timeout: float | None, tenant: str | None, secret: str | None,
                 admin_secret: str | None = None) -> None:
        super().__init__(path, timeout, tenant, secret, admin_secret)
        self._segments: dict[int, _Mapped] = {}
        self.generation = -1
        # called with (segment id, its mapped bytes) just before a segment is unmapped: whoever registered the
        # memory elsewhere (a GPU connector pins it) lets go of it first
        self.before_unmap: list[Callable[[int, np.ndarray], None]] = []

    def _rejoin(self, pid: int) -> dict[int, int]:
        self._keep_same_segments(same_daemon=self.daemon_pid in (None, pid))
        return super()._rejoin(pid)

    def _keep_same_segments(self, same_daemon: bool) -> None:
        """Unmap every segment the daemon does not hand back as the same memfd (released by a shrink, or another
        daemon's: a restarted one numbers its segments from 1 again, with memory of its own). `same_daemon`
        false (another pid) drops them all without asking."""
        keep: set[int] = set()
        ids = sorted(self._segments) if same_daemon else []
        for start in range(0, len(ids), 200):
            reply, fds = self._roundtrip("segments", {"ids": ids[start:start + 200]}, want_fds=True)
            try:
                for (sid, _, _), fd in zip(reply["segments"], fds):
                    if _ident(fd) == self._segments[sid].ident:
                        keep.add(sid)
            finally:
                for fd in fds:
                    os.close(fd)
        for sid in set(self._segments) - keep:
            self._unmap(sid)
        if not keep:
            self.generation = -1

    def _map(self, seg_ids: Iterable[int]) -> None:
        wanted = sorted(set(seg_ids) - set(self._segments))
        for start in range(0, len(wanted), 200):
            reply, fds = self._roundtrip("segments", {"ids": wanted[start:start + 200]}, want_fds=True)
            self._adopt(reply["segments"], fds)
            for sid in set(self._segments) - set(reply["live"]):
                self._unmap(sid)                  # released by a shrink
            self.generation = reply["generation"]

    def _adopt(self, info: list[list[int]], fds: list[int]) -> None:
        """Map segments whose handles came with a reply (and close the handles: the mappings keep them)."""
        try:
            for (sid, slot_bytes, nslots), fd in zip(info, fds):
                if sid not in self._segments:
                    self._segments[sid] = _Mapped(fd, slot_bytes, nslots)
        finally:
            for fd in fds:
                os.close(fd)

    def mapped_segments(self) -> dict[int, np.ndarray]:
        """The segments this client has mapped, by id: what a GPU connector registers as pinned memory once."""
        return {sid: seg.arr for sid, seg in self._segments.items() if seg.arr is not None}

    def slot(self, gid: int) -> np.ndarray:
        """The shared bytes of one slot (writable uint8 view)."""
        seg = self._segments.get(gid >> 32)
        if seg is None:
            self._map([gid >> 32])
            seg = self._segments[gid >> 32]
        i = gid & 0xFFFFFFFF
        return seg.arr[i * seg.slot_bytes:(i + 1) * seg.slot_bytes]

    def _views(self, gids: Sequence[int]) -> list[np.ndarray]:
        self._map(g >> 32 for g in gids if g and (g >> 32) not in self._segments)
        return [self.slot(g) for g in gids]

    def _unmap(self, sid: int) -> None:
        seg = self._segments.pop(sid)
        if seg.arr is not None:
            for hook in self.before_unmap:
                hook(sid, seg.arr)
        seg.close()
