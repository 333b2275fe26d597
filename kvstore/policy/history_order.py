"""The `history` policy's books that both of its shapes share — per class: its count, its history of evicted blocks'
levels and its duel of shadows (`ClassBooks`), the row of placements and the shadows' questions (`LevelsBase`) — and
its dict shape, `HistoryOrder`: the SSD tier's (keys are block ids) and the offline models' (bench/family_offline.py).
The host pool's shape, over the key table's levels with native hooks, is kvstore.policy.history's, where the policy
is described.
"""
from __future__ import annotations

import sys
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

from kvstore.policy.levels import LEVELS, History, pick
from kvstore.policy.shadow import AGING, ANEW, Duel

if TYPE_CHECKING:
    from kvstore.workflows import Touch

TOP = LEVELS - 1                # the highest level (0-based)


class ClassBooks:
    """One class's count of blocks held, its history, its duel, and the way its blocks are admitted by. The duel's
    way orders victims at once; a change of admission waits where it could split a chain being published: into
    `forget`, until a block its history does not remember comes (the blocks of a chain come tail first and a head is
    remembered at least as high as its tail: switching at a remembered one could admit a head below its tail)."""
    __slots__ = ("held", "history", "records", "duel", "way")

    def __init__(self, by_chain: bool, history: History | None = None) -> None:
        self.held = 0
        self.history = history or History()     # per class: one tenant's evictions never push another's out
        self.records = self.history.records
        self.duel = Duel(self.records.level, by_chain)
        self.way = self.duel.way            # the way blocks are admitted by

    def admitted_at(self, remembered: int, carry: int) -> int:
        """The level (0-based) a block the class does not hold comes in at: by the admitting way, from what the
        history remembers of it, never below the block placed just before it (`carry`)."""
        duel = self.duel
        if self.way != duel.way and (duel.way not in ANEW or remembered == 0):
            self.way = duel.way
        return max(0 if self.way in ANEW else min(remembered, TOP), carry)


class LevelsBase:
    """What both shapes share: the classes, the row of placements (`_carry`), the duel's questions."""

    def __init__(self, by_chain: bool) -> None:
        self._classes: dict[int, ClassBooks] = {}
        self._by_chain = by_chain
        self._carry = -1        # the level of the block placed just before, while blocks are placed in a row

    def books(self, cls: int) -> ClassBooks:
        """The class's books (its count, history, duel): for tests and reports."""
        return self._cls(cls)

    def _cls(self, cls: int) -> ClassBooks:
        c = self._classes.get(cls)
        if c is None:
            c = self._classes[cls] = ClassBooks(self._by_chain)
        return c

    def asked(self, keys: list[bytes], cls: int) -> None:
        """A request asked for this chain of the class (head first): the shadows score what each way would hold."""
        self._carry = -1
        c = self._classes.get(cls)
        if c is not None:
            c.duel.asked(keys, c.held, self._holds)

    def _holds(self, key: bytes) -> bool:
        """Whether the real cache holds `key` (the duel weighs it against the lru shadow)."""
        raise NotImplementedError

    def _histories(self) -> dict[str, Any]:
        return {"history_records": sum(c.history.remembered for c in self._classes.values()),
                "history_capacity": sum(c.history.records.capacity for c in self._classes.values()),
                "history_bytes": sum(c.history.nbytes for c in self._classes.values()),
                "classes": {str(cls): {"way": c.duel.way, "admits_anew": self._anew(cls, c),
                                       "switches": c.duel.switches,
                                       "shadow_hits": c.duel.hits(), "sample_rate": c.duel.rate}
                            for cls, c in self._classes.items()}}

    def _anew(self, cls: int, c: ClassBooks) -> bool:
        """Whether the class admits a block at level 1 now, whatever the history remembers of it."""
        return c.way in ANEW

    def report(self) -> dict[str, Any]:
        """`kvstore stats`: blocks per level (used once, twice, LEVELS or more times), the histories' records and
        bytes, and each class's way, how often it changed, and its shadows' recent hits (kvstore.policy)."""
        return self.levels()

    def levels(self) -> dict[str, Any]:
        raise NotImplementedError


