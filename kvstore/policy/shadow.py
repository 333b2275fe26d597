"""Shadow caches: what each way of ordering a class would have hit, so the `history` policy can follow the best one.

Without hints, no single ordering wins on every traffic we know (issue 34): on the public Mooncake trace a block that
comes back after its eviction is the one worth keeping (remember its uses); on a round robin of agent sessions larger
than the pool it is the one to let go (forget them: the sessions already resident stay, instead of every session
thrashing); where the working set moves (sessions that end, a shift), uses that protect a block for ever keep dead
blocks and fall below LRU, and uses that protect it for a while do not. A fixed choice falls below LRU somewhere.

So each class of the history policy runs a `Duel` of five key-only caches of the same occupancy as the real one,
all with levels by use: `remember` (a returning block comes back at the level the real policy knows for it: held,
or in its history), `forget` (a returning block starts over), `bypass` (as `forget`, and a full shadow takes a new
block in only in place of a block used once: the block coming is the victim otherwise, and the index, asked by
`HistoryPolicy.admits`, stops the put there), `aging` (as `remember`, but a block's uses protect it only while it
has gone unused for less than twice as long as the oldest block used once: kvstore.policy.levels.pick) and `lru`
(levels protect nothing: the safety net, never far below LRU).

**What a shadow sees is the requests, not the real cache.** Where requests tell their chains (the host pool: every
lookup and get, `Duel.asked`), each shadow serves each request as the index would: the prefix it holds is a hit and
is read, then the chain is stored as the index stores it (head first, never evicting the put's own blocks,
stopping where no other victim is left; published tail first).
An earlier form fed the shadows the real cache's stores and reads: a shadow then saw only what the way being
followed stored, and a pool that refuses blocks (`bypass`) starved every other shadow of the traffic that would
show refusing was wrong (measured: 25 points below LRU on sessions whose population moves). Where no request tells
its chain (a lower tier, scored by reads), every store and read is offered to each shadow: a hit if the shadow
still holds the key, else the shadow takes it in. Hits are halved every WINDOW shadow-occupancies of events, so the
choice follows the traffic, and the real policy changes its way only when another shadow is ahead by MARGIN and
MIN_LEAD. This is set dueling (Qureshi et al., ISCA 2007) with whole shadow caches instead of sampled sets: sets
would split a chain's blocks between ways and break its prefix closure; shadows hold no bytes, so the real cache
stays one order.

**The real cache is weighed too.** A shadow follows one way for ever; the real cache pays a turnover of the pool at
each switch, and where the ways are close (agent traffic whose best order is plain recency) following the leader
of each short window cost it more than any one way (measured: 2–3 points below LRU on a coding agent's trace, while
every shadow but two stayed within 1.5). So the duel also counts, on the same sampled keys, what the real cache hit
(`asked` with `holds`: its held prefix) over a LONG window: once it is behind the lru shadow by SLACK of that
shadow's hits, the class settles on lru, and leaves it only when another way's shadow leads lru by 2 × SLACK over
the long window (`_settle`). Where no request tells its chain (a lower tier) the real cache is not counted.

**Evidence starts with pressure.** A shadow is sized to the class's occupancy, so while the real class still grows
into free memory the shadows evict and the real cache does not: the ways differ there in a contest the real cache is
not in. Their hits count from the first victim the real class is asked for (`Duel.press`; the native hooks'
`pressed`), so the way a full pool starts with is chosen on what eviction there does.

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
MARGIN = 1.0                # another way is taken as soon as its hits exceed the current way's by MIN_LEAD: the
MIN_LEAD = 1.0              # shadows serve the requests themselves, so a lead is what that way would have hit; a
                            # late switch cost more than frequent ones (4 agent families x 5 seeds x 3 pools x 2
                            # saves: 7 of 120 cells below LRU by over 0.5 point, against 19 with a 2% and 4-hit lead)
AGING: dict[str, float | None] = {"remember": None, "forget": None, "aging": 2.0, "lru": 1.0, "bypass": None}
WAYS = tuple(AGING)                         # (AGING: pick's factor)
ANEW = frozenset({"forget", "bypass"})      # the ways that admit a returning block at level 1
INITIAL = "remember"         # the way before the shadows have seen anything: the policy's own (reuse protects)
LRU = WAYS.index("lru")
LONG = 4                    # windows in the long one, over which the real cache is weighed against the lru shadow
SLACK = 0.01                # the share of the lru shadow's hits the real cache may fall behind before it settles on
                            # lru. No hints, agent families x seeds 1-8 x 3 pools x 2 saves (384 cells), cells more
                            # than 0.5 point below LRU: 31 (worst -3.1) before the guard and the faithful put, 29
                            # without the guard, 14 (worst -2.6) with it; LONG 2: 20 (worst -1.3), 8: 10 of 240


class Shadow:
    """One way of ordering, keys only: LEVELS recency lists (fingerprint -> tick of its last use), the victim by
    `pick`. Keys admitted by the request being served wait in `staged` (held, not yet candidates) until the next
    request or their next use: the index never evicts a put's own blocks for its later ones."""

    def __init__(self, way: str) -> None:
        self.way = way
        self.aging = AGING[way]
        self.lists: list[OrderedDict[int, int]] = [OrderedDict() for _ in range(LEVELS)]
        self.where: dict[int, int] = {}
        self.staged: dict[int, None] = {}       # admitted one at a time (a lower tier's `used`), not yet candidates
        self.hits = 0.0
        self.long = 0.0                         # hits over the long window (Duel: the real cache against lru)
        self.tick = 0

    def use(self, fp: int, hit: bool) -> bool:
        """A read or a store of a key: if held, it goes one level up (a hit where `hit`) and True; else False."""
        held = self.where.get(fp)
        if held is None:
            return False
        if fp in self.staged:
            self.settle()
        self.tick += 1
        self.hits += hit
        self.long += hit
        del self.lists[held][fp]
        if held < LEVELS - 1:
            held += 1
            self.where[fp] = held
        self.lists[held][fp] = self.tick
        return True

    def admit(self, fp: int, level: int, size: int) -> None:
        """A key it does not hold comes in, at level 1 for `forget` and `bypass`, at `level` (0-based) for the
        others. Where full, the index evicts first (never a block of the same put: `staged`); `bypass` takes the
        key in and then trims, so the key itself goes if it is the victim — the index refuses it then
        (HistoryPolicy.admits)."""
        new = 0 if self.way in ANEW else level
        if self.way == "bypass":
            self.tick += 1
            self.where[fp] = new
            self.lists[new][fp] = self.tick
            self.trim(size)
            return
        self.trim(size - 1)
        self.where[fp] = new
        self.staged[fp] = None

    def serve(self, chain: list[tuple[int, bytes]], size: int, remembered: Callable[[bytes], int]) -> None:
        """A request for `chain` ((fingerprint, key), head first): the prefix held is a hit and is read; then the
        chain is stored as the index stores it (kvstore.index.stores): head first, each new block in place of a
        victim that is not one of the chain's own blocks (they are no candidates while the put runs), the put
        stopping where there is none (or `bypass` refuses: every candidate was used more than once), and what it
        kept published tail first, so the head is the most recent. (Storing tail first and letting a new block
        evict the chain's own head, as an earlier form did, kept tails without their heads: the lru shadow hit
        3–6% less than LRU itself where chains are long against the pool, and the duel misjudged lru.)"""
        self.trim(size)                         # the real class may have shrunk (deletes, memory lent away)
        n = 0
        for fp, _ in chain:
            if fp not in self.where:
                break
            n += 1
        self.hits += n
        self.long += n
        for fp, _ in chain[:n]:
            self.use(fp, False)                 # the read
        if self.staged:
            self.settle()
        kept: list[int] = []
        placed: set[int] = set()
        lists, where = self.lists, self.where
        for fp, key in chain:                   # the put
            if fp in placed:
                continue                        # a key the chain names twice is stored once
            level = where.get(fp)
            if level is not None:               # held: refreshed one level up, no candidate until published
                del lists[level][fp]
                level = min(level + 1, LEVELS - 1)
            else:
                level = 0 if self.way in ANEW else min(remembered(key), LEVELS - 1)
                if not self.trim(size - 1, put=True):
                    break
            where[fp] = level
            kept.append(fp)
            placed.add(fp)
        for fp in reversed(kept):
            self.tick += 1
            lists[where[fp]][fp] = self.tick

    def settle(self) -> None:
        """The staged keys become candidates, in the order they came (a put publishes tail first)."""
        for fp in self.staged:
            level = self.where.get(fp)
            if level is not None:
                self.tick += 1
                self.lists[level][fp] = self.tick
        self.staged.clear()

    def trim(self, size: int, put: bool = False) -> bool:
        """Evict candidates until at most `size` keys are held (staged keys count, but are not candidates); False
        where none is left, or, for a `put`'s block under `bypass`, where the victim was used more than once (the
        index's `admits` refuses it: the put stops there)."""
        while len(self.where) > size:
            fp = pick(self.lists, self.aging, self.tick)
            if fp is None:
                return False
            level = self.where[fp]
            if put and level and self.way == "bypass":
                return False
            del self.lists[level][fp]
            del self.where[fp]
        return True

    def resample(self, rate: int) -> None:
        """Keep only the keys of the sample at `rate` (the rate doubled)."""
        self.settle()
        for keys in self.lists:
            for fp in [f for f in keys if f % rate]:
                del keys[fp]
                del self.where[fp]


