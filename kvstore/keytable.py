"""The index's key table: 20-byte keys (4-byte namespace id + 16-byte block hash) → u64 slot locations, with an
intrusive LRU list per eviction class.

`KeyTable` is the native table (`native/kvindex.c`, ~55 bytes a key) when it was built, else `PyKeyTable`, the
pure-Python fallback with the same contract (~300 bytes a key). `KVSTORE_NO_NATIVE=1` forces the fallback; the
tests run both.

Contract: `insert` adds a new key linked at the most-recently-used end of its class; `touch` moves a linked key
there; `unlink` takes a key out of its list (a pinned block: in the map, not an eviction candidate) and `relink`
puts it back at the MRU end; `oldest(cls)` is the least recently used linked key; `prefix_len` counts the leading
keys present, the lookup hot path.
"""
from __future__ import annotations

import os
from collections import OrderedDict
from typing import TYPE_CHECKING, Iterator

KEY_BYTES = 20
HASH_BYTES = 16


def _check_key(key: bytes) -> None:
    if not isinstance(key, bytes):
        raise TypeError(f"key must be bytes, not {type(key).__name__}")
    if len(key) != KEY_BYTES:
        raise ValueError(f"key must be {KEY_BYTES} bytes, got {len(key)}")


def _check_value(value: int) -> None:
    if not 0 <= value < 1 << 64:
        raise OverflowError(f"value must fit in 64 unsigned bits, got {value}")


def _check_cls(cls: int) -> None:
    if not 0 <= cls < 65536:
        raise ValueError(f"cls must be in 0..65535, got {cls}")


class PyKeyTable:
    """The pure-Python fallback: a dict for the map, an OrderedDict per class for its LRU order."""

    def __init__(self, capacity_hint: int = 0) -> None:
        self._map: dict[bytes, list[int]] = {}              # key → [value, cls]
        self._lru: dict[int, OrderedDict[bytes, None]] = {}

    def __len__(self) -> int:
        return len(self._map)

    def __contains__(self, key: bytes) -> bool:
        _check_key(key)
        return key in self._map

    def get(self, key: bytes) -> int | None:
        _check_key(key)
        e = self._map.get(key)
        return None if e is None else e[0]

    def insert(self, key: bytes, value: int, cls: int) -> None:
        _check_key(key)
        _check_value(value)
        _check_cls(cls)
        if key in self._map:
            raise ValueError("key already present")
        self._map[key] = [value, cls]
        self._lru.setdefault(cls, OrderedDict())[key] = None

    def set_value(self, key: bytes, value: int) -> None:
        _check_key(key)
        _check_value(value)
        self._map[key][0] = value

    def remove(self, key: bytes) -> int | None:
        _check_key(key)
        e = self._map.pop(key, None)
        if e is None:
            return None
        self._lru[e[1]].pop(key, None)
        return e[0]

    def touch(self, key: bytes) -> bool:
        _check_key(key)
        e = self._map.get(key)
        if e is None:
            return False
        lru = self._lru[e[1]]
        if key in lru:
            lru.move_to_end(key)
        return True

    def unlink(self, key: bytes) -> None:
        _check_key(key)
        self._lru[self._map[key][1]].pop(key, None)

    def relink(self, key: bytes) -> None:
        _check_key(key)
        lru = self._lru[self._map[key][1]]
        if key not in lru:
            lru[key] = None

    def is_linked(self, key: bytes) -> bool:
        _check_key(key)
        return key in self._lru[self._map[key][1]]

    def cls_of(self, key: bytes) -> int:
        _check_key(key)
        return self._map[key][1]

    def oldest(self, cls: int) -> tuple[bytes, int] | None:
        _check_cls(cls)
        lru = self._lru.get(cls)
        if not lru:
            return None
        key = next(iter(lru))
        return key, self._map[key][0]

    def class_len(self, cls: int) -> int:
        _check_cls(cls)
        return len(self._lru.get(cls, ()))

    def prefix_len(self, prefix: bytes, hashes: bytes, touch: bool = False) -> int:
        if len(prefix) != 4:
            raise ValueError(f"prefix must be 4 bytes, got {len(prefix)}")
        if len(hashes) % HASH_BYTES:
            raise ValueError(f"hashes must be a multiple of 16 bytes, got {len(hashes)}")
        n = 0
        for i in range(0, len(hashes), HASH_BYTES):
            key = prefix + hashes[i:i + HASH_BYTES]
            if key not in self._map:
                break
            if touch:
                self.touch(key)
            n += 1
        return n

    def items(self) -> Iterator[tuple[bytes, int]]:
        return iter([(k, e[0]) for k, e in self._map.items()])

    def nbytes(self) -> int:
        import sys

        n = len(self._map)
        # dict + key bytes + [value, cls] list + OrderedDict node, measured per entry with sys.getsizeof
        per = (sys.getsizeof(b"x" * KEY_BYTES) + sys.getsizeof([0, 0]) + 32 + 100) if n else 0
        return sys.getsizeof(self._map) + n * per


NATIVE = False
if TYPE_CHECKING:
    KeyTable = PyKeyTable
elif os.environ.get("KVSTORE_NO_NATIVE") != "1":
    try:
        from kvstore._kvindex import KeyTable as _Native

        KeyTable, NATIVE = _Native, True
    except ImportError:
        pass
if not NATIVE and not TYPE_CHECKING:
    KeyTable = PyKeyTable
