"""What the `history` policy remembers of the blocks it evicted: their level (how often each was used), by an 8-byte
fingerprint, in a bounded history that forgets the oldest evictions first (kvstore.policy.history uses it, and the
`remember` shadow of kvstore.policy.shadow keeps one of its own).

`pick` is the victim rule both share: the least recently used block of the lowest non-empty level, or, aging by a
factor F, the least recently used of all levels' oldest blocks that have gone unused for F times as long as the
oldest block of the lowest level has (a block's uses protect it for a while, not for ever). F = 1 is plain LRU over
all levels; no factor, levels for ever.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import TypeVar

import numpy as np

LEVELS = 3                  # used once, twice, three times or more
HISTORY_FACTOR = 20         # evicted blocks remembered per block held
GENERATIONS = 8             # the history forgets a generation (an eighth of it) at a time
MIN_GENERATION = 1024

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


class History:
    """The levels of evicted blocks, by 8-byte fingerprint, forgotten a generation at a time, oldest first. The
    newest generation is a dict; when it holds `generation` records it is merged into three sorted arrays
    (fingerprint, level, generation: 10 bytes a record, one binary search a look), and the oldest generation leaves
    when there are GENERATIONS of them. A fingerprint recorded twice answers with its newest record."""

    def __init__(self) -> None:
        self.generation = MIN_GENERATION
        self._new: dict[int, int] = {}
        self._gen = 0                                   # the newest frozen generation's number
        self._fps = np.empty(0, np.int64)
        self._levels = np.empty(0, np.uint8)
        self._gens = np.empty(0, np.uint8)

    def size_for(self, held: int) -> None:
        """Remember HISTORY_FACTOR evictions per block held (from the next generation on)."""
        self.generation = max(MIN_GENERATION, held * HISTORY_FACTOR // GENERATIONS)

    def record(self, key: bytes, level: int) -> None:
        self.record_fp(fingerprint(key), level)

    def record_fp(self, fp: int, level: int) -> None:
        self._new[fp] = level
        if len(self._new) >= self.generation:
            self._freeze()

    def _freeze(self) -> None:
        self._gen = (self._gen + 1) & 0xFF
        keep = ((self._gen - self._gens.astype(np.int64)) & 0xFF) < GENERATIONS - 1   # with the new: GENERATIONS
        fps = np.concatenate([self._fps[keep], np.fromiter(self._new.keys(), np.int64, len(self._new))])
        levels = np.concatenate([self._levels[keep], np.fromiter(self._new.values(), np.uint8, len(self._new))])
        ages = np.concatenate([((self._gen - self._gens[keep].astype(np.int64)) & 0xFF),
                               np.zeros(len(self._new), np.int64)])
        order = np.lexsort((-ages, fps))               # by fingerprint, the newest record of one last
        self._fps, self._levels = fps[order], levels[order]
        self._gens = ((self._gen - ages[order]) & 0xFF).astype(np.uint8)
        self._new = {}

    def level(self, key: bytes) -> int:
        """The level the block left with (0: not remembered)."""
        return self.level_of(fingerprint(key))

    def level_of(self, f: int) -> int:
        got = self._new.get(f)
        if got is not None or not len(self._fps):
            return got or 0
        i = int(self._fps.searchsorted(f, "right")) - 1
        return int(self._levels[i]) if i >= 0 and self._fps[i] == f else 0

    @property
    def remembered(self) -> int:
        return len(self._new) + len(self._fps)

    @property
    def nbytes(self) -> int:
        """The frozen records' arrays (10 bytes a record) and the newest generation's dict (about 100 a record)."""
        return self._fps.nbytes + self._levels.nbytes + self._gens.nbytes + 100 * len(self._new)
