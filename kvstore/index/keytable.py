"""The index's key table: 20-byte keys (4-byte namespace id + 16-byte block hash) → u64 values (slot locations),
with an intrusive LRU list per eviction class.

`KeyTable` is the native table (`native/kvindex.c`, about 75 bytes a key at 10 million keys) when it was built,
else `PyKeyTable`, the pure-Python fallback with the same contract (about 220 bytes a key). `KVSTORE_NO_NATIVE=1`
forces the fallback; `NATIVE` says which one `KeyTable` is. The tests run both.

Contract: every key belongs to one eviction class `cls` (0..65535) and is either linked in that class's LRU list
or unlinked (pinned: in the map, not an eviction candidate). `insert` adds a new key linked at the most recently
used end of its class; `touch` moves a linked key there (an unlinked one stays unlinked); `unlink` takes a key out
of its list and `relink` puts it back at the MRU end; `oldest(cls)` is the least recently used linked key;
`prefix_len` counts the leading keys present, the lookup hot path; `get` has no LRU effect. `items()` iterates a
snapshot. Errors: key not bytes → TypeError, not 20 bytes → ValueError; value outside 0..2**64-1 → OverflowError;
cls outside 0..65535 → ValueError; a missing key → KeyError for set_value, unlink, relink, is_linked, cls_of.
"""
from __future__ import annotations

import os
import sys
from collections import OrderedDict
from operator import index
from typing import TYPE_CHECKING, Iterator

KEY_BYTES = 20
HASH_BYTES = 16
MAX_CLS = 65536
_CLS_BITS = 16
_CLS_MASK = MAX_CLS - 1


def _check_key(key: bytes) -> None:
    if not isinstance(key, bytes):
        raise TypeError(f"key must be bytes, not {type(key).__name__}")
    if len(key) != KEY_BYTES:
        raise ValueError(f"key must be {KEY_BYTES} bytes, got {len(key)}")


def _u64(value: int) -> int:
    v = index(value)
    if not 0 <= v < 1 << 64:
        raise OverflowError(f"value must be in 0..2**64-1, got {v}")
    return v


def _cls(cls: int) -> int:
    c = index(cls)
    if not 0 <= c < MAX_CLS:
        raise ValueError(f"cls must be in 0..65535, got {cls!r}")
    return c


def _bytes_like(b: bytes) -> bytes:
    return b if type(b) is bytes else memoryview(b).tobytes()   # TypeError if not bytes-like, like the native


class PyKeyTable:
    """The pure-Python fallback: one dict key → value << 16 | cls (a plain int: nothing for the garbage collector
    to traverse), and per class an OrderedDict of its linked keys, least recently used first."""

    def __init__(self, capacity_hint: int = 0) -> None:
        if index(capacity_hint) < 0:
            raise ValueError(f"capacity_hint must be >= 0, got {capacity_hint}")
        self._map: dict[bytes, int] = {}
        self._lru: dict[int, OrderedDict[bytes, None]] = {}

    def __len__(self) -> int:
        return len(self._map)

    def __contains__(self, key: bytes, /) -> bool:
        _check_key(key)
        return key in self._map

    def _entry(self, key: bytes) -> int:
        _check_key(key)
        return self._map[key]                      # KeyError if absent

    def get(self, key: bytes, /) -> int | None:
        _check_key(key)
        e = self._map.get(key)
        return None if e is None else e >> _CLS_BITS

    def insert(self, key: bytes, value: int, cls: int) -> None:
        _check_key(key)
        v, c = _u64(value), _cls(cls)
        if key in self._map:
            raise ValueError("key already present")
        self._map[key] = v << _CLS_BITS | c
        lru = self._lru.get(c)
        if lru is None:
            lru = self._lru[c] = OrderedDict()
        lru[key] = None

    def set_value(self, key: bytes, value: int) -> None:
        e = self._entry(key)
        self._map[key] = _u64(value) << _CLS_BITS | e & _CLS_MASK

    def remove(self, key: bytes, /) -> int | None:
        _check_key(key)
        e = self._map.pop(key, None)
        if e is None:
            return None
        self._lru[e & _CLS_MASK].pop(key, None)
        return e >> _CLS_BITS

    def touch(self, key: bytes, /) -> bool:
        _check_key(key)
        e = self._map.get(key)
        if e is None:
            return False
        lru = self._lru[e & _CLS_MASK]
        if key in lru:
            lru.move_to_end(key)
        return True

    def unlink(self, key: bytes, /) -> None:
        self._lru[self._entry(key) & _CLS_MASK].pop(key, None)

    def relink(self, key: bytes, /) -> None:
        lru = self._lru[self._entry(key) & _CLS_MASK]
        if key not in lru:
            lru[key] = None

    def is_linked(self, key: bytes, /) -> bool:
        return key in self._lru[self._entry(key) & _CLS_MASK]

    def cls_of(self, key: bytes, /) -> int:
        return self._entry(key) & _CLS_MASK

    def oldest(self, cls: int, /) -> tuple[bytes, int] | None:
        lru = self._lru.get(_cls(cls))
        if not lru:
            return None
        key = next(iter(lru))
        return key, self._map[key] >> _CLS_BITS

    def class_len(self, cls: int, /) -> int:
        lru = self._lru.get(_cls(cls))
        return len(lru) if lru else 0

    def prefix_len(self, prefix: bytes, hashes: bytes, touch: bool = False) -> int:
        prefix, hashes = _bytes_like(prefix), _bytes_like(hashes)
        if len(prefix) != 4:
            raise ValueError(f"prefix must be 4 bytes, got {len(prefix)}")
        if len(hashes) % HASH_BYTES:
            raise ValueError(f"hashes must be a multiple of 16 bytes, got {len(hashes)}")
        m, n = self._map, 0
        for i in range(0, len(hashes), HASH_BYTES):
            key = prefix + hashes[i:i + HASH_BYTES]
            e = m.get(key)
            if e is None:
                break
            if touch:
                lru = self._lru[e & _CLS_MASK]
                if key in lru:
                    lru.move_to_end(key)
            n += 1
        return n

    def items(self) -> Iterator[tuple[bytes, int]]:
        return iter([(k, e >> _CLS_BITS) for k, e in self._map.items()])

    def nbytes(self) -> int:
        """An estimate: the dict, and per key its bytes object, its int and an OrderedDict node if linked."""
        n = len(self._map)
        per_key = sys.getsizeof(b"k" * KEY_BYTES) + sys.getsizeof(1 << 70)
        lists = sum(sys.getsizeof(lru) + 32 * len(lru) for lru in self._lru.values())
        return sys.getsizeof(self._map) + sys.getsizeof(self._lru) + n * per_key + lists

    __sizeof__ = nbytes


NATIVE = False
if TYPE_CHECKING:
    KeyTable = PyKeyTable
else:
    KeyTable = PyKeyTable
    if os.environ.get("KVSTORE_NO_NATIVE", "") in ("", "0"):
        try:
            from kvstore._kvindex import KeyTable as _NativeKeyTable
        except ImportError:
            pass
        else:
            KeyTable, NATIVE = _NativeKeyTable, True
