"""Shadow caches: what each way of ordering a class would have hit, so the `history` policy can follow the best one.

Without hints, no single ordering wins on every traffic we know (issue 34): on the public Mooncake trace a block that
comes back after its eviction is the one worth keeping (remember its uses); on a round robin of agent sessions larger
than the pool it is the one to let go (forget them: the sessions already resident stay, instead of every session
thrashing); where the working set moves (sessions that end, a shift), uses that protect a block for ever keep dead
blocks and fall below LRU, and uses that protect it for a while do not. A fixed choice falls below LRU somewhere.

So each class of the history policy runs a `Duel` of four key-only caches of the same occupancy as the real one,
all with levels by use: `remember` (a returning block comes back at the level the real policy knows for it: held,
or in its history), `forget` (a returning block starts over), `aging` (as `remember`, but a block's uses protect it
only while it has gone unused for less than twice as long as the oldest block used once: kvstore.policy.levels.pick)
and `lru` (levels protect nothing: the safety net, never far below LRU). Every store and read is offered to each
shadow: a hit if the shadow still holds the key, else the shadow takes it in (it would have missed and stored it).
Hits are halved every WINDOW shadow-occupancies of events, so the choice follows the traffic, and the real policy
changes its way only when another shadow is ahead by MARGIN and MIN_LEAD. This is set dueling (Qureshi et al., ISCA
2007) with whole shadow caches instead of sampled sets: sets would split a chain's blocks between ways and break its
prefix closure; shadows hold no bytes, so the real cache stays one order.

Cost: the shadows see a sample of the keys (SHARDS, Waldspurger et al., FAST 2015: keys whose fingerprint is 0
modulo `rate`, each shadow sized to the class's occupancy / `rate`), the rate doubling whenever a shadow would hold
more than SHADOW_BLOCKS keys: a class of up to SHADOW_BLOCKS blocks is simulated exactly, a larger one at about
SHADOW_BLOCKS keys a shadow (3 dict entries of ~100 bytes each a key), whatever the pool's size.
"""
from __future__ import annotations

import sys
from collections import OrderedDict
from collections.abc import Callable

from kvstore.policy.levels import LEVELS, fingerprint, pick

SHADOW_BLOCKS = 2048        # keys a shadow holds at most before it samples half as many
WINDOW = 4                  # hits are halved every WINDOW shadow-occupancies of events
MARGIN = 1.02               # another way is taken when its hits exceed the current way's by 2% (and by MIN_LEAD)
MIN_LEAD = 4.0
AGING: dict[str, float | None] = {"remember": None, "forget": None, "aging": 2.0, "lru": 1.0}   # pick's factor
WAYS = tuple(AGING)
INITIAL = "remember"         # the way before the shadows have seen anything: the policy's own (reuse protects)


class Shadow:
    """One way of ordering, keys only: LEVELS recency lists (fingerprint -> tick of its last use), the victim by
    `pick`."""

    def __init__(self, way: str) -> None:
        self.way = way
        self.aging = AGING[way]
        self.lists: list[OrderedDict[int, int]] = [OrderedDict() for _ in range(LEVELS)]
        self.where: dict[int, int] = {}
        self.hits = 0.0
        self.tick = 0

    def use(self, fp: int, hit: bool) -> bool:
        """A read or a store of a key: if held, it goes one level up (a hit where `hit`) and True; else False."""
        held = self.where.get(fp)
        if held is None:
            return False
        self.tick += 1
        self.hits += hit
        del self.lists[held][fp]
        if held < LEVELS - 1:
            held += 1
            self.where[fp] = held
        self.lists[held][fp] = self.tick
        return True

    def admit(self, fp: int, level: int, size: int) -> None:
        """A key it does not hold comes in, at level 1 for `forget`, at `level` (0-based) for the others; then the
        shadow trims to `size`."""
        self.tick += 1
        new = 0 if self.way == "forget" else level
        self.where[fp] = new
        self.lists[new][fp] = self.tick
        if len(self.where) > size:
            self.trim(size)

    def trim(self, size: int) -> None:
        while len(self.where) > size:
            fp = pick(self.lists, self.aging, self.tick)
            assert fp is not None
            del self.lists[self.where.pop(fp)][fp]

    def resample(self, rate: int) -> None:
        """Keep only the keys of the sample at `rate` (the rate doubled)."""
        for keys in self.lists:
            for fp in [f for f in keys if f % rate]:
                del keys[fp]
                del self.where[fp]


class Duel:
    """The shadows of one class and the way the real policy follows (see the module docstring)."""

    def __init__(self, remembered: Callable[[bytes], int]) -> None:
        self.remembered = remembered            # the real policy's history: the level an evicted key left with
        self.shadows = [Shadow(w) for w in WAYS]
        self.rate = 1
        self.events = 0
        self.way = INITIAL
        self.switches = 0
        self.by_chain = False                   # scored by `asked` (the host pool), else by reads (a lower tier)

    def used(self, key: bytes, held: int, level: int, hit: bool = True) -> None:
        """A block of a class that holds `held` blocks was stored or read (`hit`: count a hit where a shadow holds
        it; False for a store of a block just read, whose read counted); `level`: where the real policy places it
        (0-based), or 0 where it does not know: then one above the level its history remembers."""
        fp = fingerprint(key)
        if fp % self.rate:
            return
        while held // self.rate > SHADOW_BLOCKS:
            self.rate *= 2
            for s in self.shadows:
                s.resample(self.rate)
            if fp % self.rate:
                return
        size = max(1, held // self.rate)
        hit = hit and not self.by_chain
        new = -1                                # the level a shadow that lacks it admits it at, asked once
        for s in self.shadows:
            if not s.use(fp, hit):
                if new < 0:
                    new = min(level or self.remembered(key), LEVELS - 1)
                s.admit(fp, new, size)
        self.events += 1
        if self.events >= WINDOW * max(16, size):
            self.events = 0
            for s in self.shadows:
                s.hits /= 2

    def asked(self, keys: list[bytes]) -> None:
        """A request asked for this chain (head first): each shadow scores the prefix of it it holds, among the
        sampled keys (an unsampled key is taken as held)."""
        self.by_chain = True
        fps = [fp for fp in map(fingerprint, keys) if fp % self.rate == 0]
        if not fps:
            return
        for s in self.shadows:
            n = 0
            for fp in fps:
                if fp not in s.where:
                    break
                n += 1
            s.hits += n

    def shrunk(self, held: int) -> None:
        """The real class lost a block (evicted or deleted): the shadows trim to the same occupancy."""
        size = max(1, held // self.rate)
        for s in self.shadows:
            if len(s.where) > size:
                s.trim(size)

    def choose(self) -> str:
        """The way to follow now: the current one unless another is ahead by MARGIN and MIN_LEAD."""
        hits = {s.way: s.hits for s in self.shadows}
        best = max(WAYS, key=hits.__getitem__)
        if best != self.way and hits[best] > max(hits[self.way] * MARGIN, hits[self.way] + MIN_LEAD):
            self.way = best
            self.switches += 1
        return self.way

    def nbytes(self) -> int:
        """The shadows' dicts (their fingerprints are small ints: ~32 bytes a key besides the dict slots)."""
        return sum(sys.getsizeof(s.where) + sum(sys.getsizeof(lst) for lst in s.lists) + 32 * len(s.where)
                   for s in self.shadows)

    def hits(self) -> dict[str, float]:
        return {s.way: round(s.hits, 1) for s in self.shadows}
