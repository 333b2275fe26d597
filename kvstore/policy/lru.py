"""Least-recently-used eviction on the key table's per-class intrusive lists: every hook is O(1)."""
from __future__ import annotations

from kvstore.index.keytable import KeyTable


class LruPolicy:
    name = "lru"

    def __init__(self, table: KeyTable) -> None:
        self.table = table

    def accessed(self, key: bytes) -> None:
        self.table.touch(key)

    def pinned(self, key: bytes) -> None:
        self.table.unlink(key)

    def unpinned(self, key: bytes) -> None:
        self.table.relink(key)

    def victim(self, cls: int) -> bytes | None:
        oldest = self.table.oldest(cls)
        return None if oldest is None else oldest[0]
