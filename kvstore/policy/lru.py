"""Least recently used, in both shapes (see kvstore.policy): every hook is O(1)."""
from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvstore.index.keytable import KeyTable
    from kvstore.policy.workflow import Touch


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
    """A lower tier's LRU: one recency list per class, least recently used first."""
    name = "lru"

    def __init__(self) -> None:
        self._lists: dict[int, OrderedDict[bytes, None]] = {}
        self._cls: dict[bytes, int] = {}

    def added(self, key: bytes, cls: int, touch: Touch | None = None) -> None:
        old = self._cls.get(key)
        if old is not None:
            del self._lists[old][key]
        self._cls[key] = cls
        self._lists.setdefault(cls, OrderedDict())[key] = None

    def removed(self, key: bytes) -> None:
        cls = self._cls.pop(key, None)
        if cls is not None:
            del self._lists[cls][key]

    def accessed(self, key: bytes, touch: Touch | None = None) -> None:
        cls = self._cls.get(key)
        if cls is not None:
            self._lists[cls].move_to_end(key)

    def victim(self, cls: int) -> bytes | None:
        lru = self._lists.get(cls)
        return next(iter(lru)) if lru else None