class Duel:
    """The shadows of one class and the way the real policy follows (see the module docstring)."""

    def __init__(self, remembered: Callable[[bytes], int], by_chain: bool = False) -> None:
        self.remembered = remembered            # the real policy's history: the level an evicted key left with
        self.shadows = [Shadow(w) for w in WAYS]
        self.rate = 1
        self.events = 0
        self.way = INITIAL
        self.switches = 0
        self.chain: list[bytes] = []            # the last chain asked for (head first)
        self.refusing = False                   # the index asks `admits` (no lower tier): `bypass` may be followed
        self.by_chain = by_chain                # scored by `asked` (the host pool), else by reads (a lower tier)
        self._scored = True                     # hits changed since the way was last chosen
        self.real = 0.0                         # the real cache's hits over the long window (sampled keys)
        self.windows = 0                        # windows since the long one began
        self.settled = False                    # on lru: following the shadows cost more than it won
        self.judged = False                     # the real cache's hits are counted (`asked` with `holds`)
        self.pressed = False                    # the real class was asked for a victim (`press`): hits count

    def refuse(self) -> None:
        """The index asked whether a block may be evicted for another (no lower tier): `bypass` may be followed."""
        if not self.refusing:
            self.refusing = self._scored = True

    def used(self, key: bytes, held: int, level: int, hit: bool = True) -> None:
        """A block of a class that holds `held` blocks was stored or read (`hit`: count a hit where a shadow holds
        it); `level`: where the real policy places it (0-based), or 0 where it does not know: then one above the
        level its history remembers. Only where no request tells its chain (a lower tier, scored by reads): where
        one does (`asked`), the shadows replay the requests themselves."""
        if self.by_chain:
            return
        self._fit(held)
        fp = fingerprint(key)
        if fp % self.rate:
            return
        size = max(1, held // self.rate)
        new = -1                                # the level a shadow that lacks it admits it at, asked once
        for s in self.shadows:
            if not s.use(fp, hit):
                if new < 0:
                    new = min(level or self.remembered(key), LEVELS - 1)
                s.admit(fp, new, size)
                s.settle()                      # a lower tier's blocks come one at a time
        self._count(1, size)

    def asked(self, keys: list[bytes], held: int, holds: Callable[[bytes], bool] | None = None) -> None:
        """A request asked for this chain (head first) of a class that holds `held` blocks: each shadow serves it
        as the index would — the prefix it holds is a hit, read, and the put that follows stores the whole chain
        (Shadow.serve: the held blocks refreshed, the others admitted at the level the history remembers). So a
        shadow's hits depend on the requests only, never on what the real cache, following another way, stored or
        refused. A chain that is the head of the one just asked (a get of the prefix a lookup found) is the same
        request: not served twice. Sampled keys only (an unsampled key is taken as held)."""
        self.by_chain = True
        last, self.chain = self.chain, keys
        if keys and len(keys) <= len(last) and keys[0] == last[0] and keys[-1] == last[len(keys) - 1]:
            return
        self._fit(held)
        sampled = [(fp, key) for key in keys if (fp := fingerprint(key)) % self.rate == 0]
        if not sampled:
            return
        size = max(1, held // self.rate)
        if holds is not None:                   # the real cache's hit: its held prefix (chains are prefix-closed)
            self.judged = True
            self.real += next((i for i, (_, key) in enumerate(sampled) if not holds(key)), len(sampled))
        for s in self.shadows:
            s.serve(sampled, size, self.remembered)
        self._count(len(sampled), size)

    def _fit(self, held: int) -> None:
        """The sampling rate for a class of `held` blocks: doubled (the shadows resampled) while a shadow would
        hold more than SHADOW_BLOCKS keys."""
        while held // self.rate > SHADOW_BLOCKS:
            self.rate *= 2
            for s in self.shadows:
                s.resample(self.rate)

    def press(self) -> None:
        """The real class was asked for a victim: from now on the shadows' hits are evidence (`_count`)."""
        self.pressed = True

    def _count(self, events: int, size: int) -> None:
        """Hits are halved every WINDOW shadow-occupancies of events. Before the real class first evicts, they are
        dropped: the shadows, sized to the class's occupancy, evict while the real class still grows into free
        memory, so the ways differ there in a contest the real cache is not in. Leads formed then chose the way a
        full pool began with from noise (a few hits of some hundreds), and each switch they caused cost the real
        cache a turnover (agent families, short traces of 24 workflows: 46 of 384 cells more than 0.5 point below
        LRU with those leads, 35 without; 80 workflows: 14 → 8)."""
        if not self.pressed:
            for s in self.shadows:
                s.hits = s.long = 0.0
            self.real = 0.0
            self.events = 0
            return
        self.events += events
        self._scored = True
        if self.events >= WINDOW * max(16, size):
            self.events = 0
            for s in self.shadows:
                s.hits /= 2
            self.windows += 1
            if self.windows >= LONG:
                self.windows = 0
                self.real /= 2
                for s in self.shadows:
                    s.long /= 2

    def shrunk(self, held: int) -> None:
        """The real class lost a block (evicted or deleted): the shadows trim to the same occupancy. Not where the
        shadows serve requests themselves: there a put's evictions come before its stores, and the occupancy is
        taken when the next request is served."""
        if self.by_chain:
            return
        size = max(1, held // self.rate)
        for s in self.shadows:
            if len(s.where) > size:
                s.trim(size)

    def choose(self) -> str:
        """The way to follow now: the current one unless another is ahead by MARGIN and MIN_LEAD (weighed again
        only after the shadows scored: an eviction asks this, and most follow no new score)."""
        if not self._scored:
            return self.way
        self._scored = False
        ways = [w for w in WAYS if self.refusing or w != "bypass"]
        if self._settle(ways):
            return self.way
        hits = {s.way: s.hits for s in self.shadows}
        best = max(ways, key=hits.__getitem__)
        if best != self.way and hits[best] > max(hits[self.way] * MARGIN, hits[self.way] + MIN_LEAD):
            self.way = best
            self.switches += 1
        return self.way

    def _settle(self, ways: list[str]) -> bool:
        """Whether to stay on lru: the real cache, following the shadows, has hit less than the lru shadow by
        SLACK over the long window (each switch costs a turnover of the pool, which no shadow pays), until another
        way's shadow leads lru by 2 × SLACK over it."""
        lru = self.shadows[LRU].long
        if not self.settled and self.judged and lru - self.real > max(MIN_LEAD, SLACK * lru):
            self.settled = True
            if self.way != "lru":
                self.way = "lru"
                self.switches += 1
        elif self.settled and max(s.long for s in self.shadows if s.way in ways) > lru * (1 + 2 * SLACK) + MIN_LEAD:
            self.settled = False
            self.real = lru                     # judged afresh from here
        return self.settled

    def nbytes(self) -> int:
        """The shadows' dicts (their fingerprints are small ints: ~32 bytes a key besides the dict slots)."""
        return sum(sys.getsizeof(s.where) + sum(sys.getsizeof(lst) for lst in s.lists) + 32 * len(s.where)
                   for s in self.shadows)

    def hits(self) -> dict[str, float]:
        return {s.way: round(s.hits, 1) for s in self.shadows}
