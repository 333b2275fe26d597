"""A toy eviction policy, registered from outside kvstore (tests/test_extending.py): first in, first out — a read
changes nothing, so the oldest block stored leaves first even when it was just read (LRU would keep it). What the
README's "Adding an eviction policy" asks for: a module with `host_policy` and `tier_policy`."""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any


class Fifo:
    """Both shapes of kvstore.policy's contract: the oldest candidate of a class, pinned blocks set aside."""
    name = "fifo"

    def __init__(self) -> None:
        self.order: dict[int, OrderedDict[bytes, None]] = {}
        self.cls: dict[bytes, int] = {}
        self.pinned_keys: set[bytes] = set()

    def added(self, key: bytes, cls: int, touch: Any = None) -> None:
        self.cls[key] = cls
        self.order.setdefault(cls, OrderedDict())[key] = None

    def removed(self, key: bytes) -> None:
        cls = self.cls.pop(key, None)
        if cls is not None:
            self.order[cls].pop(key, None)
        self.pinned_keys.discard(key)

    def accessed(self, key: bytes, touch: Any = None) -> None:
        pass                                    # first in, first out: a read changes nothing

    def pinned(self, key: bytes) -> None:
        self.pinned_keys.add(key)

    def unpinned(self, key: bytes) -> None:
        self.pinned_keys.discard(key)

    def victim(self, cls: int) -> bytes | None:
        return next((k for k in self.order.get(cls, ()) if k not in self.pinned_keys), None)

    def moved(self, key: bytes, src: int, dst: int) -> None:
        pass                                    # books by key: nothing follows the slot


def host_policy(table: Any, workflows: Any = None, key_at: Callable[[int], bytes | None] | None = None,
                slots_of: Callable[[int], int] | None = None) -> Fifo:
    return Fifo()


def tier_policy(workflows: Any = None) -> Fifo:
    return Fifo()
