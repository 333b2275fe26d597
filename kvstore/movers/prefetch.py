"""Prefetch: promote SSD blocks into the host pool ahead of the get that will want them (PBKV §4.3, conservative).

Only into free host space: a prefetch never evicts, so it never displaces a pinned or recently used block. Each
block is one transfer in the traffic manager's prefetch lane, whose bounded queue is the prefetch queue: a request
that does not fit is refused at once with `busy` and queues nothing. A get that meets a block still queued moves
its transfer up to the critical lane and waits for it instead of reading it twice; a delete of a block still queued
cancels its transfer, and a delete that races a read in progress wins: the block is never published.

The daemon's own predictive prefetch (kvstore.movers.predictive) queues through `submit` too, with the workflow's
hint context (the blocks land tagged with it, in its group of the eviction policy) and a callback told of each
block's outcome; it makes room from retired blocks itself before it submits, so this mover still only fills free
space.
"""
from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass
from functools import partial
from threading import Condition
from typing import Any

from kvstore.index import Holdings, Index, NamespaceEntry
from kvstore.tiers import LowerTier, LowerTiers
from kvstore.tiers.host import HostPool
from kvstore.traffic import Busy, Lane
from kvstore.workflows import Touch

Outcome = Callable[[bytes, int | None], None]   # (index key, its gid if it landed, else None): under the state lock


class LaneFull(Exception):
    """The prefetch lane has no room for the whole request: nothing was queued; the message says how much fits."""


@dataclass
class Ticket:
    """One prefetch request's progress: queued = done + skipped + pending."""
    queued: int
    done: int = 0
    skipped: int = 0

    @property
    def pending(self) -> int:
        return self.queued - self.done - self.skipped


@dataclass(eq=False)
class _Flight:
    ns: NamespaceEntry
    tier: LowerTier
    plan: list[tuple[bytes, int]]
    ticket: Ticket
    view: memoryview
    future: Future[Any] | None = None
    touch: Touch | None = None
    outcome: Outcome | None = None

    @property
    def block_id(self) -> bytes:
        return self.ns.block_id(self.plan[0][0])


class Prefetcher:
    def __init__(self, index: Index, pool: HostPool, lower: LowerTiers, changed: Condition,
                 counters: Counter[str]) -> None:
        self.index = index
        self.pool = pool
        self.lower = lower
        self.changed = changed                  # on the state lock: notified when a prefetch lands or gives up
        self.counters = counters
        self.holder = Holdings()                # the prefetcher's own reservations
        self.flights: dict[bytes, _Flight] = {}  # index key → its transfer
        self._closed = False

    def room(self) -> int:
        """How many more blocks the prefetch lane takes now (0 once closed)."""
        return 0 if self._closed else min(t.path.room(Lane.PREFETCH) for t in self.lower)

    def submit(self, ns: NamespaceEntry, hashes: list[bytes], touch: Touch | None = None,
               outcome: Outcome | None = None) -> Ticket:
        """(Under the state lock.) Queue the blocks' reads, or refuse them all (LaneFull) if they do not fit.
        `touch`: the hint context the landed blocks are tagged with; `outcome`: told of each queued block's end."""
        room = self.room()
        if room < len(hashes) or self._closed:
            self.counters["prefetch_busy"] += 1
            raise LaneFull(f"prefetch: the prefetch lane has room for {max(room, 0)} more blocks; {len(hashes)} do "
                           "not fit, try again later")
        ticket = Ticket(len(hashes))
        self.holder.namespaces.add(ns.id)
        for h in hashes:
            tier = self.lower.holder(ns.block_id(h))
            plan = self.index.plan_promotion(ns, [h], self.holder, evict=False) if tier is not None else []
            if not plan or tier is None:
                self._skip(ticket)
                continue
            flight = _Flight(ns, tier, plan, ticket, self.pool.view(plan[0][1]), touch=touch, outcome=outcome)
            try:
                flight.future = tier.read_async(ns.block_id(h), flight.view, Lane.PREFETCH,
                                                partial(self._landed, flight))
            except Busy:
                flight.future = None
            if flight.future is None:
                self._finish(flight, ok=False)
                continue
            self.flights[ns.key(h)] = flight
        return ticket

    def _skip(self, ticket: Ticket) -> None:
        ticket.skipped += 1
        self.counters["prefetch_skipped"] += 1

    def _landed(self, flight: _Flight, f: Future[Any]) -> None:
        """(A path worker.) Publish the block, unpinned — unless it was deleted while it was read."""
        r = f.result() if f.exception() is None else False
        with self.changed:
            self._finish(flight, r is not False, r if type(r) is int else None)

    def _finish(self, flight: _Flight, ok: bool, crc: int | None = None) -> None:
        """(Under the state lock.)"""
        flight.view.release()
        self.flights.pop(flight.ns.key(flight.plan[0][0]), None)
        got = self.index.finish_promotion(flight.ns, flight.plan, int(ok), self.holder, pin=False, crcs=[crc],
                                          touch=flight.touch)
        if got:
            flight.ticket.done += 1
            self.counters["prefetched"] += 1
        else:
            self._skip(flight.ticket)
        if flight.outcome is not None:
            flight.outcome(flight.ns.key(flight.plan[0][0]), got[0] if got else None)
        self.changed.notify_all()

    def cancel(self, ns: NamespaceEntry, hashes: list[bytes]) -> int:
        """(Under the state lock.) Drop the queued reads of these keys (they are being deleted); a read already
        running is left to finish, and the index does not publish it. Returns how many were cancelled."""
        return self.cancel_keys(ns.key(h) for h in hashes)

    def cancel_keys(self, keys: Iterable[bytes]) -> int:
        """(Under the state lock.) `cancel` by index keys (a workflow whose prefetch is still queued ended)."""
        n = 0
        for key in keys:
            flight = self.flights.get(key)
            if flight is not None and flight.tier.path.cancel(flight.block_id):
                self.counters["prefetch_cancelled"] += 1
                self._finish(flight, ok=False)
                n += 1
        return n

    def escalate(self, key: bytes) -> bool:
        """(Under the state lock.) A get waits for this key: its queued read becomes critical."""
        flight = self.flights.get(key)
        return flight is not None and flight.tier.path.escalate(flight.block_id, Lane.CRITICAL) > 0

    def queued(self) -> int:
        return len(self.flights)

    def close(self, timeout: float = 10.0) -> None:
        """Cancel what is queued and wait for the reads in progress (their slots must outlive them)."""
        with self.changed:
            self._closed = True
            for flight in list(self.flights.values()):
                if flight.tier.path.cancel(flight.block_id):
                    self._finish(flight, ok=False)
            deadline = time.monotonic() + timeout
            while self.flights and time.monotonic() < deadline:
                self.changed.wait(0.1)
