"""`history`: reuse-aware eviction without hints (issue 34), in both shapes (see kvstore.policy); the default.

What a cache of KV blocks sees without hints: most blocks are never asked for again (76% of the blocks of the public
Mooncake trace, 48% of its references), and a block's reuse mostly comes long after its last use, beyond what the
pool can hold. Plain LRU spends its space on the blocks used once. This policy keeps its blocks in LEVELS recency
lists by how often each was used (1, 2, LEVELS or more sightings: stored, read, stored again) and evicts the least
recently used block of the lowest non-empty level, so a block used once goes before any block used again, however
old. A block's uses outlive its eviction: a `History` per class (kvstore.policy.levels) remembers the level of the
blocks it evicted (its last HISTORY_FACTOR evictions per block the class holds, 19–29 bytes each, no KV; per class, so
that one tenant's evictions never push another's out).

What to do with a block that comes back, and for how long uses protect a block, depends on the traffic, so each
class follows whichever of five ways its shadow caches (kvstore.policy.shadow) show hitting most: `remember` (it
comes back at the level it left with, one higher), `forget` (it starts over at level 1: a round robin of sessions
larger than the pool keeps the sessions that are resident instead of thrashing through all of them), `bypass` (as
`forget`, and a block used more than once is never evicted for a new one: the put stops there, `admits`; only
where an eviction drops the block, i.e. no lower tier), `aging` (as `remember`, but a block unused for twice as
long as the lowest level's oldest block loses its protection: where the working set moves, dead blocks do not stay
for their past uses; kvstore.policy.levels.pick) or `lru` (the least recently used block of any level).

Chains stay prefix-closed: the index sees a chain's earlier block whenever it sees a later one (a read is a prefix;
a store refreshes the whole chain, tail first), so an earlier block's level is never lower and its last use never
older; every victim is the oldest of a level, or the oldest of several levels' oldest, so a tail leaves before its
head. A change of way orders victims at once but admits blocks by it only where that keeps every chain's head at or
above its tail (`ClassBooks.admitted_at`, kvstore.policy.history_order), and a block placed right after another (a
chain published tail first, a held block refreshed between) never comes in below it (`_carry`: a head stored again
alone, and evicted again at a lower level, would otherwise be remembered below its tail).
Cost (issue 34: per operation ≤ 1.5× LRU's, ≤ 32 bytes a remembered block). In the host pool the levels are the key
table's own lists (kvstore.index.keytable: a class's list split by level; `use`, `pick`) and the per-block hooks are
native (`NativeHistoryPolicy`: kvstore._kvindex.Hooks, which the index calls straight into C): a read, an eviction
and a commit cost 0.7–0.9×, 0.9–1.05× and 1.3–1.5× LRU's (bench_index, 10 thousand to 1 million blocks; the commit
pays one look in a history twenty times the pool). The history is native too (kvstore._kvindex.History: a ring of
8-byte records, an index over it and Bloom filters in front that answer most never-seen keys without a memory miss,
21–32 bytes a record; records gathered 32 at a time so that their misses overlap). Per request the shadows serve
each lookup's chain in Python (a sample of at most about SHADOW_BLOCKS keys a shadow); the whole request path costs
1.05–1.25× LRU's (bench_policies). The SSD tier (`HistoryOrder`) keeps its levels in dicts: its keys are block ids,
not the key table's.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kvstore.policy.history_order import TOP, ClassBooks, HistoryOrder, LevelsBase
from kvstore.policy.levels import HISTORY_FACTOR, LEVELS, MIN_RECORDS, History
from kvstore.policy.shadow import AGING, ANEW

if TYPE_CHECKING:
    from kvstore.index.keytable import KeyTable
    from kvstore.workflows import Touch, Workflows

__all__ = ["HISTORY_FACTOR", "LEVELS", "History", "HistoryOrder", "HistoryPolicy"]

try:
    from kvstore._kvindex import Hooks as NativeHooks
    from kvstore._kvindex import KeyTable as NativeKeyTable
except ImportError:
    NativeHooks = NativeKeyTable = None

TABLE_LEVELS = 4                # kvstore.index.keytable.LEVELS: a key table's placement() is cls << 2 | level


def host_policy(table: KeyTable, workflows: Workflows | None = None, key_at: Callable[[int], bytes | None] | None
                = None, slots_of: Callable[[int], int] | None = None) -> HistoryPolicy:
    """The registry's entry for the host pool (kvstore.policy): levels in the key table's own lists. The index
    signals a read by pinning the block; `accessed` is a store of a held block."""
    if NativeHooks is not None and type(table) is NativeKeyTable:
        return NativeHistoryPolicy(table)
    return HistoryPolicy(table)


def tier_policy(workflows: Workflows | None = None) -> HistoryOrder:
    """The registry's entry for a lower tier with books of its own (the SSD: keys are block ids; `accessed` is a
    read)."""
    return HistoryOrder(reads_pin=False)

class HistoryPolicy(LevelsBase):
    """The host pool's: levels are the key table's (kvstore.index.keytable: a class's list split by level, `use`,
    `pick`), so every hook is one or two native calls; a class's count, history and duel are here. The shadows
    learn from the requests' chains only (`asked`: every lookup and get)."""
    name = "history"

    def __init__(self, table: KeyTable) -> None:
        super().__init__(by_chain=True)
        self.table = table

    def _holds(self, key: bytes) -> bool:
        return self.table.get(key) is not None

    def added(self, key: bytes, cls: int, touch: Touch | None = None) -> None:
        c = self._classes.get(cls) or self._cls(cls)
        c.held += 1
        if c.way != c.duel.way:
            level = c.admitted_at(c.records.level(key), self._carry)
        elif c.way in ANEW:                     # (the history is not asked: a block comes at level 1)
            level = max(0, self._carry)
        else:
            level = max(min(c.records.level(key), TOP), self._carry)
        self._carry = level
        if level:
            self.table.set_level(key, level)
        if c.held > c.history.grow_at:
            c.history.size_for(c.held)

    def accessed(self, key: bytes, touch: Touch | None = None) -> None:
        level = self.table.use(key, TOP)
        if level >= 0:
            self._carry = level

    def pinned(self, key: bytes) -> None:
        """A read (the index pins what it reads): a use, and no candidate until unpinned."""
        self._carry = -1
        self.table.use(key, TOP, True)

    def unpinned(self, key: bytes) -> None:
        self._carry = -1
        self.table.relink(key)

    def removed(self, key: bytes) -> None:
        self._carry = -1
        at = self.table.placement(key)
        if at >= 0:
            c = self._classes[at >> 2]
            c.held -= 1
            c.records.record(key, (at & 3) + 1)
            if c.held < c.history.shrink_at:
                c.history.size_for(c.held)

    def moved(self, key: bytes, src: int, dst: int) -> None:
        pass                                    # the key keeps its place in the table's lists: only its gid changed

    def asked(self, keys: list[bytes], cls: int) -> None:
        """The shadows serve the request (LevelsBase.asked), then the class's way is chosen again: in the host pool
        the shadows score only here, so the way changes only here (admits' first refusal counts from the next)."""
        super().asked(keys, cls)
        c = self._classes.get(cls)
        if c is not None:
            c.duel.choose()

    def victim(self, cls: int) -> bytes | None:
        self._carry = -1
        c = self._classes.get(cls)
        if c is None:
            return None
        c.duel.press()
        got = self.table.pick(cls, AGING[c.duel.way])
        return None if got is None else got[0]

    def admits(self, victim: bytes, touch: Touch | None, key: bytes | None = None) -> bool:
        """Whether the index may evict `victim` for a block coming (asked only where an eviction drops the block):
        not under `bypass` if the victim was used more than once. The block coming enters at level 1 and would be
        the next to go, so the put stops there (Belady's bypass, estimated by reuse: a round robin of sessions
        larger than the pool keeps the resident ones whole instead of cutting their tails for a session that will
        not fit; where the traffic moves, a pool that stores nothing new loses, and the `bypass` shadow shows it)."""
        at = self.table.placement(victim)
        if at < 0:
            return True
        duel = self._classes[at >> 2].duel
        duel.refuse()
        return at & 3 == 0 or duel.way != "bypass"

    def nbytes(self) -> int:
        """The books besides the key table's levels (its own nbytes): the histories and the shadows."""
        return sum(c.history.nbytes + c.duel.nbytes() for c in self._classes.values())

    def levels(self) -> dict[str, Any]:
        """See `report`."""
        out: dict[str, Any] = {f"used_{i + 1}": sum(self.table.class_len(cls, i) for cls in self._classes)
                               for i in range(LEVELS)}
        out.update(self._histories())
        return out


