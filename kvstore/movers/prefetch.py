"""Prefetch: promote SSD blocks into the host pool ahead of the get that will want them (PBKV §4.3, conservative).

Only into free host space: a prefetch never evicts, so it never displaces a pinned or recently used block. Each
block is one transfer in the traffic manager's prefetch lane, whose bounded queue is the prefetch queue: a request
that does not fit is refused at once with `busy` and queues nothing. A get that meets a block still queued moves
its transfer up to the critical lane and waits for it instead of reading it twice; a delete of a block still queued
cancels its transfer, and a delete that races a read in progress wins: the block is never published.
"""
from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

from kvstore.index.books import Holdings, NamespaceEntry
from kvstore.protocol import Code, ProtocolError
from kvstore.traffic import Busy, Lane, Path

if TYPE_CHECKING:
    from kvstore.daemon.ops import State


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
    plan: list[tuple[bytes, int]]
    ticket: Ticket
    view: memoryview
    future: Future[Any] | None = None


class Prefetcher:
    def __init__(self, state: State, path: Path) -> None:
        self.state = state
        self.path = path
        self.holder = Holdings()                # the prefetcher's own reservations
        self.flights: dict[bytes, _Flight] = {}  # index key → its transfer
        self._closed = False

    def submit(self, ns: NamespaceEntry, hashes: list[bytes]) -> Ticket:
        """(Under the state lock.) Queue the keys' reads, or refuse them all with `busy` if they do not fit."""
        st, idx = self.state, self.state.index
        room = self.path.room(Lane.PREFETCH)
        if room < len(hashes) or self._closed:
            idx.counters["prefetch_busy"] += 1
            raise ProtocolError(Code.BUSY, f"prefetch: the prefetch lane has room for {max(room, 0)} more blocks; "
                                           f"{len(hashes)} do not fit, try again later")
        ticket = Ticket(len(hashes))
        self.holder.namespaces.add(ns.id)
        assert idx.ssd is not None
        for h in hashes:
            plan = idx.plan_promotion(ns, [h], self.holder, evict=False)
            if not plan:
                self._skip(ticket)
                continue
            flight = _Flight(ns, plan, ticket, st.pool.view(plan[0][1]))
            try:
                flight.future = idx.ssd.read_async(ns.digest + h, flight.view, Lane.PREFETCH,
                                                   partial(self._landed, flight))
            except Busy:
                flight.future = None
            if flight.future is None:
                self._finish(flight, ok=False)
                continue
            self.flights[ns.prefix + h] = flight
        return ticket

    def _skip(self, ticket: Ticket) -> None:
        ticket.skipped += 1
        self.state.index.counters["prefetch_skipped"] += 1

    def _landed(self, flight: _Flight, f: Future[Any]) -> None:
        """(A path worker.) Publish the block, unpinned — unless it was deleted while it was read."""
        r = f.result() if f.exception() is None else False
        with self.state.lock:
            self._finish(flight, r is not False, r if type(r) is int else None)

    def _finish(self, flight: _Flight, ok: bool, crc: int | None = None) -> None:
        """(Under the state lock.)"""
        st, idx = self.state, self.state.index
        flight.view.release()
        self.flights.pop(flight.ns.prefix + flight.plan[0][0], None)
        got = idx.finish_promotion(flight.ns, flight.plan, int(ok), self.holder, pin=False, crcs=[crc])
        if got:
            flight.ticket.done += 1
            idx.counters["prefetched"] += 1
        else:
            self._skip(flight.ticket)
        st.changed.notify_all()

    def cancel(self, ns: NamespaceEntry, hashes: list[bytes]) -> int:
        """(Under the state lock.) Drop the queued reads of these keys (they are being deleted); a read already
        running is left to finish, and the index does not publish it. Returns how many were cancelled."""
        n = 0
        for h in hashes:
            flight = self.flights.get(ns.prefix + h)
            if flight is not None and self.path.cancel(ns.digest + h):
                self.state.index.counters["prefetch_cancelled"] += 1
                self._finish(flight, ok=False)
                n += 1
        return n

    def escalate(self, key: bytes) -> bool:
        """(Under the state lock.) A get waits for this key: its queued read becomes critical."""
        flight = self.flights.get(key)
        return flight is not None and self.path.escalate(flight.ns.digest + flight.plan[0][0], Lane.CRITICAL) > 0

    def queued(self) -> int:
        return len(self.flights)

    def close(self, timeout: float = 10.0) -> None:
        """Cancel what is queued and wait for the reads in progress (their slots must outlive them)."""
        st = self.state
        with st.lock:
            self._closed = True
            for flight in list(self.flights.values()):
                if self.path.cancel(flight.ns.digest + flight.plan[0][0]):
                    self._finish(flight, ok=False)
            deadline = time.monotonic() + timeout
            while self.flights and time.monotonic() < deadline:
                st.changed.wait(0.1)