class HistoryOrder(LevelsBase):
    """A lower tier's (and a model's: bench/family_offline.py), keys of any length: LEVELS recency lists per class
    (key -> tick of its last use, oldest first). Keys are whatever the tier books blocks by (the SSD: block ids); a
    class is a block size. With `reads_pin` a read is a pin, as in the host pool."""
    name = "history"

    def __init__(self, reads_pin: bool = False) -> None:
        super().__init__(by_chain=False)
        self.reads_pin = reads_pin
        self._lists: dict[int, list[OrderedDict[bytes, int]]] = {}
        self._where: dict[bytes, tuple[int, int]] = {}     # key -> (class, level - 1)
        self._pinned: set[bytes] = set()
        self._tick = 0

    def _class_lists(self, cls: int) -> list[OrderedDict[bytes, int]]:
        lists = self._lists.get(cls)
        if lists is None:
            lists = self._lists[cls] = [OrderedDict() for _ in range(LEVELS)]
        return lists

    def _place(self, key: bytes, cls: int, level: int) -> None:
        """`key` at the most recent end of level `level` (0-based) of its class, unless pinned."""
        old = self._where.get(key)
        if old is not None and key not in self._pinned:
            del self._lists[old[0]][old[1]][key]
        self._where[key] = (cls, level)
        if key not in self._pinned:
            self._tick += 1
            self._class_lists(cls)[level][key] = self._tick

    def added(self, key: bytes, cls: int, touch: Touch | None = None) -> None:
        c = self._cls(cls)
        old = self._where.get(key)
        if old is not None:
            level = min(old[1] + 1, TOP)
        else:
            c.held += 1
            level = c.admitted_at(c.records.level(key), self._carry)
        self._carry = level
        c.duel.used(key, c.held, level)
        self._place(key, cls, level)
        if c.held > c.history.grow_at:
            c.history.size_for(c.held)

    def accessed(self, key: bytes, touch: Touch | None = None) -> None:
        where = self._where.get(key)
        if where is None:
            return
        c = self._classes[where[0]]
        level = self._carry = min(where[1] + 1, TOP)
        c.duel.used(key, c.held, level, hit=not self.reads_pin)   # host: a store after its read
        self._place(key, where[0], level)

    def admits(self, victim: bytes, touch: Touch | None, key: bytes | None = None) -> bool:
        """See HistoryPolicy.admits."""
        where = self._where.get(victim)
        if where is None:
            return True
        duel = self._classes[where[0]].duel
        duel.refuse()
        return where[1] == 0 or duel.way != "bypass"

    def removed(self, key: bytes) -> None:
        self._carry = -1
        where = self._where.pop(key, None)
        if where is None:
            return
        c = self._classes[where[0]]
        if key in self._pinned:
            self._pinned.discard(key)
        else:
            del self._lists[where[0]][where[1]][key]
        c.held -= 1
        c.duel.shrunk(c.held)
        c.records.record(key, where[1] + 1)
        if c.held < c.history.shrink_at:
            c.history.size_for(c.held)

    def pinned(self, key: bytes) -> None:
        """A read where reads pin (a model of the host pool): a use, and no candidate until unpinned."""
        self._carry = -1
        where = self._where.get(key)
        if where is not None and key not in self._pinned:
            c = self._classes[where[0]]
            del self._lists[where[0]][where[1]][key]
            level = min(where[1] + 1, TOP)
            c.duel.used(key, c.held, level)
            self._pinned.add(key)
            self._where[key] = (where[0], level)

    def unpinned(self, key: bytes) -> None:
        self._carry = -1
        where = self._where.get(key)
        if where is not None and key in self._pinned:
            self._pinned.discard(key)
            self._tick += 1
            self._lists[where[0]][where[1]][key] = self._tick

    def _holds(self, key: bytes) -> bool:
        return key in self._where

    def level_of(self, key: bytes) -> int:
        """The level (0-based) of a held key; KeyError if not held."""
        return self._where[key][1]

    def victim(self, cls: int) -> bytes | None:
        self._carry = -1
        c = self._classes.get(cls)
        if c is None:
            return None
        c.duel.press()
        return pick(self._lists[cls], AGING[c.duel.choose()], self._tick)

    def oldest_tick(self, cls: int) -> int | None:
        """When the class's next victim was last used, on this policy's clock (one for all classes), None if the
        class is empty: the SSD tier's quotas take the stalest borrowed record among tenants' classes."""
        c = self._classes.get(cls)
        if c is None:
            return None
        lists = self._lists[cls]
        key = pick(lists, AGING[c.duel.way], self._tick)
        return None if key is None else lists[self._where[key][1]][key]

    def nbytes(self) -> int:
        """The books' memory: the history, the per-block dicts and the shadows (keys are the tier's objects)."""
        books = sys.getsizeof(self._where) + sys.getsizeof(self._pinned)
        books += sum(sys.getsizeof(lst) for lists in self._lists.values() for lst in lists)
        return books + sum(c.history.nbytes + c.duel.nbytes() for c in self._classes.values())

    def levels(self) -> dict[str, Any]:
        """See `report`."""
        out: dict[str, Any] = {f"used_{i + 1}": sum(len(lists[i]) for lists in self._lists.values())
                               for i in range(LEVELS)}
        out.update(self._histories())
        return out
