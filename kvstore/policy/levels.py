"""What the `history` policy remembers of the blocks it evicted: their level (how often each was used), in a bounded
history that forgets the oldest evictions first (kvstore.policy.history uses it, and the `remember` shadow of
kvstore.policy.shadow asks it).

`pick` is the victim rule of the levels kept in dicts (a lower tier's, the shadows'; the host pool's levels are the
key table's, kvstore.index.keytable, with the same rule): the least recently used block of the lowest non-empty
level, or, aging by a factor F, the least recently used of all levels' oldest blocks that have gone unused for F
times as long as the oldest block of the lowest level has (a block's uses protect it for a while, not for ever).
F = 1 is plain LRU over all levels; no factor, levels for ever.
"""
from __future__ import annotations

import os
import sys
from collections import OrderedDict, deque
from typing import Protocol, TypeVar

LEVELS = 3                  # used once, twice, three times or more
HISTORY_FACTOR = 20         # evicted blocks remembered per block held
MIN_RECORDS = 8192          # ... and at least this many

K = TypeVar("K")


def pick(lists: list[OrderedDict[K, int]], aging: float | None, now: int) -> K | None:
    """The victim among recency lists by level (key -> tick of its last use, oldest first): see the module
    docstring. Prefix-closed: a chain's tail is never more recent nor at a higher level than its head, so the tail's
    list's oldest is never younger than the tail, and the oldest of several is taken first."""
    if aging is None:
        for level in lists:
            if level:
                return next(iter(level))
        return None
    first = -1
    oldest: tuple[K, int] | None = None         # the oldest of the levels' oldest (the stalest candidate)
    for level in lists:
        if level:
            head = next(iter(level.items()))
            if first < 0:
                first = head[1]
                lowest = head[0]
            if oldest is None or head[1] < oldest[1]:
                oldest = head
    if oldest is None:
        return None
    return oldest[0] if oldest[1] < now - aging * (now - first) else lowest


def fingerprint(key: bytes) -> int:
    return hash(key) & 0x7FFF_FFFF_FFFF_FFFF


class Records(Protocol):
    """A bounded history of records key -> level (1..255): the last `capacity` made, a key answered by its newest
    among them — kvstore._kvindex.History (a ring, an index over it and Bloom filters in front, 21–32 bytes a record,
    native/kvindex.c) or PyRecords."""

    capacity: int

    def record(self, key: bytes, level: int) -> None: ...
    def level(self, key: bytes, /) -> int: ...
    def resize(self, capacity: int, /) -> None: ...
    def nbytes(self) -> int: ...
    def __len__(self) -> int: ...


class PyRecords:
    """The pure-Python fallback of the native History, the same contract: the last `capacity` records made, oldest
    first (a deque), and each key's newest record among them (a dict) — about 150 bytes a record."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._made: deque[tuple[bytes, int]] = deque()          # (key, serial), oldest first
        self._newest: dict[bytes, tuple[int, int]] = {}          # key -> (level, serial of its newest record)
        self._serial = 0

    def record(self, key: bytes, level: int) -> None:
        if not 1 <= level <= 255:
            raise ValueError(f"level must be in 1..255, got {level}")
        self._serial += 1
        self._newest[key] = (level, self._serial)
        self._made.append((key, self._serial))
        while len(self._made) > self.capacity:
            old, serial = self._made.popleft()
            if self._newest[old][1] == serial:
                del self._newest[old]

    def level(self, key: bytes, /) -> int:
        got = self._newest.get(key)
        return 0 if got is None else got[0]

    def resize(self, capacity: int, /) -> None:
        """Keep the newest live records that fit (the dead ones go)."""
        live = sorted(self._newest.items(), key=lambda item: item[1][1])[-capacity:]
        self.capacity = capacity
        self._newest = dict(live)
        self._made = deque((key, serial) for key, (_, serial) in live)

    def nbytes(self) -> int:
        return sys.getsizeof(self._newest) + sys.getsizeof(self._made) + 150 * len(self._made)

    def __len__(self) -> int:
        return len(self._newest)


def _records(capacity: int) -> Records:
    if os.environ.get("KVSTORE_NO_NATIVE", "") in ("", "0"):
        try:
            from kvstore._kvindex import History as NativeRecords
        except ImportError:
            pass
        else:
            return NativeRecords(capacity)          # type: ignore[no-any-return]
    return PyRecords(capacity)


class History:
    """The levels of a class's evicted blocks: `factor` (HISTORY_FACTOR) records per block the class holds (at least
    MIN_RECORDS), the oldest forgotten first. `records` answers the hot path (`level`, `record`: one native call
    each); `size_for` follows the class's size a quarter ahead, growing past what it has and shrinking under a quarter
    of it (`grow_at`, `shrink_at`: the caller asks only past them; a class that lends half its memory away and takes
    it back does not rebuild its history each time)."""

    def __init__(self, records: Records | None = None, factor: int = HISTORY_FACTOR) -> None:
        self.records = _records(MIN_RECORDS) if records is None else records
        self.factor = factor                        # records per block held
        self.grow_at = MIN_RECORDS // factor
        self.shrink_at = 0

    def size_for(self, held: int) -> None:
        want, have = held * self.factor, self.records.capacity
        if want > have or want < have // 4:
            want = min(max(MIN_RECORDS, want + want // 4), 1 << 30)
            if want != have:
                self.records.resize(want)
        have = self.records.capacity
        self.grow_at = have // self.factor
        self.shrink_at = have // (4 * self.factor)

    def record(self, key: bytes, level: int) -> None:
        self.records.record(key, level)

    def level(self, key: bytes) -> int:
        """The level the block left with (0: not remembered)."""
        return self.records.level(key)

    @property
    def remembered(self) -> int:
        return len(self.records)

    @property
    def nbytes(self) -> int:
        return self.records.nbytes()
