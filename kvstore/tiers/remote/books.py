"""The remote tier's books: what the store is known to hold, answered without asking it.

What the store holds is known without asking it under the daemon's lock: `has` answers from the blocks this daemon
staged, and those it put or the store said it held within `remote.known_s` (5 s: below Mooncake's lease, 10 s after
a put, a read or an existence query, during which the store does not evict the value — so the books do not promise
a block the store has evicted). `probe` — one batched existence query to
the master — runs without the state lock, for a lookup's blocks that no local tier holds.

The books, under the tier's lock (wire.py): `staged` (the write-back's blocks on their way, writeback.py), `mine`
(the blocks this daemon put, and their bytes: what `namespaces` and the stats count), `known` (blocks the store said
it held, until when believed), `announced` (write-through blocks on their way: a delete cancels them, puts.py) and
`bad` (values that failed their check, or whose node did not answer, quarantined until when: reads.py). The
`*_locked` methods are the books' primitives for the other parts; they expect the lock held. While the store is
down (link.py) the books promise nothing but staged blocks. A delete is a delete in the store too: `remove_later`
asks for the removal as a background transfer.
"""
from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import CancelledError
from concurrent.futures import TimeoutError as FutureTimeout
from typing import TYPE_CHECKING

from kvstore.tiers.remote.client import StoreDown, store_key
from kvstore.tiers.remote.wire import TierPart, Wire
from kvstore.traffic import Busy, Lane

if TYPE_CHECKING:
    from kvstore.tiers.remote.link import Link
    from kvstore.tiers.remote.writeback import Staged

KNOWN_MAX = 1 << 20             # blocks the books remember the store holds, at most (expired ones go first)
EXISTS_MAX = 1024               # keys in one existence query


