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
cls outside 0..65535 → ValueError; a missing key → KeyError for set_value, unlink, relink, is_linked, cls_of,
level_of, set_level.

Levels (the `history` eviction policy's books, kvstore.policy.history): every key also has a level 0..LEVELS-1
(0 on insert) and a class's list is one list per level, each least recently used first; LRU never leaves level 0.
`placement(key)` is cls × LEVELS + level (-1 if absent); `set_level` moves a key to a level (its MRU end if
linked); `use(key, top, pin=False)` is one use: a level up (top at most) and to the MRU end, or with `pin` a use only
of a linked key, which then leaves its list — it returns the level after, -1 for a missing key; `pick(cls,
aging=None)` is the victim by levels: the LRU key of the lowest non-empty level, or with `aging` (>= 0) the stalest
of the levels' LRU keys where it has gone unused for more than `aging` times as long as that one; `oldest(cls)` is
`pick(cls, 1.0)`, the LRU key over all levels. Ages count pushes (u32). `class_len(cls, level=None)` counts the
linked keys of a class (at one level).
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
LEVELS = 4                  # levels a class's list is split in (the history policy's; LRU stays at 0)
_LEVEL_MASK = LEVELS - 1
_VALUE_SHIFT = _CLS_BITS + 2
_LOW_MASK = (1 << _VALUE_SHIFT) - 1


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


def _level(level: int, what: str) -> int:
    v = index(level)
    if not 0 <= v < LEVELS:
        raise ValueError(f"{what} must be in 0..{LEVELS - 1}, got {v}")
    return v


def _bytes_like(b: bytes) -> bytes:
    return b if type(b) is bytes else memoryview(b).tobytes()   # TypeError if not bytes-like, like the native


class PyKeyTable:
    """The pure-Python fallback: one dict key → value << 18 | level << 16 | cls (a plain int: nothing for the
    garbage collector to traverse), and per list (class × LEVELS + level) an OrderedDict of its linked keys → the
    tick of their last push, least recently used first."""

    def __init__(self, capacity_hint: int = 0) -> None:
        if index(capacity_hint) < 0:
            raise ValueError(f"capacity_hint must be >= 0, got {capacity_hint}")
        self._map: dict[bytes, int] = {}
        self._lru: dict[int, OrderedDict[bytes, int]] = {}
        self._now = 0

    def __len__(self) -> int:
        return len(self._map)

    def __contains__(self, key: bytes, /) -> bool:
        _check_key(key)
        return key in self._map

    def _entry(self, key: bytes) -> int:
        _check_key(key)
        return self._map[key]                      # KeyError if absent

    def _list(self, e: int) -> OrderedDict[bytes, int]:
        lid = (e & _CLS_MASK) * LEVELS + (e >> _CLS_BITS & _LEVEL_MASK)
        lru = self._lru.get(lid)
        if lru is None:
            lru = self._lru[lid] = OrderedDict()
        return lru

    def _push(self, key: bytes, e: int) -> None:
        self._now = (self._now + 1) & 0xFFFF_FFFF
        self._list(e)[key] = self._now

    def get(self, key: bytes, /) -> int | None:
        _check_key(key)
        e = self._map.get(key)
        return None if e is None else e >> _VALUE_SHIFT

    def insert(self, key: bytes, value: int, cls: int) -> None:
        _check_key(key)
        v, c = _u64(value), _cls(cls)
        if key in self._map:
            raise ValueError("key already present")
        e = self._map[key] = v << _VALUE_SHIFT | c
        self._push(key, e)

    def set_value(self, key: bytes, value: int) -> None:
        e = self._entry(key)
        self._map[key] = _u64(value) << _VALUE_SHIFT | e & _LOW_MASK

    def remove(self, key: bytes, /) -> int | None:
        _check_key(key)
        e = self._map.pop(key, None)
        if e is None:
            return None
        self._list(e).pop(key, None)
        return e >> _VALUE_SHIFT

    def touch(self, key: bytes, /) -> bool:
        _check_key(key)
        e = self._map.get(key)
        if e is None:
            return False
        lru = self._list(e)
        if key in lru:
            del lru[key]
            self._push(key, e)
        return True

    def unlink(self, key: bytes, /) -> None:
        self._list(self._entry(key)).pop(key, None)

    def relink(self, key: bytes, /) -> None:
        e = self._entry(key)
        if key not in self._list(e):
            self._push(key, e)

    def is_linked(self, key: bytes, /) -> bool:
        return key in self._list(self._entry(key))

    def cls_of(self, key: bytes, /) -> int:
        return self._entry(key) & _CLS_MASK

    def level_of(self, key: bytes, /) -> int:
        return self._entry(key) >> _CLS_BITS & _LEVEL_MASK

    def placement(self, key: bytes, /) -> int:
        _check_key(key)
        e = self._map.get(key)
        return -1 if e is None else (e & _CLS_MASK) * LEVELS + (e >> _CLS_BITS & _LEVEL_MASK)

    def set_level(self, key: bytes, level: int) -> None:
        e = self._entry(key)
        self._set_level(key, e, _level(level, "level"))

    def _set_level(self, key: bytes, e: int, level: int) -> None:
        linked = self._list(e).pop(key, None) is not None
        e = self._map[key] = e & ~(_LEVEL_MASK << _CLS_BITS) | level << _CLS_BITS
        if linked:
            self._push(key, e)

    def use(self, key: bytes, top: int, pin: bool = False) -> int:
        _check_key(key)
        top = _level(top, "top")
        e = self._map.get(key)
        if e is None:
            return -1
        level = e >> _CLS_BITS & _LEVEL_MASK
        if pin and key not in self._list(e):
            return level
        level = level + 1 if level < top else level
        if pin:
            self._list(e).pop(key)
            self._map[key] = e & ~(_LEVEL_MASK << _CLS_BITS) | level << _CLS_BITS
        else:
            self._set_level(key, e, level)
        return level

    def _pick(self, cls: int, aging: float) -> bytes | None:
        """See the native contract (kvstore/index/keytable.py's docstring): aging < 0 is none."""
        first: tuple[bytes, int] | None = None
        oldest: tuple[bytes, int] | None = None
        for level in range(LEVELS):
            lru = self._lru.get(cls * LEVELS + level)
            if not lru:
                continue
            head = next(iter(lru.items()))
            age = (self._now - head[1]) & 0xFFFF_FFFF
            if first is None:
                first = (head[0], age)
                if aging < 0:
                    return head[0]
            if oldest is None or age > oldest[1]:
                oldest = (head[0], age)
        if first is None or oldest is None or oldest[0] == first[0]:
            return None if first is None else first[0]
        return oldest[0] if oldest[1] > aging * first[1] else first[0]

    def _item(self, key: bytes | None) -> tuple[bytes, int] | None:
        return None if key is None else (key, self._map[key] >> _VALUE_SHIFT)

    def oldest(self, cls: int, /) -> tuple[bytes, int] | None:
        return self._item(self._pick(_cls(cls), 1.0))

    def pick(self, cls: int, aging: float | None = None) -> tuple[bytes, int] | None:
        c = _cls(cls)
        if aging is not None and aging < 0:
            raise ValueError(f"aging must be >= 0 or None, got {aging!r}")
        return self._item(self._pick(c, -1.0 if aging is None else float(aging)))

    def class_len(self, cls: int, level: int | None = None) -> int:
        c = _cls(cls)
        levels = range(LEVELS) if level is None else (_level(level, "level"),)
        return sum(len(self._lru.get(c * LEVELS + lv) or ()) for lv in levels)

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
                self.touch(key)
            n += 1
        return n

    def items(self) -> Iterator[tuple[bytes, int]]:
        return iter([(k, e >> _VALUE_SHIFT) for k, e in self._map.items()])

    def nbytes(self) -> int:
        """An estimate: the dict, and per key its bytes object, its int and an OrderedDict node if linked."""
        n = len(self._map)
        per_key = sys.getsizeof(b"k" * KEY_BYTES) + sys.getsizeof(1 << 70)
        lists = sum(sys.getsizeof(lru) + 64 * len(lru) for lru in self._lru.values())
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
