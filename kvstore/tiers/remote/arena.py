"""Registered memory handed out as a ring: blocks on their way to the store (write-back staging) and the trailers
of transfers in flight. Taken at the head, given back roughly in the order taken (puts finish in order); one given
back early is only marked, and its room comes back when the blocks before it are gone. Take and give are O(1)
amortised; the caller holds the lock that guards it."""
from __future__ import annotations

import mmap
from collections import deque

import numpy as np


class Arena:
    def __init__(self, nbytes: int) -> None:
        self.size = max(nbytes, mmap.PAGESIZE)
        self.mm = mmap.mmap(-1, self.size, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        probe = np.frombuffer(self.mm, dtype=np.uint8)
        self.addr = int(probe.ctypes.data)          # stable while the mapping lives
        del probe                                   # no export left: close() can unmap
        self.used = 0
        self._live: deque[list[int]] = deque()      # [offset, length, given back] in the order taken
        self._index: dict[int, list[int]] = {}

    def take(self, n: int) -> int | None:
        """The offset of `n` free bytes, or None while the ring has no room for them."""
        if n <= 0 or n > self.size:
            return None
        if not self._live:
            off: int | None = 0
        else:
            tail = self._live[0][0]
            head = self._live[-1][0] + self._live[-1][1]
            if self._live[-1][0] >= tail:           # not wrapped: room after the head, else before the tail
                off = head if head + n <= self.size else (0 if n <= tail else None)
            else:
                off = head if head + n <= tail else None
        if off is None:
            return None
        entry = [off, n, 0]
        self._live.append(entry)
        self._index[off] = entry
        self.used += n
        return off

    def give(self, off: int) -> None:
        entry = self._index.pop(off)
        entry[2] = 1
        self.used -= entry[1]
        while self._live and self._live[0][2]:
            self._live.popleft()

    def view(self, off: int, n: int) -> memoryview:
        return memoryview(self.mm)[off:off + n]

    def close(self) -> None:
        try:
            self.mm.close()
        except BufferError:
            pass                                    # a view is still alive: the mapping goes with it
