"""Least recently used, in both shapes (see kvstore.policy): every hook is O(1)."""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvstore.index.keytable import KeyTable
    from kvstore.workflows import Touch, Workflows


def host_policy(table: KeyTable, workflows: Workflows | None = None, key_at: Callable[[int], bytes | None] | None
                = None, slots_of: Callable[[int], int] | None = None) -> LruPolicy:
    """The registry's entry for the host pool (kvstore.policy): hints and slots play no part in LRU."""
    return LruPolicy(table)


def tier_policy(workflows: Workflows | None = None) -> LruOrder:
    """The registry's entry for a lower tier with books of its own."""
    return LruOrder()


class LruPolicy:
    """The host pool's LRU, on the key table's per-class intrusive lists."""
    name = "lru"

    def __init__(self, table: KeyTable) -> None:
        self.table = table

    def added(self, key: bytes, cls: int, touch: Touch | None = None) -> None:
        pass                                    # the key table links a new key as the most recent

    def removed(self, key: bytes) -> None:
        pass                                    # ... and unlinks a removed one

    def accessed(self, key: bytes, touch: Touch | None = None) -> None:
        self.table.touch(key)

    def pinned(self, key: bytes) -> None:
        self.table.unlink(key)

    def unpinned(self, key: bytes) -> None:
        self.table.relink(key)

    def moved(self, key: bytes, src: int, dst: int) -> None:
        pass                                    # the key keeps its place in the table's list: only its gid changed

    def victim(self, cls: int) -> bytes | None:
        oldest = self.table.oldest(cls)
        return None if oldest is None else oldest[0]


class LruOrder:
    """A lower tier's LRU: one recency list per class, least recently used first. Each entry carries the tick of
    its last use, so that the oldest of several classes can be told (`oldest_tick`: the SSD tier's quotas take the
    least recently used borrowed record among tenants' classes)."""
    name = "lru"

    def __init__(self) -> None:
        self._lists: dict[int, OrderedDict[bytes, int]] = {}
        self._cls: dict[bytes, int] = {}
        self._tick = 0

    def added(self, key: bytes, cls: int, touch: Touch | None = None) -> None:
        old = self._cls.get(key)
        if old is not None:
            del self._lists[old][key]
        self._cls[key] = cls
        self._tick += 1
        self._lists.setdefault(cls, OrderedDict())[key] = self._tick

    def removed(self, key: bytes) -> None:
        cls = self._cls.pop(key, None)
        if cls is not None:
            del self._lists[cls][key]

    def accessed(self, key: bytes, touch: Touch | None = None) -> None:
        cls = self._cls.get(key)
        if cls is not None:
            self._tick += 1
            lru = self._lists[cls]
            lru[key] = self._tick
            lru.move_to_end(key)

    def victim(self, cls: int) -> bytes | None:
        lru = self._lists.get(cls)
        return next(iter(lru)) if lru else None

    def oldest_tick(self, cls: int) -> int | None:
        """When the class's victim was last used (a tick of this policy's clock), None if the class is empty."""
        lru = self._lists.get(cls)
        return lru[next(iter(lru))] if lru else None