class NativeHistoryPolicy(HistoryPolicy):
    """HistoryPolicy over the native key table with its per-block hooks native too (kvstore._kvindex.Hooks: the
    class's count and history, the row of placements and the way's parameters are there; each hook is one call the
    index makes straight into C). What stays here is per request: the shadows (`asked`), which choose the class's
    way and hand it to the hooks (`set_way`)."""

    def __init__(self, table: KeyTable) -> None:
        super().__init__(table)
        hooks = self._hooks = NativeHooks(table, TOP, HISTORY_FACTOR, MIN_RECORDS)
        self._ways: dict[int, str] = {}             # the way each class's hooks follow
        self.added = hooks.added                    # type: ignore[method-assign]
        self.accessed = hooks.accessed              # type: ignore[method-assign]
        self.pinned = hooks.pinned                  # type: ignore[method-assign]
        self.unpinned = hooks.unpinned              # type: ignore[method-assign]
        self.removed = hooks.removed                # type: ignore[method-assign]
        self.victim = hooks.victim                  # type: ignore[method-assign]
        self.admits = hooks.admits                  # type: ignore[method-assign]

    def books(self, cls: int) -> ClassBooks:
        return self._known(cls)

    def _known(self, cls: int) -> ClassBooks:
        c = self._classes.get(cls)
        if c is None:
            c = self._classes[cls] = ClassBooks(True, History(self._hooks.history(cls)))
        c.held = self._hooks.held(cls)
        return c

    def asked(self, keys: list[bytes], cls: int) -> None:
        """The shadows serve the request (see LevelsBase.asked); then the class's way, chosen again, goes to the
        hooks."""
        hooks = self._hooks
        hooks.reset_carry()
        if cls not in self._classes and not hooks.held(cls):
            return                                  # a class that never held a block (as the Python form)
        c = self._known(cls)
        duel = c.duel
        if hooks.pressed(cls):                      # (before the request is scored: as the Python form's victim)
            duel.press()
        duel.asked(keys, c.held, self._holds)
        if hooks.refusing(cls):
            duel.refuse()
        way = duel.choose()
        if self._ways.get(cls) != way:
            self._ways[cls] = way
            hooks.set_way(cls, AGING[way], way in ANEW, way == "bypass")

    def _anew(self, cls: int, c: ClassBooks) -> bool:
        return bool(self._hooks.admitting_anew(cls))

    def _all_known(self) -> None:
        for cls in self._hooks.classes():           # (classes the shadows were never asked of included)
            self._known(cls)

    def levels(self) -> dict[str, Any]:
        self._all_known()
        return super().levels()

    def nbytes(self) -> int:
        self._all_known()
        return super().nbytes()
