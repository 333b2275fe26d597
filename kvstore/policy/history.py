"""`history`: reuse-aware LRU without hints (issue 34), in both shapes (see kvstore.policy).

What a cache of KV blocks sees without hints: most blocks are never asked for again (76% of the blocks of the public
Mooncake trace, 48% of its references), and a block's reuse mostly comes long after its last use, beyond what the
pool can hold. Plain LRU spends its space on the blocks used once. This policy keeps its blocks in LEVELS recency
lists by how often each was used (1, 2, LEVELS or more sightings: stored, read, stored again) and evicts the least
recently used block of the lowest non-empty level, so a block used once goes before any block used again, however
old. A block's uses outlive its eviction: `History` remembers the level of the blocks it evicted (HISTORY_FACTOR
times the blocks it holds, 10 bytes a remembered block, no KV), so a block stored again comes back at the level it
left with, one higher. Every hook on a held block is O(1) dict work; storing a block that was evicted costs one
look in each history generation.

Chains stay prefix-closed: the index sees a chain's earlier block whenever it sees a later one (a read is a prefix;
a store refreshes the whole chain, tail first), so an earlier block's level is never lower, and at equal level it is
the more recent; the history forgets the oldest evictions first, and a chain's tail is evicted before its head, so
it never remembers a tail whose head it forgot.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from kvstore.index.keytable import KeyTable
    from kvstore.workflows import Touch, Workflows

LEVELS = 3                  # used once, twice, three times or more
HISTORY_FACTOR = 20         # evicted blocks remembered per block held
GENERATIONS = 8             # the history forgets a generation (an eighth of it) at a time
MIN_GENERATION = 1024


def host_policy(table: KeyTable, workflows: Workflows | None = None, key_at: Callable[[int], bytes | None] | None
                = None, slots_of: Callable[[int], int] | None = None) -> HistoryPolicy:
    """The registry's entry for the host pool (kvstore.policy): its own lists, not the key table's."""
    return HistoryPolicy()


def tier_policy(workflows: Workflows | None = None) -> HistoryPolicy:
    """The registry's entry for a lower tier with books of its own (the SSD: keys are block ids)."""
    return HistoryPolicy()


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
        self._new[fingerprint(key)] = level
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
        f = fingerprint(key)
        got = self._new.get(f)
        if got is not None:
            return got
        i = int(np.searchsorted(self._fps, f, "right")) - 1
        return int(self._levels[i]) if i >= 0 and self._fps[i] == f else 0

    @property
    def remembered(self) -> int:
        return len(self._new) + len(self._fps)

    @property
    def nbytes(self) -> int:
        """The frozen records' arrays (10 bytes a record) and the newest generation's dict (about 100 a record)."""
        return self._fps.nbytes + self._levels.nbytes + self._gens.nbytes + 100 * len(self._new)


class HistoryPolicy:
    """See the module docstring. Keys are whatever the tier books blocks by (host pool: the key table's keys; SSD:
    block ids); a class is a slot class (host) or a block size (SSD)."""
    name = "history"

    def __init__(self) -> None:
        self.history = History()
        self._lists: dict[int, list[OrderedDict[bytes, None]]] = {}
        self._where: dict[bytes, tuple[int, int]] = {}     # key -> (class, level - 1)
        self._pinned: set[bytes] = set()

    def _levels(self, cls: int) -> list[OrderedDict[bytes, None]]:
        levels = self._lists.get(cls)
        if levels is None:
            levels = self._lists[cls] = [OrderedDict() for _ in range(LEVELS)]
        return levels

    def _place(self, key: bytes, cls: int, level: int) -> None:
        """`key` at the most recent end of level `level` (0-based) of its class, unless pinned."""
        old = self._where.get(key)
        if old is not None and key not in self._pinned:
            del self._lists[old[0]][old[1]][key]
        self._where[key] = (cls, level)
        if key not in self._pinned:
            self._levels(cls)[level][key] = None

    def added(self, key: bytes, cls: int, touch: Touch | None = None) -> None:
        old = self._where.get(key)
        level = old[1] + 1 if old is not None else self.history.level(key)
        self._place(key, cls, min(level, LEVELS - 1))
        self.history.size_for(len(self._where))

    def accessed(self, key: bytes, touch: Touch | None = None) -> None:
        where = self._where.get(key)
        if where is not None:
            self._place(key, where[0], min(where[1] + 1, LEVELS - 1))

    def removed(self, key: bytes) -> None:
        where = self._where.pop(key, None)
        if where is None:
            return
        if key in self._pinned:
            self._pinned.discard(key)
        else:
            del self._lists[where[0]][where[1]][key]
        self.history.record(key, where[1] + 1)

    def pinned(self, key: bytes) -> None:
        """A read (the index pins what it reads): a use, and no candidate until unpinned."""
        where = self._where.get(key)
        if where is not None and key not in self._pinned:
            del self._lists[where[0]][where[1]][key]
            self._pinned.add(key)
            self._where[key] = (where[0], min(where[1] + 1, LEVELS - 1))

    def unpinned(self, key: bytes) -> None:
        where = self._where.get(key)
        if where is not None and key in self._pinned:
            self._pinned.discard(key)
            self._levels(where[0])[where[1]][key] = None

    def moved(self, key: bytes, src: int, dst: int) -> None:
        pass                                    # books by key: a block's slot is not the policy's business

    def victim(self, cls: int) -> bytes | None:
        for level in self._lists.get(cls, ()):
            if level:
                return next(iter(level))
        return None

    def levels(self) -> dict[str, int]:
        """Blocks per level (used once, twice, LEVELS or more times), and the history's records and bytes."""
        out = {f"used_{i + 1}": sum(len(ls[i]) for ls in self._lists.values()) for i in range(LEVELS)}
        out.update(history_records=self.history.remembered, history_bytes=self.history.nbytes)
        return out