class Books(TierPart):
    def __init__(self, wire: Wire, link: Link) -> None:
        super().__init__(wire)
        self.link = link
        self.staged: dict[bytes, Staged] = {}
        self.mine: dict[bytes, int] = {}            # blocks this daemon put → their bytes (insertion-ordered)
        self.mine_bytes = 0
        self.known: dict[bytes, float] = {}         # blocks the store said it held, until when believed
        self.announced: set[bytes] = set()          # write-through blocks on their way (a delete cancels)
        self.bad: dict[bytes, float] = {}           # values that failed their check, until when (removed too)
        self.removing: dict[bytes, None] = {}       # deleted here, their removal from the store not done yet

    def has(self, bid: bytes) -> bool:
        with self.lock:
            return self.has_locked(bid, time.monotonic())

    def has_locked(self, bid: bytes, now: float) -> bool:
        s = self.staged.get(bid)
        if s is not None:
            return not s.deleted
        if not self.link.up or self.bad and self.bad.get(bid, 0.0) > now or bid in self.removing:
            return False
        return self.known.get(bid, 0.0) > now

    def absent_locked(self, bid: bytes, now: float) -> bool:
        """(Under the tier lock.) Whether the store's copy of `bid` must not be served, whatever the store says:
        quarantined (`bad`) or deleted here and not removed from the store yet (`removing`)."""
        return self.bad.get(bid, 0.0) > now or bid in self.removing

    def learned_locked(self, bids: Sequence[bytes]) -> None:
        """(Under the tier lock.) The store holds these now."""
        until = time.monotonic() + self.cfg.known_s
        if len(self.known) + len(bids) > KNOWN_MAX:
            now = time.monotonic()
            self.known = {b: t for b, t in self.known.items() if t > now}
            while len(self.known) + len(bids) > KNOWN_MAX:
                self.known.pop(next(iter(self.known)))
        for b in bids:
            self.known[b] = until

    def mine_locked(self, bid: bytes, nbytes: int) -> None:
        """(Under the tier lock.) This daemon put the block: known present for remote.known_s, like a block the
        store said it held (the store evicts by itself; kept below Mooncake's lease, 10 s after a put or a read,
        the books never promise a block it has evicted). `mine` only counts them, per namespace."""
        self.learned_locked([bid])
        self.stored_again_locked(bid)
        self.mine_bytes += nbytes - self.mine.get(bid, 0)
        self.mine[bid] = nbytes
        if len(self.mine) > KNOWN_MAX:
            self.mine_bytes -= self.mine.pop(next(iter(self.mine)))

    def forgot_locked(self, bids: Sequence[bytes]) -> None:
        """(Under the tier lock.) The store does not hold these (any more)."""
        for b in bids:
            self.mine_bytes -= self.mine.pop(b, 0)
            self.known.pop(b, None)

    def probe(self, bids: Sequence[bytes]) -> int:
        """(Without the daemon's state lock.) How many leading blocks of `bids` the store holds: the books first,
        then one existence query for the rest. A store that does not answer within remote.timeout_s: none."""
        now = time.monotonic()
        with self.lock:
            if not self.link.up:
                return 0
            n = 0
            while n < len(bids) and self.has_locked(bids[n], now):
                n += 1
        rest = list(bids[n:n + EXISTS_MAX])
        if not rest:
            return n
        keys = [store_key(b) for b in rest]
        try:
            found = self.wire.wait(self.path.submit(Lane.CRITICAL, 0, lambda: self.client.exist(keys)), True)
        except (StoreDown, FutureTimeout, Busy, CancelledError) as e:
            self.counters["probe_failed"] += 1
            if isinstance(e, FutureTimeout):            # the master did not answer in time: down for lookups
                e = StoreDown(f"the master did not answer an existence query in {self.cfg.timeout_s} s")
            if isinstance(e, StoreDown):
                self.link.record_down(e)
            return n
        self.counters["probes"] += 1
        run = 0
        with self.lock:
            while run < len(found) and found[run] and not self.absent_locked(rest[run], now):
                run += 1
            self.learned_locked(rest[:run])
        return n + run

    def probe_each(self, bids: Sequence[bytes]) -> list[bool]:
        """(Without the daemon's state lock.) Which of `bids` the store holds, each on its own (a hybrid model's
        sliding-window and state groups ask this: see kvstore.daemon.read_ops._held). The books first, then one
        existence query for the rest (at most EXISTS_MAX of them; those past it: not held). A store that does not
        answer: none of the rest."""
        now = time.monotonic()
        with self.lock:
            if not self.link.up:
                return [False] * len(bids)
            out = [self.has_locked(b, now) for b in bids]
        ask = [i for i, there in enumerate(out) if not there][:EXISTS_MAX]
        if not ask:
            return out
        try:
            found = self.wire.wait(self.path.submit(Lane.CRITICAL, 0,
                                                    lambda: self.client.exist([store_key(bids[i]) for i in ask])),
                                   True)
        except (StoreDown, FutureTimeout, Busy, CancelledError) as e:
            self.counters["probe_failed"] += 1
            if isinstance(e, FutureTimeout):
                e = StoreDown(f"the master did not answer an existence query in {self.cfg.timeout_s} s")
            if isinstance(e, StoreDown):
                self.link.record_down(e)
            return out
        self.counters["probes"] += 1
        with self.lock:
            held = [i for i, there in zip(ask, found) if there and not self.absent_locked(bids[i], now)]
            self.learned_locked([bids[i] for i in held])
        for i in held:
            out[i] = True
        return out

    def remove_later(self, bids: list[bytes]) -> None:
        """Remove blocks from the store, as a transfer in the background lane. Until it is done they are absent
        here (`has`, `probe` and reads answer a miss, whatever the store says), and a removal the path refuses
        (its queue full) or the store does not answer is tried again (`retry_removals`, every remote.retry_s)."""
        with self.lock:
            for b in bids:
                self.removing[b] = None
            while len(self.removing) > KNOWN_MAX:
                self.removing.pop(next(iter(self.removing)))
                self.counters["remove_skipped"] += 1
        self._submit_removal(bids)

    def _submit_removal(self, bids: list[bytes]) -> None:
        def remove() -> None:
            with self.lock:                 # those put again since the delete: the store holds the new copy
                still = [b for b in bids if b in self.removing]
            if still:
                self.client.remove([store_key(b) for b in still])
            with self.lock:
                for b in still:
                    self.removing.pop(b, None)
        try:
            self.path.submit(Lane.BACKGROUND, 0, remove)
        except (Busy, RuntimeError):
            self.counters["remove_deferred"] += len(bids)

    def retry_removals(self) -> None:
        """(The link thread, while the store answers.) Ask again for the removals not done yet."""
        with self.lock:
            pending = list(self.removing)[:EXISTS_MAX]
        if pending:
            self._submit_removal(pending)

    def stored_again_locked(self, bid: bytes) -> None:
        """(Under the tier lock.) A block deleted here is put again (the same bytes: a key names its contents):
        its pending removal would take the new copy too."""
        self.removing.pop(bid, None)
